"""Faults as a user meets them: ``kill -9`` inside each long command, then the same command again; NaN/inf weights.

A killed run runs the real CLI in a process of its own through a small driver that sends itself SIGKILL at a
chosen point (``LAYERCUT_FAULT``): no ``finally`` block, signal handler or atexit hook runs, as with
``kill -9``, the OOM killer or a lost machine. The run after it is the plain ``python -m ...`` command,
and its figures are compared with an uninterrupted run's. Both start as ``python`` would, in a child forked from
a Python that has imported torch and transformers once (:mod:`tests.journeys.warm_python`), not paying that per run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.helpers import CONVERTER, NO_CONVERTER, byte_fallback_tokenizer, make_tiny_model, make_tiny_tokenizer
from tests.journeys.warm_python import WarmPython

REPO = Path(__file__).resolve().parents[2]

# Imports the CLI module named by argv[1], arms the fault LAYERCUT_FAULT names, and runs the CLI's main.
DRIVER = textwrap.dedent("""
    import importlib, os, pathlib, signal, sys

    def die():
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def die_after(module, name, when):
        real, calls = getattr(module, name), []

        def wrapped(*args, **kwargs):
            result = real(*args, **kwargs)
            calls.append(args)
            if when(len(calls), args):
                die()
            return result

        setattr(module, name, wrapped)

    fault = os.environ["LAYERCUT_FAULT"]
    if fault == "export-staging":  # the staging folder holds the weights, tokenizer and layercut.json
        import prune.checkpoint.write
        die_after(prune.checkpoint.write, "write_json", lambda n, args: args[0].name == "layercut.json")
    elif fault == "export-rename":  # the old --out moved aside, the new one not yet in its place
        real_rename = pathlib.Path.rename

        def rename(self, target):
            if self.name.endswith(".tmp"):
                die()
            return real_rename(self, target)

        pathlib.Path.rename = rename
    elif fault == "distill-checkpoint":  # half of step 4's checkpoint written
        import torch
        real_save = torch.save

        def save(obj, path, *args, **kwargs):
            real_save(obj, path, *args, **kwargs)
            if isinstance(obj, dict) and obj.get("step") == 4:
                os.truncate(path, os.path.getsize(path) // 2)
                die()

        torch.save = save
    elif fault == "compare-between":  # results.json written after the first cell, the second not begun
        import eval.compare.grid
        die_after(eval.compare.grid, "write_reports", lambda n, args: n == 2)
    elif fault == "compare-inside":  # the second cell pruned and exported, not yet measured
        import eval.compare.cells
        die_after(eval.compare.cells, "run_prune", lambda n, args: n == 2)
    elif fault == "teacher-cache":  # every array of the teacher cache written, the folder not yet renamed
        import distill.teacher_cache
        die_after(distill.teacher_cache, "_write_arrays", lambda n, args: True)
    elif fault == "distill-rank-1":  # the second of two processes dies in its third step (step 2 checkpointed)
        if os.environ.get("RANK") == "1":
            import distill.loop
            die_after(distill.loop.Run, "_micro_batch", lambda n, args: n == 3)
    elif fault == "decilm-staged":  # the DeciLM folder written under its temporary name, not yet renamed
        import prune.checkpoint.decilm
        die_after(prune.checkpoint.decilm, "_write_card", lambda n, args: True)
    elif fault == "gguf-converted":  # llama.cpp's converter wrote the file, not yet read back nor renamed
        import prune.checkpoint.gguf
        die_after(prune.checkpoint.gguf, "_run_converter", lambda n, args: True)
    elif fault == "ship-shortlist":  # the first candidate measured, the shortlist not written
        import prune.selection.repaired
        cls = prune.selection.repaired.RepairedCosts
        die_after(cls, "measure_sets", lambda n, args: n == 2)
    elif fault == "ship-build":  # the checkpoint written, its stage not marked done
        import ship.build
        die_after(ship.build, "run_prune", lambda n, args: True)
    elif fault == "ship-heal":  # the healing trained and measured, its stage not marked done
        import ship.heal
        # one measure, after the training: a float32 build's KL before is the shortlist's (ship.build.Built)
        die_after(ship.heal, "divergence", lambda n, args: n == 1)
    elif fault == "ship-heal-checkpoint":  # the heal's step-10 checkpoint in place, its training not finished
        import distill.loop
        die_after(distill.loop, "save_checkpoint", lambda n, args: args[1] == 10)
    elif fault == "ship-verify":  # the first engine check done and kept, the next not begun
        import ship.verify
        die_after(ship.verify, "write_json_atomic", lambda n, args: args[0].name == "serving.json")
    elif fault == "ship-card":  # the card written into the checkpoint, the checkpoint not yet moved to --out
        import ship.shipper
        die_after(ship.shipper, "write_json_atomic", lambda n, args: args[0].name == "ship.json"
                  and args[0].parent.name in ("checkpoint", "healed"))
    else:
        raise SystemExit(f"unknown fault {fault}")
    raise SystemExit(importlib.import_module(sys.argv[1]).main(sys.argv[2:]))
""")


def _env(root: Path, fault: str | None = None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "LAYERCUT_CACHE": str(root / "cache")}  # never the user's ~/.cache/layercut
    env.pop("LAYERCUT_FAULT", None)
    if fault is not None:
        env["LAYERCUT_FAULT"] = fault
    return env


@pytest.fixture(scope="module")
def python(tmp_path_factory):
    """Starts each command as ``python`` would, in a child forked with torch and transformers already imported."""
    server = WarmPython(_env(tmp_path_factory.mktemp("warm-python")))
    yield server
    server.close()


def run_killed(python: WarmPython, root: Path, fault: str, module: str, args: list) -> None:
    """``module``'s CLI with ``fault`` armed; asserts it died of SIGKILL (not an error before the fault)."""
    driver = root / "fault_driver.py"
    driver.write_text(DRIVER, encoding="utf-8")
    done = python.run([driver, module, *args], cwd=root, env=_env(root, fault))
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]


def run_again(python: WarmPython, root: Path, module: str, args: list) -> subprocess.CompletedProcess:
    """The plain ``python -m module ARGS`` a user types after the kill; asserts exit 0."""
    done = python.run(["-m", module, *args], cwd=root, env=_env(root))
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def in_process(main, args: list) -> int:
    """A CLI's ``main`` in this process (the uninterrupted reference); torch's thread count restored after."""
    threads = torch.get_num_threads()
    try:
        return main([str(a) for a in args])
    finally:
        torch.set_num_threads(threads)


def hidden(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def without(value, keys: set[str]):
    """``value`` with every mapping's ``keys`` left out, at any depth (wall-clock times differ between runs)."""
    if isinstance(value, dict):
        return {k: without(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [without(v, keys) for v in value]
    return value


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.fixture(scope="module")
def text_file(tmp_path_factory, sample_text) -> Path:
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text(sample_text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------------------------
# prune.run: killed while its export is staged, over an earlier output


@pytest.fixture(scope="module")
def prune_killed(tmp_path_factory, python, tiny_folder, text_file) -> dict:
    from prune.run import main

    root = tmp_path_factory.mktemp("prune-kill")
    out = root / "slim"
    args = ["--model", tiny_folder, "--data", text_file, "--samples", "8", "--seq-len", "32", "--drop", "2",
            "--threads", "1", "--out", out]
    assert in_process(main, args) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    run_killed(python, root, "export-staging", "prune.run", [*args, "--overwrite"])
    state = {"root": root, "out": out, "args": args, "before": before,
             "after_kill": {p.name: p.read_bytes() for p in out.iterdir()}, "hidden_after_kill": hidden(root)}
    run_again(python, root, "prune.run", [*args, "--overwrite"])
    state["hidden_after_rerun"] = hidden(root)
    return state


def test_prune_run_killed_in_its_export_keeps_the_previous_output_and_reruns_to_the_same(prune_killed):
    out, before = prune_killed["out"], prune_killed["before"]
    # the staging folder already held weights and layercut.json: none of it reached --out
    assert prune_killed["after_kill"] == before
    assert any(name.endswith(".tmp") for name in prune_killed["hidden_after_kill"]), "the fault did not fire"
    assert_same_tensors(load_file(out / "model.safetensors"), load_safetensors(before["model.safetensors"]))
    ignored = {"seconds", "fit_seconds", "overwrite"}  # the rerun's --overwrite is recorded in its config
    assert without(json.loads((out / "layercut.json").read_text()), ignored) == without(
        json.loads(before["layercut.json"]), ignored)


def test_a_rerun_clears_the_staging_folder_a_killed_export_left(prune_killed):
    assert prune_killed["hidden_after_rerun"] == []


def test_prune_run_killed_between_its_two_renames_keeps_the_previous_output(python, prune_killed):
    root = prune_killed["root"]
    out = root / "slim-rename"
    shutil.copytree(prune_killed["out"], out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    args = [*prune_killed["args"][:-1], out, "--overwrite"]
    run_killed(python, root, "export-rename", "prune.run", args)
    # the next command into that folder puts the previous output back (here: one without --overwrite, refused)
    from prune.run import main

    assert in_process(main, args[:-1]) == 2
    assert out.is_dir(), f"--out is gone; beside it: {hidden(root)}"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert not [name for name in hidden(root) if name.startswith(".slim-rename")]


# ---------------------------------------------------------------------------------------------------------------
# NaN / inf in a model's weights


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_prune_run_refuses_a_model_with_a_non_finite_weight(tiny_folder, text_file, tmp_path, capsys, bad):
    from prune.run import main

    model = AutoModelForCausalLM.from_pretrained(tiny_folder)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = bad
    model.save_pretrained(tmp_path / "broken")
    make_tiny_tokenizer().save_pretrained(tmp_path / "broken")
    out = tmp_path / "slim"
    code = in_process(main, ["--model", tmp_path / "broken", "--data", text_file, "--samples", "8", "--seq-len", "32",
                             "--drop", "1", "--threads", "1", "--out", out])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "model.safetensors" in errors[0], errors
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------------------
# distill.run: killed while writing a checkpoint; NaN in training


@pytest.fixture(scope="module")
def student(tmp_path_factory, tiny_folder) -> Path:
    """The tiny llama with blocks 1 and 2 removed, exported as prune.run would, naming tiny_folder as its teacher."""
    from prune.checkpoint.write import export_checkpoint
    from prune.model.surgery import drop_blocks_

    model = AutoModelForCausalLM.from_pretrained(tiny_folder)
    drop_blocks_(model, [1, 2])
    folder = tmp_path_factory.mktemp("student") / "student"
    report = {"source_model": str(tiny_folder), "model_name": str(tiny_folder), "num_blocks_before": 4,
              "num_blocks_after": 2, "dropped": [1, 2]}
    export_checkpoint(model, make_tiny_tokenizer(), folder, report)
    return folder


def distill_args(student: Path, text_file: Path, out: Path) -> list:
    return ["--student", student, "--data", text_file, "--samples", "8", "--seq-len", "16", "--batch-size", "4",
            "--steps", "6", "--save-every", "2", "--log-every", "1", "--train", "all", "--lr", "1e-3",
            "--heldout-samples", "2", "--threads", "1", "--out", out]


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, student, text_file) -> Path:
    """The uninterrupted run's output."""
    from distill.run import main

    out = tmp_path_factory.mktemp("distill-ref") / "healed"
    assert in_process(main, distill_args(student, text_file, out)) == 0
    return out


def log_rows(folder: Path) -> list[dict]:
    return [without(json.loads(line), {"seconds"}) for line in (folder / "train_log.jsonl").read_text().splitlines()]


def assert_same_distillation(out: Path, reference: Path, start_step: int) -> None:
    """Same weights, final loss, held-out figures and log as the uninterrupted run; started from ``start_step``."""
    assert_same_tensors(load_file(out / "model.safetensors"), load_file(reference / "model.safetensors"))
    got = json.loads((out / "layercut.json").read_text())["distill"]
    want = json.loads((reference / "layercut.json").read_text())["distill"]
    assert got["start_step"] == start_step and got["steps"] == want["steps"] == 6
    assert got["final_loss"] == want["final_loss"] and got["final_terms"] == want["final_terms"]
    assert got["generalisation"] == want["generalisation"]
    assert log_rows(out) == log_rows(reference) and [row["step"] for row in log_rows(out)] == [1, 2, 3, 4, 5, 6]


def test_distill_run_killed_while_checkpointing_resumes_to_the_same_weights(python, tmp_path, student, text_file,
                                                                            distilled, capsys):
    from distill.run import main

    out, work = tmp_path / "healed", tmp_path / "healed.work"
    args = distill_args(student, text_file, out)
    run_killed(python, tmp_path, "distill-checkpoint", "distill.run", args)
    assert not out.exists()
    checkpoints = work / "checkpoints"
    # the half-written step-4 file stays under its temporary name; step 2 is the one a resume reads
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".")) == ["step-00000002.pt"]
    assert any(p.name.startswith(".step-00000004.pt.tmp") for p in checkpoints.iterdir()), "the fault did not fire"
    assert [json.loads(line)["step"] for line in (work / "train_log.jsonl").read_text().splitlines()] == [1, 2, 3, 4]

    # the same command again refuses, in one line, to drop the checkpoint, and says how to continue
    assert in_process(main, args) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "--resume" in errors[0] and "step 2" in errors[0], errors

    done = run_again(python, tmp_path, "distill.run", [*args, "--resume"])
    assert "(from step 2)" in done.stdout  # steps 1 and 2 are not trained again
    assert_same_distillation(out, distilled, start_step=2)
    assert not work.exists(), "the work folder (and the half checkpoint in it) is removed after the export"


def test_distill_run_killed_while_writing_its_teacher_cache_reruns_to_the_same_weights(python, tmp_path, student,
                                                                                       text_file):
    from distill.run import main

    cached = ["--teacher-cache", "topk=8"]
    reference = tmp_path / "reference"
    assert in_process(main, [*distill_args(student, text_file, reference / "healed"), *cached]) == 0
    out, work = tmp_path / "healed", tmp_path / "healed.work"
    args = [*distill_args(student, text_file, out), *cached]
    run_killed(python, tmp_path, "teacher-cache", "distill.run", args)
    assert not out.exists() and not (work / "teacher_cache").exists()
    assert [p.name for p in work.iterdir() if p.name.startswith(".teacher_cache.tmp-")], "the fault did not fire"
    done = run_again(python, tmp_path, "distill.run", args)  # nothing was trained: the same command starts again
    assert "teacher cache: top-8" in done.stdout and "written in" in done.stdout
    assert_same_tensors(load_file(out / "model.safetensors"), load_file(reference / "healed" / "model.safetensors"))
    assert not work.exists(), "the work folder (and the dead writer's staging folder) is removed after the export"


def spoil_losses_from(monkeypatch, first: int) -> None:
    """From the ``first``-th micro-batch (0-based) on, the loss is nan."""
    from distill.loop import Run

    real = Run._micro_batch

    def micro_batch(self, index):
        loss, terms = real(self, index)
        return (loss * float("nan") if index >= first else loss), terms

    monkeypatch.setattr(Run, "_micro_batch", micro_batch)


def test_nan_loss_stops_with_the_last_good_checkpoint_and_resumes_to_the_same_weights(tmp_path, student, text_file,
                                                                                      distilled, capsys, monkeypatch):
    from distill.checkpoints import load_checkpoint
    from distill.run import main

    out, work = tmp_path / "healed", tmp_path / "healed.work"
    args = distill_args(student, text_file, out)
    spoil_losses_from(monkeypatch, 4)  # the loss of step 5 is nan
    assert in_process(main, args) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "loss became nan at step 5" in errors[0] and "step-00000004.pt" in errors[0], errors
    assert "--resume" in errors[0] and not out.exists()
    kept = load_checkpoint(work / "checkpoints" / "step-00000004.pt")
    assert kept["step"] == 4 and all(torch.isfinite(t).all() for t in kept["model"].values())

    monkeypatch.undo()  # the cause fixed
    assert in_process(main, [*args, "--resume"]) == 0
    assert_same_distillation(out, distilled, start_step=4)


def test_nan_weights_are_never_checkpointed_as_good(tmp_path, student, text_file, capsys, monkeypatch):
    from distill.checkpoints import load_checkpoint
    from distill.loop import Run
    from distill.run import main

    real_step = Run.step

    def step(self, index):
        result = real_step(self, index)
        if index == 2:  # the third update overflows one weight (bf16 / fp16 training meets this)
            with torch.no_grad():
                self.trainable.parameters[0].view(-1)[0] = float("nan")
        return result

    monkeypatch.setattr(Run, "step", step)
    args = distill_args(student, text_file, tmp_path / "healed")
    assert in_process(main, args) == 2
    error = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("error: "))
    named = [p for p in (tmp_path / "healed.work" / "checkpoints").glob("step-*.pt") if p.name in error]
    assert named and named[0].name == "step-00000002.pt", error  # the checkpoint before the bad update
    assert not (tmp_path / "healed.work" / "checkpoints" / "step-00000004.pt").exists()
    assert all(torch.isfinite(t).all() for t in load_checkpoint(named[0])["model"].values()), (
        f"{named[0].name} holds non-finite weights")


# ---------------------------------------------------------------------------------------------------------------
# eval.compare: killed between two cells and inside one


def compare_args(tiny_folder: Path, text_file: Path, out: Path) -> list:
    return ["--model", tiny_folder, "--data", text_file, "--samples", "8", "--seq-len", "32", "--batch-size", "4",
            "--speed-tokens", "0", "--threads", "1", "--drop", "1", "--methods", "shortgpt,layercut-linear",
            "--out", out]


@pytest.fixture(scope="module")
def compared(tmp_path_factory, tiny_folder, text_file) -> dict:
    """The uninterrupted comparison's results.json."""
    from eval.compare.cli import main

    out = tmp_path_factory.mktemp("compare-ref") / "cmp"
    assert in_process(main, compare_args(tiny_folder, text_file, out)) == 0
    return json.loads((out / "results.json").read_text())


TIMES = {"seconds", "prune_seconds", "copy_seconds"}


def figures(results: dict) -> dict:
    """What a comparison measured, without its wall-clock times."""
    return without({k: results.get(k) for k in ("dense", "cells", "calibration", "heldout", "domains", "analysis")},
                   TIMES)


def weight_files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in (out / "cells").rglob("*")
                  if p.suffix in (".safetensors", ".bin", ".pt"))


@pytest.mark.parametrize("fault", ["compare-between", "compare-inside"])
def test_eval_compare_killed_resumes_without_recomputing_finished_cells(python, tmp_path, tiny_folder, text_file,
                                                                        compared, fault):
    out = tmp_path / "cmp"
    args = compare_args(tiny_folder, text_file, out)
    run_killed(python, tmp_path, fault, "eval.compare.cli", args)  # the module holding main
    # the record on disk is whole and holds the finished cell alone: nothing of the killed one is a result
    killed = json.loads((out / "results.json").read_text())
    assert sorted(killed["cells"]) == ["shortgpt@1"]
    assert figures(killed)["cells"]["shortgpt@1"] == figures(compared)["cells"]["shortgpt@1"]
    if fault == "compare-inside":  # kill -9 skips the finally that deletes a cell's weights; the rerun replaces them
        assert weight_files(out) == ["cells/layercut-linear-drop1/model.safetensors",
                                     "cells/layercut-linear-drop1/replacements.safetensors"]

    run_again(python, tmp_path, "eval.compare", args)
    results = json.loads((out / "results.json").read_text())
    assert figures(results) == figures(compared)
    assert [run["cells"] for run in results["timing"]["runs"]] == [1, 1]  # the rerun ran the unfinished cell alone
    assert weight_files(out) == [] and hidden(out) == []


# ---------------------------------------------------------------------------------------------------------------
# prune.ship: killed in each stage, then the same command


@pytest.fixture(scope="module")
def ship_args(tiny_folder, text_file) -> list:
    return ["--model", tiny_folder, "--data", text_file, "--samples", "16", "--seq-len", "32", "--heldout-samples",
            "2", "--drop", "2", "--engine", "transformers", "--threads", "1", "--repeats", "1", "--prompt-len", "16",
            "--new-tokens", "4", "--heal-steps", "20"]


@pytest.fixture(scope="module")
def shipped(tmp_path_factory, ship_args) -> Path:
    """The uninterrupted run, without the engine checks (the faults before them compare with it)."""
    from prune.ship import main

    root = tmp_path_factory.mktemp("ship-ref")
    assert in_process(main, [*ship_args, "--no-verify", "--out", root / "slim"]) == 0
    return root / "slim"


def _shortlist(folder: Path) -> dict:
    return without(json.loads((folder / "ship.json").read_text())["shortlist"], {"seconds"})


@pytest.mark.parametrize("fault", ["ship-shortlist", "ship-build", "ship-heal-checkpoint", "ship-heal", "ship-card"])
def test_prune_ship_killed_in_a_stage_continues_to_the_same_checkpoint(python, tmp_path, ship_args, shipped, fault):
    args = [*ship_args, "--no-verify", "--out", "slim"]
    run_killed(python, tmp_path, fault, "prune.ship", args)
    assert not (tmp_path / "slim").exists(), "a killed run left a partial --out"
    if fault == "ship-shortlist":  # the first repair's candidates are kept: the rerun measures only the others
        kept = json.loads((tmp_path / "slim.work" / "shortlist.partial.json").read_text())
        assert len(kept) == 1 and all(row["kl"] is not None for row in next(iter(kept.values())))
    if fault == "ship-heal-checkpoint":  # distill's checkpoint of step 10 (of 20) is kept for the rerun
        checkpoints = tmp_path / "slim.work" / "healed.work" / "checkpoints"
        assert [p.name for p in checkpoints.iterdir()] == ["step-00000010.pt"]
    done = run_again(python, tmp_path, "prune.ship", args)
    assert "continuing the run kept in" in done.stdout
    assert ("resuming from step 10" in done.stdout) == (fault == "ship-heal-checkpoint"), done.stdout
    assert _shortlist(tmp_path / "slim") == _shortlist(shipped)
    assert_same_tensors(load_file(tmp_path / "slim" / "model.safetensors"), load_file(shipped / "model.safetensors"))
    card = (tmp_path / "slim" / "README.md").read_text()
    assert card.startswith("---\n") and card.count("## What was chosen, and why") == 1


def test_prune_ship_killed_between_engine_checks_runs_only_the_checks_left(python, tmp_path, ship_args):
    args = [*ship_args, "--out", "slim"]
    run_killed(python, tmp_path, "ship-verify", "prune.ship", args)
    work = tmp_path / "slim.work"
    assert (work / "verify" / "serving.json").is_file()  # the held-out texts' check is done
    assert not (work / "verify" / "fidelity.json").is_file() and not (work / "verify" / "speed.json").is_file()
    done = run_again(python, tmp_path, "prune.ship", args)
    # the generation fidelity and speed checks alone, not the held-out texts' again
    assert done.stdout.count("verifying:") == 2, done.stdout
    assert "verifying: what the checkpoint writes" in done.stdout and "held-out text(s)" not in done.stdout
    card = (tmp_path / "slim" / "README.md").read_text()
    assert "## Speed in transformers" in card and "What it writes:" in card


@pytest.mark.skipif(CONVERTER is None, reason=NO_CONVERTER)
def test_prune_ship_killed_inside_its_gguf_export_reruns_to_the_same_file(python, tmp_path, text_file):
    model = tmp_path / "model"
    make_tiny_model("llama").save_pretrained(model)
    byte_fallback_tokenizer().save_pretrained(model)  # a vocabulary llama.cpp's converter reads
    args = ["--model", model, "--data", text_file, "--samples", "16", "--seq-len", "32", "--heldout-samples", "2",
            "--drop", "2", "--engine", "llamacpp", "--gguf-type", "f32", "--converter", CONVERTER, "--no-verify",
            "--heal-steps", "0"]
    run_again(python, tmp_path, "prune.ship", [*args, "--out", "reference"])
    run_killed(python, tmp_path, "gguf-converted", "prune.ship", [*args, "--out", "slim"])
    assert not (tmp_path / "slim").exists()
    assert list(tmp_path.glob("slim.work/checkpoint/gguf/.slim-f32.gguf*")), "the fault did not fire"
    done = run_again(python, tmp_path, "prune.ship", [*args, "--out", "slim"])
    assert "continuing the run kept in" in done.stdout and "writing the f32 GGUF" in done.stdout
    shipped, reference = tmp_path / "slim" / "gguf" / "slim-f32.gguf", tmp_path / "reference" / "gguf"
    assert shipped.read_bytes() == (reference / "reference-f32.gguf").read_bytes()
    assert not list(shipped.parent.glob(".*")), "the killed export's temporary file is left in the shipped folder"


# ---------------------------------------------------------------------------------------------------------------
# prune.export_gguf: killed once the converter wrote its file, before the file was checked and renamed


@pytest.mark.skipif(CONVERTER is None, reason=NO_CONVERTER)
def test_gguf_export_killed_before_its_check_keeps_the_earlier_file_and_reruns_whole(python, tmp_path):
    folder = tmp_path / "slim"
    make_tiny_model("llama").save_pretrained(folder)
    byte_fallback_tokenizer().save_pretrained(folder)
    out = tmp_path / "slim.gguf"
    out.write_bytes(b"the earlier export")
    args = [folder, "--out", out, "--converter", CONVERTER]
    run_killed(python, tmp_path, "gguf-converted", "prune.export_gguf", args)
    assert out.read_bytes() == b"the earlier export"  # the new file never replaced it unchecked
    assert [p.name for p in tmp_path.glob(".slim.gguf*")], "the fault did not fire"
    run_again(python, tmp_path, "prune.export_gguf", args)
    assert out.read_bytes()[:4] == b"GGUF" and not list(tmp_path.glob(".slim.gguf*"))


# ---------------------------------------------------------------------------------------------------------------
# distill.run on two processes (accelerate launch, gloo): one of them killed mid-step


def _launch_two(root: Path, pair: dict, out: Path, *extra, fault: str | None = None) -> subprocess.CompletedProcess:
    driver = root / "fault_driver.py"
    driver.write_text(DRIVER, encoding="utf-8")
    args = ["--student", pair["student"], "--out", out, "--data", pair["data"], "--seq-len", "16", "--samples", "16",
            "--heldout-samples", "0", "--batch-size", "2", "--steps", "4", "--save-every", "2", "--train", "all",
            "--lr", "1e-3", "--log-every", "1", *extra]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    target = [str(driver), "distill.run"] if fault else ["-m", "distill.run"]
    env = {**_env(root, fault), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([*launch, *target, *map(str, args)], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_one_of_two_distill_processes_killed_ends_the_launch_naming_it_and_resume_reaches_the_same_weights(
        tmp_path):
    import time

    from tests.helpers import make_student_pair

    pair = make_student_pair(tmp_path / "pair")
    reference = _launch_two(tmp_path, pair, tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr[-3000:]
    out = tmp_path / "healed"
    started = time.perf_counter()
    killed = _launch_two(tmp_path, pair, out, fault="distill-rank-1")
    # the launcher sees its worker die and stops the other, which would wait in the collective: no hang
    assert killed.returncode != 0 and time.perf_counter() - started < 120
    assert "local_rank: 1" in killed.stderr and "Signal 9 (SIGKILL)" in killed.stderr, killed.stderr[-3000:]
    checkpoints = tmp_path / "healed.work" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith(".")) == ["step-00000002.pt"]
    resumed = _launch_two(tmp_path, pair, out, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_tensors(load_file(out / "model.safetensors"), load_file(tmp_path / "reference" / "model.safetensors"))


# ---------------------------------------------------------------------------------------------------------------
# prune.decilm: killed with the DeciLM folder staged, over an earlier output


def test_decilm_export_killed_when_staged_keeps_the_earlier_output_and_reruns_to_the_same(python, tmp_path,
                                                                                          text_file):
    from transformers import LlamaConfig, LlamaForCausalLM

    from prune.decilm import main as decilm
    from prune.run import main

    # a width DeciLM's ffn_mult can say (tests/prune/checkpoint/test_decilm.py's tiny llama)
    model_folder = tmp_path / "tiny-decilm"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=48, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=320, max_position_embeddings=256, pad_token_id=0,
                                 bos_token_id=1, eos_token_id=2)).save_pretrained(model_folder)
    make_tiny_tokenizer().save_pretrained(model_folder)
    source = tmp_path / "units"
    assert in_process(main, ["--model", model_folder, "--data", text_file, "--samples", "8", "--seq-len", "32",
                             "--unit", "attention,mlp", "--drop", "2", "--replace", "none", "--threads", "1",
                             "--out", source]) == 0
    reference = tmp_path / "reference"
    assert in_process(decilm, [source, "--out", reference]) == 0
    out = tmp_path / "decilm"
    shutil.copytree(reference, out)
    (out / "earlier.txt").write_text("the earlier output")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    run_killed(python, tmp_path, "decilm-staged", "prune.decilm", [source, "--out", out, "--overwrite"])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert any(name.endswith(".tmp") for name in hidden(tmp_path)), "the fault did not fire"
    run_again(python, tmp_path, "prune.decilm", [source, "--out", out, "--overwrite"])
    assert not (out / "earlier.txt").exists() and not [n for n in hidden(tmp_path) if n.startswith(".decilm")]
    assert_same_tensors(load_file(out / "model.safetensors"), load_file(reference / "model.safetensors"))
    assert json.loads((out / "config.json").read_text()) == json.loads((reference / "config.json").read_text())
