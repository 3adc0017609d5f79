"""Replay the careless inputs of the "Dependable" issue against one checkout, and say what each did.

    python -m eval.lab.careless --code /path/to/checkout --tiny TINY_FOLDER --out after.json
    python -m eval.lab.careless --table before.json after.json > table.md

(``reports/careless-inputs/run.sh`` builds the tiny model and runs both.)

Each row is a command (or a few lines of the Python API) a careless user types, run in a fresh folder with
``--code`` first on ``PYTHONPATH``, so the same rows run against any commit. A row's outcome is one of
``error`` (exit 2 and one ``error:`` line, or a ``ValueError``/``TypeError`` of layercut's own in the API),
``ran`` (exit 0), ``traceback`` (a Python traceback reached the user) or ``wrong`` (a row's own check of what
a right answer is failed); the seconds show how late a refusal came. The rows use a tiny random Llama (built
here) and text of the project's shared data folder; two use SmolLM2-135M's embedded checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DATA = Path(os.environ.get("LAYERCUT_DATA", "../shared/data")).resolve()
TEXT = DATA / "austen" / "sensesensibility.txt"
SHIP = ["--samples", "16", "--seq-len", "32", "--heldout-samples", "2", "--engine", "transformers", "--threads", "1",
        "--repeats", "1", "--prompt-len", "16", "--new-tokens", "4", "--heal-steps", "0", "--no-verify"]

# the API rows run through this wrapper: a refusal of layercut's own is "error", any other exception "traceback"
API = """
import sys, traceback
from prune.errors import LayercutError
try:
{body}
except Exception as err:
    ours = isinstance(err, (ValueError, TypeError)) and (isinstance(err, LayercutError) or
                                                          type(err).__module__.startswith("prune"))
    if ours and "\\n" not in str(err):
        print(f"error: {{err}}", file=sys.stderr)
        sys.exit(2)
    traceback.print_exc()
    sys.exit(1)
"""


def run(args: list, cwd: Path, code: Path, env: dict | None = None, timeout: int = 600) -> dict:
    """``python ARGS`` in ``cwd`` with ``code`` first on the path: its exit code, seconds and outcome."""
    environment = {**os.environ, "PYTHONPATH": str(code), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                   "OMP_NUM_THREADS": "1", "LAYERCUT_CACHE": str(cwd.parent / "cache"), **(env or {})}
    began = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=environment, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"rc": None, "seconds": timeout, "outcome": "timeout", "said": ""}
    seconds = round(time.perf_counter() - began, 1)
    # argparse's refusals begin with the program's name
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:") or " error: " in line]
    if "Traceback (most recent call last)" in done.stderr:
        outcome = "traceback"
        said = done.stderr.strip().splitlines()[-1]
    elif done.returncode == 2 and len(errors) == 1:
        outcome, said = "error", errors[0]
    elif done.returncode == 0:
        outcome, said = "ran", (done.stdout.strip().splitlines() or [""])[-1]
    else:
        outcome, said = f"exit {done.returncode}", (done.stderr.strip().splitlines() or [""])[-1]
    return {"rc": done.returncode, "seconds": seconds, "outcome": outcome, "said": said[:300],
            "stdout": done.stdout[-2000:], "weights_read": "Loading weights" in done.stderr or "it/s]" in done.stderr}


def api(body: str) -> list:
    """``python -c`` of lines of the Python API, a refusal of layercut's own an exit 2 with one line."""
    return ["-c", API.format(body="\n".join("    " + line for line in body.strip().splitlines()))]


def ship(model: Path, out: str, *extra, heal: str = "0", verify: bool = False, data=TEXT) -> list:
    """A small ``prune.ship`` on ``model`` (``--drop 2`` unless a --target-params is among ``extra``)."""
    budget = [] if "--target-params" in extra else ["--drop", "2"]
    options = [*SHIP[:SHIP.index("--heal-steps")], "--heal-steps", heal] + ([] if verify else ["--no-verify"])
    return ["-m", "prune.ship", "--model", model, "--data", data, *options, *budget, "--out", out, *extra]


# the test that fails on the code before each row's fix (tests/...)
TESTS = {
    "t1": "journeys/test_bad_values.py (prune.run --target-params, every value)",
    "t2": "ship/test_shipper.py::test_a_target_the_blocks_cannot_reach_is_refused_before_any_weight_is_read",
    "t3": "ship/test_shipper.py::test_bad_input_is_one_line_before_any_weight_is_read[--time-budget 1s]",
    "t4": "journeys/test_traps.py::test_recipe_values_of_the_wrong_type_are_one_line",
    "t5": "journeys/test_traps.py::test_recipe_values_of_the_wrong_type_are_one_line",
    "t6": "journeys/test_traps.py::test_recipe_values_of_the_wrong_type_are_one_line",
    "t7": "prune/test_api.py::test_slim_and_score_refuse_what_they_cannot_run",
    "t8": "prune/test_api.py::test_slim_and_score_refuse_what_they_cannot_run",
    "t9": "prune/test_api.py::test_slim_and_score_refuse_what_they_cannot_run",
    "t10": "prune/test_api.py::test_slim_and_score_refuse_what_they_cannot_run",
    "t11": "prune/test_api.py::test_protect_as_a_number_is_one_line",
    "t12": "ship/test_shipper.py::test_a_damaged_work_folder_is_one_line_that_says_how_to_start_over[plan.json]",
    "t13": "ship/test_shipper.py::test_a_damaged_work_folder_is_one_line_that_says_how_to_start_over[ship.json]",
    "t14": "ship/test_work.py (damaged settings)",
    "t15": "ship/test_work.py::test_a_damaged_result_is_one_line_that_says_how_to_start_over",
    "t16": "ship/test_work.py::test_a_file_in_the_way_of_the_work_folder_and_damaged_settings_are_one_line",
    "t17": "ship/test_shipper.py::test_the_heal_is_kept_only_when_it_lowers_the_kl_on_rows_it_never_trained_on_and_"
           "the_card_says_so",
    "t18": "ship/test_config.py::test_a_duration_that_is_not_positive_and_finite_is_refused",
    "t19": "ship/test_config.py::test_a_duration_that_is_not_positive_and_finite_is_refused",
    "t20": "prune/loading/test_loader.py::test_a_pickle_torch_refuses_is_one_line_and_runs_nothing",
    "w1": "ship/test_card.py::test_the_ship_command_of_the_cli_parses_back_to_the_same_config",
    "w2": "prune/loading/test_loader.py::test_a_config_that_lies_about_its_block_count_is_refused_before_loading",
    "w3": "prune/loading/test_loader.py::test_a_config_that_lies_about_its_block_count_is_refused_before_loading",
    "l1": "ship/test_config.py::test_a_missing_heldout_file_is_refused_before_any_stage",
    "l2": "ship/test_shipper.py::test_bad_input_is_one_line_before_any_weight_is_read (no ship.json left)",
    "n1": "prune/test_api.py::test_save_of_something_else_says_what_it_takes",
    "n2": "journeys/test_bad_values.py (prune.ship --time-budget)",
    "n3": "journeys/test_bad_values.py (distill.run --steps)",
    "n4": "journeys/test_traps.py, prune/loading (a missing local folder)",
}


def table(before: Path, after: Path) -> str:
    """The markdown table of two replays: each row's outcome before and after, and its test."""
    old, new = (json.loads(path.read_text())["rows"] for path in (before, after))
    lines = ["| row | what | before | after | test (tests/...) |", "|---|---|---|---|---|"]
    for key, row in new.items():
        def cell(result):
            said = result["said"].replace("|", "/")[:110]
            return f"**{result['outcome']}** ({result['seconds']} s): {said}"
        lines.append(f"| {key} | {row['what']} | {cell(old[key]) if key in old else '-'} | {cell(row)} | "
                     f"{TESTS.get(key, '')} |")
    counts = {}
    for name, rows in (("before", old), ("after", new)):
        tally: dict[str, int] = {}
        for result in rows.values():
            tally[result["outcome"]] = tally.get(result["outcome"], 0) + 1
        counts[name] = ", ".join(f"{n} {k}" for k, n in sorted(tally.items()))
    return "\n".join(lines) + f"\n\nbefore: {counts['before']}; after: {counts['after']}\n"


def main(argv=None) -> int:
    """Every row against ``--code``; the JSON to ``--out``, a line a row to the terminal."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", type=Path, help="the checkout to run")
    parser.add_argument("--out", type=Path, help="the JSON of every row")
    parser.add_argument("--tiny", type=Path, help="a tiny random Llama checkpoint folder with its tokenizer")
    parser.add_argument("--only", default=None, help="comma-separated row ids")
    parser.add_argument("--table", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), help="print the table of two runs")
    args = parser.parse_args(argv)
    if args.table:
        print(table(*args.table), end="")
        return 0
    if args.code is None or args.out is None or args.tiny is None:
        parser.error("--code, --tiny and --out name the checkout to run, the tiny model and the JSON to write")
    code = args.code.resolve()
    root = Path(tempfile.mkdtemp(prefix="careless-"))
    tiny = args.tiny.resolve()
    from transformers import AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny).parameters())
    rows: dict[str, dict] = {}

    def row(key: str, what: str, argv: list, check=None, setup=None, env=None, timeout: int = 300) -> None:
        if args.only and key not in args.only.split(","):
            return
        folder = root / key
        folder.mkdir()
        if setup is not None:
            setup(folder)
        result = run(argv, folder, code, env, timeout)
        if check is not None and result["outcome"] != "traceback":
            wrong = check(folder, result)
            if wrong:
                result["outcome"], result["said"] = "wrong", wrong
        rows[key] = {"what": what, **{k: v for k, v in result.items() if k not in ("stdout", "weights_read")}}
        print(f"{key:>4} {result['outcome']:>9} {result['seconds']:>6} s  {what}: {result['said'][:150]}", flush=True)

    def late(folder, result):  # a refusal after weights were read (a progress bar ran) came after heavy work
        if result["outcome"] == "error" and result["weights_read"]:
            return f"refused only after reading weights ({result['seconds']} s): {result['said']}"
        return None

    def shipped(folder: Path, *extra, heal: str = "0") -> None:  # a finished ship to damage
        done = run(ship(tiny, "slim", *extra, heal=heal), folder, code)
        assert done["rc"] == 0, done

    def damage(name: str, text: str, drop_out: bool = True):
        def setup(folder):
            shipped(folder)
            if drop_out:
                shutil.rmtree(folder / "slim")
            target = folder / name
            target.write_text(text)
        return setup

    # -- tracebacks
    row("t1", "prune.run --target-params 110M --plan", ["-m", "prune.run", "--model", "smollm2-135m",
                                                         "--target-params", "110M", "--plan"])
    row("t2", "prune.ship --target-params below one block", ship(tiny, "s", "--target-params", str(params // 50)),
        check=late)
    row("t3", "prune.ship --model smollm2-135m --target-params 110M --time-budget 1s",
        ["-m", "prune.ship", "--model", "smollm2-135m", "--target-params", "110M", "--time-budget", "1s",
         "--engine", "transformers", "--out", "s"],
        check=late, timeout=120)  # a run that never checks its budget ships SmolLM2 for half an hour
    for key, recipe in (("t4", "protect: 5"), ("t5", "protect: 0.5"), ("t6", "load: {model: MODEL, dtype: 7}")):
        text = (f"load: {{model: {tiny}}}\ndrop: 1\n{recipe}\n" if "load" not in recipe else
                f"drop: 1\n{recipe.replace('MODEL', str(tiny))}\n")
        row(key, f"a recipe with {recipe.replace('MODEL, ', '')}",
            ["-m", "prune.run", "--recipe", "r.yaml", "--data", TEXT, "--samples", "4", "--seq-len", "32"],
            setup=lambda f, t=text: (f / "r.yaml").write_text(t))
    slim = ("import prune, torch\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"tok = AutoTokenizer.from_pretrained('{tiny}')\n")
    row("t7", "prune.slim of a model on the meta device", api(
        slim + f"config = AutoModelForCausalLM.from_pretrained('{tiny}').config\n"
        "with torch.device('meta'):\n    m = AutoModelForCausalLM.from_config(config)\n"
        "prune.slim(m, tok, drop=1)"))
    row("t8", "prune.slim(model, tokenizer=None)", api(
        slim + f"m = AutoModelForCausalLM.from_pretrained('{tiny}')\nprune.slim(m, None, drop=1)"))
    row("t9", "prune.slim('a string', tokenizer)", api(slim + "prune.slim('smollm2-135m', tok, drop=1)"))
    row("t10", "prune.slim with a tokenizer whose ids run past the vocabulary", api(
        slim + f"big = AutoTokenizer.from_pretrained('{tiny}')\n"
        f"m = AutoModelForCausalLM.from_pretrained('{tiny}')\nm.resize_token_embeddings(16)\n"
        "prune.slim(m, big, drop=1)"))
    row("t11", "prune.slim(..., protect=5)", api(
        slim + f"m = AutoModelForCausalLM.from_pretrained('{tiny}')\nprune.slim(m, tok, drop=1, protect=5)"))
    row("t12", "garbage OUT.work/plan.json, same command", ship(tiny, "slim"),
        setup=damage("slim.work/plan.json", "{not json"))
    row("t13", "garbage OUT.work/ship.json, same command", ship(tiny, "slim"),
        setup=damage("slim.work/ship.json", "{not json"))
    row("t14", "garbage OUT/ship.json, same command", ship(tiny, "slim"),
        setup=damage("slim/ship.json", "{not json", drop_out=False))

    def bad_choice(folder):
        shipped(folder)
        shutil.rmtree(folder / "slim")
        path = folder / "slim.work" / "shortlist.json"
        data = json.loads(path.read_text())
        data["chosen"] = 99
        path.write_text(json.dumps(data))
    row("t15", "shortlist.json whose choice is out of range, same command", ship(tiny, "slim"), setup=bad_choice)
    row("t16", "a file named OUT.work in the way", ship(tiny, "slim"),
        setup=lambda f: (f / "slim.work").write_text("mine"))

    def healed_then_removed(folder):
        shipped(folder, heal="20")
        shutil.rmtree(folder / "slim")
    row("t17", "after a ship whose heal ran (--heal-steps 20), rm -rf OUT and the same command",
        ship(tiny, "slim", heal="20"), setup=healed_then_removed,
        check=lambda f, r: None if r["outcome"] == "ran" else r["said"])
    for key, value in (("t18", "nan"), ("t19", "1e400")):
        row(key, f"--time-budget {value}", ship(tiny, "s", "--time-budget", value), check=late)

    def pickled(folder):
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tiny)
        model.config.save_pretrained(folder / "m")
        # a pickle that names a function: torch.load(weights_only=True) refuses it unexecuted
        torch.save({**model.state_dict(), "payload": os.system}, folder / "m" / "pytorch_model.bin")
        shutil.copy(tiny / "tokenizer.json", folder / "m")
        shutil.copy(tiny / "tokenizer_config.json", folder / "m")
    row("t20", "prune.load of a folder whose weights are a pickle", api("import prune\nprune.load('m')"),
        setup=pickled)

    # -- silently wrong
    def card_command(folder, result):
        card = (folder / "slim" / "README.md").read_text()
        lines = [line.strip() for line in card.splitlines() if "python -m prune.ship" in line]
        if not lines:
            return "no prune.ship command on the card"
        command = lines[0].strip("`$ ")
        wanted = ("--protect", "--dtype", "--batch-size", "--time-budget 150")
        missing = [flag for flag in wanted if flag not in command]
        if missing:
            return f"the card's command lacks {', '.join(missing)}: {command}"
        again = run(["-c", f"import shlex, runpy, sys; sys.argv = shlex.split({command!r})[2:]; "
                           "sys.argv[0] = 'prune.ship'; runpy.run_module('prune.ship', run_name='__main__')"],
                    folder, code)
        if again["outcome"] != "ran" or "shipped already" not in again["stdout"]:
            return f"the card's own command on the same --out: {again['outcome']}: {again['said']}"
        return None
    def relative(folder):  # the card names files by their names: the paths given are relative ones
        shutil.copytree(tiny, folder / "tiny")
        shutil.copy(TEXT, folder / TEXT.name)
    row("w1", "the card's prune.ship command carries every option (and reruns as 'shipped already')",
        ship(Path("tiny"), "slim", "--protect", "0", "--dtype", "float32", "--batch-size", "2", "--time-budget",
             "150s", data=TEXT.name), setup=relative, check=card_command)

    def lying(folder, layers):
        shutil.copytree(tiny, folder / "m")
        config = json.loads((folder / "m" / "config.json").read_text())
        config["num_hidden_layers"] += layers
        (folder / "m" / "config.json").write_text(json.dumps(config))
    for key, layers in (("w2", 1), ("w3", -1)):
        row(key, f"a config.json with {layers:+d} num_hidden_layers against its weights",
            ["-m", "prune.run", "--model", "m", "--drop", "1", "--data", TEXT, "--samples", "4", "--seq-len", "32",
             "--out", "o"], setup=lambda f, n=layers: lying(f, n),
            check=lambda f, r: "it ran" if r["outcome"] == "ran" else None)

    # -- late
    row("l1", "--heldout missing.txt", ship(tiny, "s", "--heldout", "missing.txt", verify=True), check=late)

    def refused_first(folder):
        run(ship(tiny, "slim", "--target-params", str(params // 50)), folder, code)
    row("l2", "a plan refused, then the corrected command on the same --out", ship(tiny, "slim"),
        setup=refused_first, check=lambda f, r: None if r["outcome"] == "ran" else r["said"])

    # -- new user
    row("n1", "prune.save('x', 'out/')", api("import prune\nprune.save('x', 'out/')"))
    row("n2", "--time-budget -5m", ship(tiny, "s", "--time-budget", "-5m"))
    row("n3", "distill.run --steps -1", ["-m", "distill.run", "--student", tiny, "--teacher", tiny, "--out", "o",
                                         "--steps", "-1"],
        check=lambda f, r: None if "--steps" in r["said"] else f"blames another flag: {r['said']}")
    row("n4", "--model ./nope (a missing local folder)", ["-m", "prune.run", "--model", "./nope", "--drop", "1"],
        check=lambda f, r: None if "hub" not in r["said"] else f"blames the hub: {r['said']}")

    args.out.write_text(json.dumps({"code": str(code), "rows": rows}, indent=1) + "\n")
    counts: dict[str, int] = {}
    for result in rows.values():
        counts[result["outcome"]] = counts.get(result["outcome"], 0) + 1
    print(json.dumps(counts))
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
