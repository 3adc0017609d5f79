"""The whole prune stage as one function: load, calibrate, score, select, remove or replace, distill, export.

``prune.run`` (the CLI) and recipes build a :class:`PruneConfig` and call :func:`run_prune`.
Distillation (``distill_steps > 0``) imports ``distill`` lazily: prune's library never needs it otherwise.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prune.adapters import arch_spec, hidden_size, num_blocks
from prune.checkpoint import save
from prune.data import CalibrationData, DataConfig, calibration_data
from prune.errors import LayercutError
from prune.export import atomic_directory, check_output_dir, library_versions, write_json
from prune.loading import LoadedModel, load_model
from prune.profile import plot_linearity_profile, score_table
from prune.replace import ReplaceConfig, check_replacement_supported, replace_blocks_
from prune.scores import SCORES, block_scores, get_score
from prune.select import DEFAULT_PROTECT, SELECTIONS, SelectionInput, parse_drop, parse_protect, select_blocks
from prune.stats import StateMoments, stream_moments
from prune.surgery import block_layout, replacement_records

logger = logging.getLogger(__name__)

# Fewer tokens than this many times the hidden size make every linearity score trivially close to 1.
MIN_TOKENS_PER_DIM = 4
PROFILE_PNG = "linearity_profile.png"
SCORES_MD = "scores.md"


@dataclass
class LoadConfig:
    """How to load the model (see ``prune.loading.load_model``)."""

    model: str = "smollm2-135m"
    dtype: str = "auto"
    device: str = "cpu"
    load_in_4bit: bool = False
    load_in_8bit: bool = False

    def __post_init__(self):
        if self.load_in_4bit and self.load_in_8bit:
            raise LayercutError("--load-in-4bit and --load-in-8bit exclude each other: pass one")

    def load(self) -> LoadedModel:
        """Load the model these options describe."""
        return load_model(self.model, dtype=self.dtype, device=self.device, load_in_4bit=self.load_in_4bit,
                          load_in_8bit=self.load_in_8bit)


@dataclass
class PruneConfig:
    """One prune run; a recipe's ``prune:`` section maps key for key onto it.

    Attributes:
        load: model and how to load it.
        data: calibration text.
        drop: blocks to remove, a count (4) or a share ("25%"); None only scores.
        score: criterion used to rank blocks (all registered scores are reported).
        select: topk | span | greedy.
        protect: blocks never removed ("0,-1" = first and last; "none").
        batch_size: sequences per forward pass while streaming statistics.
        replace: what takes the removed blocks' place: none | linear | lowrank | fold | block.
        fit: independent (each span fitted on the original model's states) | sequential (on the
            states of the model with the earlier spans already replaced).
        rank: rank of ``lowrank`` maps (None: max(1, hidden // 100)).
        ridge: ridge of the closed-form fits, relative to the mean input variance (0: pseudo-inverse).
        replace_steps: Adam steps of ``lowrank`` / ``block`` replacements (None: the kind's default).
        distill_steps: layerwise distillation steps against the original model after surgery (0: none).
        distill: more ``distill.config.DistillConfig`` fields (lr, batch_size, seq_len, kl_weight, ...).
        out: output folder; None writes nothing when only scoring, and ``<model>-drop<K>`` when
            dropping, so the first command a user types keeps its result.
        overwrite: replace a non-empty ``out``.
    """

    load: LoadConfig = field(default_factory=LoadConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drop: str | int | None = None
    score: str = "linearity"
    select: str = "topk"
    protect: str = DEFAULT_PROTECT
    batch_size: int = 4
    replace: str = "none"
    fit: str = "independent"
    rank: int | None = None
    ridge: float = 0.0
    replace_steps: int | None = None
    distill_steps: int = 0
    distill: dict = field(default_factory=dict)
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
        self.replace_config()
        self._check_surgery_options()
        if self.out is None and self.drop is not None:
            stem = Path(self.load.model.rstrip("/")).name.removesuffix(".gguf")
            kind = "" if self.replace == "none" else f"-{self.replace}"
            self.out = f"{stem}-drop{str(self.drop).replace('%', 'pct')}{kind}"

    def _check_surgery_options(self) -> None:
        if self.drop is None and (self.replace != "none" or self.distill_steps):
            flag = "--replace" if self.replace != "none" else "--distill-steps"
            raise LayercutError(f"{flag} needs blocks to remove: pass --drop (a count or a share)")
        if self.replace == "none" and self.fit != "independent":
            raise LayercutError("--fit sequential applies to replacements: pass --replace linear|lowrank|fold|block")
        if not isinstance(self.distill_steps, int) or self.distill_steps < 0:
            raise LayercutError(f"--distill-steps must be an integer >= 0, got {self.distill_steps}")
        if not isinstance(self.distill, dict):
            raise LayercutError(f"distill must be a mapping of DistillConfig fields, got {type(self.distill).__name__}")
        if self.distill_steps:
            self.distill_config()  # validates the extra fields now, before any heavy work

    def replace_config(self) -> ReplaceConfig:
        """The :class:`prune.replace.ReplaceConfig` these options describe (validated)."""
        return ReplaceConfig(kind=self.replace, fit=self.fit, rank=self.rank, ridge=self.ridge,
                             steps=self.replace_steps, batch_size=self.batch_size)

    def distill_config(self):
        """The ``distill.config.DistillConfig`` for ``--distill-steps`` (imports ``distill`` lazily)."""
        import dataclasses

        from distill.config import DistillConfig

        extra = dict(self.distill)
        if self.data.data is not None and "data" not in extra:
            # distil on the user's text too, at distillation's own (short) sequence length and count
            defaults = DistillConfig().data
            extra["data"] = dataclasses.replace(defaults, data=self.data.data, text_field=self.data.text_field)
        try:
            return DistillConfig(steps=self.distill_steps, **extra)
        except TypeError as err:
            known = ", ".join(f.name for f in dataclasses.fields(DistillConfig) if f.name != "steps")
            raise LayercutError(f"distill: {err}; known keys: {known}") from None


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


def check_enough_tokens(tokens: int, dim: int) -> None:
    """Linearity needs n >= 4 d tokens; otherwise the least-squares fit is (nearly) exact by counting."""
    needed = MIN_TOKENS_PER_DIM * dim
    if tokens < needed:
        raise LayercutError(
            f"{tokens} calibration tokens are too few for hidden size {dim}: need at least {needed} "
            f"({MIN_TOKENS_PER_DIM} x hidden); raise --samples or --seq-len"
        )


def score_model(model, calibration: CalibrationData, config: PruneConfig) -> tuple[StateMoments, dict]:
    """One streamed pass; every registered score for every block."""
    check_enough_tokens(calibration.num_tokens, hidden_size(model))
    span_pairs = config.select == "span" and config.score in ("angular", "bi", "cosine")
    moments = stream_moments(
        model, calibration.token_ids, batch_size=config.batch_size, cosine_pairs="all" if span_pairs else "adjacent"
    )
    return moments, block_scores(moments, list(SCORES))


def choose_blocks(model, calibration, moments, scores, config: PruneConfig) -> list[int]:
    """Apply ``config.drop`` / ``select`` / ``protect`` to the scores."""
    if config.drop is None:
        return []
    count = num_blocks(model)
    inputs = SelectionInput(
        score=get_score(config.score),
        moments=moments,
        values=scores[config.score],
        count=parse_drop(config.drop, count),
        protected=parse_protect(config.protect, count),
        model=model,
        token_ids=calibration.token_ids,
        batch_size=config.batch_size,
    )
    return select_blocks(config.select, inputs)


def run_prune(config: PruneConfig, loaded: LoadedModel | None = None) -> PruneResult:
    """Load (unless given), score, select, remove and export according to ``config``."""
    started = time.perf_counter()
    if config.out is not None:
        check_output_dir(config.out, config.overwrite)
    loaded = loaded or config.load.load()
    model = loaded.model
    arch_spec(model)
    check_replacement_supported(model, config.replace)
    before = num_blocks(model)
    if config.drop is not None:
        parse_drop(config.drop, before)
    calibration = calibration_data(loaded.tokenizer, config.data)
    moments, scores = score_model(model, calibration, config)
    dropped = choose_blocks(model, calibration, moments, scores, config)
    if dropped:
        replace_blocks_(model, dropped, calibration.token_ids, config.replace_config())
    distilled = distill_student(loaded, config) if dropped and config.distill_steps else None
    report = build_report(loaded, config, calibration, scores, dropped, before, time.perf_counter() - started)
    if distilled is not None:
        report["distill"] = distilled[0]
    out = write_outputs(loaded, report, config, distilled[1] if distilled else None) if config.out is not None else None
    if distilled is not None and distilled[1] is not None:
        shutil.rmtree(distilled[1].parent, ignore_errors=True)  # the work folder; its log was copied into out
    return PruneResult(loaded, calibration, moments, scores, dropped, report, out)


def distill_student(loaded: LoadedModel, config: PruneConfig) -> tuple[dict, Path | None]:
    """Distil the surgered model towards a fresh copy of the original; returns (report section, log path)."""
    from distill.checkpoints import default_work_folder
    from distill.train import distill  # lazy: prune's library does not depend on distill

    distill_config = config.distill_config()
    logger.info("loading the teacher (%s) for %d distillation steps", config.load.model, config.distill_steps)
    teacher = config.load.load()
    work = default_work_folder(config.out) if config.out is not None else None
    if work is not None and work.exists():
        shutil.rmtree(work)  # a fresh run: prune.run has no --resume (distill.run has)
    result = distill(loaded.model, teacher.model, loaded.tokenizer, distill_config, out=work)
    del teacher
    return result.report(distill_config), result.log_path


def build_report(loaded, config, calibration, scores, dropped, before, seconds) -> dict:
    """The content of ``layercut.json``."""
    return {
        "source_model": loaded.source,
        "model_name": loaded.name,
        "architecture": loaded.model.config.model_type,
        "num_blocks_before": before,
        "num_blocks_after": before - len(dropped),
        "dropped": sorted(dropped),
        "score": config.score,
        "select": config.select,
        "protect": parse_protect(config.protect, before),
        "replace": config.replace,
        "fit": config.fit if config.replace != "none" else None,
        "replacements": replacement_records(loaded.model) if dropped else [],
        "layout": block_layout(loaded.model),
        "scores": scores,
        "data": calibration.describe(),
        "versions": library_versions(),
        "seconds": round(seconds, 2),
        "config": asdict(config),
    }


def write_outputs(loaded: LoadedModel, report: dict, config: PruneConfig, train_log: Path | None = None) -> Path:
    """Export the checkpoint (if blocks were dropped) or just the profile, atomically."""

    def profile_files(folder: Path) -> None:
        title = f"{loaded.name}: block linearity ({report['data']['tokens']} tokens)"
        plot_linearity_profile(report["scores"], folder / PROFILE_PNG, title, report["dropped"])
        (folder / SCORES_MD).write_text(score_table(report["scores"], report["dropped"]) + "\n", encoding="utf-8")
        if train_log is not None and train_log.is_file():
            shutil.copy2(train_log, folder / train_log.name)

    if report["dropped"]:
        return save(loaded.model, loaded.tokenizer, config.out, report, config.overwrite, profile_files)
    with atomic_directory(config.out, config.overwrite) as staging:
        write_json(staging / "layercut.json", report)
        profile_files(staging)
    return Path(config.out)

