"""Where the share of the update is best, text by text: hidden-state error against KL at the logits.

Reads the stop-37 ``eval.mapfit --update-scale`` results (``selection-scale-*/results.json``): for each text,
the share S of the least-squares update that minimises the parabola through S = 0 (removal), 0.3, 0.5, 0.7 and
1, for the hidden-state error (exactly quadratic in S) and for the KL from the original model. The KL is not
quadratic in S, so it gets two estimates: least squares over the five points, and the parabola through the three
nearest the optimum (0.5, 0.7 and 1).

    python reports/smollm2-135m-mapfit/optimum.py reports/smollm2-135m-mapfit/selection-scale-12-15 ...
"""

import json
import sys
from pathlib import Path

import numpy as np

SHARES = {"removal": 0.0, "ls-mixed-64*0.3": 0.3, "ls-mixed-64*0.5": 0.5, "ls-mixed-64*0.7": 0.7,
          "ls-mixed-64": 1.0}
NEAR = ("ls-mixed-64*0.5", "ls-mixed-64*0.7", "ls-mixed-64")


def best_share(values: dict, names=tuple(SHARES)) -> float:
    """The vertex of the least-squares parabola through (S, value) over ``names``."""
    a, b, _ = np.polyfit([SHARES[name] for name in names], [values[name] for name in names], 2)
    return float(-b / (2 * a))


def main(folders: list[str]) -> None:
    """One markdown row per span and measure, one column per text."""
    texts = list(json.loads((Path(folders[0]) / "results.json").read_text())["errors"])
    print("| span | measure | " + " | ".join(texts) + " |")
    print("|---|---|" + "---:|" * len(texts))
    for folder in folders:
        results = json.loads((Path(folder) / "results.json").read_text())
        span = "-".join(map(str, results["span"]))
        hidden = {text: best_share({n: row[n]["relative"] for n in SHARES}) for text, row in results["errors"].items()}
        kl = {text: {n: row[n]["kl_relative"] for n in SHARES} for text, row in results["logits"].items()}
        print(f"| {span} | hidden-state error | " + " | ".join(f"{hidden[t]:.2f}" for t in hidden) + " |")
        print(f"| {span} | KL, five shares | " + " | ".join(f"{best_share(kl[t]):.2f}" for t in hidden) + " |")
        print(f"| {span} | KL, 0.5-1 | " + " | ".join(f"{best_share(kl[t], NEAR):.2f}" for t in hidden) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
