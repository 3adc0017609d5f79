"""Distillation of surgered students back to their teacher (logits by default, block outputs on request)."""
