"""The diagnostics ``reports/`` quotes, one subcommand each.

    python -m eval.lab paired BASELINE.json::remove@4 OTHER.json::linear-long@4
    python -m eval.lab paired-fidelity A.json::layercut-local-heal@8 B.json::llm-streamline@8
    python -m eval.lab hellaswag-by-source reports/smollm2-135m-tasks-draw/results.json HELLASWAG_VAL.txt
    python -m eval.lab share-optimum reports/smollm2-135m-mapfit/selection-scale-12-15
    python -m eval.lab selection-split ../shared/data /tmp/layercut-selection
    python -m eval.lab task-prompts ../shared/data /tmp/layercut-prompts
    python -m eval.lab share-tasks 12-15 removal,ls,0.7 OUT.json

Each prints its table or the files it wrote; ``eval.lab``'s modules hold the functions.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from prune.errors import CommandParser, LayercutError, cli_entry


def build_parser() -> argparse.ArgumentParser:
    """The ``eval.lab`` parser, one subparser per diagnostic."""
    parser = CommandParser(prog="python -m eval.lab", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    paired = sub.add_parser("paired", help="paired retention gaps of rows of eval.compare results to the first")
    paired.add_argument("rows", nargs="+", help="FILE::CELL, the first the baseline")
    fidelity = sub.add_parser("paired-fidelity", help="paired generation fidelity gaps of rows of eval.compare "
                                                      "results (--metrics fidelity) to the first")
    fidelity.add_argument("rows", nargs="+", help="FILE::CELL (dense: the original), the first the baseline")
    source = sub.add_parser("hellaswag-by-source", help="HellaSwag accuracy by source (ActivityNet, WikiHow)")
    source.add_argument("results", help="an eval.compare results.json")
    source.add_argument("hellaswag", help="the HellaSwag validation text the local task reads")
    optimum = sub.add_parser("share-optimum", help="the best share of the fitted update, text by text")
    optimum.add_argument("folders", nargs="+", help="eval.mapfit --update-scale output folders")
    for name, what in (("selection-split", "texts and task prompts no reported figure reads"),
                       ("task-prompts", "the first 1,000 task prompts with their answers, for eval.mapfit")):
        command = sub.add_parser(name, help=what)
        command.add_argument("data_dir", help="local data laid out like shared/data")
        command.add_argument("out", help="folder to write")
    tasks = sub.add_parser("share-tasks", help="task accuracy on the selection split with a share of a span's map")
    tasks.add_argument("span", help="first-last block of the span, e.g. 12-15")
    tasks.add_argument("variants", help="comma list: removal, ls (the whole update) or a share")
    tasks.add_argument("out", help="JSON file of the rows, appended to")
    tasks.add_argument("--model", default="smollm2-135m", help="the model (default: smollm2-135m)")
    tasks.add_argument("--data-dir", default="../shared/data", help="local lm-eval data (default: ../shared/data)")
    return parser


@cli_entry
def main(argv: list[str] | None = None) -> int:
    """Run one diagnostic and print its rows; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.command in ("selection-split", "task-prompts"):
        from eval.lab.splits import write_selection_split, write_task_prompts

        write = write_selection_split if args.command == "selection-split" else write_task_prompts
        if Path(args.out).exists() and not Path(args.out).is_dir():
            raise LayercutError(f"{args.out} is a file: pass a folder to write the {args.command} into")
        for path in write(args.data_dir, args.out):
            print(f"wrote {path}")
        return 0
    if args.command == "share-tasks":
        from eval.lab.share_tasks import share_tasks

        share_tasks(args.model, args.span, args.variants.split(","), args.out, data_dir=args.data_dir)
        return 0
    from eval.lab.tables import hellaswag_by_source, paired_fidelity, paired_gaps, share_optimum

    lines = {"paired": lambda: paired_gaps(args.rows),
             "paired-fidelity": lambda: paired_fidelity(args.rows),
             "hellaswag-by-source": lambda: hellaswag_by_source(args.results, args.hellaswag),
             "share-optimum": lambda: share_optimum(args.folders)}[args.command]()
    print("\n".join(lines))
    return 0


def console_main() -> None:
    """Console-script entry point."""
    raise SystemExit(main())
