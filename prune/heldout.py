"""Perplexity of a prune run's model on held-out sequences of its own calibration source.

``prune.run`` measures the original model before surgery and the slimmed one after it on the same
sequences, which scoring and fitting never saw, so a user sees at once what the cut cost. This is a
quick check on text like the calibration text; ``eval.run`` measures on other text and tasks.
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from prune.adapters import input_device


@torch.no_grad()
def batch_loss(model: torch.nn.Module, batch: torch.Tensor) -> float:
    """Mean next-token NLL of ``batch`` [batch, seq_len] (transformers' own loss: every position but the first)."""
    return float(model(input_ids=batch, labels=batch, use_cache=False).loss.float())


def packed_perplexity(model: torch.nn.Module, token_ids: torch.Tensor, batch_size: int = 4,
                      progress: bool = True) -> float:
    """``exp`` of the mean next-token NLL over packed sequences ``[n, seq_len]`` (transformers' own loss)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for start in tqdm(range(0, token_ids.shape[0], batch_size), desc="held-out perplexity", unit="batch",
                          disable=not progress):
            batch = token_ids[start : start + batch_size].to(input_device(model))  # [batch, seq_len]
            scored = batch.shape[0] * (batch.shape[1] - 1)  # every position but the first is a target
            total += batch_loss(model, batch) * scored
            count += scored
    finally:
        model.train(was_training)
    return math.exp(total / count)


def heldout_report(original: float, pruned: float, token_ids: torch.Tensor) -> dict:
    """The ``heldout`` section of ``layercut.json``."""
    samples, seq_len = token_ids.shape
    return {"samples": samples, "seq_len": seq_len, "tokens": samples * seq_len, "original": original,
            "pruned": pruned, "ratio": pruned / original}
