"""The model itself: where each architecture keeps its parts, tiny models, surgery, hooks, the shipped modeling file."""
