"""One lens run as a function: split the text, fit the shortcuts, measure them, write the report.

``eval.lens.run`` (the CLI) builds a :class:`LensConfig` and calls :func:`run_lens`.

Data split: the calibration text (``data``, default the built-in *Pride and Prejudice*) is tokenized
in document order as packed text (``prune.data.windows``: no special tokens, EOS after each document) and
cut into windows of ``seq_len`` tokens. Without ``eval_data`` the first 80% of the windows are the fit
region and the last 20% the held-out region, so no token is in both; the fit and held-out windows are
drawn from their regions with the seed. With ``eval_data`` the fit windows come from all of ``data``
and the held-out windows from ``eval_data``.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eval.lens.metrics import (
    PRECISION_GOAL,
    PRECISION_KS,
    LensPredictions,
    early_exit_sweep,
    evaluate_shortcuts,
    fixed_exit,
    heatmap_pairs,
    heatmap_states,
    identity_r2,
    layers_at_precision,
    mat_r2_per_layer,
    r2_heatmap,
)
from eval.lens.plots import write_figures
from eval.lens.report import claims, lens_readme
from eval.lens.shortcuts import (
    SHORTCUTS,
    LowRankConfig,
    ShortcutSet,
    build_shortcuts,
    mat_pairs,
    parse_shortcuts,
    settings_dict,
    train_low_rank,
)
from eval.lens.standins import SUBMODULE_PARTS, evaluate_stand_ins, fit_stand_ins, parse_blocks
from prune.atomic import atomic_directory, check_output_dir, write_json
from prune.checkpoint.load_config import LoadConfig
from prune.checkpoint.write import library_versions
from prune.data.calibration import CalibrationData, check_seq_len, load_documents
from prune.data.windows import text_windows
from prune.errors import LayercutError
from prune.loading.loader import LoadedModel
from prune.measure.moments import StateMoments, stream_moments
from prune.measure.scores import MIN_TOKENS_PER_DIM
from prune.model.adapters import arch_spec, hidden_size, num_blocks

logger = logging.getLogger(__name__)

FIT_SHARE = 0.8
RESULTS_FILE = "results.json"
README_FILE = "README.md"
# Tokenize at most this many times the tokens asked for: enough for both regions of a long dataset.
_READ_FACTOR = 10
# Largest heatmap side drawn without a stride: 33 states = 528 cross Grams.
_HEATMAP_MAX_STATES = 33


@dataclass
class LensConfig:
    """One lens run.

    Attributes:
        load: model and how to load it.
        data: fit text (file or datasets spec); None = built-in corpus.
        eval_data: held-out text; None = the last 20% of ``data``'s windows.
        text_field: column of jsonl / parquet / datasets rows.
        tokens: fit tokens (at least 4 x hidden size).
        eval_tokens: held-out tokens.
        seq_len: tokens per window.
        seed: which windows are drawn, and the low-rank initialisation.
        batch_size: windows per forward pass.
        shortcuts: kinds to fit and compare ("id,mat,njtc,n-njtc" or a list).
        ridge: ``mat`` ridge, relative to the mean diagonal of the input Gram.
        low_rank: how ``njtc`` / ``n-njtc`` train.
        early_exit: run the lambda sweep.
        heatmap: R^2 from every layer to every later one for id and mat.
        heatmap_stride: every n-th layer on the heatmap axes; 0 = all up to 32 blocks, else spread to 33.
        submodules: fit and evaluate sub-module stand-ins.
        submodule_blocks: blocks for the stand-ins ("all", "0,5,-1", "0-9").
        out: output folder; None writes nothing.
        overwrite: replace a non-empty ``out``.
        progress: tqdm bars.
    """

    load: LoadConfig = field(default_factory=LoadConfig)
    data: str | None = None
    eval_data: str | None = None
    text_field: str = "text"
    tokens: int = 16384
    eval_tokens: int = 4096
    seq_len: int = 512
    seed: int = 0
    batch_size: int = 4
    shortcuts: list[str] | str = field(default_factory=lambda: list(SHORTCUTS))
    ridge: float = 1e-3
    low_rank: LowRankConfig = field(default_factory=LowRankConfig)
    early_exit: bool = True
    heatmap: bool = True
    heatmap_stride: int = 0
    submodules: bool = False
    submodule_blocks: str | None = None
    out: str | None = None
    overwrite: bool = False
    progress: bool = True

    def __post_init__(self):
        if isinstance(self.load, dict):
            self.load = LoadConfig(**self.load)
        if isinstance(self.low_rank, dict):
            self.low_rank = LowRankConfig(**self.low_rank)
        self.shortcuts = parse_shortcuts(self.shortcuts)
        for name in ("tokens", "eval_tokens", "batch_size"):
            if getattr(self, name) <= 0:
                raise LayercutError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        check_seq_len(self.seq_len)
        if self.ridge < 0:
            raise LayercutError(f"--ridge must be >= 0, got {self.ridge}")
        if self.heatmap_stride < 0:
            raise LayercutError(f"--heatmap-stride must be >= 0 (0 = automatic), got {self.heatmap_stride}")


@dataclass
class LensResult:
    """What a lens run produced."""

    results: dict
    shortcuts: ShortcutSet
    predictions: LensPredictions
    out: Path | None


def check_lens_tokens(tokens: int, dim: int) -> None:
    """The ``mat`` fit needs n >= 4 d calibration tokens, else it is exact by counting."""
    needed = MIN_TOKENS_PER_DIM * dim
    if tokens < needed:
        raise LayercutError(
            f"--tokens {tokens} is too few for hidden size {dim}: the mat fit needs at least {needed} "
            f"({MIN_TOKENS_PER_DIM} x hidden); raise --tokens"
        )


def _token_windows(spec: str | None, tokenizer, config: LensConfig, limit: int) -> tuple[torch.Tensor, str]:
    """[windows, seq_len] token ids of ``spec``'s documents in order, packed (EOS after each), read up to ``limit``."""
    documents, source = load_documents(spec, config.text_field)
    return text_windows(tokenizer, documents, config.seq_len, limit=limit), source


def _draw(windows: torch.Tensor, count: int, seed: int, what: str, source: str) -> torch.Tensor:
    """``count`` windows chosen with ``seed``, in text order; a one-line error if there are too few."""
    if windows.shape[0] < count:
        raise LayercutError(
            f"the {what} text ({source}) holds {windows.shape[0]} windows of {windows.shape[1]} tokens, "
            f"{count} needed: lower --tokens / --eval-tokens / --seq-len or give more text"
        )
    order = torch.randperm(windows.shape[0], generator=torch.Generator().manual_seed(seed))[:count]
    return windows[order.sort().values]  # [count, seq_len]


def lens_splits(tokenizer, config: LensConfig) -> tuple[CalibrationData, CalibrationData, str]:
    """Disjoint fit and held-out token windows (see the module docstring) and a line describing the split."""
    fit_count = max(1, config.tokens // config.seq_len)
    eval_count = max(1, config.eval_tokens // config.seq_len)
    limit = _READ_FACTOR * (fit_count + eval_count) * config.seq_len
    windows, source = _token_windows(config.data, tokenizer, config, limit)
    if config.eval_data is None:
        cut = int(FIT_SHARE * windows.shape[0])
        fit_region, eval_region, eval_source = windows[:cut], windows[cut:], source
        split = (f"one text cut into {windows.shape[0]} windows of {config.seq_len} tokens: fit from the first "
                 f"{cut}, held out from the last {windows.shape[0] - cut}")  # fmt: skip
    else:
        fit_region = windows
        eval_region, eval_source = _token_windows(config.eval_data, tokenizer, config, limit)
        split = "fit on --data, held out on --eval-data"
    fit = _draw(fit_region, fit_count, config.seed, "fit", source)
    held = _draw(eval_region, eval_count, config.seed + 1, "held-out", eval_source)
    return CalibrationData(fit, source), CalibrationData(held, eval_source), split


def _heatmap_axis(config: LensConfig, count: int) -> list[int]:
    stride = config.heatmap_stride or math.ceil((count + 1) / _HEATMAP_MAX_STATES)
    return heatmap_states(count, stride)


def fit_lens(model, fit: CalibrationData, config: LensConfig) -> tuple[ShortcutSet, StateMoments | None, dict]:
    """Stream the fit moments (mat and heatmap pairs), train the low-rank maps, assemble the shortcuts."""
    count, dim = num_blocks(model), hidden_size(model)
    names = config.shortcuts
    moments = None
    if _needs_moments(config):
        pairs = set(mat_pairs(count)) | set(heatmap_pairs(_heatmap_axis(config, count)) if config.heatmap else [])
        moments = stream_moments(model, fit.token_ids, pairs=sorted(pairs), cosine_pairs="none",
                                 batch_size=config.batch_size, progress=config.progress)  # fmt: skip
    maps, losses = train_low_rank(model, fit.token_ids, names, config.low_rank, batch_size=config.batch_size,
                                  progress=config.progress)  # fmt: skip
    settings = settings_dict(config.low_rank, dim, config.ridge)
    shortcuts = build_shortcuts(names, count, dim, moments=moments, ridge=config.ridge, low_rank=maps,
                                settings=settings)  # fmt: skip
    return shortcuts, moments, losses


def _needs_moments(config: LensConfig) -> bool:
    return config.heatmap or any(n in config.shortcuts for n in ("id", "mat"))


def per_layer_table(predictions: LensPredictions, r2_from_moments: dict[str, list[float]]) -> dict:
    """Per shortcut, {metric: [value per layer 0..L]}; id/mat R^2 from moments where available."""
    table = {}
    for name in predictions.names:
        metrics = {"r2": r2_from_moments.get(name, predictions.r2[name])}
        metrics.update({f"precision@{k}": predictions.precision[name][k] for k in PRECISION_KS})
        metrics["surprisal"] = predictions.surprisal[name]
        table[name] = metrics
    return table


def early_exit_results(predictions: LensPredictions) -> dict:
    """The lambda sweep, the fixed-layer line and the layers saved at 95% precision, per shortcut."""
    count = predictions.num_layers
    out = {"goal": PRECISION_GOAL, "exit_layers": [1, count - 1], "shortcuts": {}}
    for name in predictions.names:
        sweep = early_exit_sweep(predictions.confidence[name], predictions.correct[name])
        used = layers_at_precision(sweep)
        out["shortcuts"][name] = {
            "sweep": [{"lambda": p.threshold, "precision@1": p.precision, "layers": p.layers} for p in sweep],
            "fixed": fixed_exit(predictions.correct[name]),
            "layers_used_at_goal": used,
            "layers_saved_at_goal": None if used is None else count - used,
            "saved_share": None if used is None else (count - used) / count,
        }
    saved = out["shortcuts"]
    if "id" in saved and "mat" in saved and None not in (saved["id"]["saved_share"], saved["mat"]["saved_share"]):
        out["mat_minus_id_saved_share"] = saved["mat"]["saved_share"] - saved["id"]["saved_share"]
    return out


def run_lens(config: LensConfig, loaded: LoadedModel | None = None) -> LensResult:
    """Load (unless given), split, fit, evaluate, and write ``config.out`` atomically."""
    started = time.perf_counter()
    if config.out is not None:
        check_output_dir(config.out, config.overwrite)
    loaded = loaded or config.load.load()
    model = loaded.model.eval()
    arch_spec(model)
    count, dim = num_blocks(model), hidden_size(model)
    check_lens_tokens(config.tokens, dim)
    blocks = parse_blocks(config.submodule_blocks, count) if config.submodules else []
    fit, held, split = lens_splits(loaded.tokenizer, config)
    check_lens_tokens(fit.num_tokens, dim)
    shortcuts, fit_moments, losses = fit_lens(model, fit, config)
    predictions = evaluate_shortcuts(model, shortcuts, held.token_ids, batch_size=config.batch_size,
                                     progress=config.progress)  # fmt: skip
    results = {
        "model": loaded.name, "source": loaded.source, "architecture": model.config.model_type,
        "num_blocks": count, "hidden_size": dim,
        "data": {"fit": fit.describe(), "eval": held.describe(), "split": split},
        "layers": list(range(count + 1)), "precision_ks": list(PRECISION_KS),
        "shortcuts": _shortcut_summary(shortcuts),
    }  # fmt: skip
    r2_moments, results["heatmap"] = _moment_results(model, held, fit_moments, config)
    results["per_layer"] = per_layer_table(predictions, r2_moments)
    results["r2_source"] = {n: "moments" if n in r2_moments else "tokens" for n in predictions.names}
    results["early_exit"] = early_exit_results(predictions) if config.early_exit else None
    results["submodules"] = _submodule_results(model, fit, held, predictions, blocks, config) if blocks else None
    results["training_mse"] = losses
    results["claims"] = claims(results)
    seconds = round(time.perf_counter() - started, 1)
    results.update(settings=asdict(config), versions=library_versions(), seconds=seconds)
    out = write_lens_outputs(results, shortcuts, config) if config.out is not None else None
    return LensResult(results, shortcuts, predictions, out)


def _shortcut_summary(shortcuts: ShortcutSet) -> dict:
    dim = shortcuts.dim
    summary = {}
    for name in shortcuts.names:
        params = shortcuts.parameters_per_layer(name)
        summary[name] = {"description": SHORTCUTS[name].description, "params_per_layer": params,
                         "params_total": params * shortcuts.target, "share_of_mat": params / (dim * dim + dim)}
    return summary


def _moment_results(model, held: CalibrationData, fit_moments, config: LensConfig):
    """Held-out R^2 of id and mat from moments, and the heatmap; one streamed pass over the held-out tokens."""
    if fit_moments is None:
        return {}, None
    count = num_blocks(model)
    eval_moments = stream_moments(model, held.token_ids, pairs=fit_moments.pairs, cosine_pairs="none",
                                  batch_size=config.batch_size, progress=config.progress)  # fmt: skip
    r2 = {}
    if "id" in config.shortcuts:
        r2["id"] = [identity_r2(eval_moments, layer, count) for layer in range(count)] + [1.0]
    if "mat" in config.shortcuts:
        r2["mat"] = mat_r2_per_layer(fit_moments, eval_moments, count, config.ridge) + [1.0]
    heat = None
    if config.heatmap:
        states = _heatmap_axis(config, count)
        heat = {"states": states, **r2_heatmap(fit_moments, eval_moments, states, config.ridge, config.progress)}
    return r2, heat


def _submodule_results(model, fit, held, predictions: LensPredictions, blocks, config: LensConfig) -> dict:
    fits = fit_stand_ins(model, blocks, fit.token_ids, ridge=config.ridge, batch_size=config.batch_size,
                         progress=config.progress)  # fmt: skip
    rows = evaluate_stand_ins(model, fits, held.token_ids, predictions.reference, batch_size=config.batch_size,
                              progress=config.progress)  # fmt: skip
    full = predictions.surprisal[predictions.names[0]][-1]
    return {"parts": list(SUBMODULE_PARTS), "blocks": list(blocks),
            "original": {"precision@1": 1.0, "surprisal": full}, "rows": rows}  # fmt: skip


def render_lens_report(results: dict, folder: str | Path) -> list[str]:
    """Write README.md and the figures of ``results`` into ``folder``; returns the figure file names."""
    folder = Path(folder)
    figures = [p.name for p in write_figures(results, folder)]
    (folder / README_FILE).write_text(lens_readme(results, figures), encoding="utf-8")
    return figures


def write_lens_outputs(results: dict, shortcuts: ShortcutSet, config: LensConfig) -> Path:
    """results.json, README.md, the figures and shortcuts.safetensors, all or nothing."""
    with atomic_directory(config.out, config.overwrite) as staging:
        write_json(staging / RESULTS_FILE, results)
        render_lens_report(results, staging)
        shortcuts.save(staging)
    logger.info("wrote %s", config.out)
    return Path(config.out)
