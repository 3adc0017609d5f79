"""``eval.bench``'s subcommands: each module of the package registers its own; the CLI finds them all."""

from __future__ import annotations

import pkgutil
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import eval.bench
from eval.bench.cli import NOT_SUBCOMMANDS, build_parser, discover_subcommands, main
from eval.bench.registry import SUBCOMMANDS, register_subcommand

ROOT = Path(__file__).resolve().parents[3]


def test_every_module_of_the_package_registers_its_subcommand():
    modules = {info.name for info in pkgutil.iter_modules(eval.bench.__path__)
               if info.name not in NOT_SUBCOMMANDS and not info.name.startswith("_")}
    assert discover_subcommands() == ["heal-cost", "replace", "scale", "scoring", "serving", "speed", "teacher-cache"]
    assert {name.replace("-", "_") for name in SUBCOMMANDS.names()} == modules  # one module, one subcommand
    for name, command in SUBCOMMANDS.items():
        assert command.help and callable(command.add_arguments) and callable(command.run), name
    with pytest.raises(ValueError, match="'speed' is already registered"):
        register_subcommand("speed", "again", lambda parser: None, lambda args: 0)


def test_a_registered_subcommand_gets_a_parser_and_runs(capsys):
    def add(parser):
        parser.add_argument("--times", type=int, default=1)

    def run(args):
        print("toy " * args.times)
        return 0

    register_subcommand("toy", "a subcommand of one test", add, run)
    try:
        assert "toy" in build_parser().format_usage()
        assert main(["toy", "--times", "2"]) == 0
        assert capsys.readouterr().out.strip() == "toy toy"
    finally:
        SUBCOMMANDS.unregister("toy")


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
    assert "{heal-cost,replace,scale,scoring,serving,speed,teacher-cache}" in capsys.readouterr().out
