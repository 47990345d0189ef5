"""Items: the taxonomy, the release schema, the raw source pools, the release loader, the artefact audit and subsets."""
