"""``eval.bench heal-curve``: prune.ship's heal at several step counts on one checkpoint, timed and scored.

The bench's healed weights are ``ship.heal.heal``'s for the same checkpoint, rows and seed; its step-0 row is the
checkpoint as built.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eval.bench import heal_curve as bench
from eval.bench.cli import main
from eval.quality.perplexity import perplexity, tokenize_text
from prune.checkpoint.save_load import load
from prune.errors import EXIT_BAD_INPUT
from tests.helpers import _TEXT, make_student_pair, make_tiny_tokenizer

STEPS = 3
WINDOW, TOKENS = 64, 256  # the tiny model holds 256 positions: windows shorter than the bench's 512


def capturing(monkeypatch, module) -> list[dict[str, torch.Tensor]]:
    """The student's weights after each ``heal_training`` that ``module`` calls, in call order."""
    trained, healed = module.heal_training, []

    def keeping(student, *args, **kwargs):
        done = trained(student, *args, **kwargs)
        healed.append({name: tensor.detach().clone() for name, tensor in student.model.state_dict().items()})
        return done

    monkeypatch.setattr(module, "heal_training", keeping)
    return healed


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("heal-curve")
    pair = make_student_pair(root)
    ids = make_tiny_tokenizer()(_TEXT * 40)["input_ids"]
    calibration = torch.tensor(ids[: 16 * 64]).reshape(16, 64)  # 14 rows train, rows 7 and 15 measure
    save_file({"token_ids": calibration}, str(root / "calibration.safetensors"))
    held = root / "held.txt"
    held.write_text(_TEXT[::-1] * 10, encoding="utf-8")  # words in another order than the calibration's
    return {**pair, "root": root, "calibration": calibration, "held": held}


def bench_args(setup, *extra) -> list[str]:
    return ["heal-curve", "--model", str(setup["teacher"]), "--checkpoint", str(setup["student"]),
            "--calibration", str(setup["root"] / "calibration.safetensors"), "--heldout", f"held={setup['held']}",
            "--heldout-tokens", str(TOKENS), "--window", str(WINDOW), "--threads", "1", *extra]


@pytest.fixture(scope="module")
def curve(setup):
    """The bench at steps 0,3 written to OUT, and the weights its healed run left."""
    before = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as monkeypatch:
        healed = capturing(monkeypatch, bench)
        out = setup["root"] / "curve"
        try:
            code = main(bench_args(setup, "--steps", f"0,{STEPS}", "--out", str(out)))
        finally:
            torch.set_num_threads(before)
    assert code == 0
    return out, json.loads((out / "heal_curve.json").read_text()), healed


def test_the_bench_writes_its_rows_the_table_and_the_plot(setup, curve):
    out, results, healed = curve
    assert {p.name for p in out.iterdir()} == {"heal_curve.json", "heal_curve.md", "heal_curve.png"}
    assert (out / "heal_curve.png").read_bytes()[:4] == b"\x89PNG"
    built, trained = results["points"]
    assert [built["steps"], trained["steps"]] == [0, STEPS] and len(healed) == 1  # step 0 trains nothing
    assert built["seconds"] == 0 and built["tokens"] == 0 and trained["seconds"] > 0
    assert trained["tokens"] == STEPS * 4 * 64  # 4 rows a step, the 64-token rows as they are (under 128)
    assert results["heal"]["train_rows"] == 14 and results["heal"]["measure_rows"] == 2
    assert trained["kl"] != built["kl"] and trained["domains"]["held"] != built["domains"]["held"]
    # the built checkpoint's KL is what ship's heal must lower to keep a run
    assert results["kl_before"] == built["kl"] and not built["kept"]
    assert trained["kept"] == (trained["kl"] < built["kl"])
    table = (out / "heal_curve.md").read_text()
    assert "| steps | minutes | tokens trained | KL (measuring rows) | held ppl | geometric mean |" in table
    assert f"| {STEPS} | " in table and "| original | - | - | 0 |" in table


def test_step_zero_is_the_checkpoint_as_built_and_the_original_is_scored_once(setup, curve, one_thread):
    _, results, _ = curve
    ids = tokenize_text(make_tiny_tokenizer(), setup["held"].read_text(encoding="utf-8"))[:TOKENS]
    for folder, row in ((setup["student"], results["points"][0]), (setup["teacher"], results["original"])):
        model = load(folder, dtype="float32").model
        expected = perplexity(model, ids, seq_len=WINDOW, batch_size=4, progress=False).perplexity
        assert row["domains"]["held"] == pytest.approx(expected, rel=1e-6)
        assert row["heldout_ppl"] == pytest.approx(expected, rel=1e-6)  # one text: its own mean


def test_the_healed_weights_are_ship_heals(setup, curve, tmp_path, monkeypatch):
    import ship.heal
    from prune.pipeline.config import PruneConfig
    from ship.config import ShipConfig

    _, _, (bench_weights,) = curve
    healed = capturing(monkeypatch, ship.heal)
    config = ShipConfig(prune=PruneConfig(load={"model": str(setup["teacher"])}, drop=2), out=str(tmp_path / "slim"),
                        engine="transformers", heal_steps=STEPS)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as the bench's --threads 1
    try:
        healing = ship.heal.heal(config, STEPS, "the test's", setup["student"], tmp_path / "healed",
                                 setup["calibration"], config.prune.load.load(), say=lambda line: None)
    finally:
        torch.set_num_threads(before)
    (ship_weights,) = healed
    assert sorted(ship_weights) == sorted(bench_weights)
    assert max(float((ship_weights[name] - bench_weights[name]).abs().max()) for name in ship_weights) == 0.0
    if healing.kept:  # what ship writes is those weights
        written = load_file(str(tmp_path / "healed" / "model.safetensors"))
        assert all(torch.equal(written[name], bench_weights[name]) for name in written)


def test_heal_data_adds_its_rows_to_what_the_heal_trains_on(setup, tmp_path, one_thread):
    out = tmp_path / "more"
    code = main(bench_args(setup, "--steps", "0", "--heal-data", str(setup["held"]), "--heal-samples", "4",
                           "--out", str(out)))
    assert code == 0
    results = json.loads((out / "heal_curve.json").read_text())
    assert results["heal_data"] == {"source": str(setup["held"]), "rows": [4, 64]}
    assert results["heal"]["train_rows"] == 14 + 4 and results["heal"]["measure_rows"] == 2  # judged as before
    assert f"18 training rows, 4 sequences of them from {setup['held']}" in (out / "heal_curve.md").read_text()


def test_train_flags_heal_otherwise_and_are_recorded(setup, tmp_path, monkeypatch, one_thread):
    import distill.heal

    asked = []
    trained = distill.heal.DistillStep

    def step(options, config):
        asked.append(options)
        return trained(options, config)

    monkeypatch.setattr(distill.heal, "DistillStep", step)
    out = tmp_path / "all"
    assert main(bench_args(setup, "--steps", "2", "--train", "all", "--out", str(out))) == 0
    assert main(bench_args(setup, "--steps", "2", "--lora-r", "4", "--lora-alpha", "8", "--lr", "5e-5")) == 0
    assert [o["train"] for o in asked] == ["all", "lora"] and (asked[1]["lora_r"], asked[1]["lora_alpha"]) == (4, 8)
    assert "lr" not in asked[0] and asked[1]["lr"] == 5e-5  # --lr reaches the training
    assert all(o["teacher_cache"] == distill.heal.HEAL_OPTIONS["teacher_cache"] for o in asked)  # the rest is ship's
    results = json.loads((out / "heal_curve.json").read_text())
    heal = results["heal"]
    # what was trained is recorded, not ship's LoRA settings beside it
    assert heal["train"] == "all" and heal["lr"] == 2e-5 and "lora_r" not in heal and not heal["as_ship"]
    assert "otherwise than prune.ship heals by default (train all, lr 2e-05," in (out / "heal_curve.md").read_text()
    assert results["points"][0]["kl"] != results["kl_before"]


def test_train_blocks_heals_as_ship_does_block_by_block_and_is_recorded(setup, tmp_path, one_thread):
    """``--train blocks``: the two blocks beside the cut (blocks 1-2 removed: the kept blocks 0 and 1, towards the
    original's block 3) trained on the fitting rows as they are, to the KL the heal block by block itself gives;
    ``--lr`` and ``--loss`` change it, and the record and table say what trained."""
    from distill.heal import heal_student
    from distill.local_heal import heal_built
    from prune.selection.repaired import divergence, split_rows

    out = tmp_path / "blocks"
    assert main(bench_args(setup, "--steps", f"0,{STEPS}", "--train", "blocks", "--out", str(out))) == 0
    results = json.loads((out / "heal_curve.json").read_text())
    built, trained = results["points"]
    heal = results["heal"]
    assert heal["train"] == "blocks" and heal["lr"] == 1e-3 and heal["loss"] == "rms" and heal["as_ship"]
    assert heal["train_rows"] == 14 and heal["seq_len"] == 64 and heal["teacher_cache"] is None
    fit, measure = split_rows(setup["calibration"])
    student, report = heal_student(setup["student"], "float32", "cpu")
    teacher = load(setup["teacher"], dtype="float32").model
    records = heal_built(student.model, teacher, report, fit, steps=STEPS, batch_size=4, seed=0, progress=False,
                         say=lambda _: None)
    assert [r["blocks"] for r in records] == [[0, 1]] and records[0]["target"] == 3
    # one cut, the batches its steps drew: 4 rows of 64 tokens, or the last 2 of the 14 fitting rows
    assert trained["tokens"] == records[0]["tokens_read"] and STEPS * 2 * 64 <= trained["tokens"] <= STEPS * 4 * 64
    assert trained["kl"] == pytest.approx(divergence(student.model, teacher, measure, 4)["kl"], rel=1e-6)
    assert trained["kl"] < built["kl"]
    assert "as prune.ship --offload sequential heals (train blocks, lr 0.001, loss rms, 4 x 64 tokens a step of " \
           "each cut" in (out / "heal_curve.md").read_text()
    other = tmp_path / "other"
    assert main(bench_args(setup, "--steps", str(STEPS), "--train", "blocks", "--lr", "1e-4", "--loss", "mse",
                           "--out", str(other))) == 0
    again = json.loads((other / "heal_curve.json").read_text())
    assert (again["heal"]["lr"], again["heal"]["loss"], again["heal"]["as_ship"]) == (1e-4, "mse", False)
    assert again["points"][0]["kl"] != trained["kl"]


@pytest.mark.parametrize(("flags", "says"), [
    (("--loss", "mse"), "--loss is what the heal block by block minimises: pass --train blocks"),
    (("--train", "blocks", "--lora-r", "8"), "pass --train lora, or drop them"),
    (("--lr", "0"), "--lr must be a positive number at most 1"),
    (("--lr", "inf"), "--lr must be a positive number at most 1"),
])
def test_block_heal_flags_out_of_place_are_one_line(setup, capsys, one_thread, flags, says):
    code = main([*bench_args(setup), *flags])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_BAD_INPUT and says in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--lora-r", "0", "--lora-r must be a positive integer"),
    ("--lora-alpha", "-1", "--lora-alpha must be positive"),
    ("--steps", "0,-5", "--steps takes distinct step counts of 0 or more"),
    ("--steps", "ten", "--steps takes distinct step counts of 0 or more"),
    ("--steps", "50,50", "--steps takes distinct step counts of 0 or more"),
    ("--checkpoint", "no/such/folder", "--checkpoint no/such/folder: no checkpoint there"),
    ("--calibration", "no/such.safetensors", "no such file"),
    ("--window", "1", "--window must be at least 2"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_model_loads(setup, capsys, one_thread, flag, value, says):
    code = main([*bench_args(setup), flag, value])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_BAD_INPUT and says in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("flag", [("--lora-r", "16"), ("--lora-targets", "q_proj")])
def test_lora_flags_with_every_weight_trained_are_one_line(setup, capsys, one_thread, flag):
    code = main([*bench_args(setup), "--train", "all", *flag])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_BAD_INPUT and "pass --train lora, or drop them" in err and len(err.splitlines()) == 1, err


def test_lora_targets_adapt_those_layers_and_are_recorded(setup, tmp_path, monkeypatch, one_thread):
    import distill.trainable

    adapted = []
    apply = distill.trainable.apply_lora

    def spy(student, config, exclude=None):
        model = apply(student, config, exclude)
        adapted.extend(name for name, _ in model.named_modules() if name.endswith(".lora_A"))
        return model

    monkeypatch.setattr(distill.trainable, "apply_lora", spy)
    out = tmp_path / "attention"
    assert main(bench_args(setup, "--steps", "2", "--lora-targets", "q_proj,o_proj", "--out", str(out))) == 0
    kinds = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name in adapted}
    assert kinds == {"q_proj", "o_proj"}, kinds
    heal = json.loads((out / "heal_curve.json").read_text())["heal"]
    assert heal["lora_targets"] == "q_proj,o_proj" and not heal["as_ship"]
    assert "adapters on q_proj,o_proj" in (out / "heal_curve.md").read_text()


def test_a_misspelt_lora_target_is_one_line_naming_the_models_layers(setup, capsys, one_thread):
    code = main([*bench_args(setup), "--steps", "2", "--lora-targets", "q_porj"])
    # refused once the original loads (its progress bar above), before anything is measured: one line of error
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert code == EXIT_BAD_INPUT and len(err) == 1, err
    assert "no Linear layer named q_porj; theirs are q_proj, k_proj, v_proj, o_proj" in err[0], err


def test_a_window_longer_than_the_model_holds_is_one_line(setup, capsys, one_thread):
    code = main([*bench_args(setup), "--window", "512"])
    err = capsys.readouterr().err.strip()  # after the original loads: its progress bar, then the one line
    assert code == EXIT_BAD_INPUT and "Traceback" not in err, err
    assert "holds 256 positions: pass --window 256 or less" in err.splitlines()[-1]


def test_tasks_are_scored_at_every_point_and_for_the_original_once(setup, tmp_path, one_thread, shared_data,
                                                                    monkeypatch):
    scored = []
    measure = bench.CurveTasks.measure

    def counting(self, model, tokenizer):
        scored.append(model)
        return measure(self, model, tokenizer)

    monkeypatch.setattr(bench.CurveTasks, "measure", counting)
    out = tmp_path / "tasks"
    code = main(bench_args(setup, "--steps", "0,2", "--tasks", "piqa", "--limit", "4", "--data-dir",
                           str(shared_data), "--out", str(out)))
    assert code == 0
    results = json.loads((out / "heal_curve.json").read_text())
    assert len(scored) == 3  # the original once, then each point
    built, trained = results["points"]
    for row in (results["original"], built, trained):
        accuracy = row["tasks"]["piqa"]
        assert accuracy * 4 == round(accuracy * 4) and len(row["task_rows"]["piqa"]) == 4
        assert row["task_stderr"]["piqa"] == pytest.approx((accuracy * (1 - accuracy) / 3) ** 0.5)
    # 4 rows of a random model are not clearly above chance: the plain task mean, as eval.compare falls back
    assert results["tasks"]["quality"] == "task_mean" or built["tasks"]["piqa"] > 0.5  # 4 of 4 right: counted
    if results["tasks"]["quality"] == "task_mean":  # as eval.compare falls back when no task is counted
        assert built["figures"]["task_mean"] == built["tasks"]["piqa"] and "vs_built" not in built
        assert trained["vs_built"]["gap"] == pytest.approx(trained["tasks"]["piqa"] - built["tasks"]["piqa"])
    table = (out / "heal_curve.md").read_text()
    assert "| geometric mean | piqa | task mean | retention | vs step 0 |" in table
    assert "Tasks (the first 4 rows of each task)" in table
    assert (out / "heal_curve.png").read_bytes()[:4] == b"\x89PNG"


def _task_row(scores: dict[str, list[int]], steps: int | None = None) -> dict:
    """An eval.compare-like row of 0/1 answers per task (``steps``: a curve's point, at 1 minute a 100 steps)."""
    row = {"tasks": {t: sum(r) / len(r) for t, r in scores.items()}, "task_rows": scores,
           "task_stderr": {t: (sum(r) / len(r) * (1 - sum(r) / len(r)) / (len(r) - 1)) ** 0.5
                           for t, r in scores.items()}}
    if steps is not None:
        row.update({"steps": steps, "minutes": steps / 100, "tokens": steps * 512, "kl": 1 / (1 + steps),
                    "domains": {"held": 30.0 - steps / 100}, "heldout_ppl": 30.0 - steps / 100})
    return row


ORIGINAL = {"arc_easy": [1] * 14 + [0] * 6, "piqa": [1, 0] * 10}  # 0.70 (chance 0.25); piqa at its chance 0.5


def test_retention_counts_the_tasks_the_original_is_above_chance_on_and_pairs_the_gap():
    original = _task_row(ORIGINAL)
    built = _task_row({"arc_easy": [1] * 8 + [0] * 12, "piqa": [1, 0] * 10}, 0)
    healed = _task_row({"arc_easy": [1] * 10 + [0] * 10, "piqa": [1, 0] * 10}, 100)
    summary = bench.task_summary([built, healed], original, ["arc_easy", "piqa"])
    # piqa's 0.50 is within 2 standard errors of its 0.5 chance: only arc_easy is counted
    assert summary["quality"] == "retention" and summary["counted"] == ["arc_easy"] and "piqa" in summary["excluded"]
    assert original["figures"]["retention"] == pytest.approx(1.0)
    assert built["figures"]["retention"] == pytest.approx((0.40 - 0.25) / (0.70 - 0.25))
    assert healed["figures"]["retention"] == pytest.approx((0.50 - 0.25) / (0.70 - 0.25))
    assert healed["vs_built"]["gap"] == pytest.approx(0.10 / 0.45) and "vs_built" not in built
    # paired: two of 20 answers changed, so the gap's error is their spread, not the two errors combined
    diff = torch.tensor([0.0] * 8 + [1.0, 1.0] + [0.0] * 10)
    assert healed["vs_built"]["gap_stderr"] == pytest.approx(float((diff.var() / 20) ** 0.5) / 0.45)
    assert healed["vs_built"]["clear"] is False  # 0.222 < 2 x 0.145


def test_a_gap_of_nothing_is_a_tie_and_without_step_0_there_is_no_gap():
    original = _task_row(ORIGINAL)
    same = {"arc_easy": [1] * 8 + [0] * 12, "piqa": [1, 0] * 10}
    points = [_task_row(same, 0), _task_row(same, 50)]
    bench.task_summary(points, original, ["arc_easy", "piqa"])
    assert points[1]["vs_built"] == {"gap": 0.0, "gap_stderr": 0.0, "clear": False}
    later = [_task_row(same, 50), _task_row(same, 100)]  # --steps 50,100: none is the checkpoint as built
    bench.task_summary(later, original, ["arc_easy", "piqa"])
    assert all("vs_built" not in point for point in later)


def test_the_table_and_plot_carry_retention_and_a_task_lm_eval_gave_no_score_for(tmp_path):
    original = _task_row(ORIGINAL)
    built = _task_row({"arc_easy": [1] * 8 + [0] * 12, "piqa": [1, 0] * 10}, 0)
    healed = _task_row({"arc_easy": [1] * 16 + [0] * 4}, 200)  # piqa missing from lm-eval's output
    names = ["arc_easy", "piqa"]
    results = {"model": "m", "checkpoint": "/x/checkpoint", "heldout": {"domains": {"held": {}}, "window": 64},
               "heal": {**bench.HEAL_OPTIONS, "seed": 0, "seq_len": 64, "train_rows": 14, "measure_rows": 2,
                        "measure_tokens": 128},
               "original": {"domains": {"held": 20.0}, "heldout_ppl": 20.0, **original}, "points": [built, healed]}
    results["tasks"] = {"names": names, "limit": "400~:-500",
                        **bench.task_summary(results["points"], results["original"], names)}
    table = bench.heal_curve_markdown(results)
    lines = table.splitlines()
    assert "| held ppl | geometric mean | arc_easy | piqa | task mean | retention | vs step 0 |" in lines[2]
    assert lines[-3].startswith("| original |") and lines[-3].endswith(" | 100.0 ± 23.4 | - |")
    # the healed point: arc_easy 80 % ((0.80-0.25)/0.45 = 122.2 % retention), piqa "-", +88.9 points, clear
    assert "| 80.0 ± 9.2 | - | 80.0 ± 9.2 | 122.2 ± 20.4 | +88.9 ± 25.0 |" in lines[-4]
    assert "400 rows of each task drawn at random" in lines[-1] and "left out: piqa" in lines[-1]
    assert bench.plot_heal_curve(results, tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("flags", [["--limit", "4"], ["--data-dir", "somewhere"]])
def test_rows_of_tasks_without_tasks_is_one_line_and_exit_2(setup, capsys, one_thread, flags):
    code = main([*bench_args(setup), *flags])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_BAD_INPUT and "pass --tasks too" in err and len(err.splitlines()) == 1, err
