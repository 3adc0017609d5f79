"""The whole prune stage as one function: load, calibrate, score, select, remove, export.

``prune.run`` (the CLI) and recipes build a :class:`PruneConfig` and call :func:`run_prune`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prune.adapters import arch_spec, hidden_size, num_blocks
from prune.data import CalibrationData, DataConfig, calibration_data
from prune.errors import LayercutError
from prune.export import atomic_directory, check_output_dir, export_checkpoint, library_versions, write_json
from prune.loading import LoadedModel, load_model
from prune.profile import plot_linearity_profile, score_table
from prune.scores import SCORES, block_scores, get_score
from prune.select import DEFAULT_PROTECT, SELECTIONS, SelectionInput, parse_drop, parse_protect, select_blocks
from prune.stats import StateMoments, stream_moments
from prune.surgery import drop_blocks_

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
        if self.out is None and self.drop is not None:
            stem = Path(self.load.model.rstrip("/")).name.removesuffix(".gguf")
            self.out = f"{stem}-drop{str(self.drop).replace('%', 'pct')}"


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
    load = config.load
    loaded = loaded or load_model(
        load.model, dtype=load.dtype, device=load.device, load_in_4bit=load.load_in_4bit, load_in_8bit=load.load_in_8bit
    )
    model = loaded.model
    arch_spec(model)
    before = num_blocks(model)
    if config.drop is not None:
        parse_drop(config.drop, before)
    calibration = calibration_data(loaded.tokenizer, config.data)
    moments, scores = score_model(model, calibration, config)
    dropped = choose_blocks(model, calibration, moments, scores, config)
    if dropped:
        drop_blocks_(model, dropped)
    report = build_report(loaded, config, calibration, scores, dropped, before, time.perf_counter() - started)
    out = write_outputs(loaded, report, config) if config.out is not None else None
    return PruneResult(loaded, calibration, moments, scores, dropped, report, out)


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
        "scores": scores,
        "data": calibration.describe(),
        "versions": library_versions(),
        "seconds": round(seconds, 2),
        "config": asdict(config),
    }


def write_outputs(loaded: LoadedModel, report: dict, config: PruneConfig) -> Path:
    """Export the checkpoint (if blocks were dropped) or just the profile, atomically."""

    def profile_files(folder: Path) -> None:
        title = f"{loaded.name}: block linearity ({report['data']['tokens']} tokens)"
        plot_linearity_profile(report["scores"], folder / PROFILE_PNG, title, report["dropped"])
        (folder / SCORES_MD).write_text(score_table(report["scores"], report["dropped"]) + "\n", encoding="utf-8")

    if report["dropped"]:
        return export_checkpoint(loaded.model, loaded.tokenizer, config.out, report, config.overwrite, profile_files)
    with atomic_directory(config.out, config.overwrite) as staging:
        write_json(staging / "layercut.json", report)
        profile_files(staging)
    return Path(config.out)

