"""Benchmarks of slimmed models against their original.

    python -m eval.bench speed --model slim/ --baseline smollm2-135m [--model slim8/] [--out bench/]
    python -m eval.bench speed --engine llamacpp --model slim/ --baseline dense/ --threads 2 [--out bench/]
    python -m eval.bench scoring --model smollm2-135m [--tokens 8192,32768] [--out bench-scoring/]
    python -m eval.bench serving --model dense=smollm2-135m --model slim=slim/ --heldout ptb.txt [--out serving/]
    python -m eval.bench replace --model smollm2-135m --drop 4,8 --heldout emma.txt [--out bench-replace/]
    python -m eval.bench teacher-cache --model smollm2-135m --drop 4 --steps 100 [--out bench-teacher-cache/]

Subcommands live in ``SUBCOMMANDS`` (name -> how to add its arguments, how to run it); a new one is
one :func:`register_subcommand` call.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass

from eval.bench.serving import SERVING_HELP, add_serving_arguments, run_serving
from eval.bench.teacher_cache import TEACHER_CACHE_HELP, add_teacher_cache_arguments, run_teacher_cache
from eval.quality.report import speed_markdown, write_speed_report
from eval.speed.engines import ENGINES, EngineSettings
from eval.speed.measure import SpeedOptions, benchmark_engine_speed, benchmark_speed, memory_mode, noise_warnings
from prune.data.calibration import BUILTIN
from prune.errors import LayercutError, cli_entry
from prune.options import (
    add_data_arguments,
    add_load_arguments,
    add_threads_argument,
    apply_threads,
    data_config_from_args,
    load_config_from_args,
)
from prune.registry import Registry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Subcommand:
    """One ``eval.bench`` subcommand: its help line, its arguments and what it runs."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMANDS: Registry[Subcommand] = Registry("eval.bench subcommand")


def register_subcommand(name: str, help: str, add_arguments, run) -> None:
    """Add a subcommand to ``python -m eval.bench``."""
    SUBCOMMANDS.register(name, Subcommand(help, add_arguments, run))


# ---- speed ----


def _add_speed_arguments(parser: argparse.ArgumentParser) -> None:
    models = parser.add_argument_group("models")
    models.add_argument("--model", action="append", required=True, help="candidate name or folder (repeatable)")
    models.add_argument("--baseline", required=True, help="original model name or folder")
    add_load_arguments(parser, model_flag=False, title="loading")
    sizes = parser.add_argument_group("workload")
    defaults = SpeedOptions()
    sizes.add_argument("--prompt-len", type=int, default=defaults.prompt_len, help="prefill tokens (default: 256)")
    sizes.add_argument("--new-tokens", type=int, default=defaults.new_tokens, help="decode steps (default: 64)")
    sizes.add_argument("--batch-size", type=int, default=defaults.batch_size, help="sequences (default: 1)")
    sizes.add_argument("--repeats", type=int, default=defaults.repeats, help="timed rounds (default: 5)")
    sizes.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed rounds first (default: 1)")
    sizes.add_argument(
        "--memory",
        choices=("subprocess", "inprocess", "off"),
        default=None,
        help="peak memory (--engine transformers only): each model in a fresh process (the default), in this "
             "process (approximate), or not at all; other engines: off",
    )
    _add_engine_arguments(parser)
    add_threads_argument(parser)
    parser.add_argument("--out", help="folder for speed.json and speed.md (default: print only)")


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group("engine")
    defaults = EngineSettings()
    engine.add_argument("--engine", default="transformers",
                        help=f"what runs the models, one of {', '.join(ENGINES.names())}: transformers in this "
                             "process (default), llama.cpp (llama-cpp-python; a folder is exported to float32 GGUF "
                             "once) or vLLM; --threads also sets llama.cpp's threads")
    engine.add_argument("--gpu-layers", type=int, default=defaults.gpu_layers,
                        help="llamacpp: layers offloaded to the GPU (default: 0, CPU only; -1: all)")
    engine.add_argument("--converter", default=None,
                        help="llamacpp: llama.cpp's convert_hf_to_gguf.py, for folders (default: $LLAMA_CPP_CONVERTER)")
    engine.add_argument("--gpu-memory", type=float, default=defaults.gpu_memory,
                        help="vllm: share of the GPU's memory all the models together may take (default: 0.85)")
    engine.add_argument("--eager", action="store_true",
                        help="vllm: no CUDA graphs (enforce_eager; faster start, slower decode)")


def _engine_settings(args: argparse.Namespace, load, options: SpeedOptions) -> EngineSettings:
    return EngineSettings(load=load, threads=args.threads, context=options.prompt_len + options.new_tokens + 1,
                          gpu_layers=args.gpu_layers, converter=args.converter, gpu_memory=args.gpu_memory,
                          sharing=1 + len(args.model), eager=args.eager)  # fmt: skip


def run_speed(args: argparse.Namespace) -> int:
    """Time the baseline and the candidates interleaved, measure memory, print and save."""
    apply_threads(args)
    options = SpeedOptions(prompt_len=args.prompt_len, new_tokens=args.new_tokens, batch_size=args.batch_size,
                           repeats=args.repeats, warmup=args.warmup)  # fmt: skip
    load = load_config_from_args(args, model=args.baseline)
    engine = ENGINES.get(args.engine)
    engine.check()
    memory = memory_mode(engine.name, args.memory)
    if engine.name == "transformers":
        comparison = benchmark_speed(args.baseline, args.model, load, options, memory=memory)
    else:
        settings = _engine_settings(args, load, options)
        comparison = benchmark_engine_speed(engine, args.baseline, args.model, settings, options)
    result = comparison.to_dict()
    print(f"engine: {comparison.engine} {comparison.engine_version or ''}".rstrip())
    print(speed_markdown(result))
    for ratio in comparison.ratios:
        print(
            f"{ratio.name}: prefill x{ratio.prefill:.3f}, decode x{ratio.decode:.3f}, ideal L/(L-k) x{ratio.ideal:.3f} "
            f"(decode at {ratio.decode / ratio.ideal:.1%} of ideal, prefill at {ratio.prefill / ratio.ideal:.1%})"
        )
    result["warnings"] = noise_warnings(comparison)
    for line in result["warnings"]:
        print(f"warning: {line}")
    if args.out:
        paths = write_speed_report(result, args.out)
        print(f"wrote {paths['json']} and {paths['markdown']}")
    return 0


register_subcommand("speed", "prefill/decode speed (transformers, llama.cpp, vLLM) and peak memory against a baseline",
                    _add_speed_arguments, run_speed)


# ---- scoring ----


def _add_scoring_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model name or folder (default: smollm2-135m)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    add_data_arguments(parser, samples=None, seq_len=512, data=BUILTIN,
                       data_help="builtin, the novel alone: the text does not change what scoring it costs")
    add_threads_argument(parser)
    parser.add_argument("--tokens", default="8192,32768", help="token counts for the memory rows (default: 8192,32768)")
    parser.add_argument("--time-tokens", type=int, default=8192, help="tokens per timed pass (default: 8192)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per forward pass (default: 4)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed rounds (default: 3)")
    parser.add_argument("--methods", default="streamed,stored", help="memory rows (default: streamed,stored)")
    parser.add_argument("--end-to-end", type=int, default=4, metavar="DROP",
                        help="time whole prune runs removing DROP blocks against replacing them by linear maps "
                             "(default calibration: 64 sequences of --seq-len; default: 4; 0 skips)")
    parser.add_argument("--out", help="folder for scoring.json and scoring.md (default: print only)")


def _run_scoring(args: argparse.Namespace) -> int:
    from eval.bench.scoring import benchmark_scoring, scoring_markdown

    apply_threads(args)
    token_counts = [int(t) for t in str(args.tokens).split(",")]
    if args.end_to_end < 0:
        raise LayercutError(f"--end-to-end must be a block count >= 0, got {args.end_to_end}")
    result = benchmark_scoring(args.model, args.device, data_config_from_args(args), args.batch_size,
                               args.time_tokens, args.repeats, token_counts, args.methods.split(","),
                               args.end_to_end)
    table = scoring_markdown(args.model, result["timing"], result["rows"], result["end_to_end"])
    print(table)
    if args.out:
        from prune.atomic import atomic_directory, write_json

        with atomic_directory(args.out, overwrite=True) as staging:
            write_json(staging / "scoring.json", {k: v for k, v in result.items() if k != "rows"})
            (staging / "scoring.md").write_text(table + "\n", encoding="utf-8")
    return 0


register_subcommand(
    "scoring",
    "streamed scoring time vs a plain forward pass; peak memory vs storing every hidden state",
    _add_scoring_arguments,
    _run_scoring,
)


# ---- replace ----


def _add_replace_arguments(parser: argparse.ArgumentParser) -> None:
    from eval.bench.replace import VARIANTS

    parser.add_argument("--model", default="smollm2-135m", help="model name or folder (default: smollm2-135m)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default: cpu)")
    parser.add_argument("--drop", default="4,8", help="comma-separated block counts to remove (default: 4,8)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, from {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--heldout", required=True,
                        help="text the calibration never saw: .txt/.jsonl/.parquet file or datasets spec")
    parser.add_argument("--heldout-chars", type=int, default=None,
                        help="score only the first N characters of it (default: all)")
    parser.add_argument("--score", default="linearity", help="ranking criterion, as prune.run (default: linearity)")
    parser.add_argument("--select", default="topk", help="topk, span or greedy, as prune.run (default: topk)")
    add_data_arguments(parser, samples=64, seq_len=512, what="sequence and perplexity window")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per forward pass (default: 4)")
    parser.add_argument("--distill-steps", type=int, default=100,
                        help="steps of the +distill variants, other DistillConfig defaults (default: 100)")
    parser.add_argument("--out", help="folder for replace.json, replace.md and replace.png (default: print only)")
    add_threads_argument(parser)


def _run_replace(args: argparse.Namespace) -> int:
    from eval.bench.replace import benchmark_replacements, compare_markdown, plot_compare
    from prune.pipeline.config import PruneConfig

    apply_threads(args)
    prune = PruneConfig(load={"model": args.model, "device": args.device}, data=data_config_from_args(args),
                        batch_size=args.batch_size, score=args.score, select=args.select)
    results = benchmark_replacements(prune, [int(d) for d in str(args.drop).split(",")], args.variants,
                                     args.heldout, args.heldout_chars, args.distill_steps)
    table = compare_markdown(results)
    print(table)
    if args.out:
        from prune.atomic import atomic_directory, write_json

        with atomic_directory(args.out, overwrite=True) as staging:
            write_json(staging / "replace.json", results)
            (staging / "replace.md").write_text(table + "\n", encoding="utf-8")
            plot_compare(results, staging / "replace.png")
    return 0


register_subcommand(
    "replace",
    "held-out perplexity of remove / linear / sequential / fold / lowrank / distilled replacements",
    _add_replace_arguments,
    _run_replace,
)


# ---- serving ----


register_subcommand("serving", SERVING_HELP, add_serving_arguments, run_serving)


# ---- teacher-cache ----


register_subcommand("teacher-cache", TEACHER_CACHE_HELP, add_teacher_cache_arguments, run_teacher_cache)


def build_parser() -> argparse.ArgumentParser:
    """Build the ``eval.bench`` parser with one sub-parser per registered subcommand."""
    parser = argparse.ArgumentParser(prog="python -m eval.bench", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, command in SUBCOMMANDS.items():
        command.add_arguments(sub.add_parser(name, help=command.help, description=command.help))
    return parser


@cli_entry
def main(argv: list[str] | None = None) -> int:
    """Run one ``eval.bench`` subcommand."""
    args = build_parser().parse_args(argv)
    return SUBCOMMANDS[args.command].run(args)


def console_main() -> None:
    """Entry point of the ``layercut-bench`` console script."""
    raise SystemExit(main())


if __name__ == "__main__":
    console_main()
