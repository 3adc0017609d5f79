"""The whole prune stage as one function: load, calibrate, score, select, remove or replace, export.

``prune.run`` (the CLI) and recipes build a :class:`PruneConfig` and call :func:`run_prune`. Work that
follows surgery and lives above ``prune`` (distillation) joins by composition: the caller passes
post-surgery steps (``prune.pipeline.steps``), and prune never imports the package that provides them.
"""


from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from prune.atomic import atomic_directory, check_output_dir, output_lock, write_json
from prune.checkpoint.report import REPORT_FILE
from prune.checkpoint.save_load import write_model
from prune.checkpoint.write import library_versions, written_report
from prune.data.calibration import CalibrationData, calibration_data, check_sources
from prune.errors import LayercutError
from prune.loading.loader import LoadedModel, load_config
from prune.measure.blockwise import stream_moments_blockwise
from prune.measure.heldout import heldout_report, packed_perplexity
from prune.measure.moments import StateMoments, stream_moments
from prune.measure.score_report import plot_linearity_profile, score_table
from prune.measure.scores import SCORES, block_scores, check_enough_tokens
from prune.model.adapters import hidden_size, is_offloaded, num_blocks
from prune.model.surgery import block_layout, replacement_records
from prune.pipeline.config import PruneConfig, needed_cosine_pairs
from prune.pipeline.removal import Removal, planned_blocks, remove_blocks, remove_units
from prune.pipeline.resolve import Amounts, bind_model, check_positions, check_tokens, resolve_amounts
from prune.pipeline.steps import SurgeryStep
from prune.planner.shape import build_on_meta, read_config, shape_of_model
from prune.replace import check_replacement_supported, parameter_count
from prune.selection.budget import check_params_budget
from prune.selection.map_errors import MAP_ERRORS, held_map_errors
from prune.selection.oracle import Oracle, oracle_table
from prune.selection.repaired import measuring_rows
from prune.selection.sublayers import Unit, unit_moments

logger = logging.getLogger(__name__)

PROFILE_PNG = "linearity_profile.png"
SCORES_MD = "scores.md"


@dataclass
class Scored:
    """Calibration and its statistics, computed once and shared by several runs on the same model.

    ``eval.compare`` scores a model once and hands this to every method's :func:`run_prune`;
    ``moments.cosine_pairs`` says which cosine sums it holds ("all" serves every selection).
    """

    calibration: CalibrationData
    moments: StateMoments
    scores: dict[str, list[float]]
    # what selections and the oracle measured on this model and calibration, reused by later runs
    # (``prune.selection.strategies.SelectionInput.memo``); valid only while both are unchanged
    memo: dict = field(default_factory=dict)


def score_calibration(loaded: LoadedModel, config: PruneConfig, cosine_pairs: str | None = None,
                      measuring_apart: bool = False, shares: Sequence[float] = ()) -> Scored:
    """Calibration text of ``config.data`` and one streamed pass over it.

    ``cosine_pairs`` defaults to what ``config`` needs; pass "all" to serve every selection. ``measuring_apart``:
    the pass also keeps the statistics of the rows a repaired selection measures on
    (``prune.selection.repaired.measuring_rows``), so ``repaired-fast`` needs no pass of its own. Block by block
    a pass frees each state's statistics as it goes: ``repaired-fast``'s map errors at ``shares`` (the update
    shares of the repairs it will serve) are then taken in the pass and kept in the memo; others take a pass.
    """
    calibration = calibration_data(loaded.tokenizer, config.data, model=loaded.model)
    held = measuring_rows(calibration.token_ids) if measuring_apart else None
    errors, after_block = held_map_errors(shares) if held and shares and is_offloaded(loaded.model) else ({}, None)
    moments, scores = score_model(loaded.model, calibration, config, cosine_pairs, held, after_block)
    scored = Scored(calibration, moments, scores)
    scored.memo.update({(MAP_ERRORS, share): found for share, found in errors.items()})
    return scored


@dataclass
class PruneResult:
    """What a prune run produced (the model is surgered in place)."""

    loaded: LoadedModel
    calibration: CalibrationData
    moments: StateMoments
    scores: dict[str, list[float]]
    dropped: list[int]
    report: dict
    out: Path | None


@dataclass(frozen=True)
class OnMeta:
    """A model's config and, where transformers can build it there, its skeleton on the meta device.

    ``config`` is None for a ``.gguf`` whose header transformers cannot read (the conversion says why);
    ``skeleton`` (and its parameter count ``params``) is None for a config transformers cannot build on the
    meta device.
    """

    config: object | None
    skeleton: object | None
    params: int | None = None


def on_meta(model: str) -> OnMeta:
    """Read ``model``'s config and build it on the meta device: no weight is read.

    A ``.gguf`` not converted yet is read from its header (:func:`prune.planner.shape.read_config`), so a first
    run plans and resolves its budget before the conversion, as every later one does.
    """
    model_config = load_config(model)
    if model_config is None:
        model_config = _header_config(model)
    if model_config is None:
        return OnMeta(None, None)
    try:
        skeleton = build_on_meta(model_config)
        return OnMeta(model_config, skeleton, shape_of_model(skeleton).total)
    except Exception:  # noqa: BLE001 - a config transformers cannot build on the meta device: checked once loaded
        logger.debug("no meta-device skeleton for %s: it is checked once it is loaded", model)
        return OnMeta(model_config, None)


def preflight(config: PruneConfig, meta: OnMeta | None = None) -> Amounts | None:
    """Every check that needs only the model's config, before any weight is read or any token scored.

    Every local calibration file must read as text; the amounts (``--drop``, ``--protect``, units, targets)
    are resolved once against the block count and the parameters counted on the meta device, the
    calibration ``--seq-len`` against the model's positions. Returns those amounts, which the run is
    handed; None for a model whose config is not at hand without loading it (a ``.gguf`` header transformers
    cannot read, a config it cannot build on the meta device), resolved once it is loaded. ``meta``:
    :func:`on_meta` of the same model, where the caller built it already.
    """
    check_sources(config.data)  # local files: cheap to read twice
    meta = meta if meta is not None else on_meta(config.load.model)
    if meta.config is None:  # a header transformers cannot read: the conversion says why
        return None
    if meta.skeleton is None:  # its amounts are resolved once it is loaded
        check_positions(config, meta.config)
        check_tokens(config, meta.config)
        return None
    # a layout the repair cannot take (a fold on sandwich norms) is refused before any weight is read
    check_replacement_supported(meta.skeleton, config.replace.method)
    return resolve_amounts(config, meta.config, meta.params)


def layout_refusals(meta: OnMeta, methods: Iterable[str]) -> dict[str, str]:
    """The repairs among ``methods`` that the layout of the model in ``meta`` refuses, each with its one-line why.

    From the model's config alone, before any weight is read. Empty when there is no skeleton (an unreadable
    ``.gguf`` header): those refusals come once the model is loaded.
    """
    if meta.skeleton is None:
        return {}
    refused = {}
    for method in dict.fromkeys(methods):
        try:
            check_replacement_supported(meta.skeleton, method)
        except LayercutError as err:
            refused[method] = str(err)
    return refused


def _header_config(model: str):
    """The config in the header of a ``.gguf`` not converted yet (the planner reads it too); None if unreadable.

    A header transformers cannot read is left to the conversion, which says why in one line.
    """
    try:
        return read_config(model)
    except LayercutError:
        raise
    except Exception:  # noqa: BLE001 - the conversion gives the one-line error of a file it cannot read
        logger.debug("no header config for %s: it is checked once it is loaded", model)
        return None


def score_model(model, calibration: CalibrationData, config: PruneConfig, cosine_pairs: str | None = None,
                held_rows: Sequence[int] | None = None,
                after_block: Callable[[StateMoments, int], None] | None = None) -> tuple[StateMoments, dict]:
    """One streamed pass; every registered score for every block.

    ``held_rows``: calibration rows whose statistics the pass also keeps alone (``stream_moments``); block by
    block they are freed with the rest, and only ``after_block`` (called as each block's statistics are
    complete) reads them; without it a pass block by block keeps none.
    """
    check_enough_tokens(calibration.num_tokens, hidden_size(model))
    if is_offloaded(model):  # block by block, each block's scores taken and its statistics freed at once
        moments = stream_moments_blockwise(model, calibration.token_ids, batch_size=config.batch_size,
                                            cosine_pairs=cosine_pairs or needed_cosine_pairs(config),
                                            scores=list(SCORES), after_block=after_block,
                                            held_rows=held_rows if after_block is not None else None)
    else:
        moments = stream_moments(model, calibration.token_ids, batch_size=config.batch_size,
                                 cosine_pairs=cosine_pairs or needed_cosine_pairs(config), held_rows=held_rows)
    return moments, block_scores(moments, list(SCORES))


def blocks_to_drop(model, calibration, moments, scores, config: PruneConfig, memo: dict | None = None) -> list[int]:
    """Apply ``config.drop`` / ``select`` / ``protect`` to the scores (``memo``: see ``Scored.memo``)."""
    if config.drop is None:
        return []
    return planned_blocks(model, calibration, moments, scores, config, config.resolve(model), memo)


def run_prune(config: PruneConfig, loaded: LoadedModel | None = None,
              steps: Sequence[SurgeryStep] | None = None, scored: Scored | None = None,
              amounts: Amounts | None = None) -> PruneResult:
    """Load (unless given), score, select, remove or replace, run ``steps``, export according to ``config``.

    Whole blocks and sub-layers share these stages; what differs is how they are scored
    (:func:`score_model`, ``prune.selection.sublayers.unit_moments``) and removed (``prune.pipeline.removal``).

    Args:
        config: the run.
        loaded: an already loaded model to use instead of loading ``config.load``.
        steps: post-surgery steps run in order on the surgered model; None builds the ones ``config``
            switches on (``config.build_steps()``, found by name).
        scored: calibration and statistics already computed on this model (:func:`score_calibration`); the
            model must not have been surgered since.
        amounts: what :func:`preflight` already resolved for ``config`` (a caller that checked first), so the
            config and the data files are not read again.

    ``config.out``'s lock (``prune.atomic.output_lock``) is held from the first check to the export: a second
    run writing the same folder meanwhile is refused in one line.
    """
    with output_lock(config.out):
        return _run_prune(config, loaded, steps, scored, amounts)


def _run_prune(config: PruneConfig, loaded: LoadedModel | None, steps: Sequence[SurgeryStep] | None,
               scored: Scored | None, amounts: Amounts | None) -> PruneResult:
    started = time.perf_counter()
    steps = config.build_steps() if steps is None else steps
    if config.out is not None:
        check_output_dir(config.out, config.overwrite)
    if loaded is None and amounts is None:
        amounts = preflight(config)
    if loaded is None:
        loaded = config.load.load()
    model = loaded.model
    config = config.with_default_repair(model)  # replace: auto needs the loaded model's layout
    amounts = config.resolve(model) if amounts is None else bind_model(amounts, config, model)
    calibration, memo = _calibrate(loaded, config, amounts, scored)
    # a skeleton never holds the whole model: its output is measured afterwards (eval.run)
    heldout = calibration.heldout_ids if amounts.removes and not is_offloaded(model) else None
    original = packed_perplexity(model, heldout, config.batch_size) if heldout is not None else None
    score, remove = (_score_units, remove_units) if amounts.is_sublayer else (_score_blocks, remove_blocks)
    moments, scores = score(model, calibration, config, scored, memo)
    # a repair is measured against plain removal of the same blocks, on the same held-out rows
    measure = (lambda m: packed_perplexity(m, heldout, config.batch_size)) \
        if original is not None and config.replace.method != "none" else None
    removal = remove(model, calibration, moments, scores, config, amounts, memo, measure)
    if removal.budget is not None and removal.budget.get("target_params") is not None:
        check_params_budget(parameter_count(model), removal.budget)
    # sub-layer runs take no steps yet (PruneConfig refuses distillation with them)
    done = {step.name: step(loaded, config) for step in steps} if removal.dropped and not amounts.is_sublayer \
        else {}
    report = build_report(loaded, config, calibration, scores, removal, amounts,
                          time.perf_counter() - started)
    report.update(removal.sections)
    if removal.budget is not None:
        report["budget"] = {**removal.budget, "params_before": amounts.params, "params_after": parameter_count(model)}
    if original is not None and removal.changed:
        report["heldout"] = heldout_report(original, packed_perplexity(model, heldout, config.batch_size), heldout,
                                           removal.removal_only)
    return _finish(loaded, config, removal, report, done, calibration, moments, scores)


def _calibrate(loaded: LoadedModel, config: PruneConfig, amounts: Amounts,
               scored: Scored | None) -> tuple[CalibrationData, dict]:
    """The calibration tokens (shared ones if ``scored``) and the memo of what is measured on them."""
    if scored is None:
        calibration, memo = calibration_data(loaded.tokenizer, config.data, model=loaded.model), {}
    else:
        _check_scored(scored, config, amounts.num_blocks)
        calibration, memo = scored.calibration, scored.memo
    # every score is a fit over these tokens: too few fail before the held-out pass, not after it
    check_enough_tokens(calibration.num_tokens, hidden_size(loaded.model))
    return calibration, memo


def _score_blocks(model, calibration: CalibrationData, config: PruneConfig, scored: Scored | None,
                  _memo: dict) -> tuple[StateMoments, dict]:
    """Every registered score for every block (the shared ones when ``scored``)."""
    return (scored.moments, scored.scores) if scored is not None else score_model(model, calibration, config)


def _score_units(model, calibration: CalibrationData, config: PruneConfig, _scored: Scored | None,
                 memo: dict) -> tuple[StateMoments, dict]:
    """Every registered score for every sub-layer, from one pass kept in ``memo``."""
    return unit_moments(model, calibration.token_ids, config.batch_size, memo)


def _finish(loaded: LoadedModel, config: PruneConfig, removal: Removal, report: dict, done: dict,
            calibration: CalibrationData, moments: StateMoments, scores: dict) -> PruneResult:
    """Add the steps' reports, export, and delete the steps' work folders."""
    report.update({name: result.report for name, result in done.items()})
    files = [f for result in done.values() for f in result.files]
    out = write_outputs(loaded, report, config, files) if config.out is not None else None
    for folder in (f for result in done.values() for f in result.cleanup):
        shutil.rmtree(folder, ignore_errors=True)
    return PruneResult(loaded, calibration, moments, scores, removal.dropped, report, out)


def _check_scored(scored: Scored, config: PruneConfig, blocks: int) -> None:
    # Shared statistics from another model, or too few cosine sums, would give silently wrong selections.
    if scored.moments.num_states != blocks + 1:
        raise LayercutError(f"shared statistics describe {scored.moments.num_states - 1} blocks, the model has "
                            f"{blocks}: score this model (prune.pipeline.runner.score_calibration)")
    if needed_cosine_pairs(config) == "all" and scored.moments.cosine_pairs != "all":
        raise LayercutError("shared statistics lack the all-pairs cosines --select span needs: "
                            "score with cosine_pairs='all'")


def build_report(loaded: LoadedModel, config: PruneConfig, calibration: CalibrationData, scores: dict,
                 removal: Removal, amounts: Amounts, seconds: float) -> dict:
    """The content of ``layercut.json``."""
    return {
        "source_model": loaded.source,
        "model_name": loaded.name,
        "architecture": loaded.model.config.model_type,
        "num_blocks_before": amounts.num_blocks,
        "num_blocks_after": num_blocks(loaded.model),
        "dropped": sorted(removal.dropped),
        "score": config.score,
        "select": config.select,
        "protect": list(amounts.protected),
        "replace": config.replace.method,
        "fit": config.replace.fit if config.replace.method != "none" else None,
        "replacements": replacement_records(loaded.model) if removal.dropped else [],
        "layout": block_layout(loaded.model),
        "scores": scores,
        "data": calibration.describe(),
        "versions": library_versions(),
        "seconds": round(seconds, 2),
        "config": removal.recorded(config),
    }


def write_outputs(loaded: LoadedModel, report: dict, config: PruneConfig, files: Sequence[Path] = ()) -> Path:
    """Export the checkpoint (if blocks were dropped) or just the profile, atomically; ``files`` are copied in."""

    def profile_files(folder: Path) -> None:
        if "sublayer_scores" in report:
            unit_files(folder)
            return
        title = f"{loaded.name}: block linearity ({report['data']['tokens']} tokens)"
        plot_linearity_profile(report["scores"], folder / PROFILE_PNG, title, report["dropped"])
        table = score_table(report["scores"], report["dropped"])
        if "oracle" in report:
            table += "\n\n" + oracle_table(Oracle(**report["oracle"]), report["scores"])
        (folder / SCORES_MD).write_text(table + "\n", encoding="utf-8")
        for path in files:
            if path.is_file():
                shutil.copy2(path, folder / path.name)

    def unit_files(folder: Path) -> None:
        unit_scores = {k: v for k, v in report["sublayer_scores"].items() if k != "units"}
        removed = [Unit(int(b), k).index for b, k in (u.split(".") for u in report["sublayers"]["units"])]
        title = (f"{loaded.name}: sub-layer linearity, attention (even) and MLP (odd) "
                 f"({report['data']['tokens']} tokens)")
        plot_linearity_profile(unit_scores, folder / PROFILE_PNG, title, removed, unit="sub-layer (2 x block + mlp)")
        table = score_table(unit_scores, removed, labels=report["sublayer_scores"]["units"])
        (folder / SCORES_MD).write_text(table + "\n", encoding="utf-8")

    with atomic_directory(config.out, config.overwrite) as staging:
        if report["dropped"] or report.get("sublayers"):
            write_model(staging, loaded.model, loaded.tokenizer, config.out, report)
        else:  # the scores alone
            write_json(staging / REPORT_FILE, written_report(report, config.out))  # no path of this machine in it
        profile_files(staging)
    return Path(config.out)
