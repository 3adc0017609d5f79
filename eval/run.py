"""Evaluate slimmed models against their original, or one model alone: perplexity, lm-eval tasks, a report.

    python -m eval.run --model slim/ --baseline smollm2-135m --tasks wikitext,arc_easy,piqa --out report/
    python -m eval.run --model slim-lin/ --tasks ppl:heldout.txt,wikitext --out report-lin/

All tasks: ``--tasks wikitext,ppl:PATH,arc_easy,hellaswag,piqa,lambada``; local data: ``--data-dir
../shared/data``; rows per lm-eval task: ``--limit 200``; more in ``--help``. Checkpoints with
replacement maps are evaluated with their maps (``prune.load``). Writes ``results.json``,
``README.md`` and PNG plots into ``--out``, which must be empty or new unless ``--overwrite`` is given.
"""

from __future__ import annotations

import argparse

from eval.quality.evaluate import PERPLEXITY_TASK, EvalOptions, parse_limit, run
from eval.quality.report import markdown_table
from prune.errors import CommandParser, cli_entry
from prune.options import (
    add_load_arguments,
    add_output_arguments,
    add_threads_argument,
    apply_threads,
    load_config_from_args,
)


def build_parser() -> argparse.ArgumentParser:
    """Build the ``eval.run`` argument parser."""
    parser = CommandParser(prog="python -m eval.run", description=__doc__.split("\n\n")[0])
    models = parser.add_argument_group("models")
    models.add_argument("--model", action="append", required=True, help="model name or folder (repeatable)")
    models.add_argument("--baseline", default=None,
                        help="original model to compare with (alias, hub id or folder; default: none, the models "
                        "are evaluated alone)")
    add_load_arguments(parser, model_flag=False, title="loading")
    tasks = parser.add_argument_group("tasks")
    tasks.add_argument("--tasks", default=PERPLEXITY_TASK,
                       help="comma-separated: wikitext, ppl:PATH (perplexity of a .txt/.jsonl file), lm-eval "
                       "task names, e.g. wikitext,ppl:heldout.txt,arc_easy,piqa (default: wikitext)")
    tasks.add_argument("--data-dir", help="local data folder laid out like shared/data (default: $LAYERCUT_DATA)")
    tasks.add_argument("--limit", type=parse_limit,
                       help="rows per lm-eval task: a count (the first N), a fraction in (0, 1), a range "
                       "START:END (--limit=-500: is the last 500), or N rows drawn at random from a range, "
                       "N~START:END (1000~1000:); a count also caps each perplexity text at that many "
                       "windows (see --ppl-tokens)")
    tasks.add_argument("--num-fewshot", type=int, help="lm-eval few-shot examples (default: each task's)")
    tasks.add_argument("--batch-size", type=int, default=8, help="lm-eval requests per forward pass (default: 8)")
    ppl = parser.add_argument_group("perplexity")
    ppl.add_argument("--seq-len", type=int, help="window in tokens (default: min(2048, model maximum))")
    ppl.add_argument("--stride", type=int, help="step between windows in tokens (default: seq-len)")
    ppl.add_argument("--ppl-batch-size", type=int, default=1, help="windows per forward pass (default: 1)")
    ppl.add_argument("--ppl-tokens", type=int, default=None,
                     help="score only the first N tokens of each text (default: all, or --limit windows)")
    add_output_arguments(parser, required=True, what="the report (results.json, README.md, PNG plots)")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")
    add_threads_argument(parser)
    return parser


@cli_entry
def main(argv: list[str] | None = None) -> int:
    """Run ``python -m eval.run``."""
    args = build_parser().parse_args(argv)
    apply_threads(args)
    options = EvalOptions(
        models=args.model, baseline=args.baseline, tasks=args.tasks.split(","), out=args.out, overwrite=args.overwrite,
        data_dir=args.data_dir, limit=args.limit, seq_len=args.seq_len, stride=args.stride,
        batch_size=args.batch_size, ppl_batch_size=args.ppl_batch_size, ppl_tokens=args.ppl_tokens,
        num_fewshot=args.num_fewshot, load=load_config_from_args(args, model=args.model[0]),
        progress=not args.no_progress,
    )  # fmt: skip
    results = run(options)
    print(markdown_table(results))
    print(f"wrote {args.out}/")
    return 0


def console_main() -> None:
    """Entry point of the ``layercut-eval`` console script."""
    raise SystemExit(main())


if __name__ == "__main__":
    console_main()
