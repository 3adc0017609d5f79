"""Distillation on several processes (accelerate's data parallel engine, over gloo on the CPU): the same loss
curve as one process drawing as many micro-batches per step, and checkpoints that resume on another
process count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from distill.processes import many_on_cpu
from tests.helpers import REPO, make_student_pair

# the runs are slow: each starts fresh interpreters (two of them under accelerate launch)

STEPS = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    return make_student_pair(tmp_path_factory.mktemp("ddp"))


def _distill(pair: dict, out: Path, processes: int, grad_accum: int, *extra: str, fsdp: bool = False) -> list[dict]:
    """Run ``distill.run`` on ``processes`` processes; returns its log (one line per step)."""
    args = ["--student", str(pair["student"]), "--out", str(out), "--data", str(pair["data"]), "--seq-len", "16",
            "--samples", "16", "--heldout-samples", "0", "--batch-size", "2", "--grad-accum", str(grad_accum),
            "--steps", str(STEPS), "--train", "all", "--lr", "1e-3", "--log-every", "1", *extra]
    launch = [sys.executable, "-m", "distill.run"] if processes == 1 else [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "distill.run"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "LAYERCUT_CPU_FSDP": str(int(fsdp))}
    done = subprocess.run([*launch, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    log = out / "train_log.jsonl"
    return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]


@pytest.mark.slow
def test_two_processes_follow_the_one_process_loss_curve(pair, tmp_path):
    one = _distill(pair, tmp_path / "one", 1, grad_accum=2)
    two = _distill(pair, tmp_path / "two", 2, grad_accum=1)
    assert [row["step"] for row in two] == list(range(1, STEPS + 1))
    for a, b in zip(one, two, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
    # both trained the same weights, away from the student's
    before, after_one, after_two = (load_file(folder / "model.safetensors")
                                    for folder in (pair["student"], tmp_path / "one", tmp_path / "two"))
    moved = max(float((after_one[k] - before[k]).abs().max()) for k in before)
    apart = max(float((after_one[k] - after_two[k]).abs().max()) for k in before)
    assert moved > 1e-4 and apart < 1e-5 * max(moved, 1.0)


@pytest.mark.slow
def test_a_two_process_checkpoint_resumes_on_one_process(pair, tmp_path):
    work = tmp_path / "work"
    _distill(pair, tmp_path / "two", 2, 1, "--work-dir", str(work), "--save-every", "2", "--save-total-limit", "2",
             "--keep-checkpoints")
    (work / "checkpoints" / f"step-{STEPS:08d}.pt").unlink()  # as if the two processes had stopped at step 2
    resumed = _distill(pair, tmp_path / "resumed", 1, 2, "--work-dir", str(work), "--resume")
    one = _distill(pair, tmp_path / "one", 1, grad_accum=2)
    assert [row["step"] for row in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(one, resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)


@pytest.mark.slow
def test_fsdp_shards_the_student_and_its_checkpoint_resumes_without_it(pair, tmp_path):
    """FSDP2 over gloo (LAYERCUT_CPU_FSDP): the one-process curve, and a checkpoint by name that a plain run reads."""
    one = _distill(pair, tmp_path / "one", 1, grad_accum=2)
    work = tmp_path / "work"
    sharded = _distill(pair, tmp_path / "fsdp", 2, 1, "--work-dir", str(work), "--save-every", "2",
                       "--save-total-limit", "2", "--keep-checkpoints", fsdp=True)
    for a, b in zip(one, sharded, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)  # clipped over every shard
    exported = load_file(tmp_path / "fsdp" / "model.safetensors")
    expected = load_file(tmp_path / "one" / "model.safetensors")
    assert max(float((exported[k] - expected[k]).abs().max()) for k in expected) < 1e-5
    (work / "checkpoints" / f"step-{STEPS:08d}.pt").unlink()
    resumed = _distill(pair, tmp_path / "resumed", 1, 2, "--work-dir", str(work), "--resume", "--save-every", "2",
                       "--save-total-limit", "2", "--keep-checkpoints")
    for a, b in zip(one, resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
    # and on FSDP again: the main process reads the checkpoint and sends every process its shards
    (work / "checkpoints" / f"step-{STEPS:08d}.pt").unlink()
    again = _distill(pair, tmp_path / "again", 2, 1, "--work-dir", str(work), "--resume", fsdp=True)
    for a, b in zip(one, again, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)


def test_deepspeed_and_lora_under_fsdp_are_refused_in_one_line():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from distill.sharded import check_sharded_options
    from prune.errors import LayercutError

    with pytest.raises(LayercutError, match="fsdp.yaml") as err:
        check_sharded_options(SimpleNamespace(distributed_type=DistributedType.DEEPSPEED), "all")
    assert "\n" not in str(err.value)
    with pytest.raises(LayercutError, match="ddp.yaml"):
        check_sharded_options(SimpleNamespace(distributed_type=DistributedType.FSDP), "lora")
    check_sharded_options(SimpleNamespace(distributed_type=DistributedType.MULTI_CPU), "lora")  # DDP runs LoRA


@pytest.mark.parametrize("world_size,cuda,expected", [(None, False, False), ("1", False, False), ("2", False, True),
                                                      ("2", True, False)])
def test_several_processes_talk_over_gloo_only_without_a_gpu(monkeypatch, world_size, cuda, expected):
    if world_size is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world_size)
    monkeypatch.setattr("torch.cuda.is_available", lambda: cuda)
    assert many_on_cpu() is expected
