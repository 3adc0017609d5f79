"""``eval.bench speed``: its flags default to the measurement's options, and they size every engine's context."""

import argparse

import pytest

from eval.bench.cli import main
from eval.bench.speed import add_speed_arguments, engine_settings
from eval.speed.engines import ENGINES, setting_values
from eval.speed.timing import SpeedOptions
from prune.checkpoint.load_config import LoadConfig


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_speed_arguments(parser)
    return parser.parse_args(["--baseline", "base", "--model", "a", "--model", "b", *argv])


def test_the_workload_flags_default_to_the_speed_options():
    args, defaults = parse(), SpeedOptions()
    assert (args.prompt_len, args.new_tokens, args.batch_size, args.repeats, args.warmup) == (
        defaults.prompt_len, defaults.new_tokens, defaults.batch_size, defaults.repeats, defaults.warmup)
    assert (args.model, args.baseline, args.engine, args.memory, args.out) == (["a", "b"], "base", "transformers",
                                                                                None, None)


def test_the_engines_context_holds_the_workload_and_every_model_shares_the_device():
    args = parse("--gpu-layers", "3", "--threads", "2")
    settings = engine_settings(LoadConfig(dtype="float32"), SpeedOptions(prompt_len=8, new_tokens=3), len(args.model),
                               args.threads, setting_values(args))
    assert (settings.context, settings.sharing, settings.threads) == (12, 3, 2)  # prompt + new + 1; 1 + 2 models
    assert settings.of(ENGINES["llamacpp"]).gpu_layers == 3 and settings.load.dtype == "float32"


def test_the_baseline_is_required(capsys):
    with pytest.raises(SystemExit) as done:
        main(["speed", "--model", "a"])
    assert done.value.code == 2 and "--baseline" in capsys.readouterr().err
