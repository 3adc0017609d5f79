"""What a benchmark writes under ``--out``: its JSON, its markdown table and its figure, drawn the same way.

A module of :mod:`eval.bench` that registers no subcommand (``eval.bench.cli.NOT_SUBCOMMANDS``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path


def report_results(out: str | Path | None, name: str, results: dict, table: str,
                   plot: Callable[[dict, Path], Path] | None = None) -> None:
    """Print ``table``; with ``out``, write ``name.json`` (``results``), ``name.md`` and ``name.png`` (``plot``) there.

    The folder is written all or nothing (:func:`prune.atomic.atomic_directory`), replacing an earlier one.
    """
    print(table)
    if not out:
        return
    from prune.atomic import atomic_directory, write_json

    with atomic_directory(out, overwrite=True) as staging:
        write_json(Path(staging) / f"{name}.json", results)
        (Path(staging) / f"{name}.md").write_text(table + "\n", encoding="utf-8")
        if plot is not None:
            plot(results, Path(staging) / f"{name}.png")


def pyplot():
    """The pyplot of matplotlib, drawing off-screen (imported here: it costs seconds at start-up)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def steps_line(ax, xs: Sequence[float], ys: Sequence[float], steps: Sequence[int], label: str) -> None:
    """A line through the points (``xs``, ``ys``), each labelled with its step count."""
    ax.plot(list(xs), list(ys), "o-", label=label)
    for x, y, count in zip(xs, ys, steps, strict=True):
        ax.annotate(f"{count}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")


def finish_figure(fig, ax, path: str | Path, *, reference: tuple[float, str], xlabel: str, ylabel: str,
                  title: str) -> Path:
    """Draw ``reference`` (value, label) as a dashed line, label the axes, and write the PNG to ``path``."""
    value, label = reference
    ax.axhline(value, color="black", ls="--", lw=1, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    pyplot().close(fig)
    return path
