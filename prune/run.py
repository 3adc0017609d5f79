"""Score every block of a decoder, drop (or replace) the most linear ones, export a checkpoint.

    python -m prune.run --model smollm2-135m --drop 4 --out slim/
    python -m prune.run --model smollm2-135m --drop 4 --replace linear --out slim-lin/
    python -m prune.run --model smollm2-135m --drop 4 --replace fold --out slim-fold/   # vanilla checkpoint
    python -m prune.run --model opt-1.3b --drop 4 --replace linear --distill-steps 2000 --out opt-slim/
    python -m prune.run --model opt-1.3b --drop 25% --select span --out opt-1.3b-slim/
    python -m prune.run --model gpt2 --score angular            # scores only, nothing written

Prints a table of every block's scores; with ``--out`` writes the checkpoint, its tokenizer,
``layercut.json``, a model card, ``scores.md`` and ``linearity_profile.png``. Checkpoints with
linear / low-rank maps also hold ``replacements.safetensors``: load them with ``prune.load(path)``.
"""

from __future__ import annotations

import argparse

from prune.data import DataConfig
from prune.errors import cli_entry
from prune.pipeline import LoadConfig, PruneConfig, run_prune
from prune.profile import score_table
from prune.recipes import config_from_recipe
from prune.replace import REPLACEMENTS
from prune.scores import SCORES
from prune.select import DEFAULT_PROTECT, SELECTIONS


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """Model-loading flags, shared by every layercut CLI that loads a model."""
    group = parser.add_argument_group("model")
    group.add_argument("--model", default="smollm2-135m",
                       help="alias (smollm2-135m, opt-1.3b, gpt2, ...), hub id, local folder or .gguf file "
                       "(default: smollm2-135m, embedded, works offline)")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="weights dtype (default: auto = float32 on CPU, the checkpoint's dtype on GPU)")
    group.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (accelerate device_map); default cpu")
    group.add_argument("--load-in-4bit", action="store_true", help="bitsandbytes 4-bit weights (CUDA only)")
    group.add_argument("--load-in-8bit", action="store_true", help="bitsandbytes 8-bit weights (CUDA only)")


def add_data_arguments(parser: argparse.ArgumentParser) -> None:
    """Calibration-data flags."""
    group = parser.add_argument_group("calibration data")
    group.add_argument("--data", default=None,
                       help=".txt/.jsonl/.parquet file or datasets spec name[:config[:split]] "
                       "(default: built-in Austen corpus)")
    group.add_argument("--text-field", default="text",
                       help="text column of jsonl/parquet/datasets rows (default: text)")
    group.add_argument("--samples", type=int, default=64, help="packed sequences (default: 64)")
    group.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default: 512; 64 x 512 = 32k)")
    group.add_argument("--seed", type=int, default=0, help="which sequences are drawn (default: 0)")
    group.add_argument("--batch-size", type=int, default=4, help="sequences per forward pass (default: 4)")


def build_parser() -> argparse.ArgumentParser:
    """The ``prune.run`` argument parser."""
    parser = argparse.ArgumentParser(prog="python -m prune.run", description=__doc__.split("\n")[0])
    add_load_arguments(parser)
    add_data_arguments(parser)
    group = parser.add_argument_group("selection")
    group.add_argument("--drop", default=None,
                       help="blocks to remove: a count (4) or a share (25%%); omit to only score")
    group.add_argument("--score", default="linearity", choices=list(SCORES),
                       help="ranking criterion (default: linearity)")
    group.add_argument("--select", default="topk", choices=list(SELECTIONS),
                       help="topk: the K most removable blocks; span: best contiguous K; greedy: drop one, "
                       "re-score, repeat (default: topk)")
    group.add_argument("--protect", default=DEFAULT_PROTECT,
                       help="blocks never dropped, negative from the end, or 'none' (default: 0,-1 = first and last)")
    group = parser.add_argument_group("replacement")
    group.add_argument("--replace", default="none", metavar="KIND",
                       help="what takes the removed blocks' place: " + "; ".join(
                           f"{name}: {spec.description}" for name, spec in REPLACEMENTS.items()) + " (default: none)")
    group.add_argument("--fit", default="independent",
                       help="independent: fit each span on the original model's states; sequential: on the states "
                       "of the model with the earlier spans already replaced (two passes per later span) "
                       "(default: independent)")
    group.add_argument("--rank", type=int, default=None,
                       help="rank of --replace lowrank maps (default: max(1, hidden // 100))")
    group.add_argument("--ridge", type=float, default=0.0,
                       help="ridge of the closed-form fits, relative to the mean input variance (default: 0)")
    group.add_argument("--replace-steps", type=int, default=None,
                       help="Adam steps for lowrank (default 100) and block (default 200) replacements")
    group.add_argument("--distill-steps", type=int, default=0,
                       help="after surgery, distil layerwise against the original model for N steps "
                       "(distill.config.DistillConfig defaults; default: 0 = no distillation)")
    group = parser.add_argument_group("recipe")
    group.add_argument("--recipe", default=None,
                       help="YAML recipe (see recipes/); its values replace the defaults, "
                       "--out/--overwrite still apply")
    group = parser.add_argument_group("output")
    group.add_argument("--out", default=None, help="folder for the checkpoint and reports (default: write nothing)")
    group.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    return parser


def config_from_args(args: argparse.Namespace) -> PruneConfig:
    """Map parsed flags onto the :class:`PruneConfig` dataclasses."""
    return PruneConfig(
        load=LoadConfig(args.model, args.dtype, args.device, args.load_in_4bit, args.load_in_8bit),
        data=DataConfig(args.data, args.samples, args.seq_len, args.seed, args.text_field),
        drop=args.drop,
        score=args.score,
        select=args.select,
        protect=args.protect,
        batch_size=args.batch_size,
        replace=args.replace,
        fit=args.fit,
        rank=args.rank,
        ridge=args.ridge,
        replace_steps=args.replace_steps,
        distill_steps=args.distill_steps,
        out=args.out,
        overwrite=args.overwrite,
    )


@cli_entry
def main(argv: list[str] | None = None) -> int:
    """Run the prune CLI; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.recipe:
        overrides = {k: v for k, v in (("out", args.out), ("overwrite", args.overwrite or None)) if v is not None}
        config = config_from_recipe(args.recipe, overrides)
    else:
        config = config_from_args(args)
    result = run_prune(config)
    report = result.report
    print(score_table(result.scores, result.dropped))
    print(f"\n{report['num_blocks_before']} blocks -> {report['num_blocks_after']}; dropped {result.dropped} "
          f"by {report['select']} on {report['score']} over {report['data']['tokens']} tokens "
          f"in {report['seconds']:.1f}s")
    for record in report["replacements"]:
        added = f"{record['params']} parameters"
        if record["kind"] == "fold":
            added = f"folded into the previous block's {record['rewrites']}"
        elif "linear_params" in record:  # lowrank: say what the full map would have cost
            added += f", {record['params'] / record['linear_params']:.1%} of a linear map's {record['linear_params']}"
        print(f"replaced blocks {record['replaces']} "
              f"by {record['kind']} ({added}, {record['fit']} fit, {record['fit_seconds']:.1f}s)")
    if "distill" in report:
        print(f"distilled {report['distill']['steps']} steps: loss {report['distill']['first_loss']} -> "
              f"{report['distill']['final_loss']}")
    if result.out is not None:
        print(f"wrote {result.out}/")
    return 0


def console_main() -> None:
    """Console-script entry point."""
    raise SystemExit(main())


if __name__ == "__main__":
    console_main()
