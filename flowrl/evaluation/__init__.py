"""Evaluation helpers: data loaders and graders for recorded or fresh generations."""
