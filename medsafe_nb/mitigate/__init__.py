"""Defences: search providers and the mitigation wrappers (warning, search) around a model."""
