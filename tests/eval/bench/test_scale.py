"""``eval.bench scale`` on the tiny shape: the checkpoint written, the run planned, run and checked tensor by tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eval.bench.cli import main
from eval.bench.scale import RANDOM_NOTE, ScaleOptions, check_export, prune_argv
from prune.errors import LayercutError

REPLACE = "fold"  # the bench's default repair: it rewrites the MLP output projection of the block before the span


@pytest.fixture(scope="module")
def scale_run(tmp_path_factory) -> tuple[int, Path]:
    """The bench once, end to end on the tiny shape: (exit code, its --out)."""
    from prune.loading.names import find_embedded_gguf

    if find_embedded_gguf() is None:
        pytest.skip("the embedded SmolLM2-135M (the shapes' tokenizer) is not installed")
    out = tmp_path_factory.mktemp("scale") / "bench"
    code = main(["scale", "--shape", "llama-tiny", "--drop", "1", "--samples", "4", "--seq-len", "64",
                 "--replace", REPLACE, "--out", str(out), "--threads", "1", "--in-memory"])
    return code, out


def test_the_bench_writes_plans_runs_and_checks_the_tiny_shape(scale_run):
    code, out = scale_run
    assert code == 0
    result = json.loads((out / "scale.json").read_text())
    assert result["shape"] == "llama-tiny" and result["parameters"] == 3_293_760 and "meaningless" in \
        result["random_weights"]
    assert result["write"]["bytes"] == 4 * 3_293_760 and result["write"]["peak_rss"] > 0
    assert result["plan"]["plan"]["peak"]["cpu"] > 0 and "--plan" in result["plan"]["argv"]
    run = result["run"]
    assert run["peak_rss"] > 0 and run["seconds"] >= run["run_seconds"] > 0 and len(run["dropped"]) == 1
    assert set(result["ratios"]) == {"peak_rss", "seconds"}
    check = result["check"]
    assert check["passed"] and check["layers"] == check["expected_layers"] == 3
    assert not check["mismatched"] and not check["missing"] and not check["unexpected"]
    if REPLACE == "fold":  # the host block's down projection, and nothing else
        host = next(i for i, entry in enumerate(check["layout"]) if len(entry) == 2)
        assert check["changed"] == [f"model.layers.{host}.mlp.down_proj.weight"]
    assert check["equal"] == check["tensors"] - len(check["changed"]) > 20
    table = (out / "scale.md").read_text()
    assert RANDOM_NOTE in table
    assert "| stage | wall s | peak RSS GB | planner's estimate | measured / planned |" in table
    assert "Export check passed" in table and (out / "logs" / "run.txt").is_file()
    slim = json.loads((out / "slim" / "config.json").read_text())
    assert slim["num_hidden_layers"] == 3 and slim["layercut_shaped"]["shape"] == "llama-tiny"  # still says random


def test_the_block_by_block_run_exports_what_the_in_memory_run_does(scale_run, tmp_path):
    from eval.bench.scale import compare_runs

    _, out = scale_run
    result = json.loads((out / "scale.json").read_text())
    compare = result["in_memory"]["compare"]
    assert compare["dropped_equal"] and compare["score_difference"] < 1e-6 and compare["tensor_difference"] < 1e-6
    assert result["in_memory"]["peak_rss_ratio"] > 0 and "Block by block / in memory" in (out / "scale.md").read_text()
    # a changed tensor in one of them is found and named
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "slim"
    shutil.copytree(out / "slim-in-memory", copy)
    tensors = load_file(copy / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 0.5
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    found = compare_runs(out / "slim", copy)
    assert found["tensor"] == "model.norm.weight" and found["tensor_difference"] == pytest.approx(0.5)


def test_a_corrupted_kept_tensor_fails_the_export_check(scale_run, tmp_path):
    from safetensors.torch import load_file, save_file

    _, out = scale_run
    source, slim = out / "llama-tiny-float32", tmp_path / "slim"
    shutil.copytree(out / "slim", slim)
    tensors = load_file(slim / "model.safetensors")
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] = torch.nextafter(tensors[name][0, 0], torch.tensor(1.0))  # one value, one ulp
    save_file(tensors, slim / "model.safetensors", metadata={"format": "pt"})
    check = check_export(source, slim, expected_layers=3)
    assert not check["passed"] and check["mismatched"] == [name]
    assert not check_export(source, out / "slim", expected_layers=2)["passed"]  # the layer count is checked too


def test_write_only_writes_the_checkpoint_and_its_report(scale_run, tmp_path):
    _, out = scale_run
    assert main(["scale", "--shape", "llama-tiny", "--write-only", "--out", str(tmp_path),
                 "--checkpoint", str(out / "llama-tiny-float32")]) == 0
    result = json.loads((tmp_path / "scale.json").read_text())
    assert result["write"]["reused"] and "run" not in result and not (tmp_path / "llama-tiny-float32").exists()
    assert RANDOM_NOTE in (tmp_path / "scale.md").read_text()


def test_the_calibration_default_gives_the_scores_four_tokens_per_dimension():
    assert ScaleOptions("llama-tiny", drop=1).calibration_samples() == 8  # 4096 tokens at least
    assert ScaleOptions("llama-3-8b").calibration_samples() == 32  # 4 x 4096 tokens of 512
    argv = prune_argv(ScaleOptions("qwen2.5-7b", dtype="bfloat16", out="o", replace="none", threads=2))
    assert argv[:8] == ["--model", str(Path("o") / "qwen2.5-7b-bfloat16"), "--offload", "sequential", "--dtype",
                        "bfloat16", "--device", "cpu"]
    assert " ".join(argv).endswith("--replace none --data builtin --samples 28 --seq-len 512 --heldout-samples 0 "
                                   "--threads 2")


def test_bad_options_are_one_line_errors(capsys):
    assert main(["scale", "--shape", "llama-tiny", "--drop", "3"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "--drop 3: llama-tiny has 4 blocks, the first and last kept; choose 1 to 2")
    with pytest.raises(LayercutError, match="--samples must be a positive integer, got 0"):
        ScaleOptions("llama-tiny", drop=1, samples=0)
    with pytest.raises(SystemExit):
        main(["scale", "--shape", "llama-9b"])
