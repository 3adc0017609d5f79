"""The comparison's plots, and writing its record and README whole after every cell."""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from eval.compare.leaderboard import BLOCKS_PNG, PPL_PNG, STEPS_PNG, leaderboard
from eval.compare.results import Results, write_text
from eval.compare.stats import analyse
from prune.atomic import write_file_atomic

README = "README.md"


def method_colour(name: str):
    """A method's colour, the same in every plot of every run (a hash of its name, not its place in a list)."""
    import matplotlib

    return matplotlib.colormaps["tab20"](zlib.crc32(name.encode()) % 20)


def plot_perplexity(results: Results, path: Path) -> None:
    """PNG: held-out perplexity against blocks removed, one line per method, dense as a dashed line.

    With a single drop every line would run from the dense point to one x and hide the others behind it:
    the methods are then bars, best first.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drops = sorted({row["drop"] for row in results.cells.values()})
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    if len(drops) == 1:
        _perplexity_bars(ax, results, drops[0])
    else:
        _perplexity_lines(ax, results, drops)
    ax.set_title(f"{results.setup['model']}: held-out perplexity by method")
    fig.tight_layout()
    write_file_atomic(path, fig.savefig)
    plt.close(fig)


def _perplexity_lines(ax, results: Results, drops: list[int]) -> None:
    from matplotlib.ticker import ScalarFormatter

    dense = results.dense["heldout_ppl"]
    for name in sorted({row["method"] for row in results.cells.values()}):  # every line starts at the dense model
        rows = sorted((r for r in results.cells.values() if r["method"] == name), key=lambda r: r["drop"])
        ax.plot([0] + [r["drop"] for r in rows], [dense] + [r["heldout_ppl"] for r in rows], marker="o", label=name,
                color=method_colour(name))
    ax.axhline(dense, color="black", ls="--", lw=1, label="dense")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.set_xticks([0, *drops])
    ax.set_xlabel("blocks removed")
    ax.set_ylabel("held-out perplexity (log)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)


def _perplexity_bars(ax, results: Results, drop: int) -> None:
    rows = sorted(results.cells.values(), key=lambda r: r["heldout_ppl"])
    names = [r["method"] for r in rows]
    ax.barh(range(len(rows)), [r["heldout_ppl"] for r in rows], color=[method_colour(n) for n in names])
    ax.set_yticks(range(len(rows)), names, fontsize=7)
    ax.invert_yaxis()  # best on top, as in the leaderboard
    ax.axvline(results.dense["heldout_ppl"], color="black", ls="--", lw=1, label="dense")
    ax.set_xlabel(f"held-out perplexity, {drop} blocks removed")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=7)


def plot_blocks(results: Results, path: Path, blocks: int) -> None:
    """PNG: which blocks each method removed at each drop, one row per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(results.cells.values(), key=lambda r: (r["drop"], r["method"]))
    grid = torch.zeros(len(rows), blocks)
    for i, row in enumerate(rows):
        grid[i, row["dropped"]] = 1
        for unit in row.get("sublayers", []):  # half a block for each sub-layer removed alone
            block = int(unit.split(".")[0])
            if block not in row["dropped"]:
                grid[i, block] += 0.5
    fig, ax = plt.subplots(figsize=(max(5, blocks * 0.3 + 3), max(2, len(rows) * 0.25 + 1)), dpi=120)
    ax.imshow(grid.numpy(), cmap="Greys", aspect="auto", vmin=0, vmax=1)
    ax.set_yticks(range(len(rows)), [f"{r['method']} (drop {r['drop']})" for r in rows], fontsize=7)
    ax.set_xticks(range(blocks), [str(b) for b in range(blocks)], fontsize=7)
    ax.set_xlabel("block (black: removed; grey: its attention or MLP alone)")
    ax.set_title("blocks each method removed")
    fig.tight_layout()
    write_file_atomic(path, fig.savefig)
    plt.close(fig)


def plot_selection_steps(results: Results, path: Path) -> bool:
    """PNG: what a stepping selection measured, one panel per method (its deepest drop), one column of dots per step.

    Each dot is one candidate block's cost at that step (the repaired model's perplexity on the measuring rows,
    against dense's there), the chosen one ringed and labelled. False when no cell stepped.
    """
    deepest: dict[str, dict] = {}
    for row in results.cells.values():
        if row.get("selection") and row["drop"] >= deepest.get(row["method"], {}).get("drop", -1):
            deepest[row["method"]] = row
    if not deepest:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(deepest), figsize=(5 * len(deepest), 4), dpi=120, squeeze=False)
    for ax, (name, row) in zip(axes[0], sorted(deepest.items()), strict=True):
        selection = row["selection"]
        criterion = selection.get("criterion", "ppl")
        for step, entry in enumerate(selection["steps"], start=1):
            costs = {int(b): c[criterion] for b, c in entry["costs"].items() if c[criterion] != float("inf")}
            ax.scatter([step] * len(costs), list(costs.values()), s=10, color=method_colour(name), alpha=0.6)
            chosen = costs[entry["drop"]]
            ax.scatter([step], [chosen], s=60, facecolors="none", edgecolors="black")
            ax.annotate(str(entry["drop"]), (step, chosen), xytext=(4, -10), textcoords="offset points", fontsize=7)
        ax.set_yscale("log")
        ax.set_xticks(range(1, len(selection["steps"]) + 1))  # whole steps only
        ax.set_xlabel("step (one block removed per step)")
        ax.set_ylabel("measuring rows' perplexity" if criterion == "ppl" else "KL from the original (nats/token)")
        ax.set_title(f"{name}: {selection['selection']}, repair {selection['repair']}", fontsize=9)
    fig.suptitle("cost of each candidate block at each step (ringed: the block removed)", fontsize=10)
    fig.tight_layout()
    write_file_atomic(path, fig.savefig)
    plt.close(fig)
    return True


def write_reports(results: Results, out: Path, blocks: int, plots: bool = True) -> None:
    """results.json, README.md and (unless ``plots`` is False) the plots, each replaced whole."""
    results.analysis = analyse(results)
    results.save(out)
    if results.cells:
        write_text(out / README, leaderboard(results) + "\n")
        if plots:
            plot_perplexity(results, out / PPL_PNG)
            plot_blocks(results, out / BLOCKS_PNG, blocks)
            plot_selection_steps(results, out / STEPS_PNG)
