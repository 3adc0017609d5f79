"""The two ways a prune run removes: whole blocks, or attention / MLP sub-layers.

:func:`prune.pipeline.runner.run_prune` is one skeleton (load, calibrate, score, remove, export); what differs
between the ways sits here, behind one signature: :func:`remove_blocks` selects blocks (a registered
selection, a budget met by re-selecting) and removes or replaces them; :func:`remove_units` ranks the
candidate sub-layers and removes them (``prune.selection.sublayers``). Each returns a :class:`Removal`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from torch import nn

from prune.data.calibration import CalibrationData
from prune.loading.offload import streamed
from prune.measure.moments import StateMoments
from prune.measure.scores import get_score
from prune.model.adapters import get_blocks
from prune.model.surgery import blocks_removed
from prune.pipeline.resolve import Amounts
from prune.replace import parameter_count, replace_blocks_
from prune.selection.budget import blocks_for_params
from prune.selection.oracle import removal_cache, run_oracle
from prune.selection.repaired import replace_as_measured_
from prune.selection.strategies import Chosen, SelectionInput, choose_blocks, span_candidates
from prune.selection.sublayers import (
    MEASURE_SEQUENCES,
    Unit,
    measured_costs,
    rank_measured,
    rank_units,
    remove_units_,
    unit_parameters,
)

if TYPE_CHECKING:
    from prune.pipeline.config import PruneConfig


@dataclass
class Removal:
    """What a run removed.

    Attributes:
        dropped: blocks removed whole (original numbering).
        sections: entries of ``layercut.json`` only this way writes, in their order.
        budget: the amount a target asked for and met (``target_params`` / ``target_speedup``), or None.
        amounts: the amounts the removal met (a met block budget is its ``drop``); the caller's config is
            never changed.
        changed: whether the model changed (its held-out perplexity is then measured again).
        removal_only: a repaired run's held-out perplexity with the same blocks only removed, where measured.
    """

    dropped: list[int]
    sections: dict
    budget: dict | None
    amounts: Amounts
    changed: bool
    removal_only: float | None = None

    def recorded(self, config: PruneConfig) -> dict:
        """``config`` as ``layercut.json`` records it: a met block budget is written as the ``drop`` it became."""
        written = {**asdict(config), "replace": config.replace.to_dict()}  # the flat layout of replace:
        if self.budget is not None and not self.amounts.is_sublayer:
            written.update(drop=self.budget["drop"], target_params=None, target_speedup=None)
        return written


def selection_input(model: nn.Module, calibration: CalibrationData, moments: StateMoments, scores: dict,
                    config: PruneConfig, amounts: Amounts, memo: dict | None = None) -> SelectionInput:
    """What the selection strategy sees for ``amounts.drop`` / ``amounts.protected`` and ``config.score``."""
    return SelectionInput(
        score=get_score(config.score),
        moments=moments,
        values=scores[config.score],
        count=amounts.drop,
        protected=list(amounts.protected),
        model=model,
        token_ids=calibration.token_ids,
        batch_size=config.batch_size,
        memo=memo,
        replace=config.replace,
    )


def planned_blocks(model: nn.Module, calibration: CalibrationData, moments: StateMoments, scores: dict,
                   config: PruneConfig, amounts: Amounts, memo: dict | None = None) -> list[int]:
    """The blocks ``config.select`` picks for ``amounts`` (none without a drop; ``memo``: ``Scored.memo``)."""
    if amounts.drop is None:
        return []
    return chosen_blocks(model, calibration, moments, scores, config, amounts, memo).blocks


def chosen_blocks(model: nn.Module, calibration: CalibrationData, moments: StateMoments, scores: dict,
                  config: PruneConfig, amounts: Amounts, memo: dict | None = None) -> Chosen:
    """What ``config.select`` chooses for ``amounts``: the blocks and, for a selection that steps, its trace."""
    if amounts.drop is None:
        return Chosen([])
    return choose_blocks(config.select, selection_input(model, calibration, moments, scores, config, amounts, memo))


def span_report(model: nn.Module, calibration: CalibrationData, moments: StateMoments, scores: dict,
                config: PruneConfig, amounts: Amounts) -> list[dict]:
    """For ``--select span``: every candidate span with the score it was ranked by, best first."""
    inputs = selection_input(model, calibration, moments, scores, config, amounts)
    return [{"blocks": [start, start + inputs.count - 1], config.score: inputs.score.removability([value])[0]}
            for start, value in span_candidates(inputs)]  # removability is its own inverse: the raw score


def block_budget(model: nn.Module, calibration: CalibrationData, moments: StateMoments, scores: dict,
                 config: PruneConfig, amounts: Amounts, memo: dict | None = None) -> dict | None:
    """The block count a ``target_params`` / ``target_speedup`` asks for (None for a plain ``drop``)."""
    if amounts.target_speedup is not None:
        count, drop = amounts.num_blocks, amounts.drop
        return {"target_speedup": amounts.target_speedup, "drop": drop, "ideal_speedup": count / (count - drop)}
    if amounts.target_params is None:
        return None
    _, blocks = get_blocks(model)

    def select(k: int) -> list[int]:
        return planned_blocks(model, calibration, moments, scores, config, amounts.with_drop(k), memo)

    sizes = [parameter_count(b) for b in blocks]
    drop = blocks_for_params(amounts.target_params, amounts.params, sizes, select, amounts.free)
    return {"target_params": amounts.target_params, "drop": drop}


def remove_blocks(model: nn.Module, calibration: CalibrationData, moments: StateMoments, scores: dict,
                  config: PruneConfig, amounts: Amounts, memo: dict,
                  measure: Callable[[nn.Module], float] | None = None) -> Removal:
    """Whole blocks: the oracle if asked, the budget, the selection, then removal or replacement.

    ``measure`` (a held-out perplexity) is also taken with the chosen blocks only removed, before the repair, so
    that the run says what its repair gained over removal of the same blocks.
    """
    oracle = None
    if config.oracle:
        with streamed(model):  # a skeleton's passes read each block as it is called
            oracle = run_oracle(model, calibration.token_ids, scores, config.batch_size, cache=removal_cache(memo))
    budget = block_budget(model, calibration, moments, scores, config, amounts, memo)
    if budget is not None:
        amounts = amounts.with_drop(budget["drop"])
    chosen = chosen_blocks(model, calibration, moments, scores, config, amounts, memo)
    dropped = chosen.blocks
    sections = {}
    if chosen.trace:  # a selection that steps: what it measured at each step
        sections["selection"] = chosen.trace
    if dropped and config.select == "span":
        sections["span_scores"] = span_report(model, calibration, moments, scores, config, amounts)
    removal_only = None
    if dropped and measure is not None:
        with blocks_removed(model, dropped):
            removal_only = measure(model)
    if dropped and config.replace.fit_rows == "fitting":  # the repair a repaired selection measured, as it was
        replace_as_measured_(model, dropped, calibration.token_ids, config.replace, memo)
    elif dropped:
        replace_blocks_(model, dropped, calibration.token_ids, config.replace, moments)
    if oracle is not None:
        sections["oracle"] = oracle.as_dict()
    return Removal(dropped, sections, budget, amounts, changed=bool(dropped), removal_only=removal_only)


def remove_units(model: nn.Module, calibration: CalibrationData, moments: StateMoments, scores: dict,
                 config: PruneConfig, amounts: Amounts, memo: dict, _measure: object = None) -> Removal:
    """Sub-layers: rank the candidates (by a score, or measured), meet the amount, remove them."""
    candidates, ids = list(amounts.candidates), calibration.token_ids
    if config.select == "measured":
        costs = measured_costs(model, ids, candidates, config.batch_size, memo.setdefault("sublayer-removal-ppl", {}))
        ranked = rank_measured(costs, {u: unit_parameters(model, u) for u in candidates}, candidates)
    else:
        ranked = rank_units(scores[config.score], get_score(config.score).removability, candidates)
    budget = _unit_budget(model, amounts, ranked)
    count = amounts.drop if budget is None else budget["drop"]
    removal = remove_units_(model, ranked[:count], ids[:1, : min(32, ids.shape[1])])
    labels = [Unit.at(u).label() for u in range(2 * amounts.num_blocks)]
    # per-block scores: none; the streamed pass rated sub-layers, reported under their labels
    sections = {"scores": {}, "unit": list(amounts.units), "sublayers": removal,
                "sublayer_scores": {"units": labels, **scores}}
    if config.select == "measured":
        sections["sublayer_measured"] = {"sequences": min(MEASURE_SEQUENCES, ids.shape[0]),
                                         "perplexity": dict(costs), "ranked": [u.label() for u in ranked]}
    return Removal(removal["blocks_removed_whole"], sections, budget, amounts.with_drop(count), changed=True)


def _unit_budget(model: nn.Module, amounts: Amounts, ranked: list[Unit]) -> dict | None:
    """The sub-layer count ``target_params`` asks for, removing in ``ranked`` order (None for a plain ``drop``)."""
    if amounts.target_params is None:
        return None
    sizes = [unit_parameters(model, unit) for unit in ranked]
    # ranked order: the K most removable units are positions 0..K-1
    count = blocks_for_params(amounts.target_params, amounts.params, sizes, lambda k: list(range(k)), len(ranked),
                              what="removable sub-layer")
    return {"target_params": amounts.target_params, "drop": count}
