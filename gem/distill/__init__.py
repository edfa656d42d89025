"""Distillation of a GEM teacher into a small student (`gem distill`)."""
