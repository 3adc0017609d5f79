"""End-to-end tests of ``python -m distill.run`` on a tiny saved student/teacher pair, and its one-line errors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from distill.run import main
from prune.checkpoint.write import export_checkpoint
from prune.model.surgery import drop_blocks_
from tests.helpers import _TEXT, make_tiny_model, make_tiny_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def _student_report(teacher_dir: Path) -> dict:
    return {"source_model": str(teacher_dir), "model_name": str(teacher_dir), "num_blocks_before": 4,
            "num_blocks_after": 2, "dropped": [1, 2]}


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    """teacher/ (tiny llama + tokenizer), student/ (blocks 1 and 2 removed, plain export), data.txt."""
    root = tmp_path_factory.mktemp("pair")
    teacher, tokenizer = make_tiny_model("llama"), make_tiny_tokenizer()
    teacher.save_pretrained(root / "teacher")
    tokenizer.save_pretrained(root / "teacher")
    student = copy.deepcopy(teacher)
    drop_blocks_(student, [1, 2])
    export_checkpoint(student, tokenizer, root / "student", _student_report(root / "teacher"))
    (root / "data.txt").write_text(_TEXT * 20, encoding="utf-8")
    return {"root": root, "teacher": root / "teacher", "student": root / "student", "data": root / "data.txt"}


def _args(pair: dict, out: Path, *extra: str) -> list[str]:
    return ["--student", str(pair["student"]), "--out", str(out), "--data", str(pair["data"]), "--seq-len", "16",
            "--samples", "8", "--batch-size", "4", "--steps", "4", "--train", "all", "--lr", "1e-3", *extra]


def test_cli_distills_and_exports_a_checkpoint(pair, tmp_path, capsys):
    out = tmp_path / "distilled"
    assert main(_args(pair, out, "--save-every", "2", "--log-every", "1", "--heldout-samples", "3")) == 0
    printed = capsys.readouterr().out
    assert "wrote" in printed
    for name in ("config.json", "model.safetensors", "tokenizer.json", "layercut.json", "README.md", "train_log.jsonl"):
        assert (out / name).is_file(), name
    assert not (tmp_path / "distilled.work").exists()  # checkpoints removed after a successful export
    report = json.loads((out / "layercut.json").read_text())
    assert report["dropped"] == [1, 2]  # the student's own report is kept
    section = report["distill"]
    # the teacher named without the path of this machine (found from the student's model_path)
    assert section["steps"] == 4 and section["layout"] == [[0], [3]] and section["teacher"] == pair["teacher"].name
    assert str(pair["root"]) not in (out / "layercut.json").read_text() + (out / "README.md").read_text()
    assert section["config"]["train"] == "all" and section["peak_memory_bytes"] > 0
    assert section["final_loss"] > 0 and section["steps_per_second"] > 0
    # the loss on 3 sequences training never drew, beside 3 it did, before and after the 4 steps
    fit = section["generalisation"]
    assert fit["sequences"] == {"training": 3, "held_out": 3}
    assert fit["training"]["after"]["loss"] < fit["training"]["before"]["loss"]
    line = f"held-out loss {fit['held_out']['before']['loss']:.4g} -> {fit['held_out']['after']['loss']:.4g}"
    assert line in printed and line in (out / "README.md").read_text()
    assert json.loads((out / "config.json").read_text())["layercut_layout"] == [[0], [3]]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.num_hidden_layers == 2
    before = AutoModelForCausalLM.from_pretrained(pair["student"])
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, before.model.layers[0].mlp.up_proj.weight)
    assert len((out / "train_log.jsonl").read_text().splitlines()) == 4


def test_cli_resume_continues_from_the_kept_checkpoint(pair, tmp_path, capsys):
    out, work = tmp_path / "out", tmp_path / "work"
    assert main(_args(pair, out, "--work-dir", str(work), "--keep-checkpoints", "--save-every", "2")) == 0
    assert (work / "checkpoints" / "step-00000004.pt").is_file() and (work / "train_log.jsonl").is_file()
    capsys.readouterr()
    assert main(_args(pair, out, "--work-dir", str(work), "--resume", "--overwrite", "--steps", "6")) == 0
    assert "(from step 4)" in capsys.readouterr().out
    assert json.loads((out / "layercut.json").read_text())["distill"]["start_step"] == 4


def _error(capsys) -> str:
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1
    return errors[0]


def test_cli_resume_without_checkpoint_exits_2(pair, tmp_path, capsys):
    assert main(_args(pair, tmp_path / "out", "--resume")) == 2
    assert "no checkpoint" in _error(capsys)


def test_cli_refuses_to_discard_old_checkpoints(pair, tmp_path, capsys):
    out, work = tmp_path / "out", tmp_path / "work"
    assert main(_args(pair, out, "--work-dir", str(work), "--keep-checkpoints")) == 0
    assert main(_args(pair, tmp_path / "other", "--work-dir", str(work))) == 2
    assert "--resume" in _error(capsys)


def test_cli_rejects_a_teacher_with_another_hidden_size(pair, tmp_path, capsys):
    wide = make_tiny_model("llama", hidden_size=48)
    wide.save_pretrained(tmp_path / "wide")
    make_tiny_tokenizer().save_pretrained(tmp_path / "wide")
    assert main(_args(pair, tmp_path / "out", "--teacher", str(tmp_path / "wide"))) == 2
    assert "hidden size differs" in _error(capsys)


def test_cli_rejects_a_teacher_with_another_tokenizer(pair, tmp_path, capsys):
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(pair["teacher"])
    other.add_tokens(["zebra-token"])  # one more entry: a different vocabulary
    AutoModelForCausalLM.from_pretrained(pair["teacher"]).save_pretrained(tmp_path / "t2")
    other.save_pretrained(tmp_path / "t2")
    assert main(_args(pair, tmp_path / "out", "--teacher", str(tmp_path / "t2"))) == 2
    assert "tokenizers differ" in _error(capsys)


def test_cli_rejects_a_student_that_is_not_pruned(pair, tmp_path, capsys):
    argv = _args(pair, tmp_path / "out", "--teacher", str(pair["teacher"]))
    argv[1] = str(pair["teacher"])
    assert main(argv) == 2
    assert "not a pruned model" in _error(capsys)


def test_cli_replacements_mode_needs_replacements(pair, tmp_path, capsys):
    argv = _args(pair, tmp_path / "out")
    argv[argv.index("all")] = "replacements"
    assert main(argv) == 2
    assert "no replacement modules" in _error(capsys)


def test_cli_inf_weights_exit_2_before_training(pair, tmp_path, capsys):
    broken = AutoModelForCausalLM.from_pretrained(pair["student"])
    with torch.no_grad():
        broken.model.layers[1].mlp.down_proj.weight[0, 0] = float("inf")
    export_checkpoint(broken, make_tiny_tokenizer(), tmp_path / "broken", _student_report(pair["teacher"]))
    argv = _args(pair, tmp_path / "out")
    argv[1] = str(tmp_path / "broken")
    assert main(argv) == 2
    message = _error(capsys)
    # refused on load, naming the file and the tensor, before a step runs (a NaN loss mid-run: journeys/test_faults)
    assert "broken/model.safetensors holds NaN or inf in model.layers.1.mlp.down_proj.weight" in message
    assert "\n" not in message and not (tmp_path / "out").exists()


def test_cli_distills_a_linear_replacement_student_and_keeps_its_maps(pair, tmp_path):
    import prune
    from prune.checkpoint.save_load import save
    from prune.replace import ReplaceConfig, replace_blocks_

    loaded = prune.load(str(pair["teacher"]))
    ids = torch.randint(3, 320, (32, 16), generator=torch.Generator().manual_seed(0))
    replace_blocks_(loaded.model, [1, 2], ids, ReplaceConfig(method="linear", progress=False))
    save(loaded.model, loaded.tokenizer, tmp_path / "lin", _student_report(pair["teacher"]))
    out = tmp_path / "lin-distilled"
    argv = _args(pair, out)
    argv[1] = str(tmp_path / "lin")
    argv[argv.index("all")] = "replacements"
    assert main(argv) == 0
    assert (out / "replacements.safetensors").is_file()
    before, after = prune.load(str(tmp_path / "lin")).model, prune.load(str(out)).model
    assert after.config.layercut_layout == [[0, 1, 2], [3]]
    assert not torch.equal(after.model.layers[0].after.proj.weight, before.model.layers[0].after.proj.weight)
    torch.testing.assert_close(after.model.layers[1].mlp.up_proj.weight, before.model.layers[1].mlp.up_proj.weight)


def test_cli_rejects_bad_numbers_before_loading_anything(pair, tmp_path, capsys):
    assert main(_args(pair, tmp_path / "out", "--threads", "0")) == 2
    assert "--threads" in _error(capsys)
    assert main(_args(pair, tmp_path / "out", "--warmup-steps", "9")) == 2  # more than --steps 4
    assert "--warmup-steps" in _error(capsys)


@pytest.mark.parametrize(("flag", "value"), [("--steps", "-1"), ("--steps", "0"), ("--batch-size", "0"),
                                            ("--grad-accum", "-2")])
def test_a_count_the_samples_follow_is_named_itself(capsys, monkeypatch, flag, value):
    # --steps -1 was refused as "--samples 1: the default calibration ... takes a sequence from each of its 2
    # sources", a flag the user never typed (the sequences drawn are --steps x --batch-size x --grad-accum)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["--student", "s", "--out", "o", flag, value]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert err == [f"error: {flag} must be a positive integer, got {value}"]


def test_lora_targets_of_no_layer_name_are_one_line_before_any_model_loads(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["--student", "s", "--out", "o", "--train", "lora", "--lora-targets", "self_attn.q_proj"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "--lora-targets takes all-linear or a comma list" in err[0], err


@pytest.mark.parametrize(("argv", "samples"), [
    (["--steps", "20"], 80),  # 20 steps of 4: sampling the default 512 took 15 minutes for 80 sequences
    (["--steps", "20", "--grad-accum", "2", "--batch-size", "2"], 80),
    (["--steps", "1000"], 512),  # at most the default
    (["--steps", "20", "--samples", "300"], 300),  # typed: as typed
])
def test_without_samples_only_the_sequences_the_steps_read_are_drawn(argv, samples, monkeypatch):
    from distill.run import build_parser, config_from_args

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = config_from_args(build_parser().parse_args(["--student", "s", "--out", "o", *argv]))
    assert config.data.samples == samples
    monkeypatch.setenv("WORLD_SIZE", "2")  # accelerate launch: each process reads its own sequences
    config = config_from_args(build_parser().parse_args(["--student", "s", "--out", "o", *argv]))
    assert config.data.samples == (samples if "--samples" in argv else min(512, 2 * samples))


def test_the_summary_compares_means_of_steps_not_two_single_batches():
    from distill.run import loss_trend

    # a falling loss whose last batch is harder than the first: the single-batch comparison read 0.44 -> 0.451
    losses = [0.44, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.3, 0.3] * 2 + [0.451]
    assert loss_trend(losses, 0.451) == "loss 0.67 -> 0.3755 (means of the first and last 2 steps)"
    assert loss_trend([0.5], 0.5) == "loss 0.5"
