"""Clinician review: the rubric and harm tiers, packets, ratings, the LLM judge and agreement."""
