"""Evaluate models (slimmed ones against their original, or one alone): perplexity, lm-eval tasks, a report.

``eval.run`` (the CLI) builds :class:`EvalOptions` and calls :func:`run`. Task names:

* ``wikitext``: layercut's perplexity protocol on the WikiText-2 raw test split (``eval.quality.perplexity``);
* ``ppl:PATH``: the same protocol on any text file (.txt, or .jsonl/.json/.parquet rows with a
  ``text`` field), reported as ``ppl:<file stem>/perplexity``;
* anything else goes to lm-eval (``eval.quality.lmeval``).

Every model is opened with ``prune.load``, so a checkpoint with replacement maps is measured with
its maps. Models are loaded one at a time, baseline first, so memory holds one model.
"""
from __future__ import annotations

import gc
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from eval.quality.lmeval import (
    check_registry_data,
    plan_tasks,
    primary_metric,
    resolve_data_dir,
    run_lm_eval,
)
from eval.quality.perplexity import DEFAULT_MAX_SEQ_LEN, default_seq_len, load_wikitext2_test, text_perplexity
from eval.quality.report import write_report
from eval.quality.rows import parse_limit as parse_limit  # eval.run's --limit, beside the rules of the rows it reads
from eval.speed.measure import block_count
from prune.atomic import atomic_directory, check_output_dir
from prune.checkpoint.load_config import LoadConfig
from prune.checkpoint.report import read_report
from prune.data.calibration import check_seq_len, load_documents
from prune.errors import LayercutError
from prune.loading.loader import check_tokenizer
from prune.replace import parameter_count

logger = logging.getLogger(__name__)

PERPLEXITY_TASK = "wikitext"
TEXT_TASK_PREFIX = "ppl:"


@dataclass
class EvalOptions:
    """What ``eval.run`` evaluates and how.

    Attributes:
        models: Candidate names or folders.
        baseline: The original model, or None to evaluate the models alone.
        tasks: ``wikitext``, ``ppl:PATH`` and/or lm-eval task names.
        out: Report folder; it must be new or empty unless ``overwrite``.
        overwrite: Replace a non-empty ``out`` (its old files go: no plot of an earlier run stays beside
            the new results).
        data_dir: Local data folder (``$LAYERCUT_DATA`` when None); None for both means the hub.
        limit: Rows per lm-eval task: a count, a fraction, a range ``"START:END"`` or a draw ``"N~START:END"``
            (None: all).
        seq_len: Perplexity window (None: min(2048, model maximum)).
        stride: Perplexity stride (None: seq_len, non-overlapping windows).
        batch_size: lm-eval requests per forward pass.
        ppl_batch_size: Perplexity windows per forward pass.
        ppl_tokens: Score only the first this many tokens of each perplexity text (None: all, unless
            ``limit`` is a row count: then ``limit`` windows).
        num_fewshot: lm-eval few-shot examples (None: task default).
        load: How every model is loaded (dtype, device, quantization, tokenizer; its ``model`` is unused).
        progress: Show progress bars.
    """

    models: list[str]
    baseline: str | None = None
    tasks: list[str] = field(default_factory=lambda: [PERPLEXITY_TASK])
    out: str = "report"
    overwrite: bool = False
    data_dir: str | None = None
    limit: int | float | str | None = None
    seq_len: int | None = None
    stride: int | None = None
    batch_size: int = 8
    ppl_batch_size: int = 1
    ppl_tokens: int | None = None
    num_fewshot: int | None = None
    load: LoadConfig = field(default_factory=LoadConfig)
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.models:
            raise LayercutError("no --model given; name at least one model to evaluate")
        self.tasks = list(dict.fromkeys(t.strip() for t in self.tasks if t.strip()))
        if not self.tasks:
            raise LayercutError("no tasks given; e.g. --tasks wikitext,arc_easy")
        if self.seq_len is not None:
            check_seq_len(self.seq_len)
        if self.stride is not None and self.stride < 1:
            raise LayercutError(f"--stride must be at least 1, got {self.stride}")
        if self.seq_len and self.stride and self.stride > self.seq_len:
            raise LayercutError(f"--stride {self.stride} exceeds --seq-len {self.seq_len}; use a stride <= seq-len")
        if self.ppl_tokens is not None and self.ppl_tokens < 2:
            raise LayercutError(f"--ppl-tokens must be at least 2, got {self.ppl_tokens}")
        if self.ppl_batch_size < 1:
            raise LayercutError(f"--ppl-batch-size must be at least 1, got {self.ppl_batch_size}")

    @property
    def lm_eval_tasks(self) -> list[str]:
        """Task names handed to lm-eval (all but ``wikitext`` and ``ppl:PATH``)."""
        return [t for t in self.tasks if t != PERPLEXITY_TASK and not t.startswith(TEXT_TASK_PREFIX)]

    @property
    def text_files(self) -> list[str]:
        """The paths of the ``ppl:PATH`` tasks."""
        return [t.removeprefix(TEXT_TASK_PREFIX) for t in self.tasks if t.startswith(TEXT_TASK_PREFIX)]

    @property
    def model_names(self) -> list[str]:
        """Every model evaluated, baseline first."""
        return ([self.baseline] if self.baseline else []) + list(self.models)


def validate(options: EvalOptions) -> Path | None:
    """Check everything that can be checked before loading a model; return the resolved data folder."""
    check_output_dir(options.out, options.overwrite)  # an earlier report is never replaced unasked
    data_dir = resolve_data_dir(options.data_dir)
    if options.lm_eval_tasks:
        try:
            _, registry = plan_tasks(options.lm_eval_tasks, data_dir)
        except LayercutError as err:
            if "unknown task" in str(err):
                raise LayercutError(f"{err}; '{PERPLEXITY_TASK}' is layercut's WikiText-2 perplexity, "
                                    f"'{TEXT_TASK_PREFIX}PATH' the perplexity of a text file") from None
            raise
        check_registry_data(registry)
    for path in options.text_files:
        if not Path(path).expanduser().is_file():
            raise LayercutError(f"task {TEXT_TASK_PREFIX}{path}: no such file; pass a .txt or .jsonl file")
    for name in options.model_names:
        check_tokenizer(name, options.load.tokenizer)
    return data_dir


def perplexity_texts(options: EvalOptions, data_dir: Path | None) -> dict[str, str]:
    """Task label -> text for ``wikitext`` and every ``ppl:PATH`` task (labels ``ppl:<stem>``, unique)."""
    texts = {PERPLEXITY_TASK: load_wikitext2_test(data_dir)} if PERPLEXITY_TASK in options.tasks else {}
    for path in options.text_files:
        label, n = f"{TEXT_TASK_PREFIX}{Path(path).stem}", 1
        while label in texts:
            n += 1
            label = f"{TEXT_TASK_PREFIX}{Path(path).stem}#{n}"
        documents, _ = load_documents(path, flag=f"--tasks {TEXT_TASK_PREFIX}")
        texts[label] = "\n\n".join(documents)
        if not texts[label].strip():
            raise LayercutError(f"task {TEXT_TASK_PREFIX}{path}: the file holds no text")
    return texts


def evaluate_model(name: str, role: str, options: EvalOptions, data_dir: Path | None, texts: dict[str, str]) -> dict:
    """Load one model with its replacement maps, run every task on it, free it; return its results entry."""
    loaded = options.load.load(name)
    model, tokenizer = loaded.model, loaded.tokenizer
    entry = {"name": name, "role": role, "source": loaded.source, "num_blocks": block_count(model),
             "params": parameter_count(model), "metrics": {}, "details": {}}  # fmt: skip
    try:
        for task, text in texts.items():
            logger.info("%s: %s perplexity", name, task)
            result = text_perplexity(
                model, tokenizer, text, seq_len=options.seq_len, stride=options.stride,
                batch_size=options.ppl_batch_size, progress=options.progress, max_tokens=ppl_tokens(options, model),
            )  # fmt: skip
            entry["metrics"][f"{task}/perplexity"] = result.perplexity
            entry["metrics"][f"{task}/tokens_scored"] = result.tokens_scored
            entry["details"][task] = result.to_dict()
        if options.lm_eval_tasks:
            logger.info("%s: lm-eval %s", name, ",".join(options.lm_eval_tasks))
            scores = run_lm_eval(
                model, tokenizer, options.lm_eval_tasks, data_dir=data_dir, limit=options.limit,
                batch_size=options.batch_size, num_fewshot=options.num_fewshot,
            )  # fmt: skip
            for task, metrics in scores.items():
                entry["details"][task] = metrics
                entry["metrics"].update({f"{task}/{metric}": value for metric, value in metrics.items()})
    finally:
        del model, tokenizer, loaded
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return entry


def ppl_tokens(options: EvalOptions, model) -> int | None:
    """Tokens of each perplexity text to score: ``ppl_tokens``, else ``limit`` windows when it is a row count."""
    if options.ppl_tokens is not None:
        return options.ppl_tokens
    if isinstance(options.limit, int):
        return options.limit * (options.seq_len or default_seq_len(model))
    return None


def blocks_removed(entry: dict, baseline_blocks: int | None) -> int | None:
    """Blocks removed: from ``layercut.json`` when the folder has one, else the difference to the baseline."""
    if entry["role"] == "baseline":
        return 0
    info = read_report(entry["name"])
    if "num_blocks_before" in info and "num_blocks_after" in info:
        return int(info["num_blocks_before"]) - int(info["num_blocks_after"])
    return None if baseline_blocks is None else baseline_blocks - entry["num_blocks"]


def primary_keys(entries: list[dict]) -> list[str]:
    """Metric keys to plot: every perplexity, then each lm-eval task's primary metric."""
    keys = list(dict.fromkeys(key for e in entries for key in e["metrics"] if key.endswith("/perplexity")))
    text_tasks = {key.split("/")[0] for key in keys}
    tasks = dict.fromkeys(key.split("/")[0] for e in entries for key in e["metrics"])
    tasks = [task for task in tasks if task not in text_tasks]
    return keys + [f"{task}/{primary_metric(task)}" for task in tasks]


def run(options: EvalOptions) -> dict:
    """Evaluate the baseline (if any) and each model, write the report, and return the results dict."""
    data_dir = validate(options)
    texts = perplexity_texts(options, data_dir)
    entries = [evaluate_model(options.baseline, "baseline", options, data_dir, texts)] if options.baseline else []
    for name in options.models:
        entries.append(evaluate_model(name, "candidate", options, data_dir, texts))
    for entry in entries:
        entry["blocks_removed"] = blocks_removed(entry, entries[0]["num_blocks"] if options.baseline else None)
        info = read_report(entry["name"])
        if "dropped" in info:
            entry["dropped"] = info["dropped"]
    settings = {k: v for k, v in vars(options).items()
                if k not in ("models", "baseline", "progress", "load", "overwrite")}
    settings.update({k: v for k, v in asdict(options.load).items() if k != "model"})
    settings["data_dir"] = str(data_dir) if data_dir else "hub (datasets / lm-eval registry)"
    settings["seq_len"] = options.seq_len or f"min({DEFAULT_MAX_SEQ_LEN}, model maximum)"
    # a generating task's token budget is a setting of its figure, said once rather than as a table row
    budgets = {key.split("/")[0]: value for entry in entries for key, value in entry["metrics"].items()
               if key.endswith("/max_gen_toks")}
    if budgets:
        settings["max_gen_toks"] = budgets
    results = {"baseline": options.baseline, "settings": settings, "primary_metrics": primary_keys(entries),
               "models": entries}  # fmt: skip
    # written beside --out and renamed into place: a crash or kill never leaves half a report
    with atomic_directory(options.out, options.overwrite) as staging:
        write_report(results, staging)
    logger.info("report written to %s", options.out)  # renamed into place: not the staging folder's name
    return results
