"""Fit one replacement per span of removed blocks and put them into the model, whatever the method.

The driver looks the method up in the registry and asks it for its fitter, checks and modules; it
never names a method. ``fit="independent"`` feeds every span's fitter from one pass of the original
model; ``fit="sequential"`` fits span by span, each on the inputs the already-surgered model produces.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from functools import partial

import torch
from torch import nn
from tqdm.auto import tqdm

from prune.errors import LayercutError
from prune.measure.moments import StateMoments, span_pairs
from prune.model.adapters import get_blocks, is_offloaded, num_blocks
from prune.model.layouts import LAYERCUT
from prune.model.surgery import (
    RECORDS_ATTR,
    block_layout,
    blocks_replaced,
    check_block_indices,
    drop_blocks_,
    host_position,
    replacement_records,
    set_blocks_,
)
from prune.replace.capture import Recorder, record
from prune.replace.config import ReplaceConfig
from prune.replace.fitter import Replacement, SpanFitter
from prune.replace.modules import ReplacedBlock
from prune.replace.registry import get_method

logger = logging.getLogger(__name__)


def spans_of(dropped: Sequence[int]) -> list[tuple[int, ...]]:
    """Maximal runs of consecutive positions, as tuples."""
    return [tuple(range(start, stop)) for start, stop in span_pairs(dropped)]


def _assemble(original: Sequence[nn.Module], layout: list[list[int]], done: Sequence[Replacement]):
    """The block list with ``done`` spans replaced: (blocks, per-layer sources, layout)."""
    removed = {i for r in done for i in r.span}
    before = {r.host: r.module for r in done if r.where == "before"}
    after = {r.host: r.module for r in done if r.where == "after"}
    absorbed: dict[int, list[int]] = {}  # host -> original indices it now covers besides its own
    for r in done:
        if r.where != "block":
            absorbed.setdefault(r.host, []).extend(i for k in r.span for i in layout[k])
    new_blocks = {r.span[0]: r for r in done if r.where == "block"}
    blocks, sources, new_layout = [], [], []
    for i, block in enumerate(original):
        if i in new_blocks:
            r = new_blocks[i]
            blocks.append(r.module)
            sources.append(r.record["init_block_position"])
            new_layout.append([k for j in r.span for k in layout[j]])
        if i in removed:
            continue
        if i in before or i in after:
            block = ReplacedBlock(block, before.get(i), after.get(i))
        blocks.append(block)
        sources.append(i)
        new_layout.append(layout[i] + absorbed.get(i, []))
    return blocks, sources, new_layout


@contextmanager
def _surgered_view(model: nn.Module, original: Sequence[nn.Module], done: Sequence[Replacement]) -> Iterator[None]:
    """The model with the ``done`` replacements in place, for the length of a ``with``."""
    if not done:
        yield
        return
    blocks, sources, layout = _assemble(original, block_layout(model), done)
    with ExitStack() as stack:
        stack.enter_context(blocks_replaced(model, blocks, sources, layout))
        for r in done:
            if r.patch is not None:
                stack.callback(r.patch.apply())
        yield


def _batches(token_ids: torch.Tensor, config: ReplaceConfig, desc: str):
    """[batch, seq] calibration batches; with ``config.short``, then the same tokens cut short."""
    cuts = [(token_ids, config.batch_size)]
    if short_cut(token_ids, config):
        per_sequence = token_ids.shape[1] // config.short
        cuts.append((short_windows(token_ids, config.short), config.batch_size * per_sequence))  # as many tokens
    total = sum(-(-ids.shape[0] // size) for ids, size in cuts)
    with tqdm(total=total, desc=desc, unit="batch", disable=not config.progress) as bar:
        for ids, size in cuts:
            for start in range(0, ids.shape[0], size):
                yield ids[start : start + size]
                bar.update()


def short_windows(token_ids: torch.Tensor, short: int) -> torch.Tensor:
    """[samples, seq] tokens as [n, short]: whole short sequences from each long one, none straddling two."""
    tokens = token_ids.shape[1] // short * short
    return token_ids[:, :tokens].reshape(-1, short)


def short_cut(token_ids: torch.Tensor, config: ReplaceConfig) -> bool:
    """Whether ``config.short`` adds a second, shorter cut of ``token_ids``."""
    return 0 < config.short < token_ids.shape[1]


def _hook_both(fitter: SpanFitter, recorder: Recorder) -> None:
    fitter.hook_inputs(recorder)
    fitter.hook_target(recorder)


def _fit_independent(model, fitters: list[SpanFitter], token_ids, config) -> list[Replacement]:
    """One pass of the original model feeds every span's fitter."""
    if not fitters:
        return []
    started = time.perf_counter()

    def setup(recorder: Recorder) -> None:
        for fitter in fitters:
            _hook_both(fitter, recorder)

    methods = ", ".join(dict.fromkeys(fitter.config.method for fitter in fitters))  # one pass may feed several
    for batch in _batches(token_ids, config, f"fit {methods}"):
        values = record(model, batch, setup)
        for fitter in fitters:
            fitter.observe(fitter.batch(values, values))
    shared = (time.perf_counter() - started) / len(fitters)
    results = []
    for fitter in fitters:
        begun = time.perf_counter()
        results.append(fitter.finish())
        results[-1].record["fit_seconds"] = round(shared + time.perf_counter() - begun, 2)
    return results


def _fit_sequential(model, fitters: list[SpanFitter], token_ids, config) -> list[Replacement]:
    """Span by span: inputs from the model with the earlier spans already replaced, targets from the original."""
    original = fitters[0].original
    done: list[Replacement] = []
    for fitter in fitters:
        begun = time.perf_counter()
        for batch in _batches(token_ids, config, f"fit {config.method} {list(fitter.span)}"):
            if done:
                targets = record(model, batch, fitter.hook_target)
                with _surgered_view(model, original, done):
                    inputs = record(model, batch, fitter.hook_inputs)
            else:  # nothing replaced yet: one pass of the original model gives inputs and targets
                inputs = targets = record(model, batch, partial(_hook_both, fitter))
            fitter.observe(fitter.batch(inputs, targets))
        done.append(fitter.finish())
        done[-1].record["fit_seconds"] = round(time.perf_counter() - begun, 2)
    return done


def fit_spans(model: nn.Module, spans: Sequence[tuple[int, ...]], token_ids: torch.Tensor,
              config: ReplaceConfig) -> dict[tuple[int, ...], Replacement]:
    """Each span's replacement fitted alone on the original model's states (one capture pass for all of them).

    Spans may overlap (the candidates of a selection that measures repairs): an independent fit of a span
    depends on nothing but the original model and the span, so each is fitted once and reused in any set.
    The model is not changed; put a set in place with :func:`surgered_view`. Each record says whether the short
    cut fed its fit, as :func:`fit_replacements`' do: a build that installs these fits writes it to ``layercut.json``.
    """
    spec = get_method(config.method)
    if spec.fitter is None:
        return {}
    original = list(get_blocks(model)[1])
    fitters = [spec.fitter(model, original, tuple(span), config) for span in dict.fromkeys(map(tuple, spans))]
    fit = _fit_offloaded if is_offloaded(model) else _fit_independent
    return {r.span: r for r in _noted(fit(model, fitters, token_ids, config), token_ids, config)}


def fit_spans_of_methods(model: nn.Module, wanted: Sequence[tuple[ReplaceConfig, Sequence[tuple[int, ...]]]],
                         token_ids: torch.Tensor) -> list[dict[tuple[int, ...], Replacement]]:
    """:func:`fit_spans` for several methods, their fitters fed by one capture pass where their batches agree.

    ``wanted``: (a method's config, its spans) pairs; returns each pair's fits, in order. A fit observes the same
    activations whichever other fits the pass feeds (the hooks only record), so each is what :func:`fit_spans`
    gives it alone; methods that cut the batches otherwise (``short``, ``batch_size``) or a skeleton's
    block-by-block pass are fitted on their own.
    """
    results: list[dict[tuple[int, ...], Replacement]] = [{} for _ in wanted]
    groups: dict[tuple[int, int], list[int]] = {}
    offloaded = is_offloaded(model)
    for index, (config, spans) in enumerate(wanted):
        if get_method(config.method).fitter is None or not spans:
            continue
        cut = config.short if short_cut(token_ids, config) else 0
        groups.setdefault((config.batch_size, cut), []).append(index)
    original = list(get_blocks(model)[1])
    fit = _fit_offloaded if offloaded else _fit_independent  # a skeleton's group: one block-by-block pass
    for members in groups.values():
        fitters = [(index, get_method(config.method).fitter(model, original, span, config))
                   for index in members for config in [wanted[index][0]]
                   for span in dict.fromkeys(map(tuple, wanted[index][1]))]
        batches = wanted[members[0]][0]  # a group's members cut their batches alike, the short cut among them
        done = _noted(fit(model, [fitter for _, fitter in fitters], token_ids, batches), token_ids, batches)
        for (index, _), replacement in zip(fitters, done, strict=True):
            results[index][replacement.span] = replacement
    return results


def surgered_view(model: nn.Module, replacements: Sequence[Replacement]):
    """The model with ``replacements`` (fitted on its current blocks) in place for the length of a ``with``."""
    return _surgered_view(model, list(get_blocks(model)[1]), replacements)


def _fit_offloaded(model, fitters: list[SpanFitter], token_ids, config) -> list[Replacement]:
    """A skeleton's spans, fitted from one block-by-block pass over the batches the capture pass would run.

    A fit that needs only a span's (input, output) moments (``from_moments``) takes them from the pass;
    the others hook the skeleton's modules as the capture pass does and observe each batch as soon as the
    span's last block has run on it (what a hook recorded for a batch is kept until then: a fold holds its
    host's MLP activations across the span). Each span is solved as soon as its output state is complete,
    and its statistics are freed then, as are those of every state no span reads. Only methods whose fit
    reads the original model's activations can run this way (``offloadable``): none that needs the
    surgered model's outputs, which a skeleton never holds.
    """
    from prune.measure.blockwise import stream_moments_blockwise

    if config.fit != "independent":
        raise LayercutError("--offload sequential fits every span on the original model's states: use --fit "
                            "independent, or --offload none")
    started = time.perf_counter()
    by_pair: dict[tuple[int, int], list[SpanFitter]] = {}  # several methods may fit one span (prune.ship)
    for fitter in fitters:
        if fitter.from_moments:
            by_pair.setdefault((fitter.span[0], fitter.span[-1] + 1), []).append(fitter)
    hooked = [f for f in fitters if not f.from_moments]
    recorder = Recorder()
    for fitter in hooked:
        _hook_both(fitter, recorder)
    recorded: dict[int, dict[str, object]] = {}  # batch -> what the hooks recorded of it, until a span needs it
    done: dict[int, Replacement] = {}  # id(fitter) -> its fit

    def observe_ending_here(block: int, batch: int) -> None:
        values = recorded.setdefault(batch, {})
        values.update(recorder.values)
        recorder.values.clear()
        ending = [fitter for fitter in hooked if fitter.span[-1] == block]
        for fitter in ending:  # every method's fitter of a span reads the same recorded values
            fitter.observe(fitter.batch(values, values))
        prefixes = tuple({f"{fitter.span}." for fitter in ending})
        for key in [key for key in values if key.startswith(prefixes)]:
            del values[key]  # frees the host's activations once its spans have them

    def fit_ending_here(moments: StateMoments, block: int) -> None:
        ending = [(pair, group) for pair, group in by_pair.items() if pair[1] == block + 1]
        for (first, last), group in ending:
            for fitter in group:
                fitter.use_moments(moments.pair(first, last))
                done[id(fitter)] = fitter.finish()
        # a state goes once no span left reads it (a selection's candidate spans share states)
        later = {state for pair in by_pair if pair[1] > block + 1 for state in pair}
        for state in {state for pair, _ in ending for state in pair} - later:
            moments.release(state)
        for fitter in hooked:
            if fitter.span[-1] == block:
                with torch.enable_grad():  # the pass runs without gradients; a fit that trains needs them
                    done[id(fitter)] = fitter.finish()

    # the batches of the capture pass, without its progress bar: the block-by-block pass shows its own
    batches = list(_batches(token_ids, dataclasses.replace(config, progress=False), ""))
    try:
        stream_moments_blockwise(model, batches=batches, pairs=list(by_pair), cosine_pairs="none",
                                  progress=config.progress, after_block=fit_ending_here,
                                  observed={state for pair in by_pair for state in pair},
                                  after_call=observe_ending_here if hooked else None,
                                  upto=max(f.span[-1] for f in fitters) + 1)  # nothing behind the last span
    finally:
        recorder.close()
    shared = (time.perf_counter() - started) / len(fitters)
    for replacement in done.values():
        replacement.record["fit_seconds"] = round(shared, 2)
    return [done[id(f)] for f in fitters]


def check_replacement_supported(model: nn.Module, method: str) -> None:
    """Architecture-level checks for ``method`` that need no calibration pass (run them before scoring)."""
    spec = get_method(method)
    if spec.check_model is not None:
        spec.check_model(model, spec.name)


def check_drop_for_method(method: str, count: int, fix: str | None = None) -> None:
    """Refuse ``--drop`` below the span length ``method`` needs, before any weight is loaded.

    ``fix`` replaces the error's advice (a comparison has no ``--replace`` to change).
    """
    least = get_method(method).min_span
    if count < least:
        raise _short_spans(method, least, f"--drop {count} makes a span of {count}",
                           fix or f"drop {least} or more blocks, or use --replace linear")


def check_span_lengths(method: str, spans: Sequence[tuple[int, ...]], fix: str | None = None) -> None:
    """Refuse spans shorter than ``method`` needs (a top-k selection can leave blocks standing alone).

    ``fix`` replaces the error's advice, as in :func:`check_drop_for_method`.
    """
    least = get_method(method).min_span
    short = [list(span) for span in spans if len(span) < least]
    if short:
        raise _short_spans(method, least, f"the selection left {short} shorter",
                           fix or "select contiguous blocks (--select span), or use --replace linear")


def _short_spans(method: str, least: int, found: str, fix: str) -> LayercutError:
    return LayercutError(f"--replace {method} puts one block in place of a span of {least} or more blocks, and "
                         f"{found}: {fix}")


def checked_spans(model: nn.Module, dropped: Sequence[int], method: str) -> list[tuple[int, ...]]:
    """The spans of ``dropped`` (current positions) that ``method`` will replace.

    Refused in one line where it cannot: positions outside the model, spans shorter than it needs, spans its own
    check refuses.
    """
    spec = get_method(method)
    spans = spans_of(check_block_indices(dropped, num_blocks(model)))
    check_span_lengths(method, spans)
    if spec.check_spans is not None:
        spec.check_spans(model, spans, spec.name)
    return spans


def fit_replacements(model: nn.Module, dropped: Sequence[int], token_ids: torch.Tensor,
                     config: ReplaceConfig, moments: StateMoments | None = None) -> list[Replacement]:
    """Fit one replacement per span of ``dropped`` (current positions) without changing the model.

    Args:
        model: a supported model, not yet surgered for ``dropped``.
        dropped: positions of the blocks to replace.
        token_ids: [samples, seq] calibration tokens.
        config: the method and fitting options.
        moments: statistics of this model over ``token_ids`` (the scoring pass); an independent fit takes
            a span's (input, output) moments from them where they hold the pair and the method needs no
            more, and runs a capture pass only for the other spans.
    """
    spec = get_method(config.method)
    if spec.fitter is None:
        raise ValueError(f"--replace {config.method} fits nothing: use replace_blocks_")
    original = list(get_blocks(model)[1])
    spans = checked_spans(model, dropped, config.method)
    fitters = [spec.fitter(model, original, span, config) for span in spans]
    if is_offloaded(model):
        return _noted(_fit_offloaded(model, fitters, token_ids, config), token_ids, config)
    if config.fit == "sequential":
        return _noted(_fit_sequential(model, fitters, token_ids, config), token_ids, config)
    if short_cut(token_ids, config):
        moments = None  # the scoring pass saw the long sequences only
    given = [f for f in fitters if moments is not None and _feed_from(moments, f)]
    captured = _fit_independent(model, [f for f in fitters if f not in given], token_ids, config)
    done = {r.span: r for r in captured}
    for fitter in given:
        begun = time.perf_counter()
        done[fitter.span] = fitter.finish()
        done[fitter.span].record["fit_seconds"] = round(time.perf_counter() - begun, 2)
    logger.info("%d of %d span(s) fitted from the scoring pass's statistics", len(given), len(fitters))
    return _noted([done[span] for span in spans], token_ids, config)


def _noted(replacements: list[Replacement], token_ids: torch.Tensor, config: ReplaceConfig) -> list[Replacement]:
    """Each record says whether the short cut fed the fit (``layercut.json`` carries it)."""
    if short_cut(token_ids, config):
        for replacement in replacements:
            replacement.record["fit_short"] = config.short
    return replacements


def _feed_from(moments: StateMoments, fitter: SpanFitter) -> bool:
    pair = (fitter.span[0], fitter.span[-1] + 1)
    return pair in moments.cross and fitter.use_moments(moments.pair(*pair))


def install_replacements_(model: nn.Module, replacements: Sequence[Replacement]) -> list[dict]:
    """Put fitted replacements into the model for good; records them on the config and returns the records."""
    original = list(get_blocks(model)[1])
    layout = block_layout(model)
    blocks, sources, new_layout = _assemble(original, layout, replacements)
    for r in replacements:
        if r.patch is not None:
            r.patch.apply()
    records = replacement_records(model)
    set_blocks_(model, blocks, sources, new_layout)
    # "maps": the record's map lives in the maps file, which the shipped modeling code then requires
    new = [{"method": r.method, "replaces": [i for k in r.span for i in layout[k]], "where": r.where,
            **({"maps": True} if get_method(r.method).serving == LAYERCUT else {}), **r.record}
           for r in replacements]
    for entry in new:
        entry.pop("init_block_position", None)  # assembly bookkeeping, not part of the record
    # keep the earlier records whose host survived (set_blocks_ filtered against the new layout)
    kept = [r for r in records if host_position(new_layout, r["replaces"]) is not None]
    setattr(model.config, RECORDS_ATTR, kept + new)
    return new


def replace_blocks_(model: nn.Module, dropped: Sequence[int], token_ids: torch.Tensor | None,
                    config: ReplaceConfig, moments: StateMoments | None = None) -> list[dict]:
    """Remove blocks ``dropped`` (current positions) and put fitted replacements in their place.

    Args:
        model: a supported model; changed in place.
        dropped: block positions to remove.
        token_ids: [samples, seq] calibration tokens (unused by a method that fits nothing, ``none``).
        config: the method and fitting options.
        moments: the scoring pass's statistics over ``token_ids`` (see :func:`fit_replacements`).

    Returns:
        One record per replacement (method, replaces, params, fit, fit_seconds, ...).
    """
    if get_method(config.method).fitter is None:
        drop_blocks_(model, dropped)
        return []
    started = time.perf_counter()
    replacements = fit_replacements(model, dropped, token_ids, config, moments)
    for r in replacements:
        r.record["fit"] = config.fit
    records = install_replacements_(model, replacements)
    logger.info("replaced %d span(s) by %s (%s fit) in %.1f s", len(records), config.method, config.fit,
                time.perf_counter() - started)
    return records


def replacement_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that ``--train replacements`` trains, in block order.

    Each record's method says which: linear / low-rank maps, the blocks that replaced spans, the MLP
    output projections that absorbed a folded map.
    """
    _, blocks = get_blocks(model)
    layout = block_layout(model)
    modules: list[nn.Module] = []
    for entry in replacement_records(model):
        name = entry["method"]
        spec = get_method(name)
        position = host_position(layout, entry["replaces"])
        module = spec.trained_module(model, blocks[position], entry) if spec.trained_module else None
        if module is None:
            logger.warning("block %d should carry a %s replacement but has none (loaded without prune.load?)",
                           position, name)
        else:
            modules.append(module)
    return modules
