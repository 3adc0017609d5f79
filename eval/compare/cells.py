"""One cell of a comparison (a method at a drop): run it on a copy of the model, or complete it from kept weights."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import time
from pathlib import Path

from distill.config import DistillConfig
from eval.compare.config import CompareConfig, block_budget, cell_config
from eval.compare.digest import recipe_digest
from eval.compare.heldout import Heldout, measure_domains
from eval.compare.metrics import Original, measure_metrics
from eval.compare.results import Row
from eval.quality.lmeval import primary_metric, run_lm_eval
from eval.speed.measure import WEIGHT_SUFFIXES, SpeedOptions, make_prompt, time_decode
from prune.checkpoint.save_load import REPLACEMENTS_FILE
from prune.checkpoint.serving import folder_serving
from prune.errors import LayercutError
from prune.loading.loader import LoadedModel
from prune.model import remote_code as hf_remote_code
from prune.model.adapters import num_blocks
from prune.pipeline.runner import Scored, run_prune
from prune.replace import parameter_count

logger = logging.getLogger(__name__)

CELLS = "cells"
# A cell's weights read back must give its row's perplexity to this relative tolerance (the same
# float32 arithmetic agrees to ~1e-6; a checkpoint without its maps or from another run is off by far more)
REPRODUCE_RTOL = 1e-4


class CellRefused(LayercutError):
    """The cell's method refused this model or drop in one line: the comparison records why and goes on."""


def cell_dir(out: Path, name: str, drop: int) -> Path:
    """Where a cell's reports (and, with ``--keep-checkpoints``, its weights) go."""
    return out / CELLS / f"{name}-drop{drop}"


def measure_tasks(model, tokenizer, tasks: list[str], row: Row, *, limit=None, data_dir: str | None = None) -> None:
    """Put the lm-eval ``tasks`` that ``row`` lacks into it: score, standard error and the row-by-row scores."""
    tasks = [task for task in tasks if task not in row.get("tasks", {})]
    if not tasks:
        return
    rows: dict[str, list[float]] = {}
    raw = run_lm_eval(model, tokenizer, tasks, data_dir=data_dir, limit=limit, rows=rows)
    row.setdefault("tasks", {}).update({task: raw[task].get(primary_metric(task)) for task in tasks if task in raw})
    row.setdefault("task_rows", {}).update({task: [int(v) if v in (0.0, 1.0) else v for v in rows[task]]
                                            for task in tasks if task in rows})
    row.setdefault("task_stderr", {}).update({task: raw[task].get(f"{primary_metric(task)}_stderr")
                                              for task in tasks if task in raw})


def decode_seconds(model, seq_len: int, new_tokens: int) -> tuple[float, float]:
    """Median of 3 timings of ``new_tokens`` greedy steps with the KV cache, after a warm-up, and max / min."""
    options = SpeedOptions(prompt_len=min(64, seq_len), new_tokens=new_tokens)
    prompt = make_prompt(model.config.vocab_size, options)
    time_decode(model, prompt, 2)  # warm-up
    times = sorted(time_decode(model, prompt, options.new_tokens) for _ in range(3))
    return times[1], times[-1] / times[0]


def engine_decode_seconds(path: str, config: CompareConfig) -> tuple[float, float]:
    """:func:`decode_seconds` in ``config.engine``, on the checkpoint at ``path`` (written, or the dense source)."""
    from eval.speed.engines import EngineSettings, get_engine

    engine = get_engine(config.engine)
    options = SpeedOptions(prompt_len=min(64, config.seq_len), new_tokens=config.speed_tokens)
    handle = engine.load(path, EngineSettings(load=config.load, context=options.prompt_len + options.new_tokens + 8))
    try:
        prompt = make_prompt(handle.vocab_size, options)
        engine.decode_seconds(handle, prompt, 2)  # warm-up
        times = sorted(engine.decode_seconds(handle, prompt, options.new_tokens) for _ in range(3))
    finally:
        engine.close(handle)
    return times[1], times[-1] / times[0]


def measure(model, tokenizer, heldout: Heldout, config: CompareConfig, path: str | None = None,
            original: Original | None = None) -> Row:
    """Parameters, held-out perplexity per domain, lm-eval tasks and decode seconds of one model.

    ``path``: the model's checkpoint (a cell's folder, or the dense source), which an engine other than
    transformers times; a checkpoint that engine does not run gets ``decode_why`` instead of seconds.
    ``original``: what metrics that judge against the original compare ``model`` with.
    """
    row: Row = {"params": parameter_count(model), "blocks": num_blocks(model)}
    measure_domains(model, heldout, row)
    measure_tasks(model, tokenizer, config.tasks, row, limit=config.limit, data_dir=config.data_dir)
    measure_metrics(model, tokenizer, config.metrics, row, original)
    if config.speed_tokens and config.engine == "transformers":
        # the spread says whether the median is a measurement or the noise of a busy machine
        row["decode_s"], row["decode_spread"] = decode_seconds(model, config.seq_len, config.speed_tokens)
    elif config.speed_tokens:
        try:
            row["decode_s"], row["decode_spread"] = engine_decode_seconds(str(path), config)
        except LayercutError as err:  # a checkpoint with maps, or one the converter refuses: the row says why
            row["decode_why"] = str(err)
    return row


def kept_weights(folder: Path) -> bool:
    """Whether a cell's folder still holds its checkpoint's weights (``--keep-checkpoints``)."""
    return (folder / "config.json").is_file() and any(f.suffix in WEIGHT_SUFFIXES for f in folder.iterdir())


def complete_cell(row: Row, folder: Path, config: CompareConfig, heldout: Heldout,
                  original: Original | None = None) -> Row | None:
    """``row`` with the domains and tasks it lacks, measured on the cell's kept weights.

    None, and the cell runs again, when no weights were kept or they do not give the row's own
    perplexity on a domain it has: the figures added must be those of the model the row describes.
    """
    known = [name for name in heldout.names() if name in row.get("domains", {})]
    if not known or not kept_weights(folder):
        return None
    loaded = dataclasses.replace(config.load, model=str(folder)).load()
    again = heldout.perplexity(loaded.model, known[0])
    if not math.isclose(again, row["domains"][known[0]], rel_tol=REPRODUCE_RTOL):
        logger.warning("%s gives %s perplexity %.5f where its row says %.5f: running the cell again", folder,
                       known[0], again, row["domains"][known[0]])
        return None
    row = copy.deepcopy(row)
    measure_domains(loaded.model, heldout, row, [name for name in heldout.names() if name not in known])
    measure_tasks(loaded.model, loaded.tokenizer, config.tasks, row, limit=config.limit, data_dir=config.data_dir)
    measure_metrics(loaded.model, loaded.tokenizer, config.metrics, row, original)
    row["completed_from_checkpoint"] = True
    return row


def serving_layout(folder: Path) -> dict:
    """The cell's ``serving`` entry (``prune.model.layouts``): which engines run its checkpoint."""
    return folder_serving(folder)


def is_vanilla(folder: Path) -> bool:
    """Whether a written checkpoint loads with plain transformers (no maps, no removed sub-layers)."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return not (folder / REPLACEMENTS_FILE).exists() and not hf_remote_code.is_wrapped(config)


def distill_summary(config: dict) -> dict:
    """What a cell's distillation read and optimised, from its resolved settings (``layercut.json``).

    Two rows of one recipe can differ here when a default moved between runs: the row says so itself, not
    only its cell folder.
    """
    resolved = DistillConfig.from_dict(config)
    return {"data": resolved.data.data, "samples": resolved.data.samples, "seq_len": resolved.data.seq_len,
            "train": resolved.train, "losses": resolved.loss_weights()}


def _method_row(name: str, path: Path, digest: str, drop: int, prune_config, result, folder: Path) -> Row:
    """What a cell ran: its recipe, blocks, method and (when it trained) its distillation."""
    row: Row = {"method": name, "recipe": str(path), "recipe_digest": digest, "drop": drop,
                "dropped": result.dropped, "score": prune_config.score, "select": prune_config.select,
                "replace": prune_config.replace.method,
                "distill_steps": result.report.get("distill", {}).get("steps", 0), "vanilla": is_vanilla(folder),
                "serving": serving_layout(folder)}
    if "selection" in result.report:  # a selection that steps: what it measured at each step (the steps plot)
        row["selection"] = result.report["selection"]
    return row


def _add_distill(row: Row, report: dict, prune_config) -> None:
    if "sublayers" in report:
        row.update(unit=prune_config.unit, sublayers=report["sublayers"]["units"])
    if "distill" in report:
        row["distill"] = distill_summary(report["distill"]["config"])
        if report["distill"].get("generalisation"):
            row["distill"]["generalisation"] = report["distill"]["generalisation"]


def _add_ratios(row: Row, dense: Row, names: list[str]) -> None:
    row["heldout_ratio"] = row["heldout_ppl"] / dense["heldout_ppl"]
    row["domain_ratios"] = {name: row["domains"][name] / dense["domains"][name] for name in names}
    row["params_ratio"] = row["params"] / dense["params"]
    if "decode_s" in row and dense.get("decode_s"):
        row["decode_speedup"] = dense["decode_s"] / row["decode_s"]


def run_cell(name: str, path: Path, drop: int, config: CompareConfig, loaded: LoadedModel, scored: Scored,
             heldout: Heldout, dense: Row, original: Original | None = None) -> Row:
    """One method at one drop on a fresh copy of the model; the cell's row."""
    started = time.perf_counter()
    # before the recipe is read: a recipe edited while the cell runs must not lend the row its new digest
    digest = recipe_digest(path)
    folder = cell_dir(config.out, name, drop)
    prune_config = cell_config(config, path, drop, folder, block_budget(loaded.model))
    copied = time.perf_counter()
    student = dataclasses.replace(loaded, model=copy.deepcopy(loaded.model))
    copy_seconds = time.perf_counter() - copied
    # the cell measures on its own held-out text: keep run_prune from scoring the dense model again
    shared = dataclasses.replace(scored, calibration=dataclasses.replace(scored.calibration, heldout_ids=None))
    try:
        try:
            result = run_prune(prune_config, loaded=student, scored=shared)
        except LayercutError as err:  # the method's own refusal; a measurement's error is not the method's
            raise CellRefused(str(err)) from err
        row = _method_row(name, path, digest, drop, prune_config, result, folder)
        row.update(prune_seconds=round(time.perf_counter() - started, 2), copy_seconds=round(copy_seconds, 2))
        _add_distill(row, result.report, prune_config)
        row.update(measure(student.model, student.tokenizer, heldout, config, folder, original))
    finally:  # also after Ctrl-C or a failure: weights nobody asked to keep do not stay behind (a model's size each)
        if not config.keep_checkpoints:
            drop_weights(folder)
    _add_ratios(row, dense, heldout.names())
    row["seconds"] = round(time.perf_counter() - started, 2)
    del student
    return row


def drop_weights(folder: Path) -> None:
    """Delete the weight files of a cell's folder (its reports stay)."""
    if folder.is_dir():
        for file in folder.iterdir():
            if file.suffix in WEIGHT_SUFFIXES:
                file.unlink()
