"""The whole prune stage as one function: load, calibrate, score, select, remove or replace, export.

``prune.run`` (the CLI) and recipes build a :class:`PruneConfig` and call :func:`run_prune`. Work that
follows surgery and lives above ``prune`` (distillation) joins by composition: the caller passes
post-surgery steps (``prune.steps``), and prune never imports the package that provides them.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prune.adapters import arch_spec, config_layer_count, get_blocks, hidden_size, max_positions, num_blocks
from prune.budget import blocks_for_params, blocks_for_speedup, parse_param_target
from prune.checkpoint import save
from prune.data import CalibrationData, DataConfig, calibration_data, check_sources
from prune.errors import LayercutError
from prune.export import REPORT_FILE, atomic_directory, check_output_dir, library_versions, write_json
from prune.heldout import heldout_report, packed_perplexity
from prune.hf_remote_code import sublayer_records
from prune.loading import LoadedModel, load_config
from prune.options import LoadConfig
from prune.oracle import Oracle, oracle_table, removal_cache, run_oracle
from prune.replace import (
    ReplaceConfig,
    check_drop_for_method,
    check_replacement_supported,
    parameter_count,
    replace_blocks_,
)
from prune.score_report import plot_linearity_profile, score_table
from prune.scores import SCORES, block_scores, check_enough_tokens, get_score
from prune.selection import (
    DEFAULT_PROTECT,
    SELECTIONS,
    SelectionInput,
    check_enough_free,
    parse_drop,
    parse_protect,
    select_blocks,
    span_candidates,
)
from prune.stats import StateMoments, stream_moments
from prune.steps import SurgeryStep, build_step
from prune.sublayers import (
    MEASURE_SEQUENCES,
    UNIT_SELECTIONS,
    Unit,
    candidate_units,
    check_unit_count,
    check_units_supported,
    contribution_path,
    is_sublayer,
    measured_costs,
    parse_units,
    rank_measured,
    rank_units,
    remove_units_,
    unit_parameters,
)
from prune.surgery import block_layout, replacement_records

logger = logging.getLogger(__name__)

PROFILE_PNG = "linearity_profile.png"
SCORES_MD = "scores.md"
# Post-surgery steps a PruneConfig can switch on, in the order they run: config field -> step name.
STEP_SECTIONS = ("distill",)


@dataclass
class PruneConfig:
    """One prune run; a recipe maps key for key onto it (sections ``load``, ``data``, ``replace``, ``distill``).

    Attributes:
        load: model and how to load it (:class:`prune.options.LoadConfig`).
        data: calibration text (:class:`prune.data.DataConfig`).
        drop: blocks to remove, a count (4) or a share ("25%"); None only scores (or meets a target).
        target_params: remove the fewest blocks that bring the parameters to this ("110M", "1.2B", "85%");
            in place of ``drop`` (``prune.budget``).
        target_speedup: remove the fewest blocks whose ideal decode speed-up ``L / (L - K)`` reaches this
            (1.25); in place of ``drop``.
        unit: what is removed: "block" (default), or sub-layers "attention", "mlp" or "attention,mlp"
            (``prune.sublayers``; ``drop`` then counts sub-layers, ranked by ``score`` with ``select`` topk,
            or by the measured cost of skipping each with ``select`` measured).
        score: criterion used to rank blocks (all registered scores are reported).
        select: a registered selection (``prune.selection.SELECTIONS``): topk, span, greedy, greedy-ppl,
            measured, last.
        protect: blocks never removed ("0,-1" = first and last; "none").
        batch_size: sequences per forward pass while streaming statistics and fitting.
        replace: what takes the removed blocks' place (:class:`prune.replace.ReplaceConfig`); a method
            name alone (``replace: linear``) is short for ``{method: linear}``.
        distill: options of the distillation step after surgery (``distill.config.DistillConfig`` keys,
            ``steps`` > 0 switches it on); prune hands them to the ``distill`` step unread.
        oracle: also measure the calibration perplexity with each block alone removed (one pass per block)
            and each score's Spearman rank correlation with it (``prune.oracle``; into the report and
            ``scores.md``).
        out: output folder; None writes nothing when only scoring, and ``<model>-drop<K>`` when
            dropping, so the first command a user types keeps its result.
        overwrite: replace a non-empty ``out``.
    """

    load: LoadConfig = field(default_factory=LoadConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drop: str | int | None = None
    target_params: str | int | None = None
    target_speedup: float | None = None
    unit: str = "block"
    score: str = "linearity"
    select: str = "topk"
    protect: str = DEFAULT_PROTECT
    batch_size: int = 4
    replace: ReplaceConfig | str = "none"
    distill: dict = field(default_factory=dict)
    oracle: bool = False
    out: str | None = None
    overwrite: bool = False

    def __post_init__(self):
        if isinstance(self.load, dict):
            self.load = LoadConfig(**self.load)
        if isinstance(self.data, dict):
            self.data = DataConfig(**self.data)
        get_score(self.score)
        if self.select not in SELECTIONS:
            raise LayercutError(f"unknown selection '{self.select}': choose one of {', '.join(SELECTIONS)}")
        if self.batch_size <= 0:
            raise LayercutError(f"--batch-size must be positive, got {self.batch_size}")
        self.replace = _replace_config(self.replace, self.batch_size)
        if not isinstance(self.distill, dict):
            raise LayercutError(f"distill must be a mapping of DistillConfig keys, got {type(self.distill).__name__}")
        steps = self.distill.get("steps", 0)
        if not isinstance(steps, int) or steps < 0:
            raise LayercutError(f"--distill-steps (distill.steps) must be an integer >= 0, got {steps}")
        amounts = [flag for flag, value in (("--drop", self.drop), ("--target-params", self.target_params),
                                            ("--target-speedup", self.target_speedup)) if value is not None]
        if len(amounts) > 1:
            raise LayercutError(f"{' and '.join(amounts)} both say how much to remove: pass one of them")
        if not self.removes and (self.replace.method != "none" or self.step_sections()):
            flag = "--replace" if self.replace.method != "none" else "--distill-steps"
            raise LayercutError(f"{flag} needs blocks to remove: pass --drop (a count or a share), --target-params "
                                "or --target-speedup")
        units = parse_units(self.unit)
        self.unit = ",".join(units)
        if is_sublayer(units) and not self.removes:
            raise LayercutError(f"--unit {self.unit} needs an amount: pass --drop N (sub-layers) or --target-params")
        if is_sublayer(units):
            for flag, bad, fix in (("--select", self.select not in UNIT_SELECTIONS,
                                    "ranks sub-layers with --select topk (a score) or measured"),
                                   ("--replace", self.replace.method != "none", "removes them (--replace none)"),
                                   ("--target-speedup", self.target_speedup is not None,
                                    "meets --target-params or --drop (a speed-up counts whole blocks)"),
                                   ("--distill-steps", bool(self.step_sections()), "does not distill yet"),
                                   ("--oracle", self.oracle, "has no oracle yet (it measures whole blocks)")):
                if bad:
                    raise LayercutError(f"{flag} with --unit {self.unit}: sub-layer removal {fix}; drop {flag} "
                                        "or use --unit block")
        if self.out is None and self.removes:
            stem = Path(self.load.model.rstrip("/")).name.removesuffix(".gguf")
            method = "" if self.replace.method == "none" else f"-{self.replace.method}"
            amount = (f"drop{str(self.drop).replace('%', 'pct')}" if self.drop is not None else
                      f"params{str(self.target_params).replace('%', 'pct')}" if self.target_params is not None
                      else f"speedup{self.target_speedup}x")
            unit = "" if not is_sublayer(units) else "-" + self.unit.replace(",", "-")
            self.out = f"{stem}-{amount}{unit}{method}"

    @property
    def removes(self) -> bool:
        """Whether this run removes blocks (``drop`` or a target), rather than only scoring."""
        return self.drop is not None or self.target_params is not None or self.target_speedup is not None

    def step_sections(self) -> list[str]:
        """The post-surgery steps this config switches on (a section with ``steps`` > 0)."""
        return [name for name in STEP_SECTIONS if getattr(self, name).get("steps", 0)]

    def build_steps(self) -> list[SurgeryStep]:
        """The post-surgery steps this config asks for, built (and so validated) before any heavy work."""
        return [build_step(name, dict(getattr(self, name)), self) for name in self.step_sections()]


def _replace_config(value, batch_size: int) -> ReplaceConfig:
    if isinstance(value, str):
        value = {"method": value}
    if isinstance(value, dict):
        if "batch_size" in value:
            raise LayercutError("replace: batch_size is the run's top-level batch_size; move it there")
        return ReplaceConfig(**value, batch_size=batch_size)
    if not isinstance(value, ReplaceConfig):
        raise LayercutError(f"replace must be a method name or a mapping, got {type(value).__name__}")
    if value.batch_size != batch_size:
        raise LayercutError(f"replace.batch_size {value.batch_size} differs from batch_size {batch_size}: set one")
    return value


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
    # (``prune.selection.SelectionInput.memo``); valid only while both are unchanged
    memo: dict = field(default_factory=dict)


def score_calibration(loaded: LoadedModel, config: PruneConfig, cosine_pairs: str | None = None) -> Scored:
    """Calibration text of ``config.data`` and one streamed pass over it.

    ``cosine_pairs`` defaults to what ``config`` needs; pass "all" to serve every selection.
    """
    calibration = calibration_data(loaded.tokenizer, config.data, model=loaded.model)
    moments, scores = score_model(loaded.model, calibration, config, cosine_pairs)
    return Scored(calibration, moments, scores)


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


def preflight(config: PruneConfig) -> None:
    """Every check that needs only the model's config, before any weight is read or any token scored.

    Every local calibration file must read as text; ``--drop`` and ``--protect`` are checked against the
    block count, the calibration ``--seq-len`` against the model's positions. Models whose config is
    not at hand without converting them (a ``.gguf`` seen for the first time) are checked after loading.
    """
    check_sources(config.data)  # local files: cheap to read twice
    model_config = load_config(config.load.model)
    if model_config is not None:
        check_against_model(config, model_config)


def check_against_model(config: PruneConfig, model_config) -> None:
    """``--drop`` and ``--protect`` against the block count, ``--seq-len`` against the positions of a model config."""
    blocks = config_layer_count(model_config)
    if blocks is not None:
        protected = parse_protect(config.protect, blocks)
        if config.drop is not None and is_sublayer(parse_units(config.unit)):
            parse_drop(config.drop, 2 * blocks)  # sub-layers: counted against the candidates once loaded
        elif config.drop is not None:
            count = parse_drop(config.drop, blocks)
            check_enough_free(count, blocks, protected)
            check_drop_for_method(config.replace.method, count)
    limit = max_positions(model_config)
    if limit is not None and config.data.seq_len > limit:
        raise LayercutError(
            f"--seq-len {config.data.seq_len} exceeds the model's {limit} positions: lower --seq-len (and raise "
            "--samples to keep the tokens)"
        )


def needed_cosine_pairs(config: PruneConfig) -> str:
    """The cosine sums ``config``'s selection reads: every pair for a span ranked by a cosine score."""
    return "all" if config.select == "span" and config.score in ("angular", "bi", "cosine") else "adjacent"


def score_model(model, calibration: CalibrationData, config: PruneConfig,
                cosine_pairs: str | None = None) -> tuple[StateMoments, dict]:
    """One streamed pass; every registered score for every block."""
    check_enough_tokens(calibration.num_tokens, hidden_size(model))
    moments = stream_moments(model, calibration.token_ids, batch_size=config.batch_size,
                             cosine_pairs=cosine_pairs or needed_cosine_pairs(config))
    return moments, block_scores(moments, list(SCORES))


def selection_input(model, calibration, moments, scores, config: PruneConfig,
                    memo: dict | None = None) -> SelectionInput:
    """What the selection strategy sees for ``config.drop`` / ``score`` / ``protect``."""
    count = num_blocks(model)
    return SelectionInput(
        score=get_score(config.score),
        moments=moments,
        values=scores[config.score],
        count=parse_drop(config.drop, count),
        protected=parse_protect(config.protect, count),
        model=model,
        token_ids=calibration.token_ids,
        batch_size=config.batch_size,
        memo=memo,
    )


def choose_blocks(model, calibration, moments, scores, config: PruneConfig, memo: dict | None = None) -> list[int]:
    """Apply ``config.drop`` / ``select`` / ``protect`` to the scores (``memo``: see ``Scored.memo``)."""
    if config.drop is None:
        return []
    return select_blocks(config.select, selection_input(model, calibration, moments, scores, config, memo))


def span_report(model, calibration, moments, scores, config: PruneConfig) -> list[dict]:
    """For ``--select span``: every candidate span with the score it was ranked by, best first."""
    inputs = selection_input(model, calibration, moments, scores, config)
    score = get_score(config.score)
    return [{"blocks": [start, start + inputs.count - 1], config.score: score.removability([value])[0]}
            for start, value in span_candidates(inputs)]  # removability is its own inverse: the raw score


def run_prune(config: PruneConfig, loaded: LoadedModel | None = None,
              steps: Sequence[SurgeryStep] | None = None, scored: Scored | None = None) -> PruneResult:
    """Load (unless given), score, select, remove or replace, run ``steps``, export according to ``config``.

    Args:
        config: the run.
        loaded: an already loaded model to use instead of loading ``config.load``.
        steps: post-surgery steps run in order on the surgered model; None builds the ones ``config``
            switches on (``config.build_steps()``, found by name).
        scored: calibration and statistics already computed on this model (:func:`score_calibration`); the
            model must not have been surgered since.
    """
    started = time.perf_counter()
    steps = config.build_steps() if steps is None else steps
    if config.out is not None:
        check_output_dir(config.out, config.overwrite)
    if loaded is None:
        preflight(config)
        loaded = config.load.load()
    model = loaded.model
    arch_spec(model)
    check_replacement_supported(model, config.replace.method)
    before = num_blocks(model)
    check_against_model(config, model.config)
    params_before = parameter_count(model)
    if sublayer_records(model.config):
        raise LayercutError(f"{config.load.model} already has attention/MLP sub-layers removed: prune the original "
                            "model instead")
    if is_sublayer(parse_units(config.unit)):
        return _prune_units(loaded, config, started, before, params_before, scored)
    check_budget(config, params_before, before)
    memo = {}  # a greedy budget search re-selects with growing drops: each continues the last
    if scored is not None:
        _check_scored(scored, config, before)
        calibration, moments, scores, memo = scored.calibration, scored.moments, scored.scores, scored.memo
    else:
        calibration = calibration_data(loaded.tokenizer, config.data, model=loaded.model)
    heldout = calibration.heldout_ids if config.removes else None
    original = packed_perplexity(model, heldout, config.batch_size) if heldout is not None else None
    if scored is None:
        moments, scores = score_model(model, calibration, config)
    oracle = (run_oracle(model, calibration.token_ids, scores, config.batch_size, cache=removal_cache(memo))
              if config.oracle else None)
    budget = resolve_budget(model, calibration, moments, scores, config, params_before, memo)
    if budget is not None:
        config = dataclasses.replace(config, drop=budget["drop"], target_params=None, target_speedup=None)
    dropped = choose_blocks(model, calibration, moments, scores, config, memo)
    spans = span_report(model, calibration, moments, scores, config) if dropped and config.select == "span" else None
    if dropped:
        replace_blocks_(model, dropped, calibration.token_ids, config.replace, moments)
    if budget is not None and budget.get("target_params") is not None:
        check_params_budget(model, budget)
    done = {step.name: step(loaded, config) for step in steps} if dropped else {}
    report = build_report(loaded, config, calibration, scores, dropped, before, time.perf_counter() - started)
    if spans is not None:
        report["span_scores"] = spans
    if oracle is not None:
        report["oracle"] = oracle.as_dict()
    if budget is not None:
        report["budget"] = {**budget, "params_before": params_before,
                            "params_after": parameter_count(model)}
    if original is not None and dropped:
        report["heldout"] = heldout_report(original, packed_perplexity(model, heldout, config.batch_size), heldout)
    report.update({name: result.report for name, result in done.items()})
    files = [f for result in done.values() for f in result.files]
    out = write_outputs(loaded, report, config, files) if config.out is not None else None
    for folder in (f for result in done.values() for f in result.cleanup):
        shutil.rmtree(folder, ignore_errors=True)
    return PruneResult(loaded, calibration, moments, scores, dropped, report, out)


def _prune_units(loaded: LoadedModel, config: PruneConfig, started: float, before: int, params_before: int,
                 scored: Scored | None) -> PruneResult:
    """``run_prune`` for sub-layer units: one streamed pass with middle states, rank, remove, export."""
    model = loaded.model
    kinds = parse_units(config.unit)
    check_units_supported(model, kinds)
    protected = parse_protect(config.protect, before)
    candidates = candidate_units(model, kinds, protected)
    total = None if config.target_params is None else parse_param_target(config.target_params, params_before)
    if config.drop is not None:
        check_unit_count(parse_drop(config.drop, 2 * before), candidates)
    calibration = scored.calibration if scored is not None else calibration_data(loaded.tokenizer, config.data,
                                                                                   model=model)
    check_enough_tokens(calibration.num_tokens, hidden_size(model))
    heldout = calibration.heldout_ids
    original = packed_perplexity(model, heldout, config.batch_size) if heldout is not None else None
    memo = scored.memo if scored is not None else {}
    if "sublayer-moments" not in memo:  # one pass serves every sub-layer run on this model and calibration
        moments = stream_moments(model, calibration.token_ids, batch_size=config.batch_size,
                                 cosine_pairs="adjacent", mlp_contribution=contribution_path(model))
        memo["sublayer-moments"] = moments, block_scores(moments, list(SCORES))  # value u rates Unit.at(u)
    moments, scores = memo["sublayer-moments"]
    if config.select == "measured":
        costs = measured_costs(model, calibration.token_ids, candidates, config.batch_size,
                               memo.setdefault("sublayer-removal-ppl", {}))
        ranked = rank_measured(costs, {u: unit_parameters(model, u) for u in candidates}, candidates)
    else:
        ranked = rank_units(scores[config.score], get_score(config.score).removability, candidates)
    if total is not None:  # ranked order: the K most removable units are positions 0..K-1
        sizes = [unit_parameters(model, unit) for unit in ranked]
        count = blocks_for_params(total, params_before, sizes, lambda k: list(range(k)), len(ranked),
                                  what="removable sub-layer")
        budget = {"target_params": total, "drop": count}
    else:
        count, budget = parse_drop(config.drop, 2 * before), None
    chosen = ranked[:count]
    removal = remove_units_(model, chosen, calibration.token_ids[:1, : min(32, calibration.token_ids.shape[1])])
    dropped = removal["blocks_removed_whole"]
    report = build_report(loaded, config, calibration, {}, dropped, before, time.perf_counter() - started)
    labels = [Unit.at(u).label() for u in range(2 * before)]
    report.update({"unit": list(kinds), "sublayers": removal,
                   "sublayer_scores": {"units": labels, **scores}})
    if config.select == "measured":
        report["sublayer_measured"] = {"sequences": min(MEASURE_SEQUENCES, calibration.token_ids.shape[0]),
                                       "perplexity": dict(costs),
                                       "ranked": [u.label() for u in ranked]}
    if budget is not None:
        report["budget"] = {**budget, "params_before": params_before, "params_after": parameter_count(model)}
    if original is not None:
        report["heldout"] = heldout_report(original, packed_perplexity(model, heldout, config.batch_size), heldout)
    out = write_outputs(loaded, report, config) if config.out is not None else None
    return PruneResult(loaded, calibration, moments, scores, dropped, report, out)


def check_budget(config: PruneConfig, total: int, blocks: int) -> None:
    """A target the model cannot meet fails now, before any token is scored."""
    if config.target_params is not None:
        parse_param_target(config.target_params, total)
    if config.target_speedup is not None:
        check_enough_free(blocks_for_speedup(float(config.target_speedup), blocks), blocks,
                          parse_protect(config.protect, blocks))


def resolve_budget(model, calibration, moments, scores, config: PruneConfig, total: int,
                   memo: dict | None = None) -> dict | None:
    """The block count a ``target_params`` / ``target_speedup`` asks for (None when ``drop`` is given)."""
    if config.target_params is None and config.target_speedup is None:
        return None
    count = num_blocks(model)
    if config.target_speedup is not None:
        drop = blocks_for_speedup(float(config.target_speedup), count)
        check_enough_free(drop, count, parse_protect(config.protect, count))
        return {"target_speedup": float(config.target_speedup), "drop": drop, "ideal_speedup": count / (count - drop)}
    target = parse_param_target(config.target_params, total)
    free = count - len(parse_protect(config.protect, count))
    _, blocks = get_blocks(model)

    def select(k: int) -> list[int]:
        return choose_blocks(model, calibration, moments, scores, dataclasses.replace(config, drop=k,
                             target_params=None), memo)

    drop = blocks_for_params(target, total, [parameter_count(b) for b in blocks], select, free)
    return {"target_params": target, "drop": drop}


def check_params_budget(model, budget: dict) -> None:
    """Refuse a surgered model whose replacements carried it back above ``--target-params``."""
    after = parameter_count(model)
    if after > budget["target_params"]:
        raise LayercutError(f"--target-params {budget['target_params']:,}: removing {budget['drop']} blocks meets "
                            f"it, but the replacements bring the model back to {after:,} parameters; ask for "
                            f"{after - budget['target_params']:,} fewer or use --replace none / fold")


def _check_scored(scored: Scored, config: PruneConfig, blocks: int) -> None:
    # Shared statistics from another model, or too few cosine sums, would give silently wrong selections.
    if scored.moments.num_states != blocks + 1:
        raise LayercutError(f"shared statistics describe {scored.moments.num_states - 1} blocks, the model has "
                            f"{blocks}: score this model (prune.pipeline.score_calibration)")
    if needed_cosine_pairs(config) == "all" and scored.moments.cosine_pairs != "all":
        raise LayercutError("shared statistics lack the all-pairs cosines --select span needs: "
                            "score with cosine_pairs='all'")


def build_report(loaded, config, calibration, scores, dropped, before, seconds) -> dict:
    """The content of ``layercut.json``."""
    return {
        "source_model": loaded.source,
        "model_name": loaded.name,
        "architecture": loaded.model.config.model_type,
        "num_blocks_before": before,
        "num_blocks_after": num_blocks(loaded.model),
        "dropped": sorted(dropped),
        "score": config.score,
        "select": config.select,
        "protect": parse_protect(config.protect, before),
        "replace": config.replace.method,
        "fit": config.replace.fit if config.replace.method != "none" else None,
        "replacements": replacement_records(loaded.model) if dropped else [],
        "layout": block_layout(loaded.model),
        "scores": scores,
        "data": calibration.describe(),
        "versions": library_versions(),
        "seconds": round(seconds, 2),
        "config": asdict(config),
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

    if report["dropped"] or report.get("sublayers"):
        return save(loaded.model, loaded.tokenizer, config.out, report, config.overwrite, profile_files)
    with atomic_directory(config.out, config.overwrite) as staging:
        write_json(staging / REPORT_FILE, report)
        profile_files(staging)
    return Path(config.out)
