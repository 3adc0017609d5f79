"""Perplexity of a prune run's model on held-out sequences of its own calibration source.

``prune.run`` measures the original model before surgery and the slimmed one after it on the same
sequences, which scoring and fitting never saw, so a user sees at once what the cut cost. This is a
quick check on text like the calibration text; ``eval.run`` measures on other text and tasks. The
scoring is :mod:`prune.measure.perplexity`'s, the one every tool uses.
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from prune.measure.perplexity import plan_windows, stream_nll, token_nll


@torch.no_grad()
def batch_loss(model: torch.nn.Module, batch: torch.Tensor) -> float:
    """Mean next-token NLL of ``batch`` [batch, seq_len]: every position but the first is a target.

    One batch of :func:`packed_perplexity`, scored the same way, for callers that run the passes themselves.
    """
    logits = model(input_ids=batch, use_cache=False).logits  # [batch, seq_len, vocab]
    return float(token_nll(logits[:, :-1], batch[:, 1:]).sum()) / (batch.shape[0] * (batch.shape[1] - 1))


def packed_perplexity(model: torch.nn.Module, token_ids: torch.Tensor, batch_size: int = 4,
                      progress: bool = True) -> float:
    """``exp`` of the mean next-token NLL over packed sequences ``[n, seq_len]``, each row's first token unscored.

    The rows, end to end, are a stream of non-overlapping windows, so this is
    :func:`prune.measure.perplexity.perplexity` of ``token_ids.reshape(-1)`` at ``seq_len = token_ids.shape[1]``.
    """
    samples, seq_len = token_ids.shape
    windows = plan_windows(samples * seq_len, seq_len, seq_len)
    with tqdm(total=math.ceil(samples / batch_size), desc="held-out perplexity", unit="batch",
              disable=not progress) as bar:
        total = stream_nll(model, token_ids.reshape(-1), windows, batch_size, lambda _: bar.update(1))
    return math.exp(total / (samples * (seq_len - 1)))  # every position but each row's first is a target


def heldout_report(original: float, pruned: float, token_ids: torch.Tensor, removal: float | None = None) -> dict:
    """The ``heldout`` section of ``layercut.json``; ``removal``: the same blocks only removed (a repaired run)."""
    samples, seq_len = token_ids.shape
    report = {"samples": samples, "seq_len": seq_len, "tokens": samples * seq_len, "original": original,
              "pruned": pruned, "ratio": pruned / original}
    if removal is not None:
        report.update(removal=removal, removal_ratio=removal / original)
    return report
