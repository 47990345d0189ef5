"""Building a benchmark: the applicability gate, generation, checks and the build pipeline."""
