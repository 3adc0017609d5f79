"""What a new user runs into in the first hour: early one-line errors, Ctrl-C, and output that says the truth."""

import json
import sys

import pytest
import torch

from prune.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED
from tests.helpers import run_prune_cli as run


def small(folder, *extra):
    return ["--model", folder, "--samples", "8", "--seq-len", "32", "--batch-size", "4", *extra]


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if any weight is loaded: the checks under test must come first."""
    from prune.checkpoint.load_config import LoadConfig

    monkeypatch.setattr(LoadConfig, "load", lambda *a, **k: pytest.fail("weights loaded before the check"))


@pytest.mark.parametrize("extra, message", [
    (["--drop", "3"], "cannot drop 3 blocks: only 2 of 4 are not protected ([0, 3])"),
    (["--drop", "1", "--protect", "0,50"], "--protect 0,50: the model has blocks 0..3"),
    (["--drop", "4"], "--drop 4 asks for 4 of the model's 4 blocks"),
    (["--drop", "1", "--seq-len", "1000", "--samples", "2"], "--seq-len 1000 exceeds the model's 256 positions"),
    (["--drop", "1", "--replace", "block"], "--replace block puts one block in place of a span of 2 or more blocks, "
     "and --drop 1 makes a span of 1: drop 2 or more blocks, or use --replace linear"),
])  # fmt: skip
def test_block_and_length_checks_come_before_any_weight(tiny_folder, tmp_path, capsys, no_weights, extra, message):
    code, _, err = run(capsys, *small(tiny_folder, "--out", tmp_path / "o", *extra))
    assert code == EXIT_BAD_INPUT and message in err and err.count("\n") == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_unwritable_out_fails_before_any_weight(tiny_folder, capsys, no_weights):
    code, _, err = run(capsys, *small(tiny_folder, "--drop", "1", "--out", "/proc/layercut-x"))
    assert code == EXIT_BAD_INPUT and "cannot write in /proc" in err and err.count("\n") == 1


def test_latin1_text_is_one_line(tiny_folder, tmp_path, capsys, no_weights):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("Élisabeth's naïve café, déjà vu. ".encode("latin-1") * 200)
    code, _, err = run(capsys, *small(tiny_folder, "--data", latin1, "--drop", "1", "--out", tmp_path / "o"))
    assert code == EXIT_BAD_INPUT and err.count("\n") == 1
    assert "is not UTF-8 text (byte 0xc9 at offset 0)" in err and "iconv -f latin1 -t utf-8" in err


def test_ctrl_c_exits_130_and_leaves_no_folder(tiny_folder, tmp_path, capsys, monkeypatch):
    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("prune.pipeline.runner.write_json", interrupted)  # inside the temporary export folder
    code, _, err = run(capsys, *small(tiny_folder, "--out", tmp_path / "scores"))
    assert code == EXIT_INTERRUPTED and err.splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its temporary sibling


def test_summary_tells_what_was_lost_and_the_truth_about_blocks(tiny_folder, tmp_path, capsys):
    out = tmp_path / "block"
    code, stdout, err = run(capsys, *small(tiny_folder, "--drop", "2", "--protect", "0", "--select", "span",
                                           "--score", "angular", "--replace", "block", "--replace-steps", "2",
                                           "--out", out))  # fmt: skip
    assert code == 0, err
    report = json.loads((out / "layercut.json").read_text())
    # one trained block stands in for the two removed: 4 -> 3, as saved
    assert report["num_blocks_after"] == 3 == json.loads((out / "config.json").read_text())["num_hidden_layers"]
    assert "4 blocks -> 3" in stdout
    spans = report["span_scores"]
    assert spans[0]["blocks"] == [report["dropped"][0], report["dropped"][-1]]
    assert spans[0]["angular"] <= min(s["angular"] for s in spans)  # the chosen span is the closest pair
    assert f"spans by angular (best first): {spans[0]['blocks'][0]}-{spans[0]['blocks'][1]}:" in stdout
    heldout = report["heldout"]
    assert heldout["samples"] == 8 and heldout["ratio"] == pytest.approx(heldout["pruned"] / heldout["original"])
    assert f"original {heldout['original']:.3f} -> {heldout['pruned']:.3f}" in stdout
    assert "## Held-out perplexity" in (out / "README.md").read_text()


def test_heldout_sequences_are_disjoint_from_calibration_and_leave_it_unchanged(tiny_tokenizer, sample_text,
                                                                                 tmp_path):
    from prune.data.calibration import DataConfig, calibration_data

    text = tmp_path / "t.txt"
    text.write_text(sample_text)
    with_heldout = calibration_data(tiny_tokenizer, DataConfig(str(text), samples=8, seq_len=32, heldout_samples=4))
    without = calibration_data(tiny_tokenizer, DataConfig(str(text), samples=8, seq_len=32, heldout_samples=0))
    assert torch.equal(with_heldout.token_ids, without.token_ids) and without.heldout_ids is None
    calibration = {tuple(row.tolist()) for row in with_heldout.token_ids}
    assert with_heldout.heldout_ids.shape == (4, 32)
    assert not calibration & {tuple(row.tolist()) for row in with_heldout.heldout_ids}


def test_list_models(capsys):
    code, stdout, _ = run(capsys, "--list-models")
    assert code == 0 and "| opt-1.3b | facebook/opt-1.3b |" in stdout and "| smollm2-135m |" in stdout


def test_default_threads_leave_busy_cores_alone(monkeypatch):
    import os

    import prune.options as options

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1}, raising=False)
    for busy, threads in ((1, 1), (0, 2), (9, 1), (None, None)):
        monkeypatch.setattr(options, "running_processes", lambda busy=busy: busy)
        assert options.default_threads() == threads
    monkeypatch.setattr(options, "running_processes", lambda: 0)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert options.default_threads() is None


def test_running_processes_reads_this_machine():
    import sys

    from prune.options import running_processes

    count = running_processes()
    assert count is None if not sys.platform.startswith("linux") else count >= 0


def test_heldout_flag_is_named_in_its_error(tmp_path, capsys):
    from eval.bench.cli import main

    code = main(["replace", "--model", "smollm2-135m", "--heldout", str(tmp_path / "missing.txt")])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT and "to --heldout" in err and "--data" not in err
