"""Per-block scores from streamed moments, registered by name.

Every score here comes from the same single pass (``prune.measure.moments.stream_moments``). Each one says
whether a high value marks a block as safe to remove, so selection can rank any of them. A score that
compares two residual states (``register_pair_score``) also rates a whole span by its endpoints, and
says so in :attr:`Score.span`: span selection and the pipeline ask the score, never its name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from prune.errors import LayercutError
from prune.measure.least_squares import explained_sum_of_squares
from prune.measure.moments import PairMoments, StateMoments
from prune.registry import Registry


@dataclass(frozen=True)
class Score:
    """A named per-block criterion.

    Attributes:
        name: registry key and CLI value.
        description: one line for tables and help.
        higher_is_removable: True when a high value means the block does little.
        compute: (moments, block index) -> value.
        span: (moments, first state, last state) -> value: the score of the span of blocks between two
            residual states, read from the cosines of every pair of states (``cosine_pairs="all"``);
            None for scores that only rate one block (span selection then sums the blocks' values).
    """

    name: str
    description: str
    higher_is_removable: bool
    compute: Callable[[StateMoments, int], float]
    span: Callable[[StateMoments, int, int], float] | None = None

    def removability(self, values: list[float]) -> list[float]:
        """Values oriented so that larger always means "safer to remove"."""
        return list(values) if self.higher_is_removable else [-v for v in values]


# Fewer tokens than this many times the hidden size make every least-squares fit (and so every
# linearity score) trivially close to exact.
MIN_TOKENS_PER_DIM = 4


def check_enough_tokens(tokens: int, dim: int, fix: str = "raise --samples or --seq-len") -> None:
    """Linear fits need n >= 4 d tokens; otherwise a one-line error that ends with ``fix``."""
    needed = MIN_TOKENS_PER_DIM * dim
    if tokens < needed:
        raise LayercutError(
            f"{tokens} calibration tokens are too few for hidden size {dim}: need at least {needed} "
            f"({MIN_TOKENS_PER_DIM} x hidden); {fix}"
        )


SCORES: Registry[Score] = Registry("score")


def register_score(name: str, description: str, higher_is_removable: bool):
    """Decorator registering a ``(moments, block) -> float`` function in :data:`SCORES` as ``name``."""
    return SCORES.decorator(name, lambda fn: Score(name, description, higher_is_removable, fn))


def register_pair_score(name: str, description: str, higher_is_removable: bool):
    """Decorator registering a ``(moments, i, j) -> float`` comparison of residual states ``i < j``.

    A block is rated by its input and output (``i = block``, ``j = block + 1``), and a span of blocks by
    the states around it (:attr:`Score.span`), which needs the cosines of every pair of states.
    """

    def add(fn: Callable[[StateMoments, int, int], float]) -> Callable[[StateMoments, int, int], float]:
        SCORES.register(name, Score(name, description, higher_is_removable, lambda m, b: fn(m, b, b + 1), span=fn))
        return fn

    return add


def get_score(name: str) -> Score:
    """Look up a score by name; the error lists the known ones."""
    return SCORES.get(name)


def linearity(moments: PairMoments, residual: bool = True) -> float:
    """Generalised-Procrustes linearity ``1 - min_A ||X~ A - Y~||_F^2`` of centred, normalised X, Y.

    Equals ``tr(Cxy^T Cxx^+ Cxy) / tr(Cyy)``. Without the residual, Y is replaced by Y - X, the
    block's own contribution to the residual stream.
    """
    if residual:
        explained = explained_sum_of_squares(moments.cxx, moments.cxy, moments.cxx_eigh())
        return float(explained / torch.trace(moments.cyy))
    cxu, tuu = moments.update_moments()
    return float(explained_sum_of_squares(moments.cxx, cxu, moments.cxx_eigh()) / tuu)


@register_score("linearity", "linearity of block output on input (with residual)", higher_is_removable=True)
def _linearity(moments: StateMoments, block: int) -> float:
    return linearity(moments.pair(block, block + 1), residual=True)


@register_score("linearity-nores", "linearity of the block's update (output - input)", higher_is_removable=True)
def _linearity_nores(moments: StateMoments, block: int) -> float:
    return linearity(moments.pair(block, block + 1), residual=False)


@register_pair_score("cosine", "mean cosine similarity of block input and output", higher_is_removable=True)
def _cosine(moments: StateMoments, first: int, last: int) -> float:
    return moments.mean_cosine(first, last)


@register_pair_score("angular", "mean angular distance arccos(cos)/pi of input and output",
                     higher_is_removable=False)
def _angular(moments: StateMoments, first: int, last: int) -> float:
    return moments.mean_angular_distance(first, last)


@register_pair_score("bi", "Block Influence 1 - mean cosine (ShortGPT)", higher_is_removable=False)
def _block_influence(moments: StateMoments, first: int, last: int) -> float:
    return 1.0 - moments.mean_cosine(first, last)


@register_pair_score("angular-last", "angular distance arccos(cos)/pi at each sequence's last token (Gromov et al.)",
                     higher_is_removable=False)
def _angular_last(moments: StateMoments, first: int, last: int) -> float:
    # Gromov et al. (and PruneMe) compare the states of each sequence's last token only: one row per sequence
    return moments.last_token_angular_distance(first, last)


def block_scores(moments: StateMoments, names: list[str] | None = None) -> dict[str, list[float]]:
    """Every requested score (default: all registered) for every block.

    A block-by-block pass (``prune.measure.blockwise``) has taken them while it held each block's statistics,
    which it then released; those values are returned.
    """
    names = names or list(SCORES)
    if moments.early_scores and all(name in moments.early_scores for name in names):
        return {name: list(moments.early_scores[name]) for name in names}
    if any(gram is None for gram in moments.grams[:-1]):
        missing = [name for name in names if name not in moments.early_scores]
        raise LayercutError(f"the block-by-block pass freed its statistics without taking {', '.join(missing)}: "
                            "pass every score wanted to prune.measure.blockwise.stream_moments_blockwise(scores=...)")
    blocks = range(moments.num_states - 1)
    return {name: [get_score(name).compute(moments, b) for b in blocks] for name in names}
