"""LoopFM: a deep historical memory of foundation-model embeddings and the vertical models that read it."""
