"""The comparison's command line: parse, build a :class:`~eval.compare.CompareConfig`, run, print.

    python -m eval.compare --model smollm2-135m --drop 2,4,6,8 --methods all --out cmp/
    python -m eval.compare --methods list
    python -m eval.compare --model smollm2-135m --drop 2,4,6,8 --methods all --out cmp/ --plan   # the largest cell

What it measures and writes: ``eval.compare``'s docstring, and the README's "Compare methods".
"""

from __future__ import annotations

import argparse

from eval.compare.config import CompareConfig, cell_config, method_list, parse_drops, parse_methods
from eval.compare.grid import run_comparison, summary_lines
from eval.compare.metrics import METRICS
from eval.compare.plots import README
from eval.quality.evaluate import parse_limit
from eval.speed.engines import ENGINES, REFERENCE
from prune.errors import CommandParser, LayercutError, cli_entry
from prune.options import (
    add_data_arguments,
    add_load_arguments,
    add_threads_argument,
    apply_threads,
    data_config_from_args,
    load_config_from_args,
)
from prune.planner.estimate import (
    RunPlan,
    add_plan_arguments,
    format_plan,
    hardware_from_args,
    plan_config,
    refuse_if_too_big,
    write_plan_json,
)
from prune.planner.shape import shape_of_name


def build_parser() -> argparse.ArgumentParser:
    """The ``eval.compare`` argument parser."""
    parser = CommandParser(prog="python -m eval.compare", description="The field in one command: every "
                                     "method recipe x every drop on one model, one calibration set, one table.")
    add_load_arguments(parser)
    add_data_arguments(parser, samples=64, seq_len=512, heldout_samples=8)  # prune.run's: a cell is its checkpoint
    group = parser.add_argument_group("comparison")
    group.add_argument("--drop", default=None, help="block counts to remove, comma list (2,4,6,8)")
    group.add_argument("--methods", default="all",
                       help="all (every method recipe layercut ships), a comma list of method names and/or recipe "
                       "files, or list (print the known methods and exit) (default: all)")
    group.add_argument("--heldout", default=None,
                       help="texts the calibration never saw, one perplexity domain each: comma list of "
                       ".txt/.jsonl/.parquet files or datasets specs, named by file stem or name=FILE "
                       "(novel=emma.txt,news=ptb.txt); default: the calibration's --heldout-samples sequences, "
                       "one domain per --data source, disjoint from the calibration ones")
    group.add_argument("--heldout-tokens", type=int, default=None,
                       help="score only the first this many tokens of each --heldout text (default: all)")
    group.add_argument("--tasks", default=None, help="lm-eval tasks, comma list (arc_easy,piqa; default: none)")
    group.add_argument("--limit", type=parse_limit, default=None,
                       help="rows per lm-eval task: a count (the first N), a fraction, START:END (--limit=-500: is "
                       "the last 500), or N rows drawn at random from a range, N~START:END (1000~1000: draws 1,000 "
                       "from the rows a report on --limit 1000 never reads: choose defaults there) (default: all)")
    group.add_argument("--data-dir", default=None,
                       help="local lm-eval data laid out like shared/data (default: $LAYERCUT_DATA, else the hub)")
    group.add_argument("--batch-size", type=int, default=4,
                       help="sequences per forward pass while scoring, fitting and measuring (default: 4)")
    group.add_argument("--speed-tokens", type=int, default=32,
                       help="decode steps timed per model for the speed-up (0: skip; default: 32)")
    group.add_argument("--engine", default=REFERENCE, choices=ENGINES.names(),
                       help="the engine timing the decode speed-up: "
                       + "; ".join(f"{name} ({engine.summary})" for name, engine in ENGINES.items())
                       + f"; a checkpoint it does not run is marked 'not servable' (default: {REFERENCE})")
    group.add_argument("--oracle", action="store_true",
                       help="also measure calibration perplexity with each block alone removed, and each score's "
                       "Spearman correlation with it")
    group.add_argument("--metrics", default=None,
                       help="extra measurements of every model, comma list of registered metrics "
                       f"({', '.join(METRICS.names())}; fidelity: the original's NLL of each model's greedy text and "
                       "the share of its own greedy tokens kept) (default: none)")
    group.add_argument("--keep-checkpoints", action="store_true",
                       help="keep every cell's weights under cells/ (default: reports only; a cell's weights are "
                       "the size of the model)")
    parser.add_argument("--out", default=None, help="folder for results.json, README.md and the plots (required)")
    parser.add_argument("--overwrite", action="store_true", help="start afresh in a --out that holds another run")
    add_threads_argument(parser)
    add_plan_arguments(parser)
    return parser


def largest_cell_plan(args: argparse.Namespace, config: CompareConfig) -> tuple[str, RunPlan]:
    """The cell (method at drop) whose plan fills a device the most, and that plan (the original model kept)."""
    hardware = hardware_from_args(args, config.load.device)
    shape = shape_of_name(config.load.model)
    plans = {f"{name} at drop {drop}": plan_config(cell_config(config, path, drop, None), hardware, shape,
                                                  keeps_original=True)
             for name, path in config.methods.items() for drop in config.drops}
    return max(plans.items(), key=lambda item: item[1].worst()[2] / item[1].limits[item[1].worst()[1]])


def config_from_args(args: argparse.Namespace) -> CompareConfig:
    """The :class:`CompareConfig` the parsed flags describe."""
    if args.out is None:
        raise LayercutError("--out is required: the folder for results.json, README.md and the plots")
    tasks = [task.strip() for task in (args.tasks or "").split(",") if task.strip()]
    return CompareConfig(load=load_config_from_args(args), data=data_config_from_args(args),
                         drops=parse_drops(args.drop, args.model), methods=parse_methods(args.methods), out=args.out,
                         heldout=args.heldout, heldout_tokens=args.heldout_tokens, tasks=tasks, limit=args.limit,
                         data_dir=args.data_dir, batch_size=args.batch_size, speed_tokens=args.speed_tokens,
                         engine=args.engine, oracle=args.oracle, keep_checkpoints=args.keep_checkpoints,
                         overwrite=args.overwrite,
                         metrics=[name.strip() for name in (args.metrics or "").split(",") if name.strip()])


@cli_entry
def main(argv: list[str] | None = None) -> int:
    """Run the comparison CLI; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.methods.strip() == "list":
        print(method_list())
        return 0
    config = config_from_args(args)
    if args.plan:
        cell, plan = largest_cell_plan(args, config)
        print(f"largest of {len(config.methods) * len(config.drops)} cells: {cell}\n{format_plan(plan)}")
        write_plan_json(plan, args.plan_json)
        return 0
    if not args.no_plan_check:
        refuse_if_too_big(config, lambda: largest_cell_plan(args, config)[1])
    apply_threads(args)
    results = run_comparison(config)
    print("\n".join(summary_lines(results)))
    print(f"wrote {args.out}/{README}")
    return 0


def console_main() -> None:
    """Console-script entry point (``layercut-compare``)."""
    raise SystemExit(main())
