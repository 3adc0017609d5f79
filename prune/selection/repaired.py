"""Blocks chosen for their repair: the loss of the model with a set of blocks removed *and repaired*.

SLEB (``greedy-ppl``) measures the model with a candidate block removed and nothing in its place. A run
that repairs (a least-squares map, a fold, a patch) ships something else, and the block whose bare
removal costs least need not be the one whose repair costs least: on SmolLM2-135M removal alone ranks
block 11 among the worst (x4.61 perplexity), the linearity top-k leaves it in, and the two choices differ
by ~29 points of task retention at drop 8 (``reports/smollm2-135m-tasks-draw/``).

Here each candidate set is repaired by the run's own method before it is measured:

- the calibration rows are split: one row in :data:`MEASURE_EVERY` measures, the others fit. A fit never
  sees the rows its repair is judged on (a least-squares map fitted and scored on the same tokens would
  flatter the widest span). ``rows="crossfit"`` measures on every row instead: the even rows fit the
  repairs measured on the odd ones and the other way round, the two halves' costs pooled (eight times the
  measuring rows, each span fitted twice on half the text);
- each span is fitted alone on the original model's states (``prune.replace.fit_spans``, the independent
  fit), so a span's repair is fitted once and serves every set that contains it, at every step;
- a candidate set is measured on the measuring rows by its perplexity and by the KL of its next-token
  distribution from the original model's (both from one pass; the selection reads one of them). Only the
  blocks from the first one the candidate changes onward are run: the state entering it is the one the
  current set's model computes there, captured once per batch. A repair whose weights reach upstream of its
  cut (fold-rotate's change of basis) is put in by hooks on its host block instead, the same function.

``repaired-greedy`` (and ``-kl``) is SLEB's loop on these costs, ``repaired-once`` ranks every block once by
its own repaired cost (one step of it): both in :mod:`prune.selection.repaired_order`. ``repaired-fast`` measures
no view (:mod:`prune.selection.map_errors`): each block's least-squares map, fitted on the fitting rows, ranked
by the share of its output it fails to reproduce on the measuring rows, from one pass.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from prune.errors import LayercutError
from prune.measure.perplexity import LOGPROB_POSITIONS, log_prob_chunks, row_chunks, target_nll
from prune.memory import return_freed_memory
from prune.model.adapters import get_blocks, input_device
from prune.model.head import HeadOutputs, but_last, head_apart, outputs_apart
from prune.model.surgery import blocks_removed, drop_blocks_
from prune.replace import (
    LeastSquaresOptions,
    ReplaceConfig,
    Replacement,
    check_span_lengths,
    checked_spans,
    fit_spans,
    fit_spans_of_methods,
    get_method,
    install_replacements_,
    spans_of,
    surgered_view,
)
from prune.selection.oracle import logits_and_states, logits_from, states_entering

logger = logging.getLogger(__name__)

# One calibration row in this many measures a repair, the others fit it: on the default 32 x 512 tokens,
# 4 rows measure (2 of each half of the default mixture) and 28 fit.
MEASURE_EVERY = 8
# which calibration rows measure a repaired set: "eighth" (split_rows) or "crossfit" (crossfit_halves)
ROWS = ("eighth", "crossfit")
# a run's memo may hold, under this name, ``(repair key) -> dict`` making the costs dict of a repair (eval.compare
# keeps them on disk that way, so a comparison killed mid-selection resumes from its last finished step)
COSTS_STORE = "repaired-costs"
# a run's memo may hold, under this name, a dict in which every RepairedCosts keeps the original model's passes over
# the measuring rows (:func:`shared_references`)
REFERENCES = "repaired-references"


def _hosted(replacement: Replacement) -> Replacement:
    """``replacement`` as a change of its host block alone, where its patch offers that form.

    A patch that reaches upstream of the cut (fold-rotate's change of basis) would make every candidate pass
    start at the embedding; its hosted form is the same function and lets a pass start at the cut.
    """
    hosted = getattr(replacement.patch, "hosted", None)
    return replacement if hosted is None else dataclasses.replace(replacement, patch=hosted())


def _two_rows_or_more(token_ids: torch.Tensor) -> int:
    """The row count of ``token_ids``; refused under 2 (a fit and a measure need a row each)."""
    if token_ids.shape[0] < 2:
        raise LayercutError("a repaired selection fits on some calibration sequences and measures on others: pass "
                            "--samples 2 or more")
    return token_ids.shape[0]


def measuring_rows(token_ids: torch.Tensor, every: int = MEASURE_EVERY) -> list[int]:
    """The rows of ``token_ids`` [samples, seq] that measure (:func:`split_rows`): every-1, 2*every-1, ..."""
    rows = _two_rows_or_more(token_ids)
    return list(range(every - 1, rows, every)) or [rows - 1]


def split_rows(token_ids: torch.Tensor, every: int = MEASURE_EVERY) -> tuple[torch.Tensor, torch.Tensor]:
    """[samples, seq] -> (fitting rows, measuring rows): rows every-1, 2*every-1, ... measure."""
    measure = measuring_rows(token_ids, every)
    fit = [row for row in range(token_ids.shape[0]) if row not in measure]
    return token_ids[fit], token_ids[measure]


def crossfit_halves(token_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[samples, seq] -> [(even rows, odd rows), (odd rows, even rows)]: (fitting, measuring) rows of each half.

    Every row measures once, by repairs fitted on the other half; alternate rows keep a mixture's sources in
    both halves.
    """
    _two_rows_or_more(token_ids)
    even, odd = token_ids[0::2], token_ids[1::2]
    return [(even, odd), (odd, even)]


def repair_key(config: ReplaceConfig) -> str:
    """What a measured repaired cost depends on besides the model and its calibration: the repair's settings."""
    settings = {k: v for k, v in config.to_dict().items() if k not in ("progress", "batch_size", "fit", "fit_rows")}
    return json.dumps(settings, sort_keys=True, default=str)


class RepairedCosts:
    """Measured costs of block sets removed and repaired by one method, shared through a run's memo.

    Args:
        model: the original model (not surgered; it is changed only inside ``with`` blocks).
        token_ids: [samples, seq] calibration tokens, split by :func:`split_rows`.
        replace: the run's repair; ``none`` measures bare removal on the measuring rows.
        batch_size: sequences per pass.
        memo: ``prune.pipeline.runner.Scored.memo`` (fits and costs outlive one selection: a drop of 8 extends the
            drop of 4, another cell with the same repair reads the same costs); None keeps them here.
        rows: which rows measure (:data:`ROWS`): "eighth", one row in :data:`MEASURE_EVERY` (:func:`split_rows`),
            or "crossfit", every row, by repairs fitted on the other half (:func:`crossfit_halves`).
    """

    def __init__(self, model: nn.Module, token_ids: torch.Tensor, replace: ReplaceConfig, batch_size: int = 4,
                 memo: dict | None = None, rows: str = "eighth"):
        shipped = get_method(replace.method)
        # a method whose fit trains is measured through the closed-form repair it declares in its place, which
        # must still refuse the spans the shipped method refuses
        self._shipped = None
        if shipped.measured_as is not None:
            replace, self._shipped = shipped.measured_as(replace), shipped
        spec = get_method(replace.method)
        if spec.fitter is not None and "independent" not in spec.fits:
            raise LayercutError(f"a repaired selection fits each span alone on the original model's states, which "
                                f"--replace {replace.method} does not do: use --select greedy-ppl")
        if rows not in ROWS:
            raise ValueError(f"rows {rows!r}: one of {ROWS}")
        self.model = model
        self.rows = rows
        # (fitting rows, measuring rows) of each fold; the costs pool every fold's measuring rows
        self.folds = [split_rows(token_ids)] if rows == "eighth" else crossfit_halves(token_ids)
        # the run's progress setting is for its own fit; one bar for the whole selection is enough
        self.config = dataclasses.replace(replace, fit="independent", progress=False)
        self.batch_size = batch_size
        self.removes_only = spec.fitter is None
        # eighth keeps the key it had before crossfit existed: a memo written by an older run still reads
        self.key = repair_key(self.config) + ("" if rows == "eighth" else f" rows={rows}")
        shared = {} if memo is None else memo.setdefault(("repaired", self.key), {})
        # a fit's patch holds the modules of the model it was fitted on (a fold writes its host's projection):
        # whether the memo's fits are this model's (eval.compare's cells share one memo over copies of the model)
        self.owns_fits = shared.setdefault("model", weakref.ref(model))() is model
        # per fold: a span fitted on one fold's rows serves every set of that fold
        # (another copy fits its own: the measured costs, plain numbers, are shared all the same)
        fitted = shared if self.owns_fits else {}
        self._fold_fits: list[dict[tuple[int, ...], Replacement | None]] = [
            fitted.setdefault("fits" if fold == 0 else f"fits-{fold}", {}) for fold in range(len(self.folds))]
        if "costs" not in shared:
            store = memo.get(COSTS_STORE) if memo is not None else None
            shared["costs"] = store(self.key) if store is not None else {}
        self.costs: dict[tuple[int, ...], dict[str, float]] = shared["costs"]
        # the original's passes over the measuring rows, where the caller shares them (:func:`shared_references`)
        self.references: dict | None = None if memo is None else memo.get(REFERENCES)
        self._fold = 0  # the fold whose fits the views put in place
        self._plain = False  # set when starting a pass at a later block does not reproduce the whole pass
        self._checked = False
        self._apart: dict | None = None  # the views' head left to the measuring (prune.model.head.head_apart)
        self._asked = False

    @property
    def fit_ids(self) -> torch.Tensor:
        """The current fold's fitting rows."""
        return self.folds[self._fold][0]

    @property
    def measure_ids(self) -> torch.Tensor:
        """Every row a cost is measured on (all folds' measuring rows)."""
        return torch.cat([measure for _, measure in self.folds])

    @property
    def fits(self) -> dict[tuple[int, ...], Replacement | None]:
        """The current fold's fitted spans."""
        return self._fold_fits[self._fold]

    @contextmanager
    def _on_fold(self, fold: int) -> Iterator[None]:
        previous, self._fold = self._fold, fold
        try:
            yield
        finally:
            self._fold = previous

    # ---- fitting -------------------------------------------------------------------------------------------

    def _valid(self, blocks: Sequence[int]) -> bool:
        """Whether the method can replace every span of ``blocks`` (a method with a shortest span may not)."""
        spans = spans_of(sorted(blocks))
        try:
            check_span_lengths(self.config.method, spans)
            if self._shipped is not None and self._shipped.check_spans is not None:
                # what the shipped method refuses, its stand-in may not fit
                self._shipped.check_spans(self.model, spans, self._shipped.name)
        except LayercutError:
            return False
        return True

    def _fit(self, sets: Sequence[Sequence[int]]) -> None:
        """Fit, in one capture pass per fold, every span of ``sets`` not fitted yet on that fold's rows."""
        if self.removes_only:
            return
        for fold in range(len(self.folds)):
            with self._on_fold(fold):
                missing = self._missing(sets)
                if missing:
                    logger.info("repaired selection: fitting %d span(s) on %d rows", len(missing),
                                self.fit_ids.shape[0])
                    self.fits.update(fit_spans(self.model, missing, self.fit_ids, self.config))
                    return_freed_memory()  # the pass's statistics, freed into glibc's heap

    def _missing(self, sets: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """The spans of ``sets`` not fitted yet on the current fold's rows."""
        return list(dict.fromkeys(span for blocks in sets for span in spans_of(sorted(blocks))
                                  if span not in self.fits))

    def fit_sets(self, sets: Sequence[Sequence[int]]) -> None:
        """Fit every span of ``sets`` not fitted yet, all in one capture pass (rather than one pass per set)."""
        self._fit([s for s in sets if self._valid(s)])

    def replacements(self, blocks: Sequence[int]) -> list[Replacement]:
        """The fitted replacements of ``blocks``' spans (fitting those not fitted yet)."""
        self._fit([blocks])
        return [self.fits[span] for span in spans_of(sorted(blocks))]

    @contextmanager
    def view(self, blocks: Sequence[int]) -> Iterator[None]:
        """The model with ``blocks`` removed and repaired, for the length of a ``with``."""
        if self.removes_only:
            with blocks_removed(self.model, sorted(blocks)):
                yield
        else:
            with surgered_view(self.model, [_hosted(r) for r in self.replacements(blocks)]):
                yield

    def _signature(self, blocks: Sequence[int]) -> list[tuple]:
        """One entry per block of the view of ``blocks``.

        Two views' entries are equal exactly where the block computes the same thing: the same original block
        carrying the same replacements, or the same new block.
        """
        removed = set(blocks)
        done = [] if self.removes_only else self.replacements(blocks)
        hosted: dict[int, list[int]] = {}
        new = {r.span[0]: r for r in done if r.where == "block"}
        for r in done:
            if r.where != "block":
                hosted.setdefault(r.host, []).append(id(r))
        signature = []
        for i in range(len(get_blocks(self.model)[1])):
            if i in new:
                signature.append(("new", id(new[i])))
            if i not in removed:
                signature.append((i, tuple(sorted(hosted.get(i, [])))))
        return signature

    # ---- measuring ----------------------------------------------------------------------------------------

    def measure(self, base: Sequence[int], candidates: Sequence[int], bar=None) -> dict[int, dict[str, float]]:
        """``{candidate: {"ppl": .., "kl": ..}}`` for the sets ``base + [candidate]``, on the measuring rows.

        Sets measured before (in this memo) are not measured again; a set the method cannot replace costs inf.
        """
        base = sorted(set(base))
        keys = {c: tuple(sorted([*base, c])) for c in candidates}
        self._fill(base, list(keys.values()), bar)
        return {c: self.costs[keys[c]] for c in candidates}

    def measure_sets(self, sets: Sequence[Sequence[int]], bar=None) -> list[dict[str, float]]:
        """``{"ppl": .., "kl": ..}`` of each whole set removed and repaired, on the measuring rows, in order.

        Shares the memo with :meth:`measure` (a set measured by either is not measured again); a set the
        method cannot replace costs inf; the empty set is the original model.
        """
        keys = [tuple(sorted(set(blocks))) for blocks in sets]
        self._fill([], keys, bar)
        return [self.costs[key] for key in keys]

    def _fill(self, base: list[int], keys: list[tuple[int, ...]], bar) -> None:
        """Measure, against ``base``'s view, every set of ``keys`` not in the memo; inf where it cannot be repaired."""
        todo = list(dict.fromkeys(key for key in keys if key not in self.costs))
        for key in todo:
            if key and not self._valid(key):
                self.costs[key] = {"ppl": math.inf, "kl": math.inf}
        todo = [key for key in todo if key not in self.costs]
        if bar is not None:
            bar.update(len(keys) - len(todo))
        if todo:
            self._fit([*todo, base])
            for key, cost in zip(todo, self._measure_sets(base, todo, bar), strict=True):
                self.costs[key] = cost

    @torch.no_grad()
    def _measure_sets(self, base: list[int], sets: list[tuple[int, ...]], bar) -> list[dict[str, float]]:
        nll, kl = [0.0] * len(sets), [0.0] * len(sets)
        targets = 0
        for fold in range(len(self.folds)):
            with self._on_fold(fold):
                targets += self._measure_fold(base, sets, nll, kl, bar, last=fold == len(self.folds) - 1)
        return [{"ppl": math.exp(n / targets), "kl": k / targets} for n, k in zip(nll, kl, strict=True)]

    def _measure_fold(self, base: list[int], sets: list[tuple[int, ...]], nll: list[float], kl: list[float], bar,
                      last: bool) -> int:
        """Add each set's summed NLL and KL on the current fold's measuring rows; the targets counted."""
        base_signature = self._signature(base)
        starts = []
        for blocks in sets:
            signature = self._signature(blocks)
            starts.append(next((p for p, (a, b) in enumerate(zip(base_signature, signature, strict=False)) if a != b),
                               min(len(base_signature), len(signature))))
        measure_ids = self.folds[self._fold][1]
        targets = 0
        was_training = self.model.training
        self.model.eval()
        try:
            for first in range(0, measure_ids.shape[0], self.batch_size):
                batch = measure_ids[first : first + self.batch_size].to(input_device(self.model))
                # a view that differs from the base nowhere (the empty set against none) runs whole
                deepest = max((s for s in starts if s < len(get_blocks(self.model)[1])), default=0)
                if not base and self.references is not None:  # the original's pass, shared by every repair
                    dense, states = self._original_pass(first, batch)
                    states = states[: deepest + 1] if states is not None and deepest > 0 else None
                else:
                    dense = _log_probs(self.model(input_ids=batch, use_cache=False).logits)
                    states = None
                    if not self._plain and deepest > 0:
                        with self.view(base):
                            states = states_entering(self.model, batch, deepest)
                if states is None and not self._plain and deepest > 0:
                    logger.warning("repaired selection: a block ran more than once; measuring whole passes")
                    self._plain = True
                for i, blocks in enumerate(sets):
                    if not blocks:  # the original: its log-probabilities are at hand, its KL to itself nought
                        batch_nll, batch_kl = float(target_nll(dense, batch[:, 1:].to(dense.device)).sum()), 0.0
                    else:
                        with self.view(blocks):  # the head's products too, where they are left to the measuring
                            logits = self._logits(batch, starts[i], states)
                            batch_nll, batch_kl = _nll_and_kl(but_last(logits), dense, batch[:, 1:])
                        del logits  # a batch of vocabulary-wide logits: hand it back before the next view's
                        return_freed_memory()
                    nll[i] += batch_nll
                    kl[i] += batch_kl
                    if bar is not None and last and first + self.batch_size >= measure_ids.shape[0]:
                        bar.update(1)
                targets += batch.shape[0] * (batch.shape[1] - 1)
        finally:
            self.model.train(was_training)
        return targets

    def _original_pass(self, first: int, batch: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """The original model's log-probabilities on a batch of measuring rows and the state entering each block.

        Kept in :attr:`references` (shared by every repair measured on the same rows), so the repairs of a
        shortlist run the original once per batch rather than twice each.
        """
        key = (self.rows, self._fold, first)
        if key not in self.references:
            logits, states = logits_and_states(self.model, batch)
            self.references[key] = (_log_probs(logits), states)
        return self.references[key]

    def _head_apart(self) -> dict | None:
        """:func:`~prune.model.head.head_apart` of the model, asked once: the views share its head and final norm."""
        if not self._asked:
            self._asked, self._apart = True, head_apart(self.model)
        return self._apart

    def _logits(self, batch: torch.Tensor, start: int,
                states: list[torch.Tensor] | None) -> torch.Tensor | HeadOutputs:
        """The current view's logits, its blocks before ``start`` skipped when their output is at hand.

        Left to the head where it can be (:class:`~prune.model.head.HeadOutputs`): a candidate's whole logits were
        a fresh 2.1 GB tensor at every batch of Gemma-3-270M's measuring rows.
        """
        apart = self._head_apart()
        whole = lambda rows=None: outputs_apart(  # noqa: E731
            self.model, apart, lambda extra: self.model(input_ids=batch[:rows], use_cache=False, **extra).logits)
        # nothing changed in front (start 0), or nothing left to start at (the candidate's view ends there)
        if states is None or self._plain or not 0 < start < len(get_blocks(self.model)[1]):
            return whole()
        logits = outputs_apart(self.model, apart,
                               lambda extra: logits_from(self.model, batch, start, states[start], extra))
        if not self._checked:  # once: a block that passes on more than its hidden state breaks the shortcut
            self._checked = True
            # in float32 on the batch's first row alone (rows are whole, unpadded windows, so one tells what all
            # would): a whole pass of the batch was 19 s of a SmolLM2-135M shortlist's 141 s of measuring
            # (2026-12-04). A row alone runs its products in other shapes than the batch, which rounds them
            # otherwise: about 1e-6 in float32, but a 16-bit logit's last bit is above the 1e-3 the check allows,
            # so there the whole batch is compared, the same shapes on both sides
            rows = 1 if logits.dtype == torch.float32 else batch.shape[0]
            if not _all_close(logits, whole(rows), rows):
                logger.warning("repaired selection: starting at block %d differs from the whole pass; measuring "
                               "whole passes", start)
                self._plain = True
                return whole()
        return logits


@contextmanager
def shared_references(memo: dict) -> Iterator[None]:
    """Inside the ``with``, repairs measured with ``memo`` run the original once per batch of measuring rows.

    Not once per repair: its log-probabilities and states are kept (a batch's logits in float32, several hundred
    MB for a large vocabulary) and dropped at the end. Only the costs made inside the ``with`` share them.
    """
    memo[REFERENCES] = {}
    try:
        yield
    finally:
        memo.pop(REFERENCES, None)


def fit_together(wanted: Sequence[tuple[RepairedCosts, Sequence[Sequence[int]]]], progress: bool = False) -> None:
    """:meth:`RepairedCosts.fit_sets` of several repairs on the same model and rows, one capture pass per fold.

    ``prune.ship`` measures every servable repair: each fit is what its own pass would give it (the hooks of
    the others only record), and the calibration is read once rather than once per repair. ``progress``: a bar
    for the pass (ship's shortlist: on a 1B model block by block it is minutes with no other output).
    """
    wanted = [(costs, [s for s in sets if costs._valid(s)]) for costs, sets in wanted if not costs.removes_only]
    if not wanted:
        return
    first = wanted[0][0]
    for costs, _ in wanted:
        if costs.model is not first.model or len(costs.folds) != len(first.folds) or not all(
                torch.equal(a[0], b[0]) for a, b in zip(costs.folds, first.folds, strict=True)):
            raise ValueError("fit_together fits repairs of one model on the same rows")
    for fold in range(len(first.folds)):
        pending = []
        for costs, sets in wanted:
            with costs._on_fold(fold):
                pending.append((costs, costs._missing(sets)))
        fits = fit_spans_of_methods(first.model, [(dataclasses.replace(costs.config, progress=progress), missing)
                                                  for costs, missing in pending], first.folds[fold][0])
        for (costs, _), found in zip(pending, fits, strict=True):
            costs._fold_fits[fold].update(found)
        # the pass's statistics (MLP-wide Grams, their eigenvectors) are freed by now, but glibc keeps what fell
        # below its mmap threshold: on a 1B skeleton that held the resident set gigabytes above the measuring's
        return_freed_memory()


def replace_as_measured_(model: nn.Module, dropped: Sequence[int], token_ids: torch.Tensor, replace: ReplaceConfig,
                        memo: dict | None = None) -> list[dict]:
    """Replace ``dropped`` by the repair a repaired selection measured: fitted on its fitting rows alone.

    ``replace.fit_rows == "fitting"``. The fits a :class:`RepairedCosts` of the same repair and rows keeps in
    ``memo`` are put in place as they are (``prune.ship``'s build after its shortlist: no capture pass); the spans
    it lacks are fitted as it fits them, on the same rows in the same batches, so the checkpoint is the same
    whether the memo held them or not, and the KL measured on the other rows is the checkpoint's.
    """
    started = time.perf_counter()
    spec = get_method(replace.method)
    if spec.fitter is None:
        drop_blocks_(model, dropped)
        return []
    costs = RepairedCosts(model, token_ids, replace, batch_size=replace.batch_size, memo=memo)
    spans = checked_spans(model, dropped, replace.method)
    kept = sum(span in costs.fits for span in spans)
    replacements = costs.replacements(dropped)
    for replacement in replacements:
        replacement.record.update(fit="independent", fit_rows=costs.fit_ids.shape[0])
    records = install_replacements_(model, replacements)
    logger.info("replaced %d span(s) by %s fitted on %d of %d calibration rows (%d fit kept from the selection) "
                "in %.1f s", len(records), replace.method, costs.fit_ids.shape[0], token_ids.shape[0], kept,
                time.perf_counter() - started)
    return records


@torch.no_grad()
def divergence(model: nn.Module, original: nn.Module, token_ids: torch.Tensor, batch_size: int = 4) -> dict[str, float]:
    """``{"ppl": .., "kl": ..}`` of ``model`` on ``token_ids``, measured against ``original``.

    Its perplexity and the mean KL divergence of its next-token distribution from ``original``'s per predicted
    token: what a repaired selection measures of a view, here for two models. Two vocabulary-wide batches are held
    at once (``prune.planner.memory.divergence_logit_bytes``): the original's log-probabilities written over its
    logits, and the model's logits; one where the model's head allows its logits to be made a row's chunk at a
    time (:func:`~prune.model.head.head_apart`). Before 2026-12-05 the last batch's two stayed beside the next
    one's three (a whole-batch log-softmax and the copy it makes of a sliced input): this pass peaked at 13.54 GB
    on Gemma-3-270M's skeletons and 262k vocabulary, 8.47 GB after (reports/heal-blocks); the KL's chunks are one
    row's since.
    """
    nll = kl = 0.0
    targets = 0
    modes = model.training, original.training
    apart = head_apart(model)  # the model's logits a row's chunk at a time where its head allows
    model.eval()
    original.eval()
    try:
        for first in range(0, token_ids.shape[0], batch_size):
            batch = token_ids[first : first + batch_size]
            dense = _log_probs(original(input_ids=batch.to(input_device(original)), use_cache=False).logits)
            ids = batch.to(input_device(model))
            logits = but_last(outputs_apart(model, apart, lambda extra: model(input_ids=ids, use_cache=False,  # noqa: B023
                                                                          **extra).logits))
            n, k = _nll_and_kl(logits, dense.to(logits.device), batch[:, 1:])
            nll, kl, targets = nll + n, kl + k, targets + batch.shape[0] * (batch.shape[1] - 1)
            del dense, logits  # before the next batch's passes
    finally:
        model.train(modes[0])
        original.train(modes[1])
    return {"ppl": math.exp(nll / targets), "kl": kl / targets}


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    """Next-token log-probabilities of ``logits`` [batch, seq, vocab] at every position but the last, float32.

    Written over the logits (or their float32 copy) a chunk of positions at a time: the same values as one
    ``log_softmax`` over the whole batch, without a second vocabulary-wide tensor beside the first (on a 128k
    vocabulary, 525 MB a batch of two 512-token rows).
    """
    out = logits[:, :-1].float()
    for row, span, logprobs in log_prob_chunks(out):
        out[row, span] = logprobs
    return out


def _all_close(a: torch.Tensor | HeadOutputs, b: torch.Tensor | HeadOutputs, rows: int | None = None) -> bool:
    """``torch.allclose`` of two batches of logits (rtol = atol = 1e-3), their first ``rows``, a chunk at a time.

    ``allclose`` of whole vocabulary-wide batches makes several temporaries of their size at once: on a 1B
    skeleton this one check set the shortlist's peak. Logits left to the head (:class:`~prune.model.head.HeadOutputs`)
    are made a chunk at a time into a buffer of each side's own, never whole.
    """
    rows = a.shape[0] if rows is None else rows
    positions, vocab = a.shape[1], a.shape[-1]

    def chunks(x: torch.Tensor | HeadOutputs) -> Iterator[torch.Tensor]:
        if not isinstance(x, HeadOutputs):
            yield from (x[row, span].float() for row, span in row_chunks(rows, positions))
            return
        buffer = torch.empty(min(LOGPROB_POSITIONS, positions), vocab, dtype=torch.float32, device=x.device)
        yield from (x.chunk(row, span, buffer[: span.stop - span.start]) for row, span in row_chunks(rows, positions))

    return all(torch.allclose(mine, theirs.to(mine.device), rtol=1e-3, atol=1e-3)
               for mine, theirs in zip(chunks(a), chunks(b), strict=True))


def _nll_and_kl(logits: torch.Tensor | HeadOutputs, dense: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    """Summed next-token NLL of ``targets`` and summed KL(dense || model) over positions, float64.

    A row's chunk of positions at a time (:func:`prune.measure.perplexity.log_prob_chunks`), into two buffers that
    every chunk reuses: the model's log-probabilities, their difference from the original's written over them, and
    the original's probabilities, the product written over those (and 16-bit logits' float32 copy of a chunk).
    """
    nll = torch.zeros((), dtype=torch.float64, device=logits.device)
    kl = torch.zeros_like(nll)
    targets = targets.to(logits.device)
    probs = torch.empty(min(LOGPROB_POSITIONS, logits.shape[1]), logits.shape[-1], dtype=torch.float32,
                        device=logits.device)
    for row, span, logp in log_prob_chunks(logits):
        # a chunk moved, not the batch: under a device map the original's log-probabilities sit where its input
        # went, the head's logits on the head's device
        ref, p = dense[row, span].to(logits.device), probs[: span.stop - span.start]
        nll -= logp.gather(-1, targets[row, span, None]).double().sum()
        torch.exp(ref, out=p)
        kl += p.mul_(torch.sub(ref, logp, out=logp)).sum(-1).double().sum()
    return float(nll), float(kl)


def update_share(replace: ReplaceConfig | None) -> float:
    """The share of its fitted update the run's map applies (1: a method without the option, or no repair)."""
    options = replace.options if replace is not None else None
    return float(options.update_scale) if isinstance(options, LeastSquaresOptions) else 1.0
