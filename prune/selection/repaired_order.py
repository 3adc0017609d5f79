"""Blocks in the order their repaired costs give them: SLEB's greedy loop, each block alone, and the oracle's column.

:class:`prune.selection.repaired.RepairedCosts` measures what a set removed and repaired costs; here are the
orders read from those costs (``repaired-greedy`` and ``-kl``: the loop; ``repaired-once``: one step of it) and
the oracle's "repaired" column, which rates every cheap ranking, the one-pass map error of
:mod:`prune.selection.map_errors` among them, against each block's own repaired cost.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
from torch import nn

from prune.errors import LayercutError
from prune.measure.heldout import packed_perplexity
from prune.measure.scores import get_score
from prune.model.adapters import get_blocks
from prune.replace import ReplaceConfig
from prune.selection.map_errors import map_errors
from prune.selection.oracle import spearman
from prune.selection.repaired import RepairedCosts, update_share

logger = logging.getLogger(__name__)

CRITERIA = ("ppl", "kl")


def greedy_order(costs: RepairedCosts, count: int, protected: Sequence[int], criterion: str,
                 memo: dict | None = None, bar=None) -> tuple[list[int], list[dict]]:
    """SLEB's loop on repaired costs: the ``count`` blocks in the order chosen, and what each step measured.

    Each step depends only on the steps before it, so a larger drop continues a smaller one's steps (kept in
    ``memo`` per repair, criterion and protection).
    """
    if criterion not in CRITERIA:
        raise ValueError(f"criterion {criterion!r}: one of {CRITERIA}")
    key = ("repaired-greedy", costs.key, criterion, tuple(protected))
    steps: list[dict] = [] if memo is None else memo.setdefault(key, [])
    blocks = len(get_blocks(costs.model)[1])
    while len(steps) < count:
        chosen = [step["drop"] for step in steps]
        candidates = [b for b in range(blocks) if b not in chosen and b not in protected]
        measured = costs.measure(chosen, candidates, bar)
        best = min(candidates, key=lambda b: (measured[b][criterion], b))
        if math.isinf(measured[best][criterion]):
            raise LayercutError(f"--replace {costs.config.method} can replace none of the sets left after "
                                f"{chosen}: lower --drop or use --select span")
        steps.append({"chosen": chosen, "drop": best, "costs": {str(b): measured[b] for b in candidates}})
        logger.info("repaired-greedy step %d: drop block %d (measuring %s %.4f)", len(steps), best, criterion,
                    measured[best][criterion])
    return [step["drop"] for step in steps[:count]], steps[:count]


def single_costs(costs: RepairedCosts, candidates: Sequence[int], bar=None) -> dict[int, dict[str, float]]:
    """Each candidate's own repaired cost (the first step of :func:`greedy_order`)."""
    return costs.measure([], candidates, bar)


def repaired_oracle(model: nn.Module, token_ids: torch.Tensor, scores: dict[str, list[float]],
                    replace: ReplaceConfig, batch_size: int = 4, memo: dict | None = None) -> dict:
    """The oracle's "repaired" column: each block's own repaired cost, and every cheap ranking's Spearman with it.

    Returns ``{"method", "dense", "ppl", "kl", "map_error", "spearman"}``: the original model's perplexity on the
    measuring rows, per-block perplexity and KL of the model with that block alone removed and repaired (on
    the same rows), the one-pass map error (:func:`map_errors`), and
    the Spearman of each score's removability, of the map error and of the bare-removal oracle (added by the
    caller) with the repaired perplexity (+1: ranks blocks as their repair really costs).
    """
    blocks = range(len(get_blocks(model)[1]))
    costs = RepairedCosts(model, token_ids, replace, batch_size, memo)
    measured = single_costs(costs, list(blocks))
    ppl = [measured[b]["ppl"] for b in blocks]
    errors = map_errors(model, token_ids, update_share(replace), batch_size=batch_size)
    target = [-p for p in ppl]
    agreement = {name: spearman(get_score(name).removability(values), target) for name, values in scores.items()}
    agreement["map-error (repaired-fast)"] = spearman([-e for e in errors], target)
    agreement["repaired KL"] = spearman([-measured[b]["kl"] for b in blocks], target)
    dense = packed_perplexity(model, costs.measure_ids, batch_size, progress=False)
    return {"method": replace.method, "dense": dense, "ppl": ppl, "kl": [measured[b]["kl"] for b in blocks],
            "map_error": errors, "spearman": agreement}
