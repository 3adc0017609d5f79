"""Paired retention gaps between rows of different eval.compare results (same task rows, same dense model).

    PYTHONPATH=. python reports/smollm2-135m-tasks-before/paired.py \
        reports/smollm2-135m-tasks-gpu/results.json::remove@4 \
        reports/smollm2-135m-tasks-before/results.json::linear-long@4

Each row is FILE::CELL; the first is the baseline, and its file's dense model counts retention.
"""

import json
import sys
from pathlib import Path

from eval.compare import _task_figures, gap_stderr

TASK_SETS = (["arc_easy", "hellaswag", "piqa", "lambada_openai"], ["arc_easy", "hellaswag", "piqa"])


def load(spec: str) -> tuple[dict, dict]:
    """The dense row and the named cell of one results.json."""
    path, key = spec.split("::")
    results = json.loads(Path(path).read_text())
    return results["dense"], results["cells"][key]


dense, _ = load(sys.argv[1])
rows = {f"{spec.split('::')[1]} ({Path(spec.split('::')[0]).parent.name})": load(spec)[1] for spec in sys.argv[1:]}
base = next(iter(rows))
for tasks in TASK_SETS:
    print(f"{len(tasks)} tasks")
    fb = _task_figures(rows[base], tasks, tasks, dense)
    for name, row in rows.items():
        fa = _task_figures(row, tasks, tasks, dense)
        gap, se = fa["retention"] - fb["retention"], gap_stderr(row, rows[base], fa, fb, "retention", tasks, dense)
        print(f"  {name}: {100 * fa['retention']:.1f} ± {100 * fa['retention_stderr']:.1f}; "
              f"minus {base}: {100 * gap:+.1f} ± {100 * se:.1f}")
