"""HellaSwag accuracy by source (ActivityNet captions, WikiHow) on the rows an eval.compare run read.

    PYTHONPATH=. python reports/smollm2-135m-tasks-draw/by_source.py reports/smollm2-135m-tasks-draw/results.json \
        ../shared/data/hellaswag/hellaswag_val_full.txt

A row is WikiHow when its context (after the activity label) starts "How to": 6,800 of the 10,042 validation
rows, none of the first 2,565. The file is read by the parser the local hellaswag task uses, and the rows are the
ones eval.lmeval reads for the results' --limit.
"""

import json
import sys
from pathlib import Path

from eval.lmeval import task_rows
from eval.tasks.local_docs import hellaswag_items

results = json.loads(Path(sys.argv[1]).read_text())
items = hellaswag_items(Path(sys.argv[2]).read_text(encoding="utf-8"))
wikihow = {i for i, item in enumerate(items) if item["ctx"].startswith("How to")}
limit = results["task_limit"]
rows = task_rows(limit, len(items), "hellaswag")
print(f"--limit {limit}: {len(rows)} rows, {sum(r in wikihow for r in rows)} WikiHow")
print("| cell | ActivityNet (rows) | WikiHow (rows) | all |")
print("|---|---|---|---|")
for name, cell in {"dense": results["dense"], **results["cells"]}.items():
    answers = cell.get("task_rows", {}).get("hellaswag")
    if answers is None:
        continue
    if len(answers) != len(rows):
        sys.exit(f"{name}: {len(answers)} HellaSwag answers for {len(rows)} rows; not this file's rows")
    paired = list(zip(rows, answers, strict=True))
    by = [[a for r, a in paired if (r in wikihow) == is_wikihow] for is_wikihow in (False, True)]
    cells = " | ".join(f"{100 * sum(v) / len(v):.1f} ({len(v)})" if v else "-" for v in by)
    print(f"| {name} | {cells} | {100 * sum(answers) / len(answers):.1f} |")
