"""From a model and a budget to the best checkpoint your engine serves, verified there, in one command.

    python -m prune.ship --model smollm2-135m --drop 8 --engine llamacpp --out slim8/
    python -m prune.ship --model smollm2-135m --target-speedup 1.25 --engine vllm --time-budget 30m --out slim/
    python -m prune.ship --model gemma3-270m --drop 4 --engine transformers --heldout wiki.txt --out gemma-slim/
    python -m prune.ship --model smollm2-135m --drop 8 --device cuda --processes 2 --out slim8/   # heal on 2 GPUs
    python -m prune.ship --model smollm2-135m --drop 4 --engine transformers --tasks ifeval --limit 200 --out slim4/
    python -m prune.ship --model meta-llama/Meta-Llama-3-70B --offload sequential --data builtin --drop 20 \
        --dtype bfloat16 --device cuda --out slim70/   # one block in memory at a time, healed block by block

Plans (refuses what cannot fit, in one line), scores every block once, shortlists block sets x servable repairs,
measures each on calibration rows no fit saw (KL from the original and perplexity), builds the best one as
``prune.run`` would, heals it within the time left (by distillation; block by block under ``--offload sequential``;
kept when it helps on unseen rows), exports it (a GGUF for llama.cpp), checks it in the engine against transformers
and writes ``OUT/README.md``: what was chosen and why, what was lost, the speed, the commands that reproduce it.
Stopped anywhere (Ctrl-C, ``kill -9``), the same command continues from ``OUT.work/`` (:mod:`ship.shipper`).
``python -m ship`` and ``layercut-ship`` are this command too.
"""

from __future__ import annotations

import argparse

from eval.quality.rows import parse_limit
from prune.checkpoint.gguf import OUTTYPES
from prune.errors import CommandParser, cli_entry
from prune.options import (
    add_data_arguments,
    add_load_arguments,
    add_threads_argument,
    apply_threads,
    data_config_from_args,
    load_config_from_args,
)
from prune.pipeline.config import PruneConfig
from prune.selection.strategies import DEFAULT_PROTECT
from ship.config import (
    DEFAULT_HEAL_STEPS,
    HEAL_BATCH,
    HEAL_OPTIONS,
    HEAL_TRAIN_KEYS,
    ShipConfig,
    parse_duration,
    ship_engines,
)
from ship.shipper import Shipper, remove_work


def build_parser() -> argparse.ArgumentParser:
    """The ``prune.ship`` argument parser."""
    parser = CommandParser(prog="python -m prune.ship", description=__doc__.split("\n")[0])
    add_load_arguments(parser, offload=True)
    add_data_arguments(parser, samples=64, seq_len=512, heldout_samples=8)
    group = parser.add_argument_group("budget (one of)")
    group.add_argument("--drop", default=None, help="blocks to remove: a count (4) or a share (25%%)")
    group.add_argument("--target-speedup", type=float, default=None, metavar="X",
                       help="remove the fewest blocks whose ideal decode speed-up L/(L-K) reaches X (1.25)")
    group.add_argument("--target-params", default=None, metavar="N|P%",
                       help="remove the fewest blocks that bring the parameters to N (110M, 1.2B) or P%% of the "
                       "model's")
    group.add_argument("--protect", default=DEFAULT_PROTECT,
                       help="blocks never dropped, negative from the end, or 'none' (default: 0,-1)")
    group.add_argument("--batch-size", type=int, default=4, help="sequences per forward pass (default: 4)")
    group = parser.add_argument_group("shipping")
    group.add_argument("--engine", default="llamacpp", choices=ship_engines(),
                       help="where the checkpoint is served and verified (default: llamacpp)")
    group.add_argument("--time-budget", default=None, metavar="DURATION",
                       help="how long the whole run may take (30m, 1h): refused up front when the plan says even "
                       "removal alone takes more; the shortlist tries the repairs the planner fits in half of it, "
                       "the heal the steps left (default: no limit)")
    group.add_argument("--heldout", action="append", default=[], metavar="TEXT",
                       help="held-out text (.txt/.jsonl/.parquet or datasets spec), one per domain, for the card's "
                       "perplexities in transformers and the engine (repeatable; default: held-out rows of the "
                       "calibration source)")
    group.add_argument("--gguf-type", default="f32", choices=OUTTYPES,
                       help="the GGUF written for llama.cpp (default: f32; the engine check also runs it when "
                       "quantised)")
    group.add_argument("--converter", default=None,
                       help="llama.cpp's convert_hf_to_gguf.py (default: $LLAMA_CPP_CONVERTER)")
    group.add_argument("--no-repack", action="store_true",
                       help="llama.cpp's checks load with its extra buffer types off (its own --no-repack); without "
                       "it they are turned off only after a check crashes in llama.cpp")
    group.add_argument("--repeats", type=int, default=3,
                       help="timed rounds of the speed check (default: 3; 0: none, so llama.cpp's check writes no "
                       "GGUF of the original)")
    group.add_argument("--prompt-len", type=int, default=256, help="prompt tokens of the speed check (default: 256)")
    group.add_argument("--new-tokens", type=int, default=64, help="tokens the speed check generates (default: 64)")
    group.add_argument("--heal-steps", type=int, default=DEFAULT_HEAL_STEPS, metavar="N",
                       help="at most N steps of distillation towards the original after the build (KL, LoRA merged: "
                       "the checkpoint stays plain), as many as --time-budget leaves; kept only when it lowers the "
                       "KL on the calibration rows it does not train on; with --offload sequential, N steps a cut "
                       "of the two blocks beside it towards the original's hidden states "
                       f"(default: {DEFAULT_HEAL_STEPS}; 0: no healing)")
    group.add_argument("--heal-data", default=None, metavar="DATA",
                       help="more text the heal trains on beside the calibration rows, as --data takes it (a file, "
                       "datasets spec, self or a mixture); it is still judged on the calibration rows it never "
                       "trained on (default: none)")
    group.add_argument("--heal-samples", type=int, default=64, metavar="N",
                       help="sequences of --seq-len tokens drawn from --heal-data (default: 64)")
    group.add_argument("--lora-r", type=int, default=None, metavar="R",
                       help=f"LoRA rank of the heal's adapters; their update is scaled by alpha / rank, and alpha "
                       f"stays {HEAL_OPTIONS['lora_alpha']:g} unless --lora-alpha (default: {HEAL_OPTIONS['lora_r']}, "
                       "chosen on the selection split; see the README)")
    group.add_argument("--lora-alpha", type=float, default=None, metavar="A",
                       help=f"LoRA alpha of the heal's adapters (default: {HEAL_OPTIONS['lora_alpha']:g})")
    group.add_argument("--lora-targets", default=None, metavar="NAMES",
                       help="the blocks' Linear layers the heal adapts: a comma list of their names (q_proj,v_proj) "
                       "or all-linear (default: all-linear)")
    group.add_argument("--processes", type=int, default=1, metavar="N",
                       help="heal on N processes launched by accelerate (DDP: one GPU each with --device cuda, gloo "
                       f"on the CPU, where they share the cores), splitting the {HEAL_BATCH} sequences of a step "
                       "between them: the weights of one process within float rounding (a divisor of "
                       f"{HEAL_BATCH}; default: 1)")
    group.add_argument("--no-verify", action="store_true", help="skip the engine checks (the card says so)")
    group = parser.add_argument_group("lm-eval tasks (the verify stage scores them on the original and the "
                                      "checkpoint, on the same rows, in transformers)")
    group.add_argument("--tasks", default=None,
                       help="lm-eval tasks, comma list (ifeval, or arc_easy,piqa; ifeval needs pip install "
                       "\"layercut[ifeval]\"); the card gives each one's score, what is kept and the paired gap "
                       "(default: none)")
    group.add_argument("--limit", type=parse_limit, default=None,
                       help="rows per task, as eval.run takes it: a count (the first N), a fraction, START:END "
                       "(--limit=-500: is the last 500) or N~START:END (N drawn at random) (default: every row; "
                       "IFEval's 541 prompts generate up to 256 tokens each on both models)")
    group.add_argument("--data-dir", default=None,
                       help="local lm-eval data laid out like shared/data (default: $LAYERCUT_DATA, else the hub)")
    group = parser.add_argument_group("output")
    group.add_argument("--out", required=True, help="folder of the shipped checkpoint (OUT.work/ keeps each stage)")
    group.add_argument("--overwrite", action="store_true",
                       help="start again: delete OUT.work/ first (a shipped OUT/ is never replaced: remove it)")
    add_threads_argument(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> ShipConfig:
    """The :class:`ShipConfig` of the parsed flags."""
    prune = PruneConfig(load=load_config_from_args(args), data=data_config_from_args(args), drop=args.drop,
                        target_params=args.target_params, target_speedup=args.target_speedup, protect=args.protect,
                        batch_size=args.batch_size, replace="none", out=args.out)
    return ShipConfig(prune=prune, out=args.out, engine=args.engine,
                      time_budget=None if args.time_budget is None else parse_duration(args.time_budget),
                      heldout=list(args.heldout), gguf_type=args.gguf_type, converter=args.converter,
                      no_repack=args.no_repack,
                      verify=not args.no_verify, speed_repeats=args.repeats, prompt_len=args.prompt_len,
                      new_tokens=args.new_tokens, threads=args.threads, heal_steps=args.heal_steps,
                      heal_data=args.heal_data, heal_samples=args.heal_samples, processes=args.processes,
                      heal_train={key: getattr(args, key) for key in HEAL_TRAIN_KEYS
                                  if getattr(args, key) is not None},
                      tasks=(args.tasks or "").split(","), limit=args.limit, data_dir=args.data_dir)


@cli_entry
def main(argv: list[str] | None = None) -> int:
    """Run the ship CLI; returns the exit code."""
    args = build_parser().parse_args(argv)
    apply_threads(args)
    config = config_from_args(args)
    if args.overwrite:
        remove_work(config)
    Shipper(config).run()
    return 0


def console_main() -> None:
    """Console-script entry point (``layercut-ship``)."""
    raise SystemExit(main())


if __name__ == "__main__":
    console_main()
