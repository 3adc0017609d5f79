"""Task accuracy on the selection split with a share of the span's least-squares update in place (hooks).

The last 500 rows of each task (``--limit=-500:``, rows no reported figure reads), with the map of ``SPAN``
fitted as ``--replace linear`` fits it (the default calibration, ``--fit-short 64``) and put in the span's place
by ``eval.mapfit``'s hooks, one share at a time (``removal``, ``ls`` = 1, or a number). The dense rows are those
of ../smollm2-135m-distill-data/selection-tasks (same model and rows). Appends to OUT; run from the repository root:

    PYTHONPATH=. python reports/smollm2-135m-mapfit/selection_tasks.py 12-15 removal,ls,0.5,0.75,0.7 OUT.json
"""

import argparse
import json
import sys
import time

from eval.compare import measure_tasks
from eval.mapfit import build_parser, capture, span_replaced
from prune.data import DataConfig, calibration_data
from prune.linear_fit import fit_linear_map, scale_update
from prune.options import apply_threads, load_config_from_args
from prune.replace.capture import PairAccumulator
from prune.replace.driver import short_windows

span_text, variants, out_path = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
args = build_parser().parse_args(["--model", "smollm2-135m", "--span", span_text, "--out", "unused", "--threads", "2"])
apply_threads(args)
loaded = load_config_from_args(args).load()
model, tokenizer = loaded.model.eval(), loaded.tokenizer
span = tuple(int(b) for b in span_text.split("-"))
data = calibration_data(tokenizer, DataConfig(data=None, samples=32, seq_len=512, heldout_samples=8), model=model)
moments = PairAccumulator(precision="float64")
for sequences, batch in ((list(data.token_ids), 4), (list(short_windows(data.token_ids, 64)), 32)):
    captured = capture(model, sequences, span, batch)
    moments.update(captured.x, captured.y)
least_squares = fit_linear_map(moments.moments())
try:
    with open(out_path) as f:
        results = json.load(f)
except FileNotFoundError:
    with open("reports/smollm2-135m-distill-data/selection-tasks/results.json") as f:
        results = {"dense": json.load(f)["dense"], "cells": {}}
tasks = argparse.Namespace(tasks="arc_easy,hellaswag,piqa,lambada_openai", data_dir="../shared/data", limit="-500:")
for variant in variants:
    key = f"{variant}@{span_text}"
    if key in results["cells"]:
        continue
    fit = None if variant == "removal" else scale_update(least_squares, 1.0 if variant == "ls" else float(variant))
    row, start = {}, time.time()
    with span_replaced(model, span, fit):
        measure_tasks(model, tokenizer, tasks, row)
    row["seconds"] = time.time() - start
    results["cells"][key] = row
    with open(out_path, "w") as f:
        json.dump(results, f)
    print(key, row["tasks"], round(row["seconds"]), flush=True)
