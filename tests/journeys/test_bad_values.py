"""Every flag of every command fed bad values: a one-line refusal (exit 2) or acceptance, never a traceback (issue 77).

Each command's parser is walked (``parser._actions``: tests may read argparse's internals) and every option that
takes a value is given values wrong for its type: ints and floats out of range, non-finite, unparsable and empty;
choices that are not one; free strings empty, a word and a path that does not exist (under the run's own working
folder: the tests run as root, where ``/nonexistent/x`` could be made); the number-like strings (``--drop``,
``--time-budget``, ``--tokens``, ...) their own bad spellings. Each value goes into an otherwise valid command on a
tiny model, run in process from an empty working folder. Where a command would start its heavy work (load a
model, run an engine, write a shaped checkpoint), a stand-in raises :class:`_Accepted`: the value passed every
check before it. ``prune.run --recipe`` gets the same for every recipe key, in YAML (a list, a mapping or text
where a number goes, ``.nan``, ``.inf``, ``-1``, ``null``, ``true``).

A failure is an exception other than ``SystemExit(0|2)`` escaping ``main``, an exit code other than 0 and 2,
"Traceback" on stderr, or an exit 2 whose stderr has not exactly one ``error:`` line (argparse's
``prog: error: ...`` counts) or shows a ``usage:`` line.

The ``_sampled`` tests run two values per flag or key, the same ones every run (about 45 s on 2 cores); the
``slow`` ``_all`` tests run every case (about 2.5 min). Both record, per command, the values tried and the
failures found in :data:`TRIED` / :data:`FOUND`, and print the counts (``-s``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import itertools
import random
import re
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import make_student_pair, make_tiny_model, make_tiny_tokenizer

# ---- the bad values ----

INT_VALUES = ("-1", "0", "1e400", "nan", "abc", "")
FLOAT_VALUES = ("nan", "inf", "-inf", "-1", "1e400", "abc", "")
CHOICE_VALUES = ("not-a-choice", "")
STRING_VALUES = ("", "abc", "{missing}")  # {missing}: a path that does not exist, under the test's own folder
# strings that spell a number, a size, a share or a duration, and lists of them: their own bad spellings
NUMBER_WORD_VALUES = ("nan", "inf", "-5m", "1e400", "0", "-1", "101%", "abc", "", "1,,2", "1-")
NUMBER_WORDS = {
    "--drop", "--target-params", "--time-budget", "--plan-gpu-memory", "--plan-host-memory", "--protect",
    "--unit", "--tokens", "--k", "--k-candidates", "--steps", "--skip", "--shrink", "--update-scale", "--span",
    "--submodule-blocks", "--teacher-cache", "--loss", "--limit", "--variants", "--methods", "--engines",
    "--shortcuts", "--tasks", "--metrics", "span", "variants",
}


class _Accepted(Exception):
    """Raised where a command would start its heavy work: the value passed every check before it."""


def _accept(*args, **kwargs):
    raise _Accepted


# Where the commands start their heavy work. Each stand-in sits after the command's checks: the config
# dataclasses, recipe reading and the preflight on the model's config.json all run before it.
HEAVY = (
    ("prune.checkpoint.load_config", "LoadConfig.load"),  # every tool's way to open a model
    ("distill.job", "load"),  # the student of distill.run
    ("eval.bench.scoring", "load"),
    ("eval.bench.scoring", "load_offloaded"),
    ("eval.bench.speed", "benchmark_speed"),
    ("eval.bench.speed", "benchmark_engine_speed"),
    ("eval.bench.serving", "score_engine"),
    ("eval.bench.scale", "benchmark_scale"),  # writes a real model's shape: gigabytes
    ("eval.bench.teacher_cache", "benchmark_teacher_cache"),
    ("prune.checkpoint.gguf", "_run_converter"),
)


@pytest.fixture
def heavy_work_accepted(monkeypatch):
    for module, name in HEAVY:
        owner = importlib.import_module(module)
        *path, attribute = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        monkeypatch.setattr(owner, attribute, _accept)


# ---- the commands, each with a valid minimal command line ----


@dataclass
class Env:
    """The files the valid command lines name; :meth:`fresh` gives a new path for each run's output."""

    root: Path
    tiny: Path
    text: Path
    teacher: Path
    student: Path
    sublayers: Path
    converter: Path
    counter: itertools.count = field(default_factory=itertools.count)
    here: Path | None = None  # the current run's working folder

    def fresh(self, suffix: str = "") -> str:
        return str(self.root / "runs" / f"run{next(self.counter)}{suffix}")

    def enter(self, monkeypatch) -> None:
        """A new empty working folder for the next run: a relative path ("abc") lands there, and nowhere else."""
        self.here = self.root / "cwd" / str(next(self.counter))
        self.here.mkdir(parents=True)
        monkeypatch.chdir(self.here)

    @property
    def missing(self) -> str:
        return str(self.here / "nonexistent" / "x")


@dataclass
class Command:
    """A command: its ``main``, its parser and a valid command line.

    ``base`` returns (subcommand words, positional values by dest, option words). ``adjust`` maps a flag to
    (flags to remove from the base, words to add) so that the flag is tried where it means something
    (``--target-params`` without ``--drop``, ``--rank`` with ``--replace lowrank``).
    """

    name: str
    module: str
    base: Callable[[Env], tuple[list[str], dict[str, str], list[str]]]
    subcommand: str | None = None
    valid: bool = True  # the base command line runs (eval.lab's read finished measurements: here none exist)
    adjust: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = field(default_factory=dict)

    def main(self):
        return importlib.import_module(self.module).main

    def parser(self) -> argparse.ArgumentParser:
        parser = importlib.import_module(self.module).build_parser()
        if self.subcommand is None:
            return parser
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return sub.choices[self.subcommand]


_DATA = ("--samples", "4", "--seq-len", "32")
_PLAN = {flag: ((), ("--plan",)) for flag in ("--plan-json", "--plan-gpus", "--plan-gpu-memory", "--plan-host-memory")}


def _prune_run(env: Env):
    return [], {}, ["--model", env.tiny, "--data", env.text, *_DATA, "--heldout-samples", "0", "--drop", "1",
                    "--replace", "none", "--out", env.fresh(), "--threads", "1"]


def _ship(env: Env):
    return [], {}, ["--model", env.tiny, "--data", env.text, *_DATA, "--heldout-samples", "0", "--drop", "1",
                    "--engine", "transformers", "--out", env.fresh(), "--threads", "1"]


def _distill(env: Env):
    return [], {}, ["--student", env.student, "--teacher", env.teacher, "--steps", "2", "--batch-size", "1",
                    "--data", env.text, *_DATA, "--out", env.fresh(), "--threads", "1"]


def _eval_run(env: Env):
    return [], {}, ["--model", env.tiny, "--tasks", f"ppl:{env.text}", "--seq-len", "32", "--out", env.fresh(),
                    "--no-progress", "--threads", "1"]


def _lens(env: Env):
    return [], {}, ["--model", env.tiny, "--data", env.text, "--eval-data", env.text, "--seq-len", "32",
                    "--tokens", "256", "--eval-tokens", "64", "--out", env.fresh(), "--threads", "1", "--no-progress"]


def _compare(env: Env):
    return [], {}, ["--model", env.tiny, "--data", env.text, *_DATA, "--heldout-samples", "0", "--drop", "1",
                    "--methods", "shortgpt", "--out", env.fresh(), "--threads", "1"]


def _mapfit(env: Env):
    return [], {}, ["--model", env.tiny, "--span", "1-2", "--data", env.text, *_DATA, "--heldout-samples", "0",
                    "--out", env.fresh(), "--threads", "1"]


_REPLACE_WITH = {"--ridge": "linear", "--update-scale": "linear", "--fit-short": "linear", "--fit": "linear",
                 "--rank": "lowrank", "--replace-steps": "local", "--rotate-iterations": "fold-rotate"}

COMMANDS = [
    Command("prune.run", "prune.run", _prune_run, adjust={
        "--target-params": (("--drop",), ()), "--target-speedup": (("--drop",), ()),
        **{flag: (("--replace",), ("--replace", method)) for flag, method in _REPLACE_WITH.items()},
        "--distill-samples": ((), ("--distill-steps", "1")),
        "--gguf-type": (("--replace",), ("--replace", "fold", "--export", "gguf")),
        "--converter": (("--replace",), ("--replace", "fold", "--export", "gguf")),
        "--export": (("--replace",), ("--replace", "fold")),
        "--unit": (("--replace",), ()), **_PLAN, "--plan-teacher-cache": ((), ("--plan", "--distill-steps", "1"))}),
    Command("prune.ship", "ship.cli", _ship, adjust={
        "--target-params": (("--drop",), ()), "--target-speedup": (("--drop",), ()),
        "--gguf-type": (("--engine",), ("--engine", "llamacpp")),
        "--converter": (("--engine",), ("--engine", "llamacpp"))}),
    Command("prune.export_gguf", "prune.export_gguf",
            lambda env: ([], {"folder": env.tiny}, ["--out", env.fresh(".gguf"), "--converter", env.converter])),
    Command("prune.decilm", "prune.decilm", lambda env: ([], {"folder": env.sublayers}, ["--out", env.fresh()])),
    Command("distill.run", "distill.run", _distill, adjust=dict(_PLAN)),
    Command("eval.run", "eval.run", _eval_run),
    Command("eval.bench speed", "eval.bench.cli", lambda env: (["speed"], {}, [
        "--model", env.tiny, "--baseline", env.tiny, "--engine", "transformers", "--prompt-len", "8",
        "--new-tokens", "4", "--repeats", "1", "--threads", "1"]), subcommand="speed"),
    Command("eval.bench serving", "eval.bench.cli", lambda env: (["serving"], {}, [
        "--model", f"slim={env.tiny}", "--heldout", env.text, "--tokens", "64", "--seq-len", "32",
        "--engines", "transformers", "--threads", "1"]), subcommand="serving"),
    Command("eval.bench scoring", "eval.bench.cli", lambda env: (["scoring"], {}, [
        "--model", env.tiny, "--data", env.text, "--seq-len", "32", "--tokens", "64", "--time-tokens", "64",
        "--repeats", "1", "--end-to-end", "0", "--threads", "1"]), subcommand="scoring"),
    Command("eval.bench replace", "eval.bench.cli", lambda env: (["replace"], {}, [
        "--model", env.tiny, "--drop", "1", "--variants", "remove", "--heldout", env.text, "--data", env.text,
        *_DATA, "--threads", "1"]), subcommand="replace"),
    Command("eval.bench teacher-cache", "eval.bench.cli", lambda env: (["teacher-cache"], {}, [
        "--model", env.tiny, "--drop", "1", "--steps", "2", "--data", env.text, *_DATA, "--heldout-samples", "2",
        "--selection-samples", "2", "--prune-samples", "4", "--work", env.fresh(), "--threads", "1"]),
        subcommand="teacher-cache"),
    Command("eval.bench scale", "eval.bench.cli", lambda env: (["scale"], {}, [
        "--shape", "llama-tiny", "--drop", "1", "--out", env.fresh(), "--threads", "1"]), subcommand="scale"),
    Command("eval.bench heal-cost", "eval.bench.cli", lambda env: (["heal-cost"], {}, [
        "--model", env.tiny, "--drop", "1", "--heldout", env.text, "--steps", "2", "--data", env.text, *_DATA,
        "--threads", "1"]), subcommand="heal-cost"),
    Command("eval.bench heal-curve", "eval.bench.cli", lambda env: (["heal-curve"], {}, [
        "--model", env.teacher, "--checkpoint", env.student, "--heldout", env.text, "--steps", "0,2", "--data",
        env.text, *_DATA, "--heldout-tokens", "64", "--window", "32", "--threads", "1"]), subcommand="heal-curve"),
    Command("eval.lens", "eval.lens.run", _lens),
    Command("eval.compare", "eval.compare.cli", _compare, adjust=dict(_PLAN)),
    Command("eval.mapfit", "eval.mapfit.cli", _mapfit),
    Command("eval.lab paired", "eval.lab.cli", lambda env: (["paired"], {"rows": f"{env.missing}.json::remove@1"}, []),
            subcommand="paired", valid=False),
    Command("eval.lab paired-fidelity", "eval.lab.cli", lambda env: (
        ["paired-fidelity"], {"rows": f"{env.missing}.json::remove@1"}, []), subcommand="paired-fidelity", valid=False),
    Command("eval.lab hellaswag-by-source", "eval.lab.cli", lambda env: (
        ["hellaswag-by-source"], {"results": env.fresh(".json"), "hellaswag": env.text}, []),
        subcommand="hellaswag-by-source", valid=False),
    Command("eval.lab share-optimum", "eval.lab.cli", lambda env: (["share-optimum"], {"folders": env.fresh()}, []),
            subcommand="share-optimum", valid=False),
    Command("eval.lab selection-split", "eval.lab.cli", lambda env: (
        ["selection-split"], {"data_dir": env.fresh(), "out": env.fresh()}, []), subcommand="selection-split",
        valid=False),
    Command("eval.lab task-prompts", "eval.lab.cli", lambda env: (
        ["task-prompts"], {"data_dir": env.fresh(), "out": env.fresh()}, []), subcommand="task-prompts", valid=False),
    Command("eval.lab share-tasks", "eval.lab.cli", lambda env: (
        ["share-tasks"], {"span": "1-2", "variants": "removal,ls", "out": env.fresh(".json")},
        ["--model", env.tiny, "--data-dir", env.fresh()]), subcommand="share-tasks"),
]


def bad_values(action: argparse.Action) -> tuple[str, ...]:
    """The values tried for ``action``: by its type, its choices, or the flag's own kind of number word."""
    names = set(action.option_strings) or {action.dest}
    if action.choices is not None:
        return CHOICE_VALUES
    if action.type is int:
        return INT_VALUES
    if action.type is float:
        return FLOAT_VALUES
    if names & NUMBER_WORDS:
        return NUMBER_WORD_VALUES
    if action.type not in (None, str):  # a parsing function (--limit): every spelling
        return tuple(dict.fromkeys(FLOAT_VALUES + INT_VALUES))
    return STRING_VALUES


def takes_value(action: argparse.Action) -> bool:
    return (action.nargs != 0 and not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
            and action.dest != "help")


def cases(command: Command) -> list[tuple[argparse.Action, str]]:
    """Every (action, bad value) of ``command``."""
    return [(action, value) for action in command.parser()._actions if takes_value(action)
            for value in bad_values(action)]


def command_line(command: Command, env: Env, action: argparse.Action, value: str) -> list[str]:
    """The valid command line of ``command`` with ``value`` given to ``action``."""
    words, positionals, options = command.base(env)
    options = [str(word) for word in options]
    value = value.format(missing=env.missing)
    if not action.option_strings:
        positionals = {**positionals, action.dest: value}
    else:
        remove, add = command.adjust.get(action.option_strings[-1], ((), ()))
        for flag in (*remove, *action.option_strings):  # drop the base's own value of this flag
            while flag in options:
                at = options.index(flag)
                del options[at:at + 2]
        options += [*add, action.option_strings[-1], value]
    return [*words, *(str(v) for v in positionals.values()), *options]


ERROR_LINE = re.compile(r"^(error: |usage: |\S.*: error: )")


def outcome(main, argv: list[str], capsys) -> tuple[str, str | None]:
    """("accepted" | "refused", None) or ("failed", why) for one run of ``main(argv)``."""
    threads = torch.get_num_threads()
    capsys.readouterr()
    code, escaped = None, None
    try:
        code = main(argv)
    except _Accepted:
        code = "accepted"
    except SystemExit as stop:
        code = stop.code
    except Exception:  # a traceback: the thing this test is for
        escaped = traceback.format_exc(limit=-3).strip().splitlines()
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    if escaped is not None:
        return "failed", f"traceback: {escaped[-1]} (at {' | '.join(line.strip() for line in escaped[-3:-1])})"
    if "Traceback" in err:
        return "failed", f"a traceback on stderr: {err.strip().splitlines()[-1]}"
    if code in ("accepted", 0, None):
        return "accepted", None
    if code != 2:
        return "failed", f"exit {code}: {err.strip()[-300:]}"
    lines = [line for line in err.splitlines() if ERROR_LINE.match(line)]
    if len(lines) != 1 or lines[0].startswith("usage: "):
        return "failed", f"exit 2 without exactly one error line: {err.strip()[-300:]!r}"
    return "refused", None


# ---- the fixtures and the tests ----

TRIED: dict[str, int] = {}
FOUND: dict[str, list[str]] = {}


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_folder, sample_text) -> Env:
    root = tmp_path_factory.mktemp("bad-values")
    text = root / "text.txt"
    text.write_text(sample_text)
    pair = make_student_pair(root / "pair")
    wide, sublayers = root / "wide", root / "sublayers"  # DeciLM's FFN widths are multiples of 256
    make_tiny_model("llama", intermediate_size=256).save_pretrained(wide)
    make_tiny_tokenizer().save_pretrained(wide)
    from prune.run import main

    with _threads(1):
        assert main(["--model", str(wide), "--data", str(text), *_DATA, "--heldout-samples", "0", "--unit",
                     "attention,mlp", "--drop", "2", "--replace", "none", "--out", str(sublayers)]) == 0
    converter = root / "convert_hf_to_gguf.py"
    converter.write_text("raise SystemExit('never run: the test stands in for the converter')\n")
    return Env(root, tiny_folder, text, pair["teacher"], pair["student"], sublayers, converter)


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_cases(command: Command, env: Env, chosen, capsys, monkeypatch) -> list[str]:
    """Run ``chosen`` cases of ``command``; record the count and the failures in TRIED / FOUND; the failures."""
    main, counts, failures, slowest = command.main(), {"accepted": 0, "refused": 0, "failed": 0}, [], []
    for action, value in chosen:
        env.enter(monkeypatch)
        argv = command_line(command, env, action, value)
        started = time.perf_counter()
        result, why = outcome(main, argv, capsys)
        slowest.append((time.perf_counter() - started, argv))
        counts[result] += 1
        if why is not None:
            flag = action.option_strings[-1] if action.option_strings else action.dest
            failures.append(f"{command.name} {flag} {value.format(missing=env.missing)!r}: {why}")
    TRIED[command.name] = TRIED.get(command.name, 0) + len(chosen)
    FOUND.setdefault(command.name, []).extend(failures)
    print(f"{command.name}: {len(chosen)} values tried, {counts}; slowest: {max(slowest, default=None)}")
    return failures


# An unknown task name is looked up in lm-eval's own registry, indexed once a process from ~14,000 YAML files
# (30-60 s on a 2-core machine): the slow test tries these flags, the sample leaves them out.
NOT_SAMPLED = {"--tasks"}


def sample(all_cases: list, seed: str, per_flag: int = 2) -> list:
    """``per_flag`` values of each flag (but :data:`NOT_SAMPLED`), the same ones on every run."""
    rng, by_flag = random.Random(seed), {}
    for action, value in all_cases:
        if NOT_SAMPLED & set(action.option_strings):
            continue
        by_flag.setdefault(id(action), []).append((action, value))
    return [case for group in by_flag.values() for case in rng.sample(group, min(per_flag, len(group)))]


@pytest.mark.usefixtures("heavy_work_accepted", "one_thread")
@pytest.mark.parametrize("command", [c for c in COMMANDS if c.valid], ids=lambda c: c.name)
def test_the_valid_command_lines_pass_every_check(command, env, capsys, monkeypatch):
    """Each base command line reaches its heavy work: a bad value's refusal is the value's, not the base's."""
    env.enter(monkeypatch)
    words, positionals, options = command.base(env)
    argv = [*words, *(str(v) for v in positionals.values()), *(str(o) for o in options)]
    assert outcome(command.main(), argv, capsys) == ("accepted", None), capsys.readouterr().err


@pytest.mark.usefixtures("heavy_work_accepted", "one_thread")
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.name)
def test_bad_flag_values_sampled(command, env, capsys, monkeypatch):
    failures = run_cases(command, env, sample(cases(command), command.name), capsys, monkeypatch)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.usefixtures("heavy_work_accepted", "one_thread")
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.name)
def test_bad_flag_values_all(command, env, capsys, monkeypatch):
    failures = run_cases(command, env, cases(command), capsys, monkeypatch)
    assert not failures, "\n".join(failures)




# ---- recipe keys: prune.run --recipe ----

RECIPE_VALUES = ([1, 2], {"a": 1}, "abc", float("nan"), float("inf"), -1, None, True)  # YAML: [1, 2], .nan, null...


def recipe_keys() -> list[tuple[str, ...]]:
    """Every top-level key and every key of the load:, data:, replace:, distill: (and distill: data:) sections."""
    from distill.config import DistillConfig
    from prune.checkpoint.load_config import LoadConfig
    from prune.data.calibration import DataConfig
    from prune.pipeline.config import PruneConfig
    from prune.replace import ReplaceConfig

    def names(cls):
        return [f.name for f in dataclasses.fields(cls)]

    return [*((key,) for key in names(PruneConfig)), *(("load", key) for key in names(LoadConfig)),
            *(("data", key) for key in names(DataConfig)), *(("replace", key) for key in ReplaceConfig.recipe_keys()),
            *(("distill", key) for key in names(DistillConfig)),
            *(("distill", "data", key) for key in names(DataConfig))]


def _method_of(option: str) -> str:
    """The first replacement method with ``option`` among its options (linear when every method has it)."""
    from prune.replace import METHODS

    return next((name for name, method in METHODS.items()
                 if option in {f.name for f in dataclasses.fields(method.options)}), "linear")


def recipe_with(env: Env, key: tuple[str, ...] | None, value) -> dict:
    """A valid recipe on the tiny model, with ``value`` at ``key`` (None: the valid recipe itself)."""
    recipe = {"load": {"model": str(env.tiny)},
              "data": {"data": str(env.text), "samples": 4, "seq_len": 32, "heldout_samples": 0},
              "drop": 1, "replace": {"method": "linear"}, "distill": {"steps": 1}, "out": env.fresh()}
    if key is None:
        return recipe
    if key[0] in ("target_params", "target_speedup"):
        del recipe["drop"]
    if key[0] == "replace" and len(key) == 2:
        recipe["replace"]["method"] = _method_of(key[1])
    node = recipe
    for part in key[:-1]:
        node = node.setdefault(part, {})
    node[key[-1]] = value
    return recipe


def run_recipe(env: Env, recipe: dict, capsys) -> tuple[str, str | None]:
    path = env.here / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return outcome(importlib.import_module("prune.run").main, ["--recipe", str(path), "--threads", "1"], capsys)


def recipe_cases() -> list[tuple[tuple[str, ...], object]]:
    return [(key, value) for key in recipe_keys() for value in RECIPE_VALUES]


def run_recipe_cases(env: Env, chosen, capsys, monkeypatch) -> list[str]:
    counts, failures = {"accepted": 0, "refused": 0, "failed": 0}, []
    for key, value in chosen:
        env.enter(monkeypatch)
        result, why = run_recipe(env, recipe_with(env, key, value), capsys)
        counts[result] += 1
        if why is not None:
            failures.append(f"recipe {'.'.join(key)}: {value!r}: {why}")
    TRIED["prune.run --recipe"] = TRIED.get("prune.run --recipe", 0) + len(chosen)
    FOUND.setdefault("prune.run --recipe", []).extend(failures)
    print(f"prune.run --recipe: {len(chosen)} values tried, {counts}")
    return failures


@pytest.mark.usefixtures("heavy_work_accepted", "one_thread")
def test_the_valid_recipe_passes_every_check(env, capsys, monkeypatch):
    env.enter(monkeypatch)
    assert run_recipe(env, recipe_with(env, None, None), capsys) == ("accepted", None)


@pytest.mark.usefixtures("heavy_work_accepted", "one_thread")
def test_bad_recipe_values_sampled(env, capsys, monkeypatch):
    rng = random.Random("recipes")
    chosen = [case for key in recipe_keys() for case in rng.sample([(key, v) for v in RECIPE_VALUES], 2)]
    failures = run_recipe_cases(env, chosen, capsys, monkeypatch)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.usefixtures("heavy_work_accepted", "one_thread")
def test_bad_recipe_values_all(env, capsys, monkeypatch):
    failures = run_recipe_cases(env, recipe_cases(), capsys, monkeypatch)
    assert not failures, "\n".join(failures)
