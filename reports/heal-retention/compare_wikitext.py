"""The 400-step heal with WikiText-2 beside the calibration, paired row by row with the curve of drop8/.

Run from the repository root: ``PYTHONPATH=. python reports/heal-retention/compare_wikitext.py``.
"""

import json

from eval.compare.stats import gap_stderr, retention_tasks, task_figures

WIKI = "+ WikiText-2 train, 400 steps"
old = json.load(open("reports/heal-retention/drop8/heal_curve.json"))
new = json.load(open("reports/heal-retention/drop8-wikitext/heal_curve.json"))
names = old["tasks"]["names"]
# the same rows of the same tasks: the original's answers must be the same, row by row, or nothing pairs
assert old["original"]["task_rows"] == new["original"]["task_rows"], "the original's rows differ"
counted, _ = retention_tasks(old["original"], names)
points = {f"calibration, {point['steps']} steps": point for point in old["points"]}
points[WIKI] = new["points"][0]
figures = {name: task_figures(point, names, counted, old["original"]) for name, point in points.items()}
for other in ("calibration, 0 steps", "calibration, 400 steps"):
    gap = figures[WIKI]["retention"] - figures[other]["retention"]
    stderr = gap_stderr(points[WIKI], points[other], figures[WIKI], figures[other], "retention", counted,
                        old["original"])
    print(f"WikiText 400 vs {other}: {100 * gap:+.1f} ± {100 * stderr:.1f} points")
for name, point in points.items():
    print(name, "retention", round(100 * figures[name]["retention"], 1), "minutes", point["minutes"], "geo",
          round(point["heldout_ppl"], 3), point["kl"])
