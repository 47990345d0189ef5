"""The numbers: per-item tables, ASR and TASR with intervals, Table 1 and breakdowns, significance, reading and writing tables."""
