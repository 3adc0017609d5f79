"""The lens figures, drawn from a ``results.json`` dict (Jump to Conclusions / N-NJTC style PNGs).

Each function takes the results dict written by ``eval.lens.pipeline`` and a path, draws one figure
and returns the path; :func:`write_figures` draws every figure the results have data for.
"""

from __future__ import annotations

from pathlib import Path

R2_PNG = "r2.png"
PRECISION_PNG = "precision.png"
SURPRISAL_PNG = "surprisal.png"
HEATMAP_PNG = "heatmap.png"
EARLY_EXIT_PNG = "early_exit.png"
SUBMODULES_PNG = "submodules.png"

# One colour per shortcut across every figure (the papers' id-vs-mat contrast first).
COLOURS = {"id": "tab:blue", "mat": "tab:orange", "njtc": "tab:green", "n-njtc": "tab:red"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path)
    _pyplot().close(fig)
    return path


def _title(results: dict) -> str:
    """The model as typed, shortened to its last path component."""
    return Path(str(results["model"])).name


def _label(results: dict, name: str) -> str:
    params = results["shortcuts"][name]["params_per_layer"]
    return f"{name} ({params:,} params/layer)" if params else name


def _layer_axes(ax, results: dict, ylabel: str) -> None:
    ax.set_xlabel("layer l (blocks run; L = full model)")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.set_xlim(-0.5, results["num_blocks"] + 0.5)


def plot_r2(results: dict, path: str | Path) -> Path:
    """Held-out R^2 of each shortcut's prediction of the last state, per layer."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for name, metrics in results["per_layer"].items():
        label = _label(results, name)
        ax.plot(results["layers"], metrics["r2"], marker="o", ms=3, color=COLOURS.get(name), label=label)
    _layer_axes(ax, results, "R$^2$ to last block output")
    ax.set_title(f"{_title(results)}: quality of fit (held out)")
    ax.legend()
    return _save(fig, path)


def precision_figure(results: dict):
    """The figure of :func:`plot_precision`, not yet saved (tests read its artists)."""
    plt = _pyplot()
    ks = results["precision_ks"]
    fig, axes = plt.subplots(1, len(ks), figsize=(4.2 * len(ks), 3.8), dpi=120, sharey=True, squeeze=False)
    for ax, k in zip(axes[0], ks, strict=True):
        for name, metrics in results["per_layer"].items():
            ax.plot(results["layers"], metrics[f"precision@{k}"], marker="o", ms=3, color=COLOURS.get(name), label=name)
        # each panel names its own k: one shared label beside the first panel read as Precision@1 for all
        _layer_axes(ax, results, f"Precision@{k}")
        ax.tick_params(labelleft=True)
        ax.set_title(f"Precision@{k}")
        ax.set_ylim(0, 1.02)
    axes[0][0].legend()
    fig.suptitle(f"{_title(results)}: is the full model's top-1 in the shortcut's top-k?")
    return fig


def plot_precision(results: dict, path: str | Path) -> Path:
    """Precision@1/5/10 per layer, one panel per k, one line per shortcut."""
    return _save(precision_figure(results), path)


def plot_surprisal(results: dict, path: str | Path) -> Path:
    """Surprisal of the full model's top-1 under each shortcut, per layer."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for name, metrics in results["per_layer"].items():
        ax.plot(results["layers"], metrics["surprisal"], marker="o", ms=3, color=COLOURS.get(name), label=name)
    _layer_axes(ax, results, "surprisal (nats, log scale)")
    ax.set_yscale("log")  # the logit lens on the embeddings can be 100x the rest
    ax.set_title(f"{_title(results)}: -log p(full model's top-1)")
    ax.legend()
    return _save(fig, path)


def plot_heatmap(results: dict, path: str | Path) -> Path:
    """R^2 from layer l (rows) to layer l' (columns) for id and mat, side by side (the paper's Figure 2)."""
    import numpy as np

    plt = _pyplot()
    heat = results["heatmap"]
    states = heat["states"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8), dpi=120)
    for ax, name in zip(axes, ("id", "mat"), strict=True):
        grid = np.array([[np.nan if v is None else v for v in row] for row in heat[name]], dtype=float)
        image = ax.imshow(np.clip(grid, 0, 1), cmap="viridis", vmin=0, vmax=1, origin="upper")
        ticks = range(0, len(states), max(1, len(states) // 10))
        ax.set_xticks(list(ticks), [states[i] for i in ticks])
        ax.set_yticks(list(ticks), [states[i] for i in ticks])
        ax.set_xlabel("target layer l'")
        ax.set_ylabel("source layer l")
        ax.set_title(f"{name}: R$^2$ of l -> l' (held out)")
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle(f"{_title(results)} (values below 0 shown as 0)")
    return _save(fig, path)


def plot_early_exit(results: dict, path: str | Path) -> Path:
    """Precision@1 against mean layers used over the lambda sweep, with the fixed-layer exit lines.

    Drawn for id and mat as in the paper (every shortcut when neither was run); all are in results.json.
    """
    plt = _pyplot()
    exits = results["early_exit"]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    shown = {n: d for n, d in exits["shortcuts"].items() if n in ("id", "mat")} or exits["shortcuts"]
    for name, data in shown.items():
        colour = COLOURS.get(name)
        layers = [p["layers"] for p in data["sweep"]]
        precision = [p["precision@1"] for p in data["sweep"]]
        ax.plot(layers, precision, marker=".", ms=4, color=colour, label=f"{name}: exit at confidence > lambda")
        ax.plot(results["layers"], data["fixed"], ls="--", lw=1, color=colour, label=f"{name}: fixed exit layer")
        if data["layers_used_at_goal"] is not None:
            ax.plot([data["layers_used_at_goal"]], [exits["goal"]], marker="*", ms=12, color=colour)
    ax.axhline(exits["goal"], color="grey", lw=0.8, ls=":")
    ax.set_xlabel("average layers used")
    ax.set_ylabel("Precision@1 vs full model")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(f"{_title(results)}: early exit (star: fewest layers at {exits['goal']:.0%} precision)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_submodules(results: dict, path: str | Path) -> Path:
    """Precision@1 of the full model with one part of one block replaced by a linear map."""
    plt = _pyplot()
    rows = results["submodules"]["rows"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for part in results["submodules"]["parts"]:
        ax.plot([r["block"] for r in rows], [r[part]["precision@1"] for r in rows], marker="o", ms=3, label=part)
    ax.set_xlabel("block")
    ax.set_ylabel("Precision@1 vs original model")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(f"{_title(results)}: one sub-module replaced by a linear map")
    ax.legend()
    return _save(fig, path)


def write_figures(results: dict, folder: str | Path) -> list[Path]:
    """Every figure the results hold data for, into ``folder``."""
    folder = Path(folder)
    paths = [plot_r2(results, folder / R2_PNG), plot_precision(results, folder / PRECISION_PNG),
             plot_surprisal(results, folder / SURPRISAL_PNG)]  # fmt: skip
    if results.get("heatmap"):
        paths.append(plot_heatmap(results, folder / HEATMAP_PNG))
    if results.get("early_exit"):
        paths.append(plot_early_exit(results, folder / EARLY_EXIT_PNG))
    if results.get("submodules"):
        paths.append(plot_submodules(results, folder / SUBMODULES_PNG))
    return paths
