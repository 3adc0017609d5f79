"""Which blocks go: the K most removable, the best contiguous span, greedy re-scoring, or measured perplexity.

``topk``, ``span`` and ``greedy`` rank by a score; ``greedy-ppl`` (SLEB) measures the calibration
perplexity of every candidate removal; ``measured`` ranks once by what removing each block alone
costs (SLEB's first step); ``last`` takes the deepest blocks (reverse-order pruning). ``repaired-greedy``
(``-kl``), ``repaired-once`` and ``repaired-fast`` measure the model with candidate blocks removed *and
repaired* by the run's own method (``prune.selection.repaired``).

Selections are registered by name, each declaring what it is (:class:`Selection`: its help line, whether
it measures the model, whether it ranks sub-layers); ``prune.run --select``'s help and the checks of
``prune.pipeline.config`` read those declarations.

By default the first and the last block are protected: the first turns token embeddings into the
working representation and the last prepares the state for the LM head, and removing either one
breaks small models.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from tqdm.auto import tqdm

from prune.errors import LayercutError
from prune.loading.offload import streamed
from prune.measure.blockwise import stream_any
from prune.measure.moments import StateMoments
from prune.measure.scores import Score, block_scores
from prune.model.adapters import is_offloaded
from prune.model.surgery import blocks_removed
from prune.registry import Registry
from prune.selection.map_errors import MAP_ERRORS, map_errors, map_errors_of_shares
from prune.selection.oracle import removal_cache, removal_perplexities
from prune.selection.repaired import RepairedCosts, update_share
from prune.selection.repaired_order import greedy_order, single_costs

if TYPE_CHECKING:
    from prune.replace import ReplaceConfig

logger = logging.getLogger(__name__)

DEFAULT_PROTECT = "0,-1"


def parse_drop(value: str | int, num_blocks: int, protected: Sequence[int] = ()) -> int:
    """``4`` or ``25%`` (of the model's blocks, rounded) -> a block count, validated.

    Args:
        value: the amount as typed.
        num_blocks: the model's blocks (twice them for a sub-layer count).
        protected: blocks that never go; a count of all the blocks names the true maximum, the blocks
            left once the protected ones are kept, so the number it suggests is one that runs.
    """
    text = str(value).strip()
    try:
        count = round(num_blocks * float(text[:-1]) / 100) if text.endswith("%") else int(text)
    except ValueError:
        raise LayercutError(f"--drop must be a count like 4 or a share like 25%, got '{value}'") from None
    if count <= 0:
        raise LayercutError(f"--drop {value} removes no block: ask for at least 1")
    if count >= num_blocks:
        most = num_blocks - max(1, len(protected))
        why = f" (blocks {list(protected)} are protected; --protect none allows {num_blocks - 1})" if protected else ""
        raise LayercutError(
            f"--drop {value} asks for {count} of the model's {num_blocks} blocks: drop at most {most}{why}"
        )
    return count


def parse_protect(value: str | Sequence[int] | None, num_blocks: int) -> list[int]:
    """``"0,-1"`` (negative counts from the end), ``"none"``, or a list -> sorted block indices."""
    if value is None or value == "none" or value == "":
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        indices = [int(i) for i in items]
    except ValueError:
        raise LayercutError(f"--protect takes block indices like 0,-1 or 'none', got '{value}'") from None
    if any(not -num_blocks <= i < num_blocks for i in indices):
        raise LayercutError(f"--protect {value}: the model has blocks 0..{num_blocks - 1}")
    return sorted({i % num_blocks for i in indices})


@dataclass
class SelectionInput:
    """What a selection strategy sees."""

    score: Score
    moments: StateMoments
    values: list[float]  # the score for every block
    count: int
    protected: list[int]
    model: nn.Module | None = None
    token_ids: torch.Tensor | None = None
    batch_size: int = 4
    # measurements kept across runs on the same model and calibration (``prune.pipeline.runner.Scored.memo``):
    # greedy selections reuse the removals a smaller drop already chose
    memo: dict | None = None
    # the run's repair: what the repaired selections fit and measure (None: bare removal)
    replace: ReplaceConfig | None = None


@dataclass(frozen=True)
class Chosen:
    """What a selection chose: the blocks (or units) and, for a selection that steps, what each step measured.

    Attributes:
        blocks: the chosen blocks, in the strategy's order.
        trace: ``layercut.json``'s ``selection`` entry (the selection, its criterion and repair, every step's
            candidates and costs); None for a selection that does not step.
    """

    blocks: list[int]
    trace: dict | None = None


@dataclass(frozen=True)
class Selection:
    """A registered selection: its strategy and what it declares of itself when it registers.

    Attributes:
        name: the ``--select`` value.
        run: ``(SelectionInput) -> blocks`` (or a :class:`Chosen` with its trace), the strategy.
        help: one line for ``prune.run --select``'s help.
        measures: how it runs the model on the calibration rather than reading the scoring pass's scores
            ("" for a selection that only reads them): "greedy" measures every remaining block at each of its K
            steps, "once" each free block once, "pass" takes one pass. The planner times it by this pattern; on
            a skeleton (``--offload sequential``) its whole passes read each block as it is called
            (:func:`choose_blocks`).
        units: it also ranks sub-layer units (``--unit attention,mlp``, ``prune.selection.sublayers``).
        repairs: each candidate set is repaired by the run's method before it is measured.
        rows: for a repaired selection, which calibration rows measure a set (``prune.selection.repaired.ROWS``):
            "eighth" (one in eight; the others fit) or "crossfit" (every row, by repairs fitted on the other half).
        prepare: for a selection about to run for several repairs on the same model and calibration (``prune.ship``
            runs each one-pass selection once per repair), the work they share, done once into the run's memo:
            ``(memo, model, token_ids, replaces, batch_size, moments) -> None``, ``moments`` the scoring pass's
            statistics; None where there is none.
        block_solves: least-squares maps it solves per block from a pass's statistics, at the hidden width, each
            with its own decomposition and a check of its error per share of the update. The planner counts them
            (``prune.planner.rates.block_solve_flops``): negligible at SmolLM2-135M's width, 2 s a block at a
            Llama-3.2-1B shape's 2,048, unplanned (2026-12-05).
    """

    name: str
    run: Callable[[SelectionInput], list[int] | Chosen]
    help: str = ""
    measures: str = ""
    units: bool = False
    repairs: bool = False
    rows: str = "eighth"
    prepare: Callable[..., None] | None = None
    block_solves: int = 0

    def __call__(self, inputs: SelectionInput) -> list[int]:
        """The blocks (or units) the strategy chooses."""
        return self.choose(inputs).blocks

    def choose(self, inputs: SelectionInput) -> Chosen:
        """The blocks (or units) the strategy chooses, with its trace when it steps."""
        chosen = self.run(inputs)
        return chosen if isinstance(chosen, Chosen) else Chosen(list(chosen))


SELECTIONS: Registry[Selection] = Registry("selection")


def register_selection(name: str, help: str = "", *, measures: str | bool = "", units: bool = False,
                       repairs: bool = False, rows: str = "eighth", prepare: Callable[..., None] | None = None,
                       block_solves: int = 0):
    """Decorator registering a selection strategy in :data:`SELECTIONS` as ``name``, with what it declares.

    Args:
        name: the ``--select`` value.
        help: one line for ``--select``'s help.
        measures: how it measures the model (:attr:`Selection.measures`; True: "once").
        units: it ranks sub-layer units too (:attr:`Selection.units`).
        repairs: it repairs each candidate set before measuring it (:attr:`Selection.repairs`).
        rows: the rows a repaired selection measures on (:attr:`Selection.rows`).
        prepare: the work its runs for several repairs share (:attr:`Selection.prepare`).
        block_solves: the least-squares maps it solves per block (:attr:`Selection.block_solves`).
    """
    pattern = "once" if measures is True else measures or ""
    return SELECTIONS.decorator(name, lambda run: Selection(name, run, help, pattern, units, repairs, rows, prepare,
                                                            block_solves))


def measured_selections() -> tuple[str, ...]:
    """The selections that declare ``measures``: they run the model on the calibration (the planner times them)."""
    return tuple(name for name, selection in SELECTIONS.items() if selection.measures)


def pass_selections() -> list[Selection]:
    """The selections that repair each set and measure it in one pass.

    ``prune.ship`` runs each for every repair (its ``prepare`` once for all of them); its plan counts their
    ``block_solves``.
    """
    return [selection for selection in SELECTIONS.values() if selection.repairs and selection.measures == "pass"]


def unit_selections() -> tuple[str, ...]:
    """The selections that declare ``units``: those that rank sub-layers (``--unit attention,mlp``)."""
    return tuple(name for name, selection in SELECTIONS.items() if selection.units)


def selection_help() -> str:
    """``--select``'s help: each registered selection's name and help line, in registration order."""
    return "; ".join(f"{name}: {selection.help}" if selection.help else name for name, selection in SELECTIONS.items())


def select_blocks(method: str, inputs: SelectionInput) -> list[int]:
    """Run the named strategy; checks there are enough unprotected blocks first."""
    return choose_blocks(method, inputs).blocks


def choose_blocks(method: str, inputs: SelectionInput) -> Chosen:
    """Run the named strategy (enough unprotected blocks checked first): its blocks sorted, and its trace."""
    strategy = SELECTIONS.get(method)
    check_enough_free(inputs.count, len(inputs.values), inputs.protected)
    # a skeleton (--offload sequential) runs the whole passes a measuring selection takes one block at a time
    with streamed(inputs.model):
        chosen = strategy.choose(inputs)
    return Chosen(sorted(chosen.blocks), chosen.trace)


def check_enough_free(count: int, num_blocks: int, protected: Sequence[int]) -> None:
    """``count`` blocks can go only if that many are not protected."""
    free = num_blocks - len(protected)
    if count > free:
        raise LayercutError(
            f"cannot drop {count} blocks: only {free} of {num_blocks} are not protected ({list(protected)}); "
            "lower --drop or pass --protect none"
        )


@register_selection("topk", "the K most removable blocks", units=True)
def _topk(inputs: SelectionInput) -> list[int]:
    ranked = sorted(range(len(inputs.values)), key=lambda b: -inputs.score.removability(inputs.values)[b])
    return [b for b in ranked if b not in inputs.protected][: inputs.count]


def span_removability(inputs: SelectionInput, start: int) -> float:
    """How removable the span ``start .. start + count - 1`` is.

    A score that compares states (:attr:`prune.measure.scores.Score.span`) compares the span's endpoints
    directly (Gromov et al.) when all pairwise cosines were streamed; otherwise the per-block values
    are summed.
    """
    end = start + inputs.count
    if inputs.score.span is not None and inputs.moments.cosine_pairs == "all":
        return inputs.score.removability([inputs.score.span(inputs.moments, start, end)])[0]
    return sum(inputs.score.removability(inputs.values)[start:end])


def span_candidates(inputs: SelectionInput) -> list[tuple[int, float]]:
    """Every unprotected span of ``count`` blocks as (first block, removability), most removable first."""
    starts = [
        s
        for s in range(len(inputs.values) - inputs.count + 1)
        if not any(b in inputs.protected for b in range(s, s + inputs.count))
    ]
    if not starts:
        raise LayercutError(
            f"no contiguous span of {inputs.count} unprotected blocks: lower --drop or change --protect"
        )
    return sorted(((s, span_removability(inputs, s)) for s in starts), key=lambda c: -c[1])


@register_selection("span", "best contiguous K")
def _span(inputs: SelectionInput) -> list[int]:
    best = span_candidates(inputs)[0][0]
    return list(range(best, best + inputs.count))


@register_selection("greedy", "drop one, re-score, repeat")
def _greedy(inputs: SelectionInput) -> list[int]:
    """Remove the most removable block, re-score the shallower model, repeat."""
    if inputs.model is None or inputs.token_ids is None:
        raise ValueError("greedy selection needs the model and calibration tokens")
    # each step depends only on the steps before it: the order chosen for a smaller drop is this one's prefix
    order = _memo(inputs, ("greedy", inputs.score.name, tuple(inputs.protected)), list)
    chosen = order[: inputs.count]
    while len(chosen) < inputs.count:
        values = inputs.values
        if chosen:
            with blocks_removed(inputs.model, chosen):
                # a skeleton scores block by block, each block's statistics freed once it is scored
                early = {"scores": [inputs.score.name]} if is_offloaded(inputs.model) else {}
                moments = stream_any(inputs.model, inputs.token_ids, batch_size=inputs.batch_size, progress=False,
                                     **early)
                values = block_scores(moments, [inputs.score.name])[inputs.score.name]
        remaining = [b for b in range(len(inputs.values)) if b not in chosen]
        removability = inputs.score.removability(values)
        best = max((p for p, b in enumerate(remaining) if b not in inputs.protected), key=lambda p: removability[p])
        chosen.append(remaining[best])
        order[:] = chosen
        logger.info("greedy step %d: drop block %d", len(chosen), remaining[best])
    return chosen


def _memo(inputs: SelectionInput, key: tuple, default):
    """The memo entry ``key`` (created from ``default()``); a throwaway one without a memo."""
    if inputs.memo is None:
        return default()
    if key not in inputs.memo:  # built only when missing: an entry may be a whole pass over the calibration
        inputs.memo[key] = default()
    return inputs.memo[key]


@register_selection("greedy-ppl", "drop the block whose removal costs the least calibration perplexity, repeat (SLEB)",
                    measures="greedy")
def _greedy_ppl(inputs: SelectionInput) -> list[int]:
    """SLEB: remove, one at a time, the block whose removal leaves the lowest calibration perplexity.

    Costs one calibration pass per remaining candidate per removal (K x N passes); the score is unused.
    """
    if inputs.model is None or inputs.token_ids is None:
        raise ValueError("greedy-ppl selection needs the model and calibration tokens")
    cache = removal_cache(inputs.memo)  # shared with the oracle: its single removals are the first step
    chosen: list[int] = []
    blocks = len(inputs.values)
    free = blocks - len(inputs.protected)
    bar = tqdm(total=sum(free - k for k in range(inputs.count)), desc="greedy-ppl", unit="pass")
    while len(chosen) < inputs.count:
        candidates = [b for b in range(blocks) if b not in chosen and b not in inputs.protected]
        perplexities = removal_perplexities(inputs.model, inputs.token_ids, chosen, candidates, inputs.batch_size,
                                            cache, bar)
        best = min(candidates, key=lambda b: perplexities[b])
        chosen.append(best)
        logger.info("greedy-ppl step %d: drop block %d (calibration perplexity %.3f)", len(chosen), best,
                    perplexities[best])
    bar.close()
    return chosen


@register_selection("measured", "the K whose removal alone costs the least calibration perplexity (one pass each)",
                    measures="once", units=True)
def _measured(inputs: SelectionInput) -> list[int]:
    """The ``count`` blocks whose removal alone leaves the lowest calibration perplexity.

    One pass per candidate block (N, against greedy-ppl's K x N); the score is unused. Interactions
    between removals are not measured: that is what greedy-ppl pays its extra passes for.
    """
    if inputs.model is None or inputs.token_ids is None:
        raise ValueError("measured selection needs the model and calibration tokens")
    cache = removal_cache(inputs.memo)  # the oracle's and greedy-ppl's first step measure the same sets
    candidates = [b for b in range(len(inputs.values)) if b not in inputs.protected]
    with tqdm(total=len(candidates), desc="measured: remove each block", unit="block") as bar:
        perplexities = removal_perplexities(inputs.model, inputs.token_ids, [], candidates, inputs.batch_size, cache,
                                            bar)
    return sorted(candidates, key=lambda b: perplexities[b])[: inputs.count]


@register_selection("last", "the deepest blocks")
def _last(inputs: SelectionInput) -> list[int]:
    """The deepest ``count`` unprotected blocks (reverse-order pruning); the score is unused."""
    return [b for b in reversed(range(len(inputs.values))) if b not in inputs.protected][: inputs.count]


def _repaired_costs(inputs: SelectionInput, name: str) -> RepairedCosts:
    if inputs.model is None or inputs.token_ids is None:
        raise ValueError(f"{name} selection needs the model and calibration tokens")
    from prune.replace import ReplaceConfig  # the repair defaults to bare removal when a caller gives none

    replace = inputs.replace if inputs.replace is not None else ReplaceConfig(method="none")
    return RepairedCosts(inputs.model, inputs.token_ids, replace, inputs.batch_size, inputs.memo,
                         rows=SELECTIONS.get(name).rows)


def _repaired_greedy(inputs: SelectionInput, criterion: str, name: str) -> Chosen:
    costs = _repaired_costs(inputs, name)
    free = len(inputs.values) - len(inputs.protected)
    with tqdm(total=sum(free - k for k in range(inputs.count)), desc=name, unit="set") as bar:
        order, steps = greedy_order(costs, inputs.count, inputs.protected, criterion, inputs.memo, bar)
    repair = inputs.replace.method if inputs.replace is not None else "none"
    trace = {"selection": name, "criterion": criterion, "repair": repair, "steps": steps}
    if costs.config.method != repair and repair != "none":  # measured through the method's stand-in
        trace["measured_as"] = costs.config.method
    return Chosen(order, trace)


@register_selection("repaired-greedy", "SLEB's loop on the model with each candidate removed and repaired by "
                    "--replace (perplexity on calibration rows the repairs were not fitted on)", measures="greedy",
                    repairs=True)
def _repaired_greedy_ppl(inputs: SelectionInput) -> list[int]:
    """SLEB's loop on what will be shipped.

    At each step every remaining block is removed and repaired by the run's method, the perplexity measured on
    calibration rows the repairs were not fitted on; the cheapest goes.
    """
    return _repaired_greedy(inputs, "ppl", "repaired-greedy")


@register_selection("repaired-greedy-kl", "repaired-greedy ranking each step by the KL of the next-token "
                    "distribution from the original model's (on the same rows)", measures="greedy",
                    repairs=True)
def _repaired_greedy_kl(inputs: SelectionInput) -> list[int]:
    """``repaired-greedy`` ranking each step by the KL of the next-token distribution from the original model's."""
    return _repaired_greedy(inputs, "kl", "repaired-greedy-kl")


@register_selection("repaired-greedy-crossfit", "repaired-greedy measured on every calibration row, each by repairs "
                    "fitted on the other half (two fits per span, eight times the measuring rows)", measures="greedy",
                    repairs=True, rows="crossfit")
def _repaired_greedy_crossfit(inputs: SelectionInput) -> list[int]:
    """``repaired-greedy`` whose perplexity pools both halves of the calibration, each measured by the other's fits.

    One row in eight (``repaired-greedy``) is 4 rows of the default 32: a step's choice can turn on which rows
    those are. Here every row measures, and still no repair is judged on a row it was fitted on.
    """
    return _repaired_greedy(inputs, "ppl", "repaired-greedy-crossfit")


@register_selection("repaired-greedy-kl-crossfit", "repaired-greedy-kl measured on every calibration row, each by "
                    "repairs fitted on the other half", measures="greedy", repairs=True, rows="crossfit")
def _repaired_greedy_kl_crossfit(inputs: SelectionInput) -> list[int]:
    """``repaired-greedy-kl`` on every calibration row, each measured by repairs fitted on the other half."""
    return _repaired_greedy(inputs, "kl", "repaired-greedy-kl-crossfit")


@register_selection("repaired-once", "the K whose own repair costs least", measures="once", repairs=True)
def _repaired_once(inputs: SelectionInput) -> list[int]:
    """The ``count`` blocks whose own repair costs least (measured perplexity; one set per block, no re-measuring)."""
    costs = _repaired_costs(inputs, "repaired-once")
    candidates = [b for b in range(len(inputs.values)) if b not in inputs.protected]
    with tqdm(total=len(candidates), desc="repaired-once", unit="set") as bar:
        measured = single_costs(costs, candidates, bar)
    return sorted(candidates, key=lambda b: (measured[b]["ppl"], b))[: inputs.count]


def _prepare_repaired_fast(memo: dict, model, token_ids, replaces, batch_size: int, moments=None) -> None:
    """The map errors of every share of the update among ``replaces``, from one pass rather than one per share.

    From none where the scoring pass's ``moments`` kept the measuring rows apart.
    """
    shares = [share for share in dict.fromkeys(map(update_share, replaces)) if (MAP_ERRORS, share) not in memo]
    if shares:
        found = map_errors_of_shares(model, token_ids, shares, batch_size=batch_size, moments=moments)
        memo.update({(MAP_ERRORS, share): errors for share, errors in found.items()})


@register_selection("repaired-fast", "the K whose least-squares map misses least on held-out rows (one pass)",
                    measures="pass", repairs=True, prepare=_prepare_repaired_fast, block_solves=1)
def _repaired_fast(inputs: SelectionInput) -> list[int]:
    """One pass: the ``count`` blocks whose least-squares map misses the least of their output on held-out rows."""
    if inputs.model is None or inputs.token_ids is None:
        raise ValueError("repaired-fast selection needs the model and calibration tokens")
    share = update_share(inputs.replace)
    # one pass per share of the update: the repairs applying the same share (prune.ship tries several) share it
    errors = _memo(inputs, (MAP_ERRORS, share),
                   lambda: map_errors(inputs.model, inputs.token_ids, share, batch_size=inputs.batch_size,
                                      moments=inputs.moments))
    candidates = [b for b in range(len(inputs.values)) if b not in inputs.protected]
    return sorted(candidates, key=lambda b: (errors[b], b))[: inputs.count]
