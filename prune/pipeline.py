"""The whole prune stage as one function: load, calibrate, score, select, remove or replace, export.

``prune.run`` (the CLI) and recipes build a :class:`PruneConfig` and call :func:`run_prune`. Work that
follows surgery and lives above ``prune`` (distillation) joins by composition: the caller passes
post-surgery steps (``prune.steps``), and prune never imports the package that provides them.
"""


from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prune.adapters import hidden_size, is_offloaded, num_blocks
from prune.budget import check_params_budget
from prune.checkpoint import save
from prune.data import CalibrationData, DataConfig, calibration_data, check_sources
from prune.errors import LayercutError
from prune.export import REPORT_FILE, atomic_directory, check_output_dir, library_versions, write_json
from prune.heldout import heldout_report, packed_perplexity
from prune.loading import LoadedModel, load_config
from prune.options import LoadConfig
from prune.oracle import Oracle, oracle_table
from prune.plan import Plan, check_against_model, resolve_plan
from prune.removal import Removal, planned_blocks, remove_blocks, remove_units
from prune.replace import ReplaceConfig, parameter_count
from prune.score_report import plot_linearity_profile, score_table
from prune.scores import SCORES, block_scores, check_enough_tokens, get_score
from prune.selection import DEFAULT_PROTECT, MEASURED_SELECTIONS, SELECTIONS
from prune.sequential import stream_moments_sequential
from prune.sources import parse_sources
from prune.stats import StateMoments, stream_moments
from prune.steps import SurgeryStep, build_step
from prune.sublayers import UNIT_SELECTIONS, Unit, is_sublayer, parse_units, unit_moments
from prune.surgery import block_layout, replacement_records

logger = logging.getLogger(__name__)

PROFILE_PNG = "linearity_profile.png"
SCORES_MD = "scores.md"
# Replacement methods a skeleton can fit: from a span's (input, output) moments alone (prune.sequential)
OFFLOAD_METHODS = ("none", "linear")

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
            measured, last, repaired-greedy (-kl), repaired-once, repaired-fast (``prune.repaired``).
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
        SELECTIONS.get(self.select)
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
        if is_sublayer(units):
            self._check_sublayer_options()
        if self.load.offload == "sequential":
            self._check_offload_options(units)
        if self.out is None and self.removes:
            self.out = self._default_out(units)

    def _check_sublayer_options(self) -> None:
        """Refuse, in one line, what sub-layer removal does not do (yet)."""
        if not self.removes:
            raise LayercutError(f"--unit {self.unit} needs an amount: pass --drop N (sub-layers) or --target-params")
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

    def _check_offload_options(self, units: tuple[str, ...]) -> None:
        """Refuse, in one line and before any weight is read, what a skeleton cannot run block by block."""
        for flag, bad, fix in (
            ("--unit", is_sublayer(units), "rates whole blocks (--unit block)"),
            ("--select", self.select in MEASURED_SELECTIONS or needed_cosine_pairs(self) == "all",
             "selects from scores of blocks (--select topk, greedy or last): perplexity and span scores of "
             "states need the whole model"),
            ("--oracle", self.oracle, "has no oracle (it measures perplexity with the whole model)"),
            ("--replace", self.replace.method not in OFFLOAD_METHODS or self.replace.fit != "independent",
             f"fits from the original model's states only (--replace {' or '.join(OFFLOAD_METHODS)}, "
             "--fit independent)"),
            ("--distill-steps", bool(self.step_sections()),
             "exports the pruned checkpoint; distil it afterwards with python -m distill.run"),
            ("--data", any(source.is_self for source in parse_sources(self.data.data)),
             "cannot sample text from the model (the default calibration's self half): pass --data builtin, a "
             "file or a dataset"),
        ):
            if bad:
                raise LayercutError(f"{flag} with --offload sequential: a block-by-block run {fix}; change {flag} "
                                    "or use --offload none")

    def _default_out(self, units: tuple[str, ...]) -> str:
        """``<model>-drop<K>[-<units>][-<method>]``: the first command a user types keeps its result."""
        stem = Path(self.load.model.rstrip("/")).name.removesuffix(".gguf")
        method = "" if self.replace.method == "none" else f"-{self.replace.method}"
        amount = (f"drop{str(self.drop).replace('%', 'pct')}" if self.drop is not None else
                  f"params{str(self.target_params).replace('%', 'pct')}" if self.target_params is not None
                  else f"speedup{self.target_speedup}x")
        unit = "" if not is_sublayer(units) else "-" + self.unit.replace(",", "-")
        return f"{stem}-{amount}{unit}{method}"

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

    def resolve(self, model) -> Plan:
        """Amounts, protected blocks and units read against ``model`` once, every one checked (:class:`Plan`)."""
        return resolve_plan(self, model)


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


def needed_cosine_pairs(config: PruneConfig) -> str:
    """The cosine sums ``config``'s selection reads: every pair for a span ranked by a score of states."""
    return "all" if config.select == "span" and get_score(config.score).span is not None else "adjacent"


def score_model(model, calibration: CalibrationData, config: PruneConfig,
                cosine_pairs: str | None = None) -> tuple[StateMoments, dict]:
    """One streamed pass; every registered score for every block."""
    check_enough_tokens(calibration.num_tokens, hidden_size(model))
    if is_offloaded(model):  # block by block, each block's scores taken and its statistics freed at once
        moments = stream_moments_sequential(model, calibration.token_ids, batch_size=config.batch_size,
                                            cosine_pairs=cosine_pairs or needed_cosine_pairs(config),
                                            scores=list(SCORES))
    else:
        moments = stream_moments(model, calibration.token_ids, batch_size=config.batch_size,
                                 cosine_pairs=cosine_pairs or needed_cosine_pairs(config))
    return moments, block_scores(moments, list(SCORES))


def choose_blocks(model, calibration, moments, scores, config: PruneConfig, memo: dict | None = None) -> list[int]:
    """Apply ``config.drop`` / ``select`` / ``protect`` to the scores (``memo``: see ``Scored.memo``)."""
    if config.drop is None:
        return []
    return planned_blocks(model, calibration, moments, scores, config, config.resolve(model), memo)


def run_prune(config: PruneConfig, loaded: LoadedModel | None = None,
              steps: Sequence[SurgeryStep] | None = None, scored: Scored | None = None) -> PruneResult:
    """Load (unless given), score, select, remove or replace, run ``steps``, export according to ``config``.

    Whole blocks and sub-layers share these stages; what differs is how they are scored
    (:func:`score_model`, ``prune.sublayers.unit_moments``) and removed (``prune.removal``).

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
    plan = config.resolve(model)
    calibration, memo = _calibrate(loaded, config, plan, scored)
    # a skeleton never holds the whole model: its output is measured afterwards (eval.run)
    heldout = calibration.heldout_ids if plan.removes and not is_offloaded(model) else None
    original = packed_perplexity(model, heldout, config.batch_size) if heldout is not None else None
    score, remove = (_score_units, remove_units) if plan.is_sublayer else (_score_blocks, remove_blocks)
    moments, scores = score(model, calibration, config, scored, memo)
    removal = remove(model, calibration, moments, scores, config, plan, memo)
    if removal.budget is not None and removal.budget.get("target_params") is not None:
        check_params_budget(parameter_count(model), removal.budget)
    # sub-layer runs take no steps yet (PruneConfig refuses distillation with them)
    done = {step.name: step(loaded, removal.config) for step in steps} if removal.dropped and not plan.is_sublayer \
        else {}
    report = build_report(loaded, removal.config, calibration, scores, removal.dropped, plan,
                          time.perf_counter() - started)
    report.update(removal.sections)
    if removal.budget is not None:
        report["budget"] = {**removal.budget, "params_before": plan.params, "params_after": parameter_count(model)}
    if original is not None and removal.changed:
        report["heldout"] = heldout_report(original, packed_perplexity(model, heldout, config.batch_size), heldout)
    return _finish(loaded, removal, report, done, calibration, moments, scores)


def _calibrate(loaded: LoadedModel, config: PruneConfig, plan: Plan,
               scored: Scored | None) -> tuple[CalibrationData, dict]:
    """The calibration tokens (shared ones if ``scored``) and the memo of what is measured on them."""
    if scored is None:
        calibration, memo = calibration_data(loaded.tokenizer, config.data, model=loaded.model), {}
    else:
        _check_scored(scored, config, plan.num_blocks)
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


def _finish(loaded: LoadedModel, removal: Removal, report: dict, done: dict, calibration: CalibrationData,
            moments: StateMoments, scores: dict) -> PruneResult:
    """Add the steps' reports, export, and delete the steps' work folders."""
    report.update({name: result.report for name, result in done.items()})
    files = [f for result in done.values() for f in result.files]
    config = removal.config
    out = write_outputs(loaded, report, config, files) if config.out is not None else None
    for folder in (f for result in done.values() for f in result.cleanup):
        shutil.rmtree(folder, ignore_errors=True)
    return PruneResult(loaded, calibration, moments, scores, removal.dropped, report, out)


def _check_scored(scored: Scored, config: PruneConfig, blocks: int) -> None:
    # Shared statistics from another model, or too few cosine sums, would give silently wrong selections.
    if scored.moments.num_states != blocks + 1:
        raise LayercutError(f"shared statistics describe {scored.moments.num_states - 1} blocks, the model has "
                            f"{blocks}: score this model (prune.pipeline.score_calibration)")
    if needed_cosine_pairs(config) == "all" and scored.moments.cosine_pairs != "all":
        raise LayercutError("shared statistics lack the all-pairs cosines --select span needs: "
                            "score with cosine_pairs='all'")


def build_report(loaded: LoadedModel, config: PruneConfig, calibration: CalibrationData, scores: dict,
                 dropped: list[int], plan: Plan, seconds: float) -> dict:
    """The content of ``layercut.json``."""
    return {
        "source_model": loaded.source,
        "model_name": loaded.name,
        "architecture": loaded.model.config.model_type,
        "num_blocks_before": plan.num_blocks,
        "num_blocks_after": num_blocks(loaded.model),
        "dropped": sorted(dropped),
        "score": config.score,
        "select": config.select,
        "protect": list(plan.protected),
        "replace": config.replace.method,
        "fit": config.replace.fit if config.replace.method != "none" else None,
        "replacements": replacement_records(loaded.model) if dropped else [],
        "layout": block_layout(loaded.model),
        "scores": scores,
        "data": calibration.describe(),
        "versions": library_versions(),
        "seconds": round(seconds, 2),
        "config": {**asdict(config), "replace": config.replace.to_dict()},  # the flat layout of replace:
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
