"""The task prompts that eval.mapfit reads in run.sh.

The first 1,000 rows of each task the comparison runs, as lm-eval builds them from the local data (the
project's offline task definitions, ``eval.lmeval.local_tasks``): each row's prompt followed by its right
answer, one document per row so that each keeps its own short length.

    PYTHONPATH=. python reports/smollm2-135m-mapfit/prompts.py ../shared/data /tmp/layercut-prompts
"""

import json
import sys
from pathlib import Path

from eval.lmeval import answered_prompts, local_tasks

TASKS = ("arc_easy", "hellaswag", "piqa", "lambada_openai")
ROWS = 1000

data, out = sys.argv[1], Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
for name, task in local_tasks(TASKS, data).items():
    with open(out / f"{name}.jsonl", "w") as f:
        for text in answered_prompts(task)[:ROWS]:
            f.write(json.dumps({"text": text}) + "\n")
