"""Geometric-mean perplexity over the selection texts, x dense, for every cell of a comparison's results.json.

Run from the repository root: PYTHONPATH=. python reports/smollm2-135m-distill-data/geomean.py FOLDER/results.json
"""

import json
import math
import sys

results = json.load(open(sys.argv[1]))
dense = results["dense"]["domains"]
print("| cell | " + " | ".join(dense) + " | geometric mean, x dense |")
print("|---" * (len(dense) + 2) + "|")
print("| dense | " + " | ".join(f"{dense[d]:.2f}" for d in dense) + " | 1.000 |")
for key, cell in results["cells"].items():
    domains = cell.get("domains") or {}
    if not all(domains.get(d) for d in dense):
        continue
    ratios = [domains[d] / dense[d] for d in dense]
    mean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    print(f"| {key} | " + " | ".join(f"{domains[d]:.2f}" for d in dense) + f" | {mean:.3f} |")
