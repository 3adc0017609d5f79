"""``eval.bench speed``: its flags default to the measurement's options, and they size every engine's context."""

import argparse

import pytest

from eval.bench.cli import main
from eval.bench.registry import SUBCOMMANDS
from eval.bench.speed import SpeedBenchOptions, engine_settings
from eval.speed.engines import ENGINES
from eval.speed.timing import SpeedOptions
from prune.checkpoint.load_config import LoadConfig


def parse(*argv: str) -> SpeedBenchOptions:
    command = SUBCOMMANDS["speed"]
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return command.parse(parser.parse_args(["--baseline", "base", "--model", "a", "--model", "b", *argv]))


def test_the_workload_flags_default_to_the_speed_options():
    options, defaults = parse(), SpeedOptions()
    assert (options.prompt_len, options.new_tokens, options.batch_size, options.repeats, options.warmup) == (
        defaults.prompt_len, defaults.new_tokens, defaults.batch_size, defaults.repeats, defaults.warmup)
    assert (options.model, options.baseline, options.engine, options.memory, options.out) == (
        ["a", "b"], "base", "transformers", None, None)
    assert options.load.model == "base" and options.settings == {}  # the baseline is loaded; no engine setting given


def test_the_engines_context_holds_the_workload_and_every_model_shares_the_device():
    options = parse("--gpu-layers", "3", "--threads", "2")
    settings = engine_settings(LoadConfig(dtype="float32"), SpeedOptions(prompt_len=8, new_tokens=3),
                               len(options.model), options.threads, options.settings)
    assert (settings.context, settings.sharing, settings.threads) == (12, 3, 2)  # prompt + new + 1; 1 + 2 models
    assert settings.of(ENGINES["llamacpp"]).gpu_layers == 3 and settings.load.dtype == "float32"


def test_the_baseline_is_required(capsys):
    with pytest.raises(SystemExit) as done:
        main(["speed", "--model", "a"])
    assert done.value.code == 2 and "--baseline" in capsys.readouterr().err
