"""Evaluate slimmed models against their original: perplexity, lm-eval tasks, a report with plots.

    python -m eval.run --model slim/ --baseline smollm2-135m --tasks wikitext,arc_easy,piqa --out report/

All tasks: ``--tasks wikitext,arc_easy,hellaswag,piqa,lambada``; local data: ``--data-dir ../shared/data``;
rows per lm-eval task: ``--limit 200``; more in ``--help``.

``wikitext`` is layercut's perplexity protocol on the WikiText-2 raw test split (see
``eval.perplexity``); every other task name goes to lm-eval (``eval.lmeval``). Models are loaded one
at a time, baseline first, so memory holds one model. Writes ``results.json``, ``README.md`` and PNG
plots into ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eval.lmeval import plan_tasks, primary_metric, resolve_data_dir, run_lm_eval
from eval.perplexity import DEFAULT_MAX_SEQ_LEN, load_wikitext2_test, text_perplexity
from eval.report import PERPLEXITY_KEY, markdown_table, write_report
from eval.speed import block_count, check_tokenizer, count_parameters, load_for_eval
from prune.errors import LayercutError, cli_entry

logger = logging.getLogger(__name__)

PERPLEXITY_TASK = "wikitext"
LAYERCUT_REPORT = "layercut.json"


@dataclass
class EvalOptions:
    """What ``eval.run`` evaluates and how.

    Attributes:
        models: Candidate names or folders.
        baseline: The original model.
        tasks: ``wikitext`` and/or lm-eval task names.
        out: Report folder.
        data_dir: Local data folder (``$LAYERCUT_DATA`` when None); None for both means the hub.
        limit: Rows per lm-eval task (None: all).
        seq_len: Perplexity window (None: min(2048, model maximum)).
        stride: Perplexity stride (None: seq_len, non-overlapping windows).
        batch_size: lm-eval requests per forward pass.
        ppl_batch_size: Perplexity windows per forward pass.
        num_fewshot: lm-eval few-shot examples (None: task default).
        device: cpu, cuda, cuda:N or auto.
        dtype: auto, float32, bfloat16 or float16.
        tokenizer: Tokenizer for model folders saved without one.
        progress: Show progress bars.
    """

    models: list[str]
    baseline: str
    tasks: list[str] = field(default_factory=lambda: [PERPLEXITY_TASK])
    out: str = "report"
    data_dir: str | None = None
    limit: int | float | None = None
    seq_len: int | None = None
    stride: int | None = None
    batch_size: int = 8
    ppl_batch_size: int = 1
    num_fewshot: int | None = None
    device: str = "cpu"
    dtype: str = "auto"
    tokenizer: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.models:
            raise LayercutError("no --model given; name at least one model to compare with the baseline")
        self.tasks = list(dict.fromkeys(t.strip() for t in self.tasks if t.strip()))
        if not self.tasks:
            raise LayercutError("no tasks given; e.g. --tasks wikitext,arc_easy")
        for name in ("seq_len", "stride"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise LayercutError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.seq_len and self.stride and self.stride > self.seq_len:
            raise LayercutError(f"--stride {self.stride} exceeds --seq-len {self.seq_len}; use a stride <= seq-len")
        if self.ppl_batch_size < 1:
            raise LayercutError(f"--ppl-batch-size must be at least 1, got {self.ppl_batch_size}")

    @property
    def lm_eval_tasks(self) -> list[str]:
        """Task names handed to lm-eval (all but ``wikitext``)."""
        return [t for t in self.tasks if t != PERPLEXITY_TASK]


def validate(options: EvalOptions) -> Path | None:
    """Check everything that can be checked before loading a model; return the resolved data folder."""
    data_dir = resolve_data_dir(options.data_dir)
    if options.lm_eval_tasks:
        try:
            plan_tasks(options.lm_eval_tasks, data_dir)
        except LayercutError as err:
            if "unknown task" in str(err):
                raise LayercutError(f"{err}; '{PERPLEXITY_TASK}' is layercut's WikiText-2 perplexity") from None
            raise
    for name in [options.baseline, *options.models]:
        check_tokenizer(name, options.tokenizer)
    return data_dir


def layercut_info(name: str) -> dict:
    """Return ``layercut.json`` of an exported folder, or an empty dict."""
    path = Path(name).expanduser() / LAYERCUT_REPORT
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        logger.warning("%s is not valid JSON; ignoring it", path)
        return {}


def evaluate_model(name: str, role: str, options: EvalOptions, data_dir: Path | None, text: str | None) -> dict:
    """Load one model, run every task on it, free it; return its entry of the results."""
    loaded = load_for_eval(name, tokenizer=options.tokenizer, dtype=options.dtype, device=options.device)
    model, tokenizer = loaded.model, loaded.tokenizer
    entry = {"name": name, "role": role, "source": loaded.source, "num_blocks": block_count(model),
             "params": count_parameters(model), "metrics": {}, "details": {}}  # fmt: skip
    try:
        if text is not None:
            logger.info("%s: WikiText-2 perplexity", name)
            result = text_perplexity(
                model, tokenizer, text, seq_len=options.seq_len, stride=options.stride,
                batch_size=options.ppl_batch_size, progress=options.progress,
            )  # fmt: skip
            entry["metrics"][PERPLEXITY_KEY] = result.perplexity
            entry["details"][PERPLEXITY_TASK] = result.to_dict()
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


def blocks_removed(entry: dict, baseline_blocks: int) -> int:
    """Blocks removed: from ``layercut.json`` when the folder has one, else the block-count difference."""
    info = layercut_info(entry["name"])
    if "num_blocks_before" in info and "num_blocks_after" in info:
        return int(info["num_blocks_before"]) - int(info["num_blocks_after"])
    return baseline_blocks - entry["num_blocks"]


def primary_keys(options: EvalOptions, entries: list[dict]) -> list[str]:
    """Metric keys to plot: WikiText-2 perplexity, then each lm-eval task's primary metric."""
    keys = [PERPLEXITY_KEY] if PERPLEXITY_TASK in options.tasks else []
    tasks = dict.fromkeys(key.split("/")[0] for e in entries for key in e["metrics"] if key != PERPLEXITY_KEY)
    return keys + [f"{task}/{primary_metric(task)}" for task in tasks]


def run(options: EvalOptions) -> dict:
    """Evaluate the baseline and each model, write the report, and return the results dict."""
    data_dir = validate(options)
    text = load_wikitext2_test(data_dir) if PERPLEXITY_TASK in options.tasks else None
    entries = [evaluate_model(options.baseline, "baseline", options, data_dir, text)]
    for name in options.models:
        entries.append(evaluate_model(name, "candidate", options, data_dir, text))
    for entry in entries:
        entry["blocks_removed"] = 0 if entry["role"] == "baseline" else blocks_removed(entry, entries[0]["num_blocks"])
        info = layercut_info(entry["name"])
        if "dropped" in info:
            entry["dropped"] = info["dropped"]
    settings = {k: v for k, v in vars(options).items() if k not in ("models", "baseline", "progress")}
    settings["data_dir"] = str(data_dir) if data_dir else "hub (datasets / lm-eval registry)"
    settings["seq_len"] = options.seq_len or f"min({DEFAULT_MAX_SEQ_LEN}, model maximum)"
    results = {"baseline": options.baseline, "settings": settings, "primary_metrics": primary_keys(options, entries),
               "models": entries}  # fmt: skip
    paths = write_report(results, options.out)
    print(markdown_table(results))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return results


def build_parser() -> argparse.ArgumentParser:
    """Build the ``eval.run`` argument parser."""
    parser = argparse.ArgumentParser(prog="python -m eval.run", description=__doc__.split("\n\n")[0])
    models = parser.add_argument_group("models")
    models.add_argument("--model", action="append", required=True, help="candidate name or folder (repeatable)")
    models.add_argument("--baseline", required=True, help="original model: alias, hub id or folder")
    models.add_argument("--tokenizer", help="tokenizer name for model folders saved without one")
    models.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default: cpu)")
    models.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (default: auto)")
    tasks = parser.add_argument_group("tasks")
    tasks.add_argument("--tasks", default=PERPLEXITY_TASK, help="comma-separated, e.g. wikitext,arc_easy,piqa")
    tasks.add_argument("--data-dir", help="local data folder laid out like shared/data (default: $LAYERCUT_DATA)")
    tasks.add_argument("--limit", type=_limit, help="rows per lm-eval task: a count, or a fraction in (0, 1]")
    tasks.add_argument("--num-fewshot", type=int, help="lm-eval few-shot examples (default: each task's)")
    tasks.add_argument("--batch-size", type=int, default=8, help="lm-eval requests per forward pass (default: 8)")
    ppl = parser.add_argument_group("perplexity")
    ppl.add_argument("--seq-len", type=int, help="window in tokens (default: min(2048, model maximum))")
    ppl.add_argument("--stride", type=int, help="step between windows in tokens (default: seq-len)")
    ppl.add_argument("--ppl-batch-size", type=int, default=1, help="windows per forward pass (default: 1)")
    parser.add_argument("--out", required=True, help="report folder (results.json, README.md, PNG plots)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    return parser


def _limit(text: str) -> int | float:
    """Parse ``--limit`` as lm-eval does: below 1 a fraction of each task, else a row count."""
    value = float(text)
    if value < 1:
        return value
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"a row count must be a whole number, got {text}")
    return int(value)


@cli_entry
def main(argv: list[str] | None = None) -> int:
    """Run ``python -m eval.run``."""
    args = build_parser().parse_args(argv)
    options = EvalOptions(
        models=args.model, baseline=args.baseline, tasks=args.tasks.split(","), out=args.out,
        data_dir=args.data_dir, limit=args.limit, seq_len=args.seq_len, stride=args.stride,
        batch_size=args.batch_size, ppl_batch_size=args.ppl_batch_size, num_fewshot=args.num_fewshot,
        device=args.device, dtype=args.dtype, tokenizer=args.tokenizer, progress=not args.no_progress,
    )  # fmt: skip
    run(options)
    return 0


def console_main() -> None:
    """Entry point of the ``layercut-eval`` console script."""
    raise SystemExit(main())


if __name__ == "__main__":
    console_main()
