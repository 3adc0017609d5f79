"""Tables read from finished measurements: paired gaps (tasks, fidelity), HellaSwag by source, the best share."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from eval.compare.stats import gap_stderr, paired_stderr, task_figures
from eval.quality.lmeval import task_rows
from eval.tasks.local_docs import hellaswag_items
from prune.errors import LayercutError

TASK_SETS = (("arc_easy", "hellaswag", "piqa", "lambada_openai"), ("arc_easy", "hellaswag", "piqa"))
# eval.mapfit --update-scale's variant names and the share of the least-squares update each applies
SHARES = {"removal": 0.0, "ls-mixed-64*0.3": 0.3, "ls-mixed-64*0.5": 0.5, "ls-mixed-64*0.7": 0.7, "ls-mixed-64": 1.0}
NEAR = ("ls-mixed-64*0.5", "ls-mixed-64*0.7", "ls-mixed-64")


def read_measurements(path: str | Path, keys: Sequence[str], what: str) -> dict:
    """The JSON object in ``path`` holding ``keys``.

    Raises:
        LayercutError: ``path`` is missing, a folder, not JSON or without ``keys``; the line says ``what`` to pass.
    """
    path = Path(path)
    if not path.is_file():
        raise LayercutError(f"no file {path}: pass {what}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise LayercutError(f"{path} is not JSON ({err}): pass {what}") from None
    missing = [key for key in keys if not isinstance(data, dict) or key not in data]
    if missing:
        raise LayercutError(f"{path} has no {', '.join(missing)}: pass {what}")
    return data


def paired_gaps(specs: Sequence[str], task_sets: Sequence[Sequence[str]] = TASK_SETS) -> list[str]:
    """Retention of rows of several ``eval.compare`` results and their paired gaps to the first (the baseline).

    Args:
        specs: ``FILE::CELL`` each, the first the baseline.
        task_sets: the task sets to compute retention over (every task counted).

    Raises:
        LayercutError: a file's dense model answered the task rows otherwise: its rows do not pair.
    """
    files, rows = {}, {}
    for spec in specs:
        path, _, key = spec.partition("::")
        if path not in files:
            files[path] = read_measurements(path, ("cells", "dense"), "an eval.compare results.json as FILE::CELL")
        if key not in files[path]["cells"]:
            raise LayercutError(f"{spec}: no cell '{key}' in {path}; its cells: {', '.join(files[path]['cells'])}")
        rows[f"{key} ({Path(path).parent.name})"] = files[path]["cells"][key]
    dense = next(iter(files.values()))["dense"]
    for path, results in files.items():
        if results["dense"]["task_rows"] != dense["task_rows"]:
            raise LayercutError(f"{path}: its dense model answered the task rows otherwise; its rows do not pair "
                                "with the first file's")
    base = next(iter(rows))
    lines = []
    for tasks in map(list, task_sets):
        lines.append(f"{len(tasks)} tasks")
        fb = task_figures(rows[base], tasks, tasks, dense)
        for name, row in rows.items():
            fa = task_figures(row, tasks, tasks, dense)
            gap, se = fa["retention"] - fb["retention"], gap_stderr(row, rows[base], fa, fb, "retention", tasks, dense)
            lines.append(f"  {name}: {100 * fa['retention']:.1f} ± {100 * fa['retention_stderr']:.1f}; "
                         f"minus {base}: {100 * gap:+.1f} ± {100 * se:.1f}")
    return lines


def paired_fidelity(specs: Sequence[str]) -> list[str]:
    """Generation fidelity of rows of several ``eval.compare --metrics fidelity`` results, paired to the first.

    Each row's NLL by the original (mean ± standard error over prompts) and its share of the original's greedy
    tokens kept, then its gap to the first row over the same prompts: the mean of the prompt-by-prompt differences
    ± their standard error. Two slim models writing after the same prompts differ by far less noise than their
    separate standard errors suggest, and a gap under 2 standard errors is called a tie.

    Args:
        specs: ``FILE::CELL`` each (``dense`` names a file's original), the first the baseline.

    Raises:
        LayercutError: a row has no per-prompt fidelity rows, or the files' prompts differ (their settings, or the
            original's NLL of its own text prompt by prompt): their rows do not pair.
    """
    rows, settings = {}, None
    for spec in specs:
        path, _, key = spec.partition("::")
        results = read_measurements(path, ("cells", "dense"), "an eval.compare results.json as FILE::CELL")
        row = results["dense"] if key == "dense" else results["cells"].get(key)
        if row is None:
            raise LayercutError(f"{spec}: no cell '{key}' in {path}; its cells: dense, {', '.join(results['cells'])}")
        figures = row.get("fidelity") or {}
        if not isinstance(figures.get("nll_rows"), list):
            raise LayercutError(f"{spec}: no per-prompt fidelity rows; measure it with eval.compare --metrics fidelity")
        # the prompts pair when the settings and the original's own NLL of each prompt's continuation agree
        mine = ({k: figures.get(k) for k in ("prompts", "prompt_tokens", "new_tokens")},
                results["dense"].get("fidelity", {}).get("nll_rows"))
        if settings is None:
            settings = mine
        elif mine[0] != settings[0] or not _same_rows(mine[1], settings[1]):
            raise LayercutError(f"{spec}: its prompts differ from {specs[0]}'s (settings or held-out texts); "
                                "its rows do not pair")
        rows[f"{key} ({Path(path).parent.name})"] = figures
    base = next(iter(rows))
    lines = [f"{settings[0]['prompts']} prompts of {settings[0]['prompt_tokens']} tokens, "
             f"{settings[0]['new_tokens']} greedy tokens each; NLL by the original (lower: more faithful)"]
    ref = rows[base]["nll_rows"]
    for name, figures in rows.items():
        nll = np.asarray(figures["nll_rows"], dtype=np.float64)
        gap, se = float(nll.mean() - np.mean(ref)), paired_stderr(figures["nll_rows"], ref) or 0.0
        verdict = "tie" if gap == 0 or abs(gap) < 2 * se else "lower" if gap < 0 else "higher"
        lines.append(f"  {name}: NLL {nll.mean():.3f} ± {_stderr(nll):.3f}, kept {figures['kept']:.3f}; "
                     f"minus {base}: {gap:+.3f} ± {se:.3f}" + ("" if name == base else f" ({verdict})"))
    return lines


def _same_rows(a, b, tolerance: float = 1e-4) -> bool:
    """Whether two lists of per-prompt figures agree (float rounding aside)."""
    return a is not None and b is not None and len(a) == len(b) and all(
        abs(x - y) <= tolerance for x, y in zip(a, b, strict=True))


def _stderr(values: np.ndarray) -> float:
    return float(values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else 0.0


def hellaswag_by_source(results_path: str | Path, hellaswag_path: str | Path) -> list[str]:
    """HellaSwag accuracy of every row of an ``eval.compare`` result, split into ActivityNet and WikiHow rows.

    A row is WikiHow when its context (after the activity label) starts "How to". The rows are the ones
    ``eval.quality.lmeval`` read for the results' ``--limit``.

    Raises:
        LayercutError: a row's answers do not match the rows that limit reads (another file's results).
    """
    results = read_measurements(results_path, ("cells", "dense"), "an eval.compare results.json")
    if not Path(hellaswag_path).is_file():
        raise LayercutError(f"no file {hellaswag_path}: pass the HellaSwag validation text the local task reads")
    items = hellaswag_items(Path(hellaswag_path).read_text(encoding="utf-8"))
    wikihow = {i for i, item in enumerate(items) if item["ctx"].startswith("How to")}
    limit = results.get("task_limit")
    rows = task_rows(limit, len(items), "hellaswag")
    lines = [f"--limit {limit}: {len(rows)} rows, {sum(r in wikihow for r in rows)} WikiHow",
             "| cell | ActivityNet (rows) | WikiHow (rows) | all |", "|---|---|---|---|"]
    for name, cell in {"dense": results["dense"], **results["cells"]}.items():
        answers = cell.get("task_rows", {}).get("hellaswag")
        if answers is None:
            continue
        if len(answers) != len(rows):
            raise LayercutError(f"{name}: {len(answers)} HellaSwag answers for {len(rows)} rows; not this file's rows")
        paired = list(zip(rows, answers, strict=True))
        by = [[a for r, a in paired if (r in wikihow) == is_wikihow] for is_wikihow in (False, True)]
        cells = " | ".join(f"{100 * sum(v) / len(v):.1f} ({len(v)})" if v else "-" for v in by)
        lines.append(f"| {name} | {cells} | {100 * sum(answers) / len(answers):.1f} |")
    return lines


def best_share(values: dict[str, float], names: Sequence[str] = tuple(SHARES)) -> float:
    """The share at the vertex of the least-squares parabola through ``(SHARES[name], values[name])``."""
    a, b, _ = np.polyfit([SHARES[name] for name in names], [values[name] for name in names], 2)
    return float(-b / (2 * a))


def share_optimum(folders: Sequence[str | Path]) -> list[str]:
    """Where the share of the update is best, text by text: one markdown row per span and measure.

    Reads ``eval.mapfit --update-scale`` results: the hidden-state error is exactly quadratic in the share;
    the KL is not, so it gets two estimates, the parabola over all five shares and over the three nearest
    the optimum (0.5, 0.7 and 1).
    """
    what = "eval.mapfit --update-scale output folders"
    texts = list(read_measurements(Path(folders[0]) / "results.json", ("errors",), what)["errors"])
    lines = ["| span | measure | " + " | ".join(texts) + " |", "|---|---|" + "---:|" * len(texts)]
    for folder in folders:
        results = read_measurements(Path(folder) / "results.json", ("span", "errors", "logits"), what)
        span = "-".join(map(str, results["span"]))
        hidden = {text: best_share({n: row[n]["relative"] for n in SHARES}) for text, row in results["errors"].items()}
        kl = {text: {n: row[n]["kl_relative"] for n in SHARES} for text, row in results["logits"].items()}
        lines.append(f"| {span} | hidden-state error | " + " | ".join(f"{hidden[t]:.2f}" for t in hidden) + " |")
        lines.append(f"| {span} | KL, five shares | " + " | ".join(f"{best_share(kl[t]):.2f}" for t in hidden) + " |")
        lines.append(f"| {span} | KL, 0.5-1 | " + " | ".join(f"{best_share(kl[t], NEAR):.2f}" for t in hidden) + " |")
    return lines
