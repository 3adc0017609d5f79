"""``eval.bench speed``: prefill and decode speed of slimmed models against their original, and peak memory.

    python -m eval.bench speed --model slim/ --baseline smollm2-135m [--model slim8/] [--out bench/]
    python -m eval.bench speed --engine llamacpp --model slim/ --baseline dense/ --threads 2 [--out bench/]

The engines and their own flags are :mod:`eval.speed.engines`' registry; the measurement is
:mod:`eval.speed.measure`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eval.bench.registry import (
    bench_option,
    engine_settings_option,
    load_option,
    register_subcommand,
    threads_option,
)
from eval.quality.report import speed_markdown, write_speed_report
from eval.speed.engines import ENGINES, REFERENCE, EngineSettings
from eval.speed.measure import SpeedOptions, benchmark_engine_speed, benchmark_speed, memory_mode, noise_warnings
from prune.checkpoint.load_config import LoadConfig
from prune.options import apply_threads

SPEED_HELP = (f"prefill/decode speed ({', '.join(engine.display for engine in ENGINES.values())}) and peak memory "
              "against a baseline")


def _engine_help() -> str:
    # written when the parser is built: an engine registered after this module is imported is listed too
    ways = "; ".join(f"{name} ({entry.summary})" for name, entry in ENGINES.items())
    return f"what runs the models (default: {REFERENCE}): {ways}"


_WORKLOAD = SpeedOptions()


@dataclass(frozen=True)
class SpeedBenchOptions:
    """The options of ``eval.bench speed``: its flags, in ``--help``'s order.

    Attributes:
        model: the candidates' names or folders.
        baseline: the original model's name or folder.
        load: how both are loaded (its model is the baseline).
        prompt_len: prefill tokens.
        new_tokens: decode steps.
        batch_size: sequences.
        repeats: timed rounds.
        warmup: untimed rounds first.
        memory: how peak memory is measured (None: :func:`eval.speed.measure.memory_mode`'s default).
        engine: what runs the models.
        settings: the engine's own settings given, by name.
        threads: CPU threads (None: the free cores).
        out: folder for ``speed.json`` and ``speed.md`` (None: print only).
    """

    model: list[str] | None = bench_option(None, "candidate name or folder (repeatable)", action="append",
                                           required=True, group="models")
    baseline: str | None = bench_option(None, "original model name or folder", required=True, group="models")
    load: LoadConfig | None = load_option(model_from="baseline", model_flag=False, title="loading")
    prompt_len: int = bench_option(_WORKLOAD.prompt_len, "prefill tokens (default: 256)", type=int, group="workload")
    new_tokens: int = bench_option(_WORKLOAD.new_tokens, "decode steps (default: 64)", type=int, group="workload")
    batch_size: int = bench_option(_WORKLOAD.batch_size, "sequences (default: 1)", type=int, group="workload")
    repeats: int = bench_option(_WORKLOAD.repeats, "timed rounds (default: 5)", type=int, group="workload")
    warmup: int = bench_option(_WORKLOAD.warmup, "untimed rounds first (default: 1)", type=int, group="workload")
    memory: str | None = bench_option(
        None, "peak memory (--engine transformers only): each model in a fresh process (the default), in this "
              "process (approximate), or not at all; other engines: off",
        choices=("subprocess", "inprocess", "off"), group="workload")
    engine: str = bench_option(REFERENCE, _engine_help, group="engine")
    settings: dict = engine_settings_option(group="engine")
    threads: int | None = threads_option()
    out: str | None = bench_option(None, "folder for speed.json and speed.md (default: print only)")


def run_speed(options: SpeedBenchOptions) -> int:
    """Time the baseline and the candidates interleaved, measure memory, print and save."""
    apply_threads(options)
    result = measure_speed(options.engine, options.baseline, options.model, options.load,
                           prompt_len=options.prompt_len, new_tokens=options.new_tokens,
                           batch_size=options.batch_size, repeats=options.repeats, warmup=options.warmup,
                           memory=options.memory, threads=options.threads, settings=options.settings,
                           out=options.out)
    print(f"engine: {result['engine']} {result.get('engine_version') or ''}".rstrip())
    print(speed_markdown(result))
    for ratio in result["ratios"]:
        print(f"{ratio['name']}: prefill x{ratio['prefill']:.3f}, decode x{ratio['decode']:.3f}, ideal L/(L-k) "
              f"x{ratio['ideal']:.3f} (decode at {ratio['decode'] / ratio['ideal']:.1%} of ideal, prefill at "
              f"{ratio['prefill'] / ratio['ideal']:.1%})")
    for line in result["warnings"]:
        print(f"warning: {line}")
    if options.out:
        print(f"wrote {Path(options.out) / 'speed.json'} and {Path(options.out) / 'speed.md'}")
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


register_subcommand("speed", SPEED_HELP, SpeedBenchOptions, run_speed)
