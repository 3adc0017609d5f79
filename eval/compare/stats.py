"""The statistics of a comparison: chance levels, task figures, paired gaps, "better than", vs removal."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from eval.compare.results import Results, Row
from eval.quality.lmeval import chance_level

TIE_SE = 2.0  # differences under this many standard errors are ties


def chance(task: str) -> float | None:
    """Accuracy of a random guess on ``task``, from its task spec (an offline task's YAML says it); ``None`` if unknown.

    Read when asked, not copied at import: a task added in ``$LAYERCUT_TASKS`` counts as well.
    """
    return chance_level(task)


def task_stderr(row: Row, task: str) -> float:
    """lm-eval's standard error of ``task`` on ``row`` (0 where it gave none)."""
    value = row.get("task_stderr", {}).get(task)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0


def task_figures(row: dict, tasks: list[str], counted: list[str], dense: dict) -> dict:
    """Task mean, retention above chance and their standard errors for one row."""
    figures = {}
    present = [t for t in tasks if row.get("tasks", {}).get(t) is not None]
    if present:
        figures["task_mean"] = sum(row["tasks"][t] for t in present) / len(present)
        figures["task_mean_stderr"] = math.sqrt(sum(task_stderr(row, t) ** 2 for t in present)) / len(present)
    if counted and all(row.get("tasks", {}).get(t) is not None for t in counted):
        above = sum(dense["tasks"][t] - chance(t) for t in counted)  # the dense model's, > 0 by the choice of tasks
        figures["retention"] = sum(row["tasks"][t] - chance(t) for t in counted) / above
        # the dense model's own error is shared by every row: only the row's error separates two rows
        figures["retention_stderr"] = math.sqrt(sum(task_stderr(row, t) ** 2 for t in counted)) / above
    return figures


def gap_stderr(a: dict, b: dict, fa: dict, fb: dict, quality: str, tasks: list[str], dense: dict) -> float:
    """Standard error of ``fa[quality] - fb[quality]``: paired over rows where both rows have them.

    Both models answer the same questions, and most answers they share: the spread of the row-by-row
    difference is the noise of the gap, far less than the two separate standard errors combined.
    """
    rows_a, rows_b = a.get("task_rows", {}), b.get("task_rows", {})
    if not all(t in rows_a and t in rows_b and len(rows_a[t]) == len(rows_b[t]) > 1 for t in tasks):
        return math.hypot(fa[f"{quality}_stderr"], fb[f"{quality}_stderr"])
    variance = sum(paired_stderr(rows_a[task], rows_b[task]) ** 2 for task in tasks)
    scale = len(tasks) if quality == "task_mean" else sum(dense["tasks"][t] - chance(t) for t in tasks)
    return math.sqrt(variance) / scale


def paired_stderr(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Standard error of ``mean(a) - mean(b)`` over the same rows: the row-by-row difference's spread / sqrt(rows).

    None where the rows do not pair (other counts) or are fewer than two.
    """
    if len(a) != len(b) or len(a) < 2:
        return None
    diff = torch.tensor(a, dtype=torch.float64) - torch.tensor(b, dtype=torch.float64)
    return math.sqrt(float(diff.var()) / diff.numel())


def paired_tasks(original: dict, model: dict, tasks: Sequence[str]) -> dict:
    """``model`` against ``original`` on lm-eval ``tasks`` scored on the same rows: each task, and their retention.

    ``original`` and ``model`` are rows as a comparison keeps them: ``tasks`` (the primary metric), ``task_stderr``
    and ``task_rows`` (its row-by-row scores). Per task: both values and standard errors, the rows scored, ``kept``
    (model / original; None where the original scored 0) and ``gap`` (model - original) with its standard error,
    paired over the rows (``paired``; else from the two standard errors). The retention of above-chance accuracy
    over the tasks that have a chance level and that the original is clearly above it on (:func:`retention_tasks`:
    the grids' rule; ``excluded_tasks`` says why each other is not counted), with the paired standard error of its
    distance from 1.
    """
    figures = {}
    for task in tasks:
        before, after = original.get("tasks", {}).get(task), model.get("tasks", {}).get(task)
        if before is None or after is None:
            continue
        rows_a, rows_b = original.get("task_rows", {}).get(task, []), model.get("task_rows", {}).get(task, [])
        paired = paired_stderr(rows_b, rows_a)
        figures[task] = {"original": before, "model": after, "original_stderr": task_stderr(original, task),
                         "model_stderr": task_stderr(model, task), "rows": len(rows_b) or None,
                         "kept": after / before if before else None, "gap": after - before,
                         "gap_stderr": paired if paired is not None else math.hypot(task_stderr(original, task),
                                                                                    task_stderr(model, task)),
                         "paired": paired is not None}
    result: dict = {"tasks": figures}
    if figures:  # a task with no chance level is left out and named, as the grids do: it cancels no other's
        counted, excluded = retention_tasks(original, list(figures), "the original's")
        result.update(retention_tasks=counted, excluded_tasks=excluded)
        if counted:
            above = sum(original["tasks"][t] - chance(t) for t in counted)
            result["retention"] = sum(model["tasks"][t] - chance(t) for t in counted) / above
            result["retention_stderr"] = math.sqrt(sum(figures[t]["gap_stderr"] ** 2 for t in counted)) / above
    return result


def _beats(a: dict, b: dict, fa: dict, fb: dict, names: list[str], quality: str | None, stderr) -> bool:
    """Lower perplexity on every domain and, when tasks ran, the task figure higher by two standard errors."""
    if not all(a["domains"][n] < b["domains"][n] for n in names):
        return False
    if quality is None or (quality not in fa and quality not in fb):  # neither row ran the tasks: perplexity alone
        return True
    if quality not in fa or quality not in fb:
        return False
    return fa[quality] - fb[quality] >= TIE_SE * stderr() and fa[quality] > fb[quality]


def retention_tasks(dense: dict, tasks: list[str], name: str = "dense") -> tuple[list[str], dict[str, str]]:
    """The ``tasks`` retention counts (the dense model clearly above chance on them), and why each other is not.

    A task the dense model scores within :data:`TIE_SE` standard errors of chance has no room to lose: counted,
    it would divide noise by noise. ``name``: what the reasons call the dense model.
    """
    counted, excluded = [], {}
    for task in tasks:
        value = dense.get("tasks", {}).get(task)
        level = chance(task)
        if level is None:
            excluded[task] = "no chance level known"
        elif value is None:
            excluded[task] = f"no {name} score"
        elif value - level <= TIE_SE * task_stderr(dense, task):
            excluded[task] = f"{name} {value:.3f} is within {TIE_SE:g} standard errors of chance {level:g}"
        else:
            counted.append(task)
    return counted, excluded


def analyse(results: Results) -> dict:
    """Task means, retention above chance, ties and the "better than" relation of every finished row."""
    dense = results.dense or {}
    names = results.domains or list(dense.get("domains", {}))
    rows = {key: row for key, row in results.cells.items() if all(n in row.get("domains", {}) for n in names)}
    tasks = sorted({t for row in [dense, *rows.values()] for t in row.get("tasks", {})})
    counted, excluded = retention_tasks(dense, tasks)
    figures = {key: task_figures(row, tasks, counted, dense) for key, row in rows.items()}
    figures["dense"] = task_figures(dense, tasks, counted, dense) if dense else {}
    quality = None if not tasks else ("retention" if counted else "task_mean")
    used = counted if quality == "retention" else [t for t in tasks if t in dense.get("tasks", {})]

    def stderr(a: str, b: str) -> float:
        return gap_stderr(rows[a], rows[b], figures[a], figures[b], quality, used, dense)

    better, ties = {}, {}
    for key, row in rows.items():
        same = [(k, r) for k, r in rows.items() if r["drop"] == row["drop"] and k != key]
        better[key] = sorted(k for k, r in same if _beats(row, r, figures[key], figures[k], names, quality,
                                                          lambda k=k, key=key: stderr(key, k)))
        if quality is not None and quality in figures[key]:
            best = max((k for k, _ in [(key, row), *same] if quality in figures[k]), key=lambda k: figures[k][quality])
            gap = figures[best][quality] - figures[key][quality]
            tie = best == key or gap < TIE_SE * stderr(best, key)
            ties[key] = "best" if best == key else ("tie" if tie else f"-{100 * gap:.1f}")
    versus = {key: vs_removal(rows, key, figures, names, quality, stderr) for key, row in rows.items()
              if not is_plain_removal(row) and "replace" in row and "sublayers" not in row}
    return {"domains": names, "tasks": tasks, "chance": {t: chance(t) for t in tasks if chance(t) is not None},
            "retention_tasks": counted, "excluded_tasks": excluded, "task_quality": quality, "rows": figures,
            "better_than": better, "vs_best_tasks": ties, "vs_removal": versus}


def is_plain_removal(row: dict) -> bool:
    """Blocks removed whole, nothing in their place and no training after: the baseline of every repair."""
    return row.get("replace") == "none" and not row.get("distill_steps") and "sublayers" not in row


def vs_removal(rows: dict, key: str, figures: dict, names: list[str], quality: str | None, stderr) -> dict | None:
    """A repaired row against plain removal of exactly its blocks at the same drop, where that row ran.

    A repair earns its parameters only if it keeps the task figure of removing the same blocks and beats it
    in perplexity on every domain. Removal of other blocks says nothing about the repair (fold and LinearPatch
    choose their own), so without that row there is no verdict, rather than one against the wrong baseline.
    """
    row = rows[key]
    base = next((k for k, r in sorted(rows.items()) if is_plain_removal(r) and r["drop"] == row["drop"]
                 and list(r["dropped"]) == list(row["dropped"])), None)
    if base is None:
        return None
    higher = [n for n in names if row["domains"][n] >= rows[base]["domains"][n]]
    entry = {"baseline": base, "perplexity_higher_on": higher}
    if quality is not None and quality in figures[key] and quality in figures[base]:
        gap, se = figures[key][quality] - figures[base][quality], stderr(key, base)
        entry.update(gap=gap, gap_stderr=se,
                     verdict="tie" if abs(gap) < TIE_SE * se else ("win" if gap > 0 else "loss"))
    elif quality is not None and (quality in figures[key] or quality in figures[base]):
        entry["verdict"] = "tasks on one row only"  # perplexity alone would read as a verdict on both
    if len(higher) == len(names) and entry.get("verdict") not in ("win", "tie"):
        entry["worse_than_removal"] = True  # the repair costs parameters and does harm: never a row to trust
    return entry
