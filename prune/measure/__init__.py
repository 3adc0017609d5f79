"""Measuring a model: streamed moments, least squares, per-block scores, perplexity, the block-by-block pass."""
