"""Task accuracy on the selection split with a share of a span's least-squares update in place (hooks, no surgery).

The map of the span is fitted as ``--replace linear`` fits it (the default calibration and ``--fit-short 64``)
and put in the span's place by ``eval.mapfit``'s hooks, one share at a time: ``removal``, ``ls`` (the whole
update) or a number. The rows are the last 500 of each task (``--limit=-500:``), which no reported figure
reads; the dense row is ``reports/smollm2-135m-distill-data/selection-tasks``'s (same model and rows).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from eval.compare.cells import measure_tasks
from eval.mapfit import capture, parse_span, span_replaced
from prune.checkpoint.load_config import LoadConfig
from prune.data.calibration import DataConfig, calibration_data
from prune.measure.least_squares import LinearFit, fit_linear_map, scale_update
from prune.model.adapters import num_blocks
from prune.replace.capture import PairAccumulator
from prune.replace.driver import short_windows

logger = logging.getLogger(__name__)

TASKS = ("arc_easy", "hellaswag", "piqa", "lambada_openai")
SELECTION_LIMIT = "-500:"
DENSE_FROM = Path("reports/smollm2-135m-distill-data/selection-tasks/results.json")
SHORT = 64  # --fit-short's default for linear


def fit_span(model, tokenizer, span: tuple[int, int]) -> LinearFit:
    """The least-squares map of ``span`` on the default calibration, on both cuts as ``--replace linear`` fits it."""
    data = calibration_data(tokenizer, DataConfig(data=None, samples=32, seq_len=512, heldout_samples=8), model=model)
    moments = PairAccumulator(precision="float64")
    for sequences, batch in ((list(data.token_ids), 4), (list(short_windows(data.token_ids, SHORT)), 32)):
        captured = capture(model, sequences, span, batch)
        moments.update(captured.x, captured.y)
    return fit_linear_map(moments.moments())


def variant_fit(least_squares: LinearFit, variant: str) -> LinearFit | None:
    """``removal`` -> None (the span skipped), ``ls`` -> the whole update, a number -> that share of it."""
    if variant == "removal":
        return None
    return scale_update(least_squares, 1.0 if variant == "ls" else float(variant))


def share_tasks(model_name: str, span_text: str, variants: Sequence[str], out: str | Path,
                data_dir: str = "../shared/data", tasks: Sequence[str] = TASKS) -> dict:
    """Measure every variant not yet in ``out`` and append its row there (the file is rewritten after each)."""
    out = Path(out)
    loaded = LoadConfig(model=model_name).load()
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    span = parse_span(span_text, num_blocks(model))
    results = json.loads(out.read_text(encoding="utf-8")) if out.is_file() else {
        "dense": json.loads(DENSE_FROM.read_text(encoding="utf-8"))["dense"], "cells": {}}
    least_squares = fit_span(model, tokenizer, span)
    for variant in variants:
        key = f"{variant}@{span_text}"
        if key in results["cells"]:
            continue
        row, start = {}, time.time()
        with span_replaced(model, span, variant_fit(least_squares, variant)):
            measure_tasks(model, tokenizer, list(tasks), row, limit=SELECTION_LIMIT, data_dir=data_dir)
        row["seconds"] = time.time() - start
        results["cells"][key] = row
        out.write_text(json.dumps(results), encoding="utf-8")
        logger.info("%s %s %.0f s", key, row["tasks"], row["seconds"])
    return results
