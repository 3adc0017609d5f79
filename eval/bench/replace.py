"""Side-by-side comparison of what takes removed blocks' place, on held-out perplexity.

One model load, one calibration set and one scoring pass choose the blocks for every drop count;
each variant then surgers a fresh copy of the original model, is optionally distilled against the
untouched original, and is scored on a text the calibration never saw. Everything a variant
differs in is its replacement method, its fit and whether it is distilled, so the rows compare. The
variants come from the method registry (``prune.replace.METHODS``): ``<method>[+sequential][+distill]``,
with ``remove`` for the method ``none``.

    python -m eval.bench replace --model smollm2-135m --drop 4,8 --heldout emma.txt --out bench-replace/
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from eval.bench.registry import bench_option, data_option, register_subcommand, threads_option
from eval.quality.perplexity import perplexity, tokenize_text
from prune.data.calibration import CalibrationData, DataConfig, calibration_data, load_documents
from prune.errors import LayercutError
from prune.loading.loader import LoadedModel
from prune.options import apply_threads, parse_counts
from prune.pipeline.config import PruneConfig
from prune.pipeline.runner import blocks_to_drop, score_model
from prune.replace import METHODS, ReplaceConfig, check_span_lengths, replace_blocks_, spans_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    """One way of filling the removed blocks' place: a registered method, its fit, and distillation after.

    Attributes:
        method: a method of ``prune.replace.METHODS`` (``none`` is the variant ``remove``).
        fit: independent | sequential.
        distill: distil the surgered model against the original afterwards.
    """

    method: str
    fit: str = "independent"
    distill: bool = False


REMOVE = "remove"  # the variant name of the method ``none``
MODIFIERS = ("sequential", "distill")  # suffixes, in this order: <method>[+sequential][+distill]
# The variants compared by default: each method once, the sequential fit and distillation where they tell most.
DEFAULT_VARIANTS = ("remove", "linear", "linear+sequential", "fold", "lowrank", "linear+distill", "block+distill")


def variant(name: str) -> Variant:
    """The variant ``<method>[+sequential][+distill]`` (``remove`` is the method ``none``).

    Raises:
        KeyError: not a registered method, an unknown or misplaced modifier, or a fit the method lacks.
    """
    base, *modifiers = name.split("+")
    method = "none" if base == REMOVE else base
    canonical = [m for m in MODIFIERS if m in modifiers]  # each known modifier once, in order
    if base == "none" or method not in METHODS or modifiers != canonical:
        raise KeyError(name)
    fit = "sequential" if "sequential" in modifiers else "independent"
    if fit not in METHODS[method].fits:
        raise KeyError(name)
    return Variant(method, fit, "distill" in modifiers)


def variant_name(method: str) -> str:
    """A method's plain variant name."""
    return REMOVE if method == "none" else method


def default_variants() -> list[str]:
    """:data:`DEFAULT_VARIANTS`, plus every registered method none of them uses (a new method is compared too)."""
    used = {variant(name).method for name in DEFAULT_VARIANTS if name in VARIANTS}
    return [name for name in DEFAULT_VARIANTS if name in VARIANTS] + [
        variant_name(method) for method in METHODS if method not in used]


class _VariantTable(Mapping):
    """The variants, read from the registry: iterates over the default ones, looks up any valid name."""

    def __getitem__(self, name: str) -> Variant:
        return variant(name)

    def __iter__(self) -> Iterator[str]:
        return iter(default_variants())

    def __len__(self) -> int:
        return len(default_variants())


VARIANTS: Mapping[str, Variant] = _VariantTable()


def parse_variants(spec: str) -> list[str]:
    """Comma-separated variant names, each ``<method>[+sequential][+distill]`` or ``remove``."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not names:
        raise LayercutError(f"unknown variant(s) {', '.join(unknown) or '(none given)'}: choose from "
                            f"{', '.join(VARIANTS)}, or any <method>[+sequential][+distill] with a method of "
                            f"{', '.join(variant_name(m) for m in METHODS)}")
    return names


@dataclass
class CompareOptions:
    """What to compare and how.

    Attributes:
        drops: block counts to remove.
        variants: variant names (:func:`parse_variants`).
        prune: selection options (score, select, protect, batch size); its ``drop`` is overridden.
        distill: ``distill.config.DistillConfig`` for the distilled variants.
        seq_len: perplexity window.
    """

    drops: list[int]
    variants: list[str]
    prune: PruneConfig
    distill: object | None = None
    seq_len: int = 512


def _distill(student, teacher, tokenizer, config) -> dict:
    from distill.train import distill  # lazy: only the distilled variants need it

    result = distill(student, teacher, tokenizer, config)
    return {"steps": result.steps, "first_loss": result.losses[0], "final_loss": result.final_loss,
            "steps_per_second": round(result.steps_per_second, 4), "seconds": round(result.seconds, 1),
            "trainable_parameters": result.trainable_parameters, "peak_memory_bytes": result.peak_memory_bytes}


def compare_replacements(loaded: LoadedModel, calibration: CalibrationData, heldout_text: str,
                         options: CompareOptions) -> dict:
    """Held-out perplexity of the dense model and of every (drop count, variant) pair.

    Returns:
        ``{"dense": {...}, "rows": [{"drop", "variant", "dropped", "perplexity", "params", ...}], ...}``.
    """
    model, tokenizer = loaded.model, loaded.tokenizer
    model.eval()
    heldout = tokenize_text(tokenizer, heldout_text)
    dense = perplexity(model, heldout, seq_len=options.seq_len, progress=False)
    logger.info("dense perplexity %.3f over %d tokens", dense.perplexity, dense.tokens_scored)
    moments, scores = score_model(model, calibration, options.prune)
    chosen = {}
    for drop in options.drops:
        config = copy.copy(options.prune)
        config.drop = drop
        chosen[drop] = blocks_to_drop(model, calibration, moments, scores, config)
        for name in options.variants:  # every pair checked before the first variant runs
            check_span_lengths(variant(name).method, spans_of(chosen[drop]), fix=f"{name} cannot replace them at "
                               f"drop {drop}; pass --select span, or leave {name} out of --variants")
    rows = []
    for drop, dropped in chosen.items():
        for name in options.variants:
            rows.append(_run_variant(loaded, calibration, heldout, dropped, name, options))
            logger.info("drop %d %s: perplexity %.3f", drop, name, rows[-1]["perplexity"])
    return {"model": loaded.name, "heldout_tokens": dense.tokens_scored, "seq_len": options.seq_len,
            "calibration": calibration.describe(), "score": options.prune.score, "select": options.prune.select,
            "dense": {"perplexity": dense.perplexity}, "rows": rows}


def _run_variant(loaded: LoadedModel, calibration: CalibrationData, heldout: torch.Tensor, dropped: list[int],
                 name: str, options: CompareOptions) -> dict:
    chosen = variant(name)
    student = copy.deepcopy(loaded.model)
    started = time.perf_counter()
    replace = ReplaceConfig(method=chosen.method, fit=chosen.fit, batch_size=options.prune.batch_size)
    records = replace_blocks_(student, dropped, calibration.token_ids, replace)
    row = {"drop": len(dropped), "variant": name, "dropped": dropped,
           "params": sum(r["params"] for r in records), "fit_seconds": round(time.perf_counter() - started, 1)}
    scales = {r["update_scale"] for r in records if "update_scale" in r}
    if scales:  # the method's default share of its update: the row says which map it measured
        (row["update_scale"],) = scales
    if chosen.distill:
        if options.distill is None:
            raise LayercutError(f"variant {name} distils: pass a DistillConfig in CompareOptions.distill")
        row["distill"] = _distill(student, loaded.model, loaded.tokenizer, options.distill)
    row["perplexity"] = perplexity(student, heldout, seq_len=options.seq_len, progress=False).perplexity
    del student
    return row


def compare_markdown(results: dict) -> str:
    """The comparison as a markdown table, perplexity relative to the dense model."""
    dense = results["dense"]["perplexity"]
    lines = [
        f"Held-out perplexity of {results['model']} ({results['heldout_tokens']} tokens, windows of "
        f"{results['seq_len']}); blocks chosen by {results['select']} on {results['score']} over "
        f"{results['calibration']['tokens']} calibration tokens.",
        "",
        "| drop | variant | dropped | replacement params | perplexity | vs dense | distill steps/s |",
        "|---:|---|---|---:|---:|---:|---:|",
        f"| 0 | dense | - | - | {dense:.2f} | 1.000 | - |",
    ]
    for row in results["rows"]:
        rate = row["distill"]["steps_per_second"] if "distill" in row else "-"
        name = row["variant"] + (f" ({row['update_scale']:g} of the update)" if row.get("update_scale", 1) != 1 else "")
        lines.append(f"| {row['drop']} | {name} | {row['dropped']} | {row['params']:,} | "
                     f"{row['perplexity']:.2f} | {row['perplexity'] / dense:.3f} | {rate} |")
    return "\n".join(lines)


def plot_compare(results: dict, path) -> Path:
    """PNG: held-out perplexity per variant, one group of bars per drop count, dense as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drops = sorted({row["drop"] for row in results["rows"]})
    variants = list(dict.fromkeys(row["variant"] for row in results["rows"]))
    value = {(row["drop"], row["variant"]): row["perplexity"] for row in results["rows"]}
    width = 0.8 / len(variants)
    fig, ax = plt.subplots(figsize=(9, 4), dpi=120)
    for i, name in enumerate(variants):
        xs = [d + (i - (len(variants) - 1) / 2) * width for d in range(len(drops))]
        ax.bar(xs, [value.get((drop, name), float("nan")) for drop in drops], width, label=name)
    ax.axhline(results["dense"]["perplexity"], color="black", ls="--", lw=1, label="dense")
    ax.set_xticks(range(len(drops)), [f"drop {d}" for d in drops])
    ax.set_ylabel("held-out perplexity")
    ax.set_title(f"{results['model']}: what takes the removed blocks' place")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def benchmark_replacements(prune, drops: list[int], variants: str, heldout: str, heldout_chars: int | None = None,
                           distill_steps: int = 0) -> dict:
    """Load ``prune.load`` and compare ``variants`` at each drop count on a held-out text.

    Args:
        prune: a ``PruneConfig`` giving the model, calibration data, score, selection and batch size.
        drops: block counts to remove.
        variants: comma-separated variant names (see :func:`parse_variants`).
        heldout: text the calibration never saw: a file or datasets spec (``prune.data.calibration.load_documents``).
        heldout_chars: score only the first this many characters (None: all).
        distill_steps: steps of the ``+distill`` variants (other ``DistillConfig`` defaults).
    """
    from distill.config import DistillConfig

    names = parse_variants(variants)
    distilled = [name for name in names if VARIANTS[name].distill]
    if distilled and distill_steps <= 0:
        raise LayercutError(f"variant(s) {', '.join(distilled)} distil: give --distill-steps > 0 or leave them out")
    documents, _ = load_documents(heldout, flag="--heldout")
    text = "\n\n".join(documents)[:heldout_chars]
    loaded = prune.load.load()
    calibration = calibration_data(loaded.tokenizer, prune.data, model=loaded.model)
    distill = DistillConfig(steps=distill_steps) if distill_steps else None
    options = CompareOptions(drops, names, prune, distill, seq_len=prune.data.seq_len)
    return compare_replacements(loaded, calibration, text, options)


# ---- eval.bench replace ----

REPLACE_HELP = "held-out perplexity of remove / linear / sequential / fold / lowrank / distilled replacements"


@dataclass(frozen=True)
class ReplaceBenchOptions:
    """The options of ``eval.bench replace``: its flags, in ``--help``'s order.

    Attributes:
        model: model name or folder.
        device: cpu, cuda, cuda:N or auto.
        drop: comma list of block counts to remove.
        variants: comma list of variants (:func:`parse_variants`).
        heldout: text the calibration never saw (a file or datasets spec).
        heldout_chars: score only its first this many characters (None: all).
        score: ranking criterion, as ``prune.run``.
        select: selection, as ``prune.run``.
        data: the calibration text.
        batch_size: sequences per forward pass.
        distill_steps: steps of the +distill variants.
        out: folder for ``replace.json``, ``replace.md`` and ``replace.png`` (None: print only).
        threads: CPU threads (None: the free cores).
    """

    model: str = bench_option("smollm2-135m", "model name or folder (default: smollm2-135m)")
    device: str = bench_option("cpu", "cpu, cuda, cuda:N or auto (default: cpu)")
    drop: str = bench_option("4,8", "comma-separated block counts to remove (default: 4,8)")
    variants: str = bench_option(None, lambda: f"comma-separated, from {', '.join(VARIANTS)} (default: all)",
                                 default_factory=lambda: ",".join(VARIANTS))
    heldout: str | None = bench_option(
        None, "text the calibration never saw: .txt/.jsonl/.parquet file or datasets spec", required=True)
    heldout_chars: int | None = bench_option(None, "score only the first N characters of it (default: all)",
                                             type=int)
    score: str = bench_option("linearity", "ranking criterion, as prune.run (default: linearity)")
    select: str = bench_option("topk", "topk, span or greedy, as prune.run (default: topk)")
    data: DataConfig = data_option(samples=64, seq_len=512, what="sequence and perplexity window")
    batch_size: int = bench_option(4, "sequences per forward pass (default: 4)", type=int)
    distill_steps: int = bench_option(100, "steps of the +distill variants, other DistillConfig defaults "
                                           "(default: 100)", type=int)
    out: str | None = bench_option(None, "folder for replace.json, replace.md and replace.png (default: print only)")
    threads: int | None = threads_option()


def run_replace(options: ReplaceBenchOptions) -> int:
    """Run the ablation of ``options``, print its table and write it (with its plot) under ``--out``."""
    apply_threads(options)
    prune = PruneConfig(load={"model": options.model, "device": options.device}, data=options.data,
                        batch_size=options.batch_size, score=options.score, select=options.select)
    results = benchmark_replacements(prune, parse_counts(options.drop, "--drop"), options.variants,
                                     options.heldout, options.heldout_chars, options.distill_steps)
    table = compare_markdown(results)
    print(table)
    if options.out:
        from prune.atomic import atomic_directory, write_json

        with atomic_directory(options.out, overwrite=True) as staging:
            write_json(staging / "replace.json", results)
            (staging / "replace.md").write_text(table + "\n", encoding="utf-8")
            plot_compare(results, staging / "replace.png")
    return 0


register_subcommand("replace", REPLACE_HELP, ReplaceBenchOptions, run_replace)
