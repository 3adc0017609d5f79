"""The comparison's plots, and writing its record and README whole after every cell."""

from __future__ import annotations

from pathlib import Path

import torch

from eval.compare.leaderboard import BLOCKS_PNG, PPL_PNG, leaderboard
from eval.compare.results import Results, write_text
from eval.compare.stats import analyse
from prune.export import write_file_atomic

README = "README.md"


def plot_perplexity(results: Results, path: Path) -> None:
    """PNG: held-out perplexity against blocks removed, one line per method, dense as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    dense = results.dense["heldout_ppl"]
    methods = sorted({row["method"] for row in results.cells.values()})
    for name in methods:  # every line starts at the dense model (0 blocks removed)
        rows = sorted((r for r in results.cells.values() if r["method"] == name), key=lambda r: r["drop"])
        ax.plot([0] + [r["drop"] for r in rows], [dense] + [r["heldout_ppl"] for r in rows], marker="o", label=name)
    ax.axhline(dense, color="black", ls="--", lw=1, label="dense")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.set_xticks([0] + sorted({row["drop"] for row in results.cells.values()}))
    ax.set_xlabel("blocks removed")
    ax.set_ylabel("held-out perplexity (log)")
    ax.set_title(f"{results.setup['model']}: held-out perplexity by method")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    write_file_atomic(path, fig.savefig)
    plt.close(fig)


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


def write_reports(results: Results, out: Path, blocks: int, plots: bool = True) -> None:
    """results.json, README.md and (unless ``plots`` is False) the plots, each replaced whole."""
    results.analysis = analyse(results)
    results.save(out)
    if results.cells:
        write_text(out / README, leaderboard(results) + "\n")
        if plots:
            plot_perplexity(results, out / PPL_PNG)
            plot_blocks(results, out / BLOCKS_PNG, blocks)
