"""The per-block profile a user reads: a table of every score and a PNG of the linearity profile.

The plot shows linearity with and without the residual, as Figure 1 of *Your Transformer is Secretly
Linear* does.
"""

from __future__ import annotations

from pathlib import Path


def score_table(scores: dict[str, list[float]], dropped: list[int] | None = None,
                labels: list[str] | None = None) -> str:
    """Markdown table, one row per block (or per ``labels`` entry), one column per score, removed ones marked."""
    dropped = set(dropped or [])
    names = list(scores)
    header = f"| {'block' if labels is None else 'unit'} | " + " | ".join(names) + " | dropped |"
    rule = "|---:|" + "---:|" * len(names) + ":---:|"
    count = len(next(iter(scores.values())))
    labels = labels or [str(b) for b in range(count)]
    rows = [
        f"| {labels[b]} | " + " | ".join(f"{scores[n][b]:.4f}" for n in names) + f" | {'x' if b in dropped else ''} |"
        for b in range(count)
    ]
    return "\n".join([header, rule, *rows])


def plot_linearity_profile(scores: dict[str, list[float]], path: str | Path, title: str, dropped=None,
                           unit: str = "block") -> Path:
    """PNG of linearity with and without residual per block (or sub-layer, ``unit``); dropped ones shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4), dpi=120)
    for name, label in (("linearity", "with residual"), ("linearity-nores", "without residual")):
        if name in scores:
            ax.plot(range(len(scores[name])), scores[name], marker="o", markersize=3, label=label)
    for block in dropped or []:
        ax.axvspan(block - 0.5, block + 0.5, color="tab:red", alpha=0.15, lw=0)
    ax.set_xlabel(unit)
    ax.set_ylabel("linearity score")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(title="shaded: dropped" if dropped else None)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
