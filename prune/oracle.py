"""The perplexity oracle: what removing each block alone really costs, and how far each cheap score agrees.

SLEB's criterion, measured once per block: the calibration perplexity of the model with that block
removed (one pass per block; the block is skipped by a temporary surgery, no copy of the model).
Every registered score is then rated by the Spearman rank correlation of its removability with the
oracle's ranking (+1: the score orders blocks exactly as removing them hurts; 0: no better than chance).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from prune.adapters import num_blocks
from prune.heldout import packed_perplexity
from prune.scores import get_score
from prune.surgery import blocks_removed


@dataclass
class Oracle:
    """Single-block removal perplexities and each score's rank agreement with them.

    Attributes:
        dense: calibration perplexity of the whole model.
        removed: calibration perplexity with block ``i`` alone removed, for every block.
        spearman: score name -> Spearman correlation of its removability with ``-removed``.
        tokens: calibration tokens each pass saw.
    """

    dense: float
    removed: list[float]
    spearman: dict[str, float]
    tokens: int

    def as_dict(self) -> dict:
        """JSON-ready."""
        return {"dense": self.dense, "removed": self.removed, "spearman": self.spearman, "tokens": self.tokens}


def removal_perplexity(model: nn.Module, token_ids: torch.Tensor, removed: list[int], batch_size: int = 4,
                       cache: dict | None = None) -> float:
    """Calibration perplexity with the blocks ``removed`` skipped; ``cache`` remembers it by block set.

    The oracle and SLEB's greedy search measure the same sets (the oracle's single removals are SLEB's
    first step, and a drop of 4 starts with the drop of 2 on the same calibration), so a ``cache`` kept
    for one model and one calibration saves every repeat. A cache must never outlive either.
    """
    key = tuple(sorted(removed))
    if cache is not None and key in cache:
        return cache[key]
    with blocks_removed(model, list(key)):
        value = packed_perplexity(model, token_ids, batch_size, progress=False)
    if cache is not None:
        cache[key] = value
    return value


def removal_cache(memo: dict | None) -> dict | None:
    """The block-set -> perplexity cache inside a run's memo (``prune.pipeline.Scored.memo``)."""
    return None if memo is None else memo.setdefault("removal-ppl", {})


def single_removal_perplexities(model: nn.Module, token_ids: torch.Tensor, batch_size: int = 4,
                                progress: bool = True, cache: dict | None = None) -> list[float]:
    """Calibration perplexity with each block alone removed (one pass per block, the model restored after)."""
    return [removal_perplexity(model, token_ids, [block], batch_size, cache)
            for block in tqdm(range(num_blocks(model)), desc="oracle: remove each block", unit="block",
                              disable=not progress)]


def _ranks(values: list[float]) -> torch.Tensor:
    """Ranks 1..n, ties sharing their mean rank."""
    x = torch.tensor(values, dtype=torch.float64)
    order = torch.argsort(x)
    ranks = torch.empty_like(x)
    ranks[order] = torch.arange(1, len(values) + 1, dtype=torch.float64)
    for value in torch.unique(x):
        tied = x == value
        if int(tied.sum()) > 1:
            ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation (Pearson on tie-averaged ranks); NaN when either side is constant."""
    if len(a) != len(b):
        raise ValueError(f"spearman of {len(a)} and {len(b)} values")
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = torch.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / denominator) if denominator > 0 else float("nan")


def score_agreement(scores: dict[str, list[float]], removed: list[float]) -> dict[str, float]:
    """Each score's removability against the oracle's (lower perplexity after removal = more removable)."""
    target = [-p for p in removed]
    return {name: spearman(get_score(name).removability(values), target) for name, values in scores.items()}


def run_oracle(model: nn.Module, token_ids: torch.Tensor, scores: dict[str, list[float]], batch_size: int = 4,
               progress: bool = True, cache: dict | None = None) -> Oracle:
    """Dense and single-removal calibration perplexities, and every score's Spearman with them.

    ``cache``: see :func:`removal_perplexity`.
    """
    dense = removal_perplexity(model, token_ids, [], batch_size, cache)
    removed = single_removal_perplexities(model, token_ids, batch_size, progress, cache)
    return Oracle(dense, removed, score_agreement(scores, removed), int(token_ids.numel()))


def oracle_table(oracle: Oracle, scores: dict[str, list[float]] | None = None) -> str:
    """Markdown: the Spearman of every score, then the perplexity with each block removed (with the scores)."""
    lines = [f"Oracle: calibration perplexity with each block alone removed ({oracle.tokens} tokens; dense "
             f"{oracle.dense:.3f}). Spearman rank correlation of each score with it (+1 = ranks blocks as "
             "removal really hurts):", "", "| score | Spearman |", "|---|---:|"]
    lines += [f"| {name} | {rho:+.3f} |" for name, rho in sorted(oracle.spearman.items(), key=lambda kv: -kv[1])]
    names = list(scores or {})
    lines += ["", "| block | ppl without it | x dense | " + " | ".join(names) + (" |" if names else ""),
              "|---:|---:|---:|" + "---:|" * len(names)]
    for block, ppl in enumerate(oracle.removed):
        cells = "".join(f" {scores[n][block]:.4f} |" for n in names)
        lines.append(f"| {block} | {ppl:.3f} | {ppl / oracle.dense:.3f} |{cells}")
    return "\n".join(lines)
