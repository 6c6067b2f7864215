"""Evaluation of generated images: metrics and the `evaluate` command's work."""
