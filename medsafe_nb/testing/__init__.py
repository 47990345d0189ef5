"""Test doubles and fixtures (a tiny model, a scripted backend, the local mock server); production code never imports them."""
