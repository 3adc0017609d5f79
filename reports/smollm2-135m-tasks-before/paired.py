"""Paired retention gaps between rows of different eval.compare results (same task rows, same dense model).

    PYTHONPATH=. python reports/smollm2-135m-tasks-before/paired.py \
        reports/smollm2-135m-tasks-gpu/results.json::remove@4 \
        reports/smollm2-135m-tasks-before/results.json::linear-long@4

Each row is FILE::CELL; the first is the baseline. The rows pair only when every file's dense model answered
each task row alike (the same model, tasks and --limit): otherwise the script stops.
"""

import json
import sys
from pathlib import Path

from eval.compare import gap_stderr, task_figures

TASK_SETS = (["arc_easy", "hellaswag", "piqa", "lambada_openai"], ["arc_easy", "hellaswag", "piqa"])

files, rows = {}, {}
for spec in sys.argv[1:]:
    path, key = spec.split("::")
    if path not in files:
        files[path] = json.loads(Path(path).read_text())
    rows[f"{key} ({Path(path).parent.name})"] = files[path]["cells"][key]
dense = next(iter(files.values()))["dense"]
for path, results in files.items():
    if results["dense"]["task_rows"] != dense["task_rows"]:
        sys.exit(f"{path}: its dense model answered the task rows otherwise; its rows do not pair with the first's")
base = next(iter(rows))
for tasks in TASK_SETS:
    print(f"{len(tasks)} tasks")
    fb = task_figures(rows[base], tasks, tasks, dense)
    for name, row in rows.items():
        fa = task_figures(row, tasks, tasks, dense)
        gap, se = fa["retention"] - fb["retention"], gap_stderr(row, rows[base], fa, fb, "retention", tasks, dense)
        print(f"  {name}: {100 * fa['retention']:.1f} ± {100 * fa['retention_stderr']:.1f}; "
              f"minus {base}: {100 * gap:+.1f} ± {100 * se:.1f}")
