"""The run: one RunConfig, the response ledger, the benchmark runner, params files and launching from them."""
