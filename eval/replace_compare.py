"""Side-by-side comparison of what takes removed blocks' place, on held-out perplexity.

One model load, one calibration set and one scoring pass choose the blocks for every drop count;
each variant then surgers a fresh copy of the original model, is optionally distilled against the
untouched original, and is scored on a text the calibration never saw. Everything a variant
differs in is its replacement kind, its fit and whether it is distilled, so the rows compare.

    python -m eval.bench replace --model smollm2-135m --drop 4,8 --heldout emma.txt --out bench-replace/
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eval.perplexity import perplexity, tokenize_text
from prune.data import CalibrationData
from prune.errors import LayercutError
from prune.loading import LoadedModel
from prune.pipeline import PruneConfig, choose_blocks, score_model
from prune.replace import ReplaceConfig, replace_blocks_

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variant:
    """One way of filling the removed blocks' place."""

    replace: str
    fit: str = "independent"
    distill: bool = False


VARIANTS: dict[str, Variant] = {
    "remove": Variant("none"),
    "linear": Variant("linear"),
    "linear+sequential": Variant("linear", fit="sequential"),
    "fold": Variant("fold"),
    "lowrank": Variant("lowrank"),
    "linear+distill": Variant("linear", distill=True),
    "block+distill": Variant("block", distill=True),
}


def parse_variants(spec: str) -> list[str]:
    """Comma-separated variant names, checked against :data:`VARIANTS`."""
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not names:
        raise LayercutError(f"unknown variant(s) {', '.join(unknown) or '(none given)'}: "
                            f"choose from {', '.join(VARIANTS)}")
    return names


@dataclass
class CompareOptions:
    """What to compare and how.

    Attributes:
        drops: block counts to remove.
        variants: names from :data:`VARIANTS`.
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
    rows = []
    for drop in options.drops:
        config = copy.copy(options.prune)
        config.drop = drop
        dropped = choose_blocks(model, calibration, moments, scores, config)
        for name in options.variants:
            rows.append(_run_variant(loaded, calibration, heldout, dropped, name, options))
            logger.info("drop %d %s: perplexity %.3f", drop, name, rows[-1]["perplexity"])
    return {"model": loaded.name, "heldout_tokens": dense.tokens_scored, "seq_len": options.seq_len,
            "calibration": calibration.describe(), "score": options.prune.score, "select": options.prune.select,
            "dense": {"perplexity": dense.perplexity}, "rows": rows}


def _run_variant(loaded: LoadedModel, calibration: CalibrationData, heldout: torch.Tensor, dropped: list[int],
                 name: str, options: CompareOptions) -> dict:
    variant = VARIANTS[name]
    student = copy.deepcopy(loaded.model)
    started = time.perf_counter()
    replace = ReplaceConfig(kind=variant.replace, fit=variant.fit, batch_size=options.prune.batch_size)
    records = replace_blocks_(student, dropped, calibration.token_ids, replace)
    row = {"drop": len(dropped), "variant": name, "dropped": dropped,
           "params": sum(r["params"] for r in records), "fit_seconds": round(time.perf_counter() - started, 1)}
    if variant.distill:
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
        lines.append(f"| {row['drop']} | {row['variant']} | {row['dropped']} | {row['params']:,} | "
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
