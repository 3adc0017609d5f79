"""The selection split: texts and task prompts that no reported figure reads, for choosing defaults.

Writes, under OUT: the last fifth of Tiny Shakespeare (the reported "plays" domain reads its start) and
the last 500 rows of ARC-Easy, HellaSwag and PIQA as lm-eval builds them (the reported task figures read
the first 1,000; each split has more than 1,500 rows, so the two never meet), one prompt plus its right
answer per line. The other selection texts are whole files of ../shared/data: Northanger Abbey, PTB
valid, WikiText-2 validation.

    PYTHONPATH=. python reports/smollm2-135m-distill-data/selection.py ../shared/data /tmp/layercut-selection
"""

import json
import sys
from pathlib import Path

from eval.lmeval import answered_prompts, local_tasks

TASKS = ("arc_easy", "hellaswag", "piqa")
ROWS = 500
REPORTED_ROWS = 1000

data, out = sys.argv[1], Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
plays = (Path(data) / "tinyshakespeare/input.txt").read_text()
(out / "plays_last_fifth.txt").write_text(plays[len(plays) * 4 // 5:])
for name, task in local_tasks(TASKS, data).items():
    texts = answered_prompts(task)
    if len(texts) < REPORTED_ROWS + ROWS:
        raise SystemExit(f"{name} has {len(texts)} rows: its last {ROWS} would meet the reported first {REPORTED_ROWS}")
    with open(out / f"{name}.jsonl", "w") as f:
        for text in texts[-ROWS:]:
            f.write(json.dumps({"text": text}) + "\n")
