"""Inference-time scaling: spend more sampling compute at generation time instead of training."""
