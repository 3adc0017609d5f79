"""Paired retention gaps between rows of different eval.compare results.json (same rows, same dense model).

    PYTHONPATH=. python reports/smollm2-135m-tasks-before/paired.py \
        reports/smollm2-135m-tasks-gpu/results.json::remove@4 reports/smollm2-135m-tasks-before/results.json::linear-long@4

Each row is FILE::CELL; the first is the baseline, and its file's dense model counts retention.
"""
import json, sys
from eval.compare import gap_stderr, _task_figures
def load(spec):
    path, key = spec.split('::'); r = json.load(open(path)); return r['dense'], r['cells'][key]
dense, _ = load(sys.argv[1])
rows = {s.split('::')[1] + '(' + s.split('/')[1] + ')': load(s)[1] for s in sys.argv[1:]}
for tasks in (['arc_easy', 'hellaswag', 'piqa', 'lambada_openai'], ['arc_easy', 'hellaswag', 'piqa']):
    print(len(tasks), 'tasks')
    names = list(rows); base = names[0]
    fb = _task_figures(rows[base], tasks, tasks, dense)
    for k in names:
        fa = _task_figures(rows[k], tasks, tasks, dense)
        se = gap_stderr(rows[k], rows[base], fa, fb, 'retention', tasks, dense)
        print(f"  {k}: {100*fa['retention']:.1f} ± {100*fa['retention_stderr']:.1f}; minus {base}: {100*(fa['retention']-fb['retention']):+.1f} ± {100*se:.1f}")
