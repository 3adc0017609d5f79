"""``repaired-fast``: each block ranked by the share of its output its least-squares map misses, in one pass.

The other repaired selections (:mod:`prune.selection.repaired`) measure a view of the model per candidate set;
this one measures no view at all. Each block's map is fitted on the fitting rows and judged on the measuring rows
of the same split (:func:`prune.selection.repaired.split_rows`), from the moments of one pass over the
calibration, or of none where the scoring pass kept the measuring rows apart. It reads statistics, never a
repaired model, and shares nothing with the measured costs but that split.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from prune.measure.blockwise import stream_any
from prune.measure.least_squares import fit_linear_map, residual_sums, scale_update
from prune.measure.moments import StateMoments
from prune.model.adapters import get_blocks
from prune.selection.repaired import measuring_rows, split_rows

# a run's memo holds each share's map errors (map_errors_of_shares) under (MAP_ERRORS, share): repaired-fast's
MAP_ERRORS = "map_errors"


def map_errors(model: nn.Module, token_ids: torch.Tensor, update_scale: float = 1.0, ridge: float = 0.0,
               batch_size: int = 4, moments: StateMoments | None = None) -> list[float]:
    """Per block: the share of its output's energy its least-squares map misses on rows the map was not fitted on.

    One pass over the calibration (the fitting rows, then the measuring rows of :func:`split_rows`), or none
    where the scoring pass's ``moments`` kept the measuring rows apart; the map is ``update_scale`` of the way
    from the identity to the least-squares fit, as ``--replace linear`` applies it.
    """
    return map_errors_of_shares(model, token_ids, [update_scale], ridge, batch_size, moments)[update_scale]


def map_errors_of_shares(model: nn.Module, token_ids: torch.Tensor, shares: Sequence[float], ridge: float = 0.0,
                         batch_size: int = 4, moments: StateMoments | None = None) -> dict[float, list[float]]:
    """:func:`map_errors` for every share of the update in ``shares``, all from the one pass.

    The moments do not depend on the share, only the map fitted from them does: ``prune.ship``, which runs
    ``repaired-fast`` for repairs applying 0.7 and 1.0 of their update, reads the calibration once, not twice.
    ``moments``: the scoring pass's statistics of ``model`` over ``token_ids``; where that pass kept the
    measuring rows' apart (``stream_moments(held_rows=measuring_rows(...))``), no pass runs here at all.
    """
    found = _split_moments(moments, token_ids, len(get_blocks(model)[1]))
    if found is not None:
        fitted, held = found
    else:
        fit_ids, measure_ids = split_rows(token_ids)
        fitted = stream_any(model, fit_ids, batch_size=batch_size, cosine_pairs="none", progress=False)
        held = stream_any(model, measure_ids, batch_size=batch_size, cosine_pairs="none", progress=False)
    errors: dict[float, list[float]] = {share: [] for share in shares}
    for block in range(len(get_blocks(model)[1])):
        for share, error in block_map_errors(fitted, held, block, shares, ridge).items():
            errors[share].append(error)
    return errors


def block_map_errors(fitted: StateMoments, held: StateMoments, block: int, shares: Sequence[float],
                     ridge: float = 0.0) -> dict[float, float]:
    """Block ``block``'s :func:`map_errors` at each share: its map fitted on ``fitted``, measured on ``held``."""
    full, moments = fit_linear_map(fitted.pair(block, block + 1), ridge), held.pair(block, block + 1)
    energy = torch.diagonal(moments.cyy) + moments.n * moments.mean_y**2  # uncentred: the state's own size
    return {share: float(residual_sums(scale_update(full, share), moments).sum() / energy.sum()) for share in shares}


def held_map_errors(shares: Sequence[float]) -> tuple[dict[float, list[float]], Callable[[StateMoments, int], None]]:
    """({share: per-block errors}, a block-by-block pass's ``after_block`` filling them) for a skeleton.

    A block-by-block scoring pass that keeps the measuring rows apart (``stream_moments_blockwise(held_rows=...)``)
    frees each state once its scores are taken; :func:`map_errors_of_shares` could not read them afterwards, so
    the errors of each block are taken as soon as its output is complete, as an in-memory pass's are afterwards.
    """
    errors: dict[float, list[float]] = {share: [] for share in shares}

    def after_block(moments: StateMoments, block: int) -> None:
        held = moments.held.moments
        for share, error in block_map_errors(moments.minus(held), held, block, shares).items():
            errors[share].append(error)

    return errors, after_block


def _split_moments(moments: StateMoments | None, token_ids: torch.Tensor,
                   blocks: int) -> tuple[StateMoments, StateMoments] | None:
    """(fitting rows', measuring rows') statistics from a pass that kept the measuring rows apart, else None.

    Only statistics of these very tokens, every block's (input, output) pair and the measuring rows of
    :func:`split_rows` serve; anything else (another calibration, sub-layer states) is measured afresh.
    """
    held = getattr(moments, "held", None)
    if held is None or not torch.equal(held.token_ids, token_ids):
        return None
    if held.rows != tuple(measuring_rows(token_ids)) or moments.num_states != blocks + 1 or any(
            (b, b + 1) not in moments.cross for b in range(blocks)):
        return None
    return moments.minus(held.moments), held.moments
