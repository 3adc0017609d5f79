"""``eval.bench``'s subcommands: each module of the package registers its own; the CLI finds them all."""

from __future__ import annotations

import pkgutil
import runpy
import subprocess
import sys
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import pytest

import eval.bench
from eval.bench.cli import NOT_SUBCOMMANDS, build_parser, discover_subcommands, main
from eval.bench.registry import OPTION_KEY, SUBCOMMANDS, BenchOption, bench_option, register_subcommand

ROOT = Path(__file__).resolve().parents[3]


def test_every_module_of_the_package_registers_its_subcommand():
    modules = {info.name for info in pkgutil.iter_modules(eval.bench.__path__)
               if info.name not in NOT_SUBCOMMANDS and not info.name.startswith("_")}
    # sorted: the registry keeps the order the modules were first imported, which other tests' imports decide
    assert sorted(discover_subcommands()) == ["heal-cost", "heal-curve", "replace", "scale", "scoring", "serving",
                                             "speed", "teacher-cache"]
    assert {name.replace("-", "_") for name in SUBCOMMANDS.names()} == modules  # one module, one subcommand
    for name, command in SUBCOMMANDS.items():
        assert command.help and fields(command.options) and callable(command.run), name
    with pytest.raises(ValueError, match="'speed' is already registered"):
        register_subcommand("speed", "again", SUBCOMMANDS["speed"].options, lambda options: 0)


@dataclass(frozen=True)
class ToyOptions:
    """A subcommand's options of one test: a repeatable flag and a number."""

    word: list[str] | None = bench_option(None, "a word to say (repeatable)", action="append", required=True)
    times: int = bench_option(1, "how many times (default: 1)", type=int, group="toy group")


def test_a_registered_subcommand_gets_its_flags_from_its_options_and_runs_with_them(capsys):
    received = []

    def run(options: ToyOptions) -> int:
        received.append(options)
        print(" ".join(options.word * options.times))
        return 0

    register_subcommand("toy", "a subcommand of one test", ToyOptions, run)
    try:
        assert "toy" in build_parser().format_usage()
        toy = build_parser()._subparsers._group_actions[0].choices["toy"]  # the derived sub-parser
        text = " ".join(toy.format_help().split())
        assert "--word WORD a word to say (repeatable)" in text and "toy group: --times TIMES" in text
        assert main(["toy", "--word", "hi", "--word", "there", "--times", "2"]) == 0
        assert received == [ToyOptions(word=["hi", "there"], times=2)]  # the typed object, not the parsed flags
        assert capsys.readouterr().out.strip() == "hi there hi there"
        with pytest.raises(SystemExit) as refused:
            main(["toy"])
        assert refused.value.code == 2 and "--word" in capsys.readouterr().err  # required, as declared
    finally:
        SUBCOMMANDS.unregister("toy")
    assert "toy" not in SUBCOMMANDS


def test_an_options_field_without_its_flag_is_refused_when_registered():
    @dataclass
    class Undeclared:
        times: int = 1

    with pytest.raises(TypeError, match="'times' needs its metadata"):
        register_subcommand("undeclared", "no flag", Undeclared, lambda options: 0)
    assert "undeclared" not in SUBCOMMANDS


def test_every_flag_defaults_to_its_options_field_default():
    """An option not given on the command line is the default the options dataclass gives a Python caller."""
    required = {"speed": ["--model", "m", "--baseline", "b"], "serving": ["--model", "m", "--heldout", "h"],
                "replace": ["--heldout", "h"], "heal-cost": ["--heldout", "h"],
                "heal-curve": ["--checkpoint", "c", "--heldout", "h"],
                "scale": ["--shape", "llama-tiny", "--drop", "1"]}
    parser = build_parser()
    for name, command in SUBCOMMANDS.items():
        given = required.get(name, [])
        options = command.parse(parser.parse_args([name, *given]))
        assert isinstance(options, command.options), name
        for item in fields(options):
            shared_without_default = (not isinstance(item.metadata[OPTION_KEY], BenchOption)
                                      and item.default_factory is MISSING)  # --threads, the loading flags
            if f"--{item.name.replace('_', '-')}" in given or shared_without_default:
                continue
            default = item.default if item.default is not MISSING else item.default_factory()
            assert getattr(options, item.name) == default, (name, item.name)


def test_the_library_modules_do_not_import_the_cli():
    code = ("import sys, importlib, pkgutil, eval.bench\n"
            "for info in pkgutil.iter_modules(eval.bench.__path__):\n"
            "    if info.name not in ('cli', '__main__'): importlib.import_module('eval.bench.' + info.name)\n"
            "print('eval.bench.cli' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_python_dash_m_eval_bench_lists_the_subcommands(capsys, monkeypatch):
    """``python -m eval.bench --help``, run in this process: ``__main__`` reaches the CLI, which exits 0."""
    monkeypatch.setattr(sys, "argv", ["eval.bench", "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("eval.bench", run_name="__main__")
    assert done.value.code == 0
    assert "{heal-cost,heal-curve,replace,scale,scoring,serving,speed,teacher-cache}" in capsys.readouterr().out
