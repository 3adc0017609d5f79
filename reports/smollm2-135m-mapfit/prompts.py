"""The task prompts that eval.mapfit reads in run.sh.

The first 1,000 rows of each task the comparison runs, each as its prompt followed by the right answer, one
document per row so that each keeps its own short length.
"""

import json
import sys
from pathlib import Path

data, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)


def write(name: str, texts: list[str]) -> None:
    """One jsonl of ``{"text": ...}`` rows."""
    with open(out / f"{name}.jsonl", "w") as f:
        for text in texts[:1000]:
            f.write(json.dumps({"text": text}) + "\n")


def arc(row: dict) -> str:
    """An ARC row as lm-eval asks it, with its right answer."""
    question = row["question"]
    answer = next(c["text"] for c in question["choices"] if c["label"] == row["answerKey"])
    return f"Question: {question['stem']}\nAnswer: {answer}"


def piqa(goal: dict, label: str) -> str:
    """A PIQA row as lm-eval asks it, with its right solution."""
    return f"Question: {goal['goal']}\nAnswer: {goal['sol' + str(int(label) + 1)]}"


write("arc_easy", [arc(json.loads(line)) for line in open(data / "arc/ARC-Easy-Test.jsonl")])
lines = (data / "hellaswag/hellaswag_val_full.txt").read_text().split("\n")  # context, label, four endings
write("hellaswag", [f"{lines[i]} {lines[i + 2 + int(lines[i + 1])]}" for i in range(0, 6000, 6)])
goals = [json.loads(line) for line in open(data / "piqa/valid.jsonl")]
labels = (data / "piqa/valid-labels.lst").read_text().split()
write("piqa", [piqa(g, label) for g, label in zip(goals, labels, strict=False)])
write("lambada", [json.loads(line)["text"] for line in open(data / "lambada/lambada_test.jsonl")])
