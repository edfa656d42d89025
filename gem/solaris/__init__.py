"""Solaris: speculative precompute of foundation-model scores, with a hierarchical fallback lookup."""
