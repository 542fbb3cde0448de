"""Making training data: teachers (procedural and LLM), curation and decontamination, and data mixtures with epochs."""
