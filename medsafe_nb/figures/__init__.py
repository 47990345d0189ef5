"""Figures: plots, plot-label placement, the analysis notebooks' table helpers and the notebook runner."""
