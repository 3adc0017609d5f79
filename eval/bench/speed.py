"""``eval.bench speed``: prefill and decode speed of slimmed models against their original, and peak memory.

    python -m eval.bench speed --model slim/ --baseline smollm2-135m [--model slim8/] [--out bench/]
    python -m eval.bench speed --engine llamacpp --model slim/ --baseline dense/ --threads 2 [--out bench/]

The engines and their own flags are :mod:`eval.speed.engines`' registry; the measurement is
:mod:`eval.speed.measure`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eval.bench.registry import register_subcommand
from eval.quality.report import speed_markdown, write_speed_report
from eval.speed.engines import ENGINES, REFERENCE, EngineSettings, add_setting_arguments, setting_values
from eval.speed.measure import SpeedOptions, benchmark_engine_speed, benchmark_speed, memory_mode, noise_warnings
from prune.checkpoint.load_config import LoadConfig
from prune.options import add_load_arguments, add_threads_argument, apply_threads, load_config_from_args

SPEED_HELP = (f"prefill/decode speed ({', '.join(engine.display for engine in ENGINES.values())}) and peak memory "
              "against a baseline")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """``--engine`` and every engine's own flags, from the registry, in an ``engine`` group."""
    engine = parser.add_argument_group("engine")
    ways = "; ".join(f"{name} ({entry.summary})" for name, entry in ENGINES.items())
    engine.add_argument("--engine", default=REFERENCE, help=f"what runs the models (default: {REFERENCE}): {ways}")
    add_setting_arguments(engine)


def add_speed_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``eval.bench speed``."""
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
    add_engine_arguments(parser)
    add_threads_argument(parser)
    parser.add_argument("--out", help="folder for speed.json and speed.md (default: print only)")


def run_speed(args: argparse.Namespace) -> int:
    """Time the baseline and the candidates interleaved, measure memory, print and save."""
    apply_threads(args)
    result = measure_speed(args.engine, args.baseline, args.model, load_config_from_args(args, model=args.baseline),
                           prompt_len=args.prompt_len, new_tokens=args.new_tokens, batch_size=args.batch_size,
                           repeats=args.repeats, warmup=args.warmup, memory=args.memory, threads=args.threads,
                           settings=setting_values(args), out=args.out)
    print(f"engine: {result['engine']} {result.get('engine_version') or ''}".rstrip())
    print(speed_markdown(result))
    for ratio in result["ratios"]:
        print(f"{ratio['name']}: prefill x{ratio['prefill']:.3f}, decode x{ratio['decode']:.3f}, ideal L/(L-k) "
              f"x{ratio['ideal']:.3f} (decode at {ratio['decode'] / ratio['ideal']:.1%} of ideal, prefill at "
              f"{ratio['prefill'] / ratio['ideal']:.1%})")
    for line in result["warnings"]:
        print(f"warning: {line}")
    if args.out:
        print(f"wrote {Path(args.out) / 'speed.json'} and {Path(args.out) / 'speed.md'}")
    return 0


def engine_settings(load: LoadConfig, options: SpeedOptions, models: int, threads: int | None = None,
                    settings: dict | None = None) -> EngineSettings:
    """The engine settings of a comparison: a context holding the workload, the baseline and ``models`` together.

    ``settings``: each engine's own settings, by name.
    """
    return EngineSettings.build(load=load, threads=threads, context=options.prompt_len + options.new_tokens + 1,
                                sharing=1 + models, **(settings or {}))


def measure_speed(engine_name: str, baseline: str, models: list[str], load: LoadConfig, *, prompt_len: int = 256,
                  new_tokens: int = 64, batch_size: int = 1, repeats: int = 5, warmup: int = 1,
                  memory: str | None = None, threads: int | None = None, settings: dict | None = None,
                  out: str | Path | None = None) -> dict:
    """The speed comparison of ``models`` against ``baseline`` in one engine (``speed.json``'s fields).

    ``settings``: the engine's own settings by name (``{"converter": ...}``); ``out``: a folder for
    ``speed.json`` and ``speed.md``.
    """
    options = SpeedOptions(prompt_len=prompt_len, new_tokens=new_tokens, batch_size=batch_size, repeats=repeats,
                           warmup=warmup)
    engine = ENGINES.get(engine_name)
    engine.check()
    memory = memory_mode(engine.name, memory)
    if engine.name == REFERENCE:
        comparison = benchmark_speed(baseline, models, load, options, memory=memory)
    else:
        comparison = benchmark_engine_speed(engine, baseline, models,
                                            engine_settings(load, options, len(models), threads, settings), options)
    result = comparison.to_dict()
    result["warnings"] = noise_warnings(comparison)
    if out:
        write_speed_report(result, out)
    return result


register_subcommand("speed", SPEED_HELP, add_speed_arguments, run_speed)
