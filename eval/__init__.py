"""Evaluation: perplexity, lm-eval tasks, speed and memory, lens, reports."""
