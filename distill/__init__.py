"""Layerwise distillation of surgered students back to their teacher."""
