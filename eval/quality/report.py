"""Evaluation reports: ``results.json``, a markdown table (``README.md``) and PNG plots.

The results dict that :func:`write_report` takes (``eval.run`` builds it)::

    {"baseline": "smollm2-135m",
     "settings": {...},
     "models": [  # the baseline first
        {"name": ..., "role": "baseline" | "candidate", "num_blocks": 30, "blocks_removed": 0,
         "params": ..., "metrics": {"wikitext/perplexity": 20.1, "arc_easy/acc": 0.61, ...},
         "details": {...}}, ...]}

Metric keys are ``task/metric``. Rows of the table are metrics; columns are the baseline, each
model, and each model's delta to the baseline.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402

logger = logging.getLogger(__name__)

# Lower is better for these metric names; the others (accuracies) are higher-is-better.
_LOWER_IS_BETTER = ("perplexity", "nll", "bits_per_byte", "word_perplexity", "byte_perplexity")
_MIB = 1024 * 1024
# Bookkeeping numbers lm-eval returns beside the metrics: kept in results.json, left out of the table.
_NOT_METRICS = ("sample_len", "samples", "max_gen_toks")  # bookkeeping and settings, not scores


def is_lower_better(metric_key: str) -> bool:
    """Whether a smaller value of ``task/metric`` is better."""
    return metric_key.rsplit("/", 1)[-1] in _LOWER_IS_BETTER


def table_metrics(results: dict) -> list[str]:
    """Metric keys shown in the table: numeric metrics of any model, in first-seen order.

    Standard errors and lm-eval's bookkeeping (``sample_len``) stay in ``results.json`` only.
    """
    keys: list[str] = []
    for model in results["models"]:
        for key, value in model["metrics"].items():
            shown = "stderr" not in key and key.rsplit("/", 1)[-1] not in _NOT_METRICS
            if shown and isinstance(value, (int, float)) and key not in keys:
                keys.append(key)
    return keys


def plot_metrics_keys(results: dict) -> list[str]:
    """Metric keys to plot: ``results["primary_metrics"]`` when given, else every table metric."""
    return list(results.get("primary_metrics") or table_metrics(results))


def _fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, int) or abs(value) >= 1000:
        return f"{value:,.0f}" if abs(value) >= 1000 else str(value)
    return f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"


def _cell(metrics: dict, key: str) -> str:
    """A metric, with lm-eval's standard error beside it when there is one (``0.4800 ± 0.0289``)."""
    text = _fmt(metrics.get(key))
    stderr = metrics.get(f"{key}_stderr")
    return text if stderr is None or text == "-" else f"{text} ± {_fmt(stderr)}"


def _delta(base: float | None, value: float | None) -> str:
    if base is None or value is None:
        return "-"
    diff = value - base
    relative = f" ({diff / base:+.1%})" if base else ""
    return f"{diff:+.4f}{relative}" if abs(diff) < 10 else f"{diff:+.2f}{relative}"


def markdown_table(results: dict) -> str:
    """Side-by-side table: metric rows; columns baseline, each model, and each model's delta to the baseline.

    Without a baseline (``results["baseline"]`` None) the columns are the models alone.
    """
    if results.get("baseline") is None:
        base, cands = None, results["models"]
        header = ["metric", *[c["name"] for c in cands]]
        rows = [["blocks", *[str(c.get("num_blocks", "-")) for c in cands]]]
    else:
        base, *cands = results["models"]
        header = ["metric", f"baseline: {base['name']}"]
        for cand in cands:
            header += [cand["name"], "delta" if len(cands) == 1 else f"delta {cand['name']}"]
        rows = [["blocks", str(base.get("num_blocks", "-"))]]
        for cand in cands:
            removed = cand.get("blocks_removed")
            rows[0] += [str(cand.get("num_blocks", "-")), "-" if removed is None else f"-{removed}"]
    for key in table_metrics(results):
        row = [key + (" (lower is better)" if is_lower_better(key) else "")]
        if base is None:
            row += [_cell(cand["metrics"], key) for cand in cands]
        else:
            b = base["metrics"].get(key)
            row.append(_cell(base["metrics"], key))
            for cand in cands:
                row += [_cell(cand["metrics"], key), _delta(b, cand["metrics"].get(key))]
        rows.append(row)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def standard_errors(results: dict, key: str) -> list[float] | None:
    """lm-eval's standard error of ``key`` for each model (NaN where one has none); None when no model has one."""
    errors = [m["metrics"].get(f"{key}_stderr") for m in results["models"]]
    if all(not isinstance(e, (int, float)) for e in errors):
        return None
    return [float(e) if isinstance(e, (int, float)) else float("nan") for e in errors]


def metrics_figure(results: dict):
    """The figure of :func:`plot_metrics`, not yet saved (tests read its artists)."""
    keys = plot_metrics_keys(results)
    names = [m["name"] for m in results["models"]]
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(max(4.0, 3.2 * len(keys)), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=False):
        values = [m["metrics"].get(key, float("nan")) for m in results["models"]]
        colors = ["#777777" if m["role"] == "baseline" else "#3b75af" for m in results["models"]]
        # a bar without its standard error reads as exact: a 0.02 gap on 500 rows is mostly noise
        ax.bar(range(len(names)), values, color=colors, yerr=standard_errors(results, key), capsize=3,
               error_kw={"elinewidth": 1})
        ax.set_xticks(range(len(names)), [_short(n) for n in names], rotation=30, ha="right", fontsize=8)
        ax.set_title(key, fontsize=9)
        if is_lower_better(key) and all(v > 0 for v in values if not math.isnan(v)):
            ax.set_yscale("log")
    fig.tight_layout()
    return fig


def plot_metrics(results: dict, path: Path) -> Path:
    """Bar chart: one panel per (primary) metric, one bar per model, lm-eval's standard errors as error bars."""
    fig = metrics_figure(results)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_vs_blocks_removed(results: dict, path: Path) -> Path | None:
    """Perplexity and accuracies against blocks removed; None when fewer than two candidates know it."""
    models = [m for m in results["models"] if m.get("blocks_removed") is not None]
    if sum(m["role"] == "candidate" for m in models) < 2:
        return None
    models.sort(key=lambda m: m["blocks_removed"])
    removed = [m["blocks_removed"] for m in models]
    keys = plot_metrics_keys(results)
    lower = [k for k in keys if is_lower_better(k)]
    higher = [k for k in keys if not is_lower_better(k)]
    panels = [p for p in (lower, higher) if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.0 * len(panels), 3.8), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for key in panel:
            ax.plot(removed, [m["metrics"].get(key, float("nan")) for m in models], marker="o", label=key)
        ax.set_xlabel("blocks removed")
        if panel is lower:
            ax.set_yscale("log")
            ax.set_ylabel("perplexity (log scale)")
        else:
            ax.set_ylabel("accuracy")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _short(name: str, width: int = 24) -> str:
    return name if len(name) <= width else "..." + name[-(width - 3) :]


def write_report(results: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write ``results.json``, ``README.md`` and the plots into ``out_dir``.

    Returns:
        What was written, by kind (``json``, ``markdown``, ``metrics_plot``, ``blocks_plot``).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {"json": out / "results.json", "markdown": out / "README.md"}
    written["json"].write_text(json.dumps(results, indent=2, default=str) + "\n")
    plots = {"metrics_plot": plot_metrics(results, out / "metrics.png")}
    blocks_plot = plot_vs_blocks_removed(results, out / "vs_blocks_removed.png")
    if blocks_plot is not None:
        plots["blocks_plot"] = blocks_plot
    written["markdown"].write_text(_readme(results, plots))
    written.update(plots)  # the caller names the folder: eval.run writes a staging folder renamed into --out
    return written


def _readme(results: dict, plots: dict[str, Path]) -> str:
    settings = results.get("settings", {})
    names = [m["name"] for m in results["models"] if m["role"] != "baseline"]
    title = f"{results['baseline']} vs {', '.join(names)}" if results.get("baseline") else ", ".join(names)
    lines = [f"# Evaluation: {title}", ""]
    lines += [markdown_table(results), ""]
    lines += [f"- {k}: `{v}`" for k, v in settings.items()]
    lines += [""] + [f"![{kind}]({path.name})" for kind, path in plots.items()]
    return "\n".join(lines) + "\n"


# ---- speed reports (eval.bench speed) ----


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / _MIB:,.1f}"


def _rate(spread: dict) -> str:
    return f"{spread['median']:,.1f} [{spread['min']:,.1f}-{spread['max']:,.1f}]"


def speed_markdown(comparison: dict) -> str:
    """Table of a ``SpeedComparison.to_dict()``: one row per model, ratios to the baseline."""
    header = [
        "model", "blocks", "params (M)", "checkpoint (MiB)", "peak memory (MiB)",
        "prefill tok/s median [min-max]", "decode tok/s median [min-max]",
        "ideal L/(L-k)", "prefill x", "decode x", "prefill x / ideal", "decode x / ideal",
    ]  # fmt: skip
    ratios = {r["name"]: r for r in comparison["ratios"]}
    rows = []
    for model in [comparison["baseline"], *comparison["candidates"]]:
        ratio = ratios.get(model["name"])
        row = [
            model["name"], str(model["num_blocks"]), f"{model['params'] / 1e6:,.2f}",
            _mib(model["checkpoint_bytes"]), _peak_cell(model),
            _rate(model["prefill_tokens_per_s"]), _rate(model["decode_tokens_per_s"]),
        ]  # fmt: skip
        if ratio is None:
            row += ["1.000", "1.000", "1.000", "-", "-"]
        else:
            row += [
                f"{ratio['ideal']:.3f}",
                _ratio_cell(ratio["prefill"], ratio["prefill_paired"]),
                _ratio_cell(ratio["decode"], ratio["decode_paired"]),
                f"{ratio['prefill'] / ratio['ideal']:.1%}",
                f"{ratio['decode'] / ratio['ideal']:.1%}",
            ]
        rows.append(row)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def _peak_cell(model: dict) -> str:
    """Peak memory in MiB; "off" where it was not measured on purpose (an engine other than transformers)."""
    if model["peak_memory_bytes"] is None and str(model.get("memory_method") or "").startswith("off"):
        return "off"
    return _mib(model["peak_memory_bytes"])


def _engine_line(comparison: dict) -> str:
    """``engine `llamacpp` 0.3.36 (threads 2, ...)``: what ran the models; older results say transformers."""
    engine = comparison.get("engine", "transformers")
    version = comparison.get("engine_version")
    settings = comparison.get("engine_settings") or {}
    details = ", ".join(f"{k} {v}" for k, v in settings.items())
    return f"- engine `{engine}`" + (f" {version}" if version else "") + (f" ({details})" if details else "")


def _ratio_cell(ratio: float, paired: dict) -> str:
    return f"{ratio:.3f} [{paired['min']:.3f}-{paired['max']:.3f}]"


def write_speed_report(comparison: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write ``speed.json`` and ``speed.md`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "speed.json", "markdown": out / "speed.md"}
    paths["json"].write_text(json.dumps(comparison, indent=2) + "\n")
    options = comparison["options"]
    notes = [
        "",
        _engine_line(comparison),
        f"- device `{comparison['device']}`, torch threads {comparison['torch_threads']}",
        f"- prompt {options['prompt_len']} tokens, decode {options['new_tokens']} tokens, "
        f"batch {options['batch_size']}, {options['repeats']} interleaved repeats after {options['warmup']} warm-up",
        "- ratios: candidate / baseline throughput, ratio of medians [min-max of per-repeat paired ratios]",
    ]
    methods = {m["memory_method"] for m in [comparison["baseline"], *comparison["candidates"]] if m["memory_method"]}
    notes += [f"- peak memory: {m}" for m in sorted(methods)]
    notes += [f"- **warning**: {line}" for line in comparison.get("warnings", [])]
    paths["markdown"].write_text("# Speed and memory\n\n" + speed_markdown(comparison) + "\n".join(notes) + "\n")
    return paths
