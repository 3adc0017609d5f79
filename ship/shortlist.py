"""The shortlist stage: block sets x servable repairs, each measured on calibration rows no fit saw.

One scoring pass; the block sets the one-pass measures choose (the top-k of every registered score, the best
span, and each selection that declares a one-pass measure of its repair), each crossed with every training-free
repair whose checkpoint is a plain one of the original architecture (the methods registered as servable and
``closed_form``, and removal). Each candidate is fitted on most calibration rows and measured on the rows no
fit saw (``prune.selection.repaired.RepairedCosts``): the KL of its next-token distribution from the original
model's, and its perplexity. The lowest KL wins; a candidate with over 2 % more parameters than removing its
blocks (a repair that unties a tied head), or more than ``--target-params``, is not one.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from prune.errors import LayercutError
from prune.loading.offload import streamed
from prune.measure.scores import SCORES
from prune.model.adapters import get_blocks
from prune.pipeline.config import PruneConfig
from prune.pipeline.removal import planned_blocks
from prune.pipeline.runner import Scored
from prune.replace import METHODS, ReplaceConfig, parameter_count
from prune.selection.repaired import RepairedCosts, fit_together, shared_references
from prune.selection.strategies import pass_selections
from ship.config import applicable, duration_words, oversize_note, servable_repairs
from ship.work import StageResult, write_json_atomic

# the planner's seconds for the stage, given the block sets and the repairs tried (None: every one); None: no plan
Replan = Callable[[list[list[int]], Collection[str] | None], float | None]


LEFT_OUT = "not measured: --time-budget left the shortlist"  # the note of a repair the budget never fitted


@dataclass
class Candidate:
    """One row of the shortlist: a block set (and the selections that chose it) with one repair."""

    blocks: list[int]
    repair: str
    chosen_by: list[str]  # "select/score" of each selection that chose this set
    params: int | None = None
    kl: float | None = None
    ppl: float | None = None
    note: str = ""

    @property
    def measured(self) -> bool:
        """Whether it was measured (and could be repaired)."""
        return self.kl is not None and math.isfinite(self.kl)

    @property
    def select(self) -> tuple[str, str]:
        """(``--select``, ``--score``) of the first selection that chose its blocks."""
        select, _, score = self.chosen_by[0].partition("/")
        return select, score

    def describe(self) -> str:
        """``blocks [..] with --replace R (KL k on rows no fit saw)``."""
        return f"blocks {self.blocks} with --replace {self.repair} (KL {self.kl:.4f} on rows no fit saw)"


@dataclass(kw_only=True)
class Shortlist(StageResult):
    """``shortlist.json``: every candidate, the chosen one's index and the reference figures."""

    count: int
    params_before: int
    candidates: list
    chosen: int
    dense_ppl: float | None = None
    measuring_rows: list | None = None
    not_applicable: dict = field(default_factory=dict)
    planned_seconds: float | None = None  # the planner's seconds for this stage once its candidates were known
    planned_peak: dict | None = None  # the planner's bytes per device for this stage once they were known

    def __post_init__(self):
        self.candidates = [c if isinstance(c, Candidate) else Candidate(**c) for c in self.candidates]
        if not 0 <= self.chosen < len(self.candidates):
            raise ValueError(f"'chosen' is {self.chosen}, and it lists {len(self.candidates)} candidates")

    def to_json(self) -> dict:
        """The JSON-ready fields, each candidate a dict."""
        return {**dataclasses.asdict(self), "candidates": [dataclasses.asdict(c) for c in self.candidates]}

    @property
    def best(self) -> Candidate:
        """The chosen candidate."""
        return self.candidates[self.chosen]

    def ranked(self) -> list[int]:
        """The candidates' indices by KL, the unmeasured last."""
        return sorted(range(len(self.candidates)),
                      key=lambda i: (self.candidates[i].kl is None, self.candidates[i].kl or 0))


class Progress:
    """The repairs measured so far, kept in a file as each one ends: a killed shortlist measures only the rest.

    A repair's kept figures are used only for the very candidates it measured (the same block sets, chosen by
    the same selections): the scoring pass of a resumed run is the same, so its candidates are.
    """

    def __init__(self, path: Path | None = None):
        self.path = path
        self.kept: dict[str, list[dict]] = {}
        if path is not None and path.is_file():
            try:
                kept = json.loads(path.read_text(encoding="utf-8"))
                self.kept = kept if isinstance(kept, dict) else {}
            except (json.JSONDecodeError, UnicodeDecodeError):  # a damaged file: those repairs are measured again
                self.kept = {}

    def restore(self, repair: str, todo: list[Candidate]) -> bool:
        """Fill ``todo`` (one repair's candidates) from the kept figures; whether they were all there."""
        kept = self.kept.get(repair)
        if not isinstance(kept, list) or len(kept) != len(todo):
            return False
        try:
            found = [Candidate(**row) for row in kept]
        except TypeError:
            return False
        if [(c.blocks, c.chosen_by) for c in found] != [(c.blocks, c.chosen_by) for c in todo]:
            return False
        for candidate, row in zip(todo, found, strict=True):
            candidate.params, candidate.kl, candidate.ppl, candidate.note = row.params, row.kl, row.ppl, row.note
        return True

    def keep(self, repair: str, todo: list[Candidate]) -> None:
        """Record one repair's measured candidates."""
        self.kept[repair] = [dataclasses.asdict(c) for c in todo]
        if self.path is not None:
            write_json_atomic(self.path, self.kept)


def make_shortlist(scored: Scored, model, config: PruneConfig, count: int, *, deadline: float | None = None,
                   elapsed: Callable[[], float] = lambda: 0.0, progress: Progress | None = None,
                   replan: Replan | None = None, say: Callable[[str], None] = print) -> Shortlist:
    """List the candidates of ``count`` blocks, measure them on rows no fit saw; the lowest KL is chosen.

    ``deadline``: seconds of ``elapsed()`` by which the stage should end: the repairs whose fits and measures the
    planner says do not fit in the time left are not tried, and once it has passed no further repair's
    candidates are measured (removal's still are: it fits nothing); ``progress``: the repairs an earlier, stopped
    call measured (kept as each repair ends); ``replan``: the planner's seconds for the stage given block sets and
    the repairs tried (None: every one), the whole stage's kept as ``planned_seconds`` (where the budget left
    repairs out, the plan of those it measured: what the stage's time is set against).
    """
    progress = progress or Progress()
    base = dataclasses.replace(config, drop=count, target_params=None, target_speedup=None, replace="none",
                               auto_replace=False, out=None)
    amounts = base.resolve(model)
    dense = parameter_count(model)
    target = config.resolve(model).target_params
    repairs = [(name, applicable(name, model)) for name in servable_repairs()]
    candidates = _candidates(scored, model, base, amounts, [name for name, why in repairs if why is None])
    planned = None if replan is None else replan([c.blocks for c in candidates], None)
    # the original runs once over the measuring rows, for every repair; a skeleton's whole passes (the measures)
    # read each block as it is called
    with shared_references(scored.memo), streamed(model):
        done = _measured(scored, model, config, count, candidates, repairs, dense, target, deadline, elapsed,
                         progress, None if planned is None else replan, say)
    # the repairs the budget left out before any fit (a repair fitted, then left unmeasured as the time ran out, or
    # over the size cap, is still in the plan); the plan of the rest, over their own block sets and removal's
    left_out = {c.repair for c in done.candidates if c.note.startswith(LEFT_OUT)}
    if planned is not None and left_out:
        tried = [name for name, why in repairs if why is None and name != "none" and name not in left_out]
        planned = replan([c.blocks for c in candidates if c.repair not in left_out], tried)
    done.planned_seconds = None if planned is None else round(planned, 1)
    return done


def _measured(scored: Scored, model, config: PruneConfig, count: int, candidates: list[Candidate], repairs: list,
              dense: int, target: int | None, deadline: float | None, elapsed: Callable[[], float],
              progress: Progress, replan: Replan | None, say: Callable[[str], None]) -> Shortlist:
    """Fit and measure every candidate (the ones ``progress`` kept aside); the lowest KL is chosen."""
    costs = {name: RepairedCosts(model, scored.calibration.token_ids,
                                 ReplaceConfig(method=name, batch_size=config.batch_size),
                                 batch_size=config.batch_size, memo=scored.memo)
             for name, why in repairs if why is None}
    restored = {repair for repair in costs if progress.restore(repair, [c for c in candidates if c.repair == repair])}
    for candidate in candidates:  # sized before any fit: a repair that makes the model bigger is not fitted
        if candidate.repair not in restored:
            _size(candidate, model, dense, target)
    if deadline is not None and replan is not None:
        _within_time(candidates, [r for r in costs if r != "none" and r not in restored], replan,
                     deadline - elapsed(), say)
    # one capture pass fits every span of every repair's candidates
    fit_together([(cost, [c.blocks for c in candidates if c.repair == repair and not c.note])
                  for repair, cost in costs.items() if repair not in restored], progress=True)
    with tqdm(total=len(candidates), desc="shortlist", unit="candidate") as bar:
        for repair, cost in costs.items():
            todo = [c for c in candidates if c.repair == repair]
            if repair in restored:
                bar.update(len(todo))
                continue
            # removal is measured whatever the time: it fits nothing, and each repair is judged beside it
            if repair != "none" and deadline is not None and elapsed() > deadline \
                    and any(c.measured for c in candidates):
                for candidate in todo:  # a note already there (too large, left out by the planner) says more
                    candidate.note = candidate.note or "not measured: --time-budget spent"
                bar.update(len(todo))
                continue
            todo = [c for c in todo if not c.note]
            for candidate, measured in zip(todo, cost.measure_sets([c.blocks for c in todo]), strict=True):
                candidate.kl, candidate.ppl = measured["kl"], measured["ppl"]
                if not math.isfinite(candidate.kl):
                    candidate.note = f"--replace {candidate.repair} cannot repair these spans"
            every = [c for c in candidates if c.repair == repair]
            progress.keep(repair, every)
            bar.update(len(every))
    measured = [c for c in candidates if c.measured]
    if not measured:
        raise LayercutError("no candidate could be measured: " + "; ".join(
            f"{c.repair} {c.blocks}: {c.note}" for c in candidates[:3]))
    best = min(measured, key=lambda c: (c.kl, c.params or 0))
    reference = costs["none"].measure_sets([()])[0] if "none" in costs else None
    rows = costs["none"].measure_ids.shape if "none" in costs else None
    return Shortlist(count=count, params_before=dense, dense_ppl=None if reference is None else reference["ppl"],
                     measuring_rows=None if rows is None else list(rows),
                     not_applicable={name: why for name, why in repairs if why is not None},
                     candidates=candidates, chosen=candidates.index(best))


def _within_time(candidates: list[Candidate], repairs: list[str], replan: Replan, left: float,
                 say: Callable[[str], None]) -> None:
    """Leave out the repairs whose fits and measures the planner says the time ``left`` cannot pay for.

    In ``repairs``' order (the best default first), each repair is kept while the planner's seconds for the
    kept ones' fits and measures, over removal's own, stay within ``left``; the others' candidates are noted
    as not measured (the card's table says why), so their fits, which one pass shares, are never paid for.
    Removal is always measured: it fits nothing.
    """
    def sets(names: Sequence[str]) -> list[list[int]]:
        return [c.blocks for c in candidates if c.repair in names or c.repair == "none"]

    alone = replan(sets(()), ())
    if alone is None:
        return
    kept: list[str] = []
    for repair in repairs:
        if not any(c.repair == repair and not c.note for c in candidates):
            continue  # none of its candidates is fitted (each larger than the budget's parameters)
        more = (replan(sets([*kept, repair]), [*kept, repair]) or 0.0) - alone
        if more <= left:
            kept.append(repair)
            continue
        for candidate in candidates:
            if candidate.repair == repair and not candidate.note:
                candidate.note = (f"{LEFT_OUT} {duration_words(max(left, 0))}, "
                                  f"and with this repair the planner gives its fits and measures "
                                  f"{duration_words(more)}")
        say(f"--time-budget: --replace {repair} is not tried (with it the planner gives the shortlist's fits and "
            f"measures {duration_words(more)}, and {duration_words(max(left, 0))} is left)")


def _candidates(scored: Scored, model, base: PruneConfig, amounts, repairs: list[str]) -> list[Candidate]:
    """Every block set a one-pass selection chooses, crossed with every repair (``repaired-fast``: its own)."""
    calibration, moments, scores = scored.calibration, scored.moments, scored.scores
    found: dict[tuple[tuple[int, ...], str], Candidate] = {}
    choices = [("topk", score) for score in SCORES] + [("span", "linearity")]
    for select, score in choices:
        blocks = tuple(planned_blocks(model, calibration, moments, scores,
                                      dataclasses.replace(base, select=select, score=score), amounts, scored.memo))
        for repair in repairs:
            found.setdefault((blocks, repair), Candidate(list(blocks), repair, [])).chosen_by.append(
                f"{select}/{score}")
    # a selection that declares a one-pass measure of each block's repair chooses for that repair alone
    for selection in pass_selections():
        if selection.prepare is not None:  # what its runs for every repair share, done once
            selection.prepare(scored.memo, model, calibration.token_ids,
                              [dataclasses.replace(base, replace=r).replace for r in repairs if r != "none"],
                              base.batch_size, moments)
        for repair in (r for r in repairs if r != "none"):
            variant = dataclasses.replace(base, select=selection.name, replace=repair)
            blocks = tuple(planned_blocks(model, calibration, moments, scores, variant, amounts, scored.memo))
            found.setdefault((blocks, repair), Candidate(list(blocks), repair, [])).chosen_by.append(
                f"{selection.name}/linearity")
    return list(found.values())


def _size(candidate: Candidate, model, dense: int, target: int | None) -> None:
    """Its parameter count: the kept blocks' and what its repair declares it adds (``Method.adds_params``).

    A candidate above removal's count + 2 % (or above ``--target-params``) is noted as not one
    (:func:`ship.config.oversize_note`).
    """
    removed = sum(p.numel() for b in candidate.blocks for p in get_blocks(model)[1][b].parameters())
    method = METHODS[candidate.repair]
    candidate.params = dense - removed + (method.adds_params(model) if method.adds_params else 0)
    candidate.note = oversize_note(candidate.params, dense - removed, target, candidate.repair) or ""
