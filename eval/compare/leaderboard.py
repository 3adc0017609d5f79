"""README.md of a comparison: one leaderboard per drop, the notes that say how to read it, and the oracle."""

from __future__ import annotations

import os
from pathlib import Path

from eval.compare.digest import STALE_MARKS, recipe_state, stale_note
from eval.compare.metrics import METRICS
from eval.compare.results import NO_TASKS, Results
from eval.compare.stats import TIE_SE, analyse, task_stderr
from eval.quality.lmeval import describe_rows
from eval.speed.engines import REFERENCE, display_name, serves_label
from eval.speed.results import NOISY_RUN_SPREAD
from prune.checkpoint.write import portable
from prune.model.layouts import VANILLA, serving_entry

PPL_PNG = "perplexity_vs_blocks.png"
NOISY_MARK = "?"
WORSE_MARK = "**(!)**"
BLOCKS_PNG = "chosen_blocks.png"
STEPS_PNG = "selection_steps.png"


def leaderboard(results: Results) -> str:
    """README.md: one table per drop, dense on top, best mean held-out perplexity first; then the oracle."""
    analysis = results.analysis or analyse(results)
    cells = {key: row for key, row in results.cells.items() if key in analysis["better_than"]}
    states = {key: recipe_state(row) for key, row in cells.items()}
    lines = _preamble(results, analysis, cells, states)
    for drop in sorted({row["drop"] for row in cells.values()}):
        lines += _drop_table(results.dense, analysis, cells, states, drop)
    lines += _refused_table(results.refused)
    lines += [f"![held-out perplexity vs blocks removed]({PPL_PNG})", "", f"![chosen blocks]({BLOCKS_PNG})", ""]
    if any(row.get("selection") for row in results.cells.values()):
        lines += [f"![cost of each candidate at each step]({STEPS_PNG})", ""]
    if results.oracle:
        lines += ["## Oracle", "", results.oracle["table"], ""]
    return "\n".join(lines)


def shown_path(value: str) -> str:
    """A file as a shared page names it, never by this machine's absolute path.

    Relative to the working folder when close to it (``../shared/data/...``), else its folder and name; other
    text keeps its words.
    """
    if not os.path.isabs(value):
        return portable(value)
    relative = os.path.relpath(value)
    return relative if not relative.startswith(("../../", "..\\..\\")) else "/".join(Path(value).parts[-2:])


def _preamble(results: Results, analysis: dict, cells: dict, states: dict) -> list[str]:
    """The title and the notes that say what each column measured."""
    setup, timing, names = results.setup, results.timing, analysis["domains"]
    # no path of this machine in a page that is shared: a file keeps its name
    texts = "; ".join(f"{name}: {shown_path(d['source'])} ({d['tokens']} tokens)"
                      for name, d in results.heldout.get("domains", {}).items() if name in names)
    calibration = portable(results.calibration or {})
    lines = [f"# Method comparison: {shown_path(setup['model'])}", "",
             f"Held-out perplexity on {texts or '?'}; with several domains, \"held-out ppl\" is their geometric "
             f"mean. Calibration {calibration.get('tokens', '?')} tokens of "
             f"{calibration.get('source', '?')}, scored once for every cell "
             f"({timing.get('score_seconds', '?')} s). Decode speed-up: {setup['speed_tokens']} greedy steps "
             f"with the KV cache in {display_name(setup.get('engine', REFERENCE))}, "
             "median of 3, against the dense model. Wall time: the cell's prune, fit, "
             "distillation and measurements.", ""]
    lines += _task_note(analysis, results)
    for metric in METRICS.values():  # what each measured metric's column means, in its own words
        if metric.note and metric.field in (results.dense or {}):
            lines += [metric.note(results.dense[metric.field]), ""]
    lines += stale_note(states)
    lines += _versus_note(analysis)
    lines += _wall_time_note(timing)
    lines += _speed_note(cells, results.dense)
    copies = sorted(row["copy_seconds"] for row in cells.values())
    if copies and "load_seconds" in timing:
        lines += [f"Each cell starts from a copy of the loaded model: {copies[len(copies) // 2]:.2f} s (median) "
                  f"to copy it in memory against {timing['load_seconds']:.2f} s to load it.", ""]
    return lines


def _drop_table(dense: dict, analysis: dict, cells: dict, states: dict, drop: int) -> list[str]:
    """The leaderboard of one drop: its head, the dense row, then the cells by held-out perplexity."""
    names, tasks, figures = analysis["domains"], analysis["tasks"], analysis["rows"]
    domain_heads = [f"{name} ppl" for name in names] if len(names) > 1 else []
    task_heads = [*tasks, "task mean", "retention", "tasks vs best"] if tasks else []
    metrics = [m for m in METRICS.values() if any(m.field in row for row in [dense, *cells.values()])]
    head = ["rank", "method", "blocks removed", "params", "held-out ppl", "vs dense", *domain_heads, *task_heads,
            "better than", "vs removal of its blocks", *[m.head for m in metrics], "decode speed-up", "wall s",
            "serves"]
    rows = sorted(((k, r) for k, r in cells.items() if r["drop"] == drop), key=lambda kr: kr[1]["heldout_ppl"])
    lines = [f"## Drop {drop}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    domain_cells = [f"{dense['domains'][n]:.3f}" for n in names] if len(names) > 1 else []
    lines.append(f"| - | dense | - | {dense['params']:,} | {dense['heldout_ppl']:.3f} | 1.000 | "
                 + "".join(f"{v} | " for v in domain_cells + task_cells(dense, tasks, figures["dense"], "-"))
                 + "- | - | " + _metric_cells(dense, metrics) + ("1.00" if "decode_s" in dense else "-")
                 + f" | - | {serves_label(serving_entry(VANILLA))} |")
    for rank, (key, row) in enumerate(rows, 1):
        speed = f"{row['decode_speedup']:.2f}{_noisy(row, dense)}" if "decode_speedup" in row else \
            ("not servable" if (row.get("serving") or {}).get("layout") == "layercut" else "failed (results.json)") \
            if "decode_why" in row else "-"
        domain_cells = [f"{row['domains'][n]:.3f} ({100 * (row['domains'][n] / dense['domains'][n] - 1):+.1f}%)"
                        for n in names] if len(names) > 1 else []
        beaten = ", ".join(cells[k]["method"] for k in analysis["better_than"][key]) or "-"
        mark = STALE_MARKS.get(states[key], "")
        lines.append(f"| {rank} | {row['method']}{mark} | {_removed(row)} | {row['params']:,} | "
                     f"{row['heldout_ppl']:.3f} | {row['heldout_ppl'] / dense['heldout_ppl']:.3f} | "
                     + "".join(f"{v} | " for v in domain_cells + task_cells(
                         row, tasks, figures[key], analysis["vs_best_tasks"].get(key, "-")))
                     + f"{beaten} | {_versus(analysis, key)} | {_metric_cells(row, metrics)}{speed} | "
                     f"{row['seconds']:.1f} | "
                     f"{serves(row)} |")
    lines.append("")
    return lines


def _refused_table(refused: dict) -> list[str]:
    """The cells whose method refused this model or drop, with its one-line reason."""
    if not refused:
        return []
    lines = ["## Refused", "", "Each method below refused this model at that drop for the reason given and wrote no "
             "checkpoint; a resumed comparison tries it again once its recipe changes.", "",
             "| method | drop | why |", "|---|---|---|"]
    lines += [f"| {entry['method']} | {entry['drop']} | {entry['why'].replace('|', '/')} |"
              for _, entry in sorted(refused.items(), key=lambda kv: (kv[1]["drop"], kv[1]["method"]))]
    return [*lines, ""]


def serves(row: dict) -> str:
    """The engines that serve the row's checkpoint (the engines' registry, ``eval.speed.engines.serves_label``)."""
    return serves_label(row.get("serving"))


def _noisy(row: dict, dense: dict) -> str:
    """``?`` when the row's or the dense model's decode timings varied too much between repeats to be a figure."""
    spreads = [r.get("decode_spread", 1.0) for r in (row, dense)]
    return NOISY_MARK if max(spreads) > NOISY_RUN_SPREAD else ""


def _speed_note(cells: dict, dense: dict) -> list[str]:
    if not any(_noisy(row, dense) for row in cells.values() if "decode_speedup" in row):
        return []
    return [f"{NOISY_MARK} after a decode speed-up: this model's or the dense model's three timings differed by more "
            f"than x{NOISY_RUN_SPREAD:g} (a busy machine): noise, not a measurement. `python -m eval.bench speed` "
            "measures speed with interleaved repeats.", ""]


def _metric_cells(row: dict, metrics: list) -> str:
    """The cells of the registered metrics measured in this comparison, each followed by its separator."""
    return "".join(f"{m.cell(row[m.field]) if m.field in row else '-'} | " for m in metrics)


def _versus(analysis: dict, key: str) -> str:
    versus = analysis.get("vs_removal", {})
    if key not in versus:
        return "-"
    entry = versus[key]
    if entry is None:
        return "no removal row"
    higher = entry["perplexity_higher_on"]
    ppl = "ppl lower on all" if not higher else f"ppl higher on {', '.join(higher)}"
    if entry.get("worse_than_removal"):
        ppl = f"{WORSE_MARK} worse than removing its blocks; {ppl}"
    if "gap" not in entry:
        return ppl if "verdict" not in entry else f"{entry['verdict']}; {ppl}"
    return f"{100 * entry['gap']:+.1f} ± {100 * entry['gap_stderr']:.1f} ({entry['verdict']}); {ppl}"


def _versus_note(analysis: dict) -> list[str]:
    if not analysis.get("vs_removal"):
        return []
    quality = "retention" if analysis["task_quality"] == "retention" else "task mean"
    return [f"\"vs removal of its blocks\": a repaired row against the plain removal of exactly the blocks it "
            f"removed, at the same drop: the paired gap in {quality} (points; tie under {TIE_SE:g} standard errors) "
            "and the domains where its perplexity is not lower. \"no removal row\": that removal did not run "
            "here, so the repair has no baseline (a recipe with the same score and selection and `replace: none` "
            "gives it).", ""]


def _wall_time_note(timing: dict) -> list[str]:
    runs = timing.get("runs", [])
    if not runs:
        return []
    total = sum(run.get("seconds", 0.0) for run in runs)
    measured = sum(run.get("removal_sets_measured", 0) for run in runs)
    return [f"Wall time so far: {total / 3600:.2f} h over {len(runs)} invocation(s) and "
            f"{sum(run.get('cells', 0) for run in runs)} cell(s) (each invocation loads the model, draws and "
            f"scores the calibration once: {', '.join(str(run.get('setup_seconds', '?')) for run in runs)} s). "
            f"Calibration passes with blocks or sub-layers removed (SLEB, the oracle, measured rankings, repaired "
            f"selections): "
            f"{measured} set(s) measured, each once; every later use reads it back (`measurements.json`).", ""]


def _removed(row: dict) -> str:
    """The blocks a cell removed; for a sub-layer method, its sub-layers by kind and the blocks gone whole."""
    if "sublayers" not in row:
        return str(row["dropped"])
    kinds = [u.split(".")[1] for u in row["sublayers"]]
    return (f"{kinds.count('attention')} attention + {kinds.count('mlp')} MLP sub-layers "
            f"(whole: {row['dropped'] or 'none'})")


def task_rows_note(results: Results) -> str:
    """Which rows of each task the figures read: they differ between a selection run and a report."""
    return f" ({describe_rows(results.task_limit)})" if results.task_limit is not NO_TASKS else ""


def head_caveat(results: Results) -> str:
    """A warning for figures read from the head of each task: a file's order is not a sample of the task."""
    limit = results.task_limit
    if limit is None or limit is NO_TASKS or isinstance(limit, str):
        return ""
    return (" The first rows of a task need not be a sample of it (HellaSwag's first 2,565 of 10,042 rows are all "
            "ActivityNet captions, and two thirds of the task is WikiHow): for figures that speak for whole tasks, "
            "draw the rows across each (`--limit 1000~:`).")


def _task_note(analysis: dict, results: Results) -> list[str]:
    if not analysis["tasks"]:
        return ["\"Better than\": lower perplexity on every held-out domain.", ""]
    counted = ", ".join(analysis["retention_tasks"])
    excluded = "; ".join(f"{t}: {why}" for t, why in analysis["excluded_tasks"].items())
    quality = "retention" if analysis["task_quality"] == "retention" else "task mean"
    chance = ", ".join(f"{t} {c:g}" for t, c in analysis["chance"].items())
    retention = (f"Retention = sum over {counted} of (accuracy - chance) / the same sum for the dense model"
                 if counted else "Retention: none, no task has the dense model clearly above chance")
    return [f"Tasks{task_rows_note(results)}: accuracy ± lm-eval's standard error, in %. {retention} (chance: {chance})"
            + (f"; left out: {excluded}" if excluded else "") + f". \"Tasks vs best\" compares the {quality} with "
            f"the best at the same drop: tie when the gap is under {TIE_SE:g} standard errors of the paired "
            f"difference (row by row on the same rows). \"Better than\": "
            f"lower perplexity on every domain and a {quality} higher by {TIE_SE:g} standard errors or more; "
            "rows without task figures are compared with each other on perplexity alone." + head_caveat(results), ""]


def task_cells(row: dict, tasks: list[str], figures: dict, vs_best: str) -> list[str]:
    """A row's task columns as a comparison's table has them.

    Each task's accuracy (%, ± lm-eval's error; "-" where it has none), the task mean, the retention and ``vs_best``.
    """
    if not tasks:
        return []
    cells = []
    for task in tasks:
        value = row.get("tasks", {}).get(task)
        cells.append("-" if value is None else f"{100 * value:.1f} ± {100 * task_stderr(row, task):.1f}")
    for quality in ("task_mean", "retention"):
        cells.append(f"{100 * figures[quality]:.1f} ± {100 * figures[f'{quality}_stderr']:.1f}"
                     if quality in figures else "-")
    return [*cells, vs_best]
