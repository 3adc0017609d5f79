"""Tests for the teacher's top-K logits cache: the sparse KL, the files, training from them, reuse and refusals."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from distill import job as job_module
from distill.config import DistillConfig
from distill.losses import LossInputs, register_loss, teacher_student_kl, topk_kl, topk_targets, unregister_loss
from distill.teacher_cache import CACHE_DIR, HEADER, cache_folder, prepare_cache
from distill.train import distill, write_teacher_cache
from prune.errors import LayercutError
from prune.model.surgery import drop_blocks_
from tests.helpers import _TEXT, VOCAB, make_student_pair, make_tiny_model

SEQ = 16
K = 24

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(samples: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (samples, SEQ), generator=torch.Generator().manual_seed(seed))  # [samples, seq]


def _pair(seed: int = 0):
    """A tiny llama teacher and a copy with blocks 1 and 2 removed, its layout recorded."""
    teacher = make_tiny_model("llama", seed=seed)
    student = copy.deepcopy(teacher)
    kept = drop_blocks_(student, [1, 2])
    student.config.layercut_layout = [[k] for k in kept]
    return student, teacher


def _config(**kw) -> DistillConfig:
    base = dict(steps=4, lr=1e-2, batch_size=4, data={"seq_len": SEQ}, log_every=1, save_every=0, train="all")
    return DistillConfig(**{**base, **kw})


def _logits(seed: int = 0, batch: int = 2, vocab: int = 50) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, 5)
    mask[1, 3:] = 0
    return torch.randn(batch, 5, vocab, generator=g) * 3, torch.randn(batch, 5, vocab, generator=g) * 3, mask


# ---------------------------------------------------------------------------------------------------------------
# the sparse KL


def test_topk_kl_is_the_full_kl_when_k_is_the_vocabulary_and_has_finite_gradients():
    student, teacher, mask = _logits()
    student.requires_grad_(True)
    full = teacher_student_kl(LossInputs({}, {}, [], mask, student, teacher)).detach()
    sparse = topk_kl(student, topk_targets(teacher, 50), mask)
    p, log_q = F.softmax(teacher.double(), -1), F.log_softmax(student.detach().double(), -1)
    direct = ((p * (p.log() - log_q)).sum(-1) * mask).sum() / mask.sum()  # float64 reference
    value = float(sparse.detach())
    assert value == pytest.approx(float(full), abs=1e-6) and value == pytest.approx(float(direct), abs=1e-6)
    sparse.backward()
    assert torch.isfinite(student.grad).all() and student.grad.abs().sum() > 0


def test_topk_kl_groups_the_rest_so_it_is_below_the_full_kl_and_close_for_large_k():
    student, teacher, mask = _logits(seed=1)
    full = float(teacher_student_kl(LossInputs({}, {}, [], mask, student, teacher)))
    by_k = {k: float(topk_kl(student, topk_targets(teacher, k), mask)) for k in (1, 8, 40, 49)}
    assert all(value <= full * (1 + 1e-6) for value in by_k.values())  # merging classes never raises a KL
    assert by_k[1] < by_k[8] < by_k[40] <= by_k[49]
    assert by_k[49] == pytest.approx(full, rel=1e-3) and by_k[1] < 0.9 * full


def test_the_kl_loss_reads_the_cache_form_when_the_teacher_logits_are_not_there():
    student, teacher, mask = _logits(seed=2)
    topk = topk_targets(teacher, 7)
    assert torch.equal(teacher_student_kl(LossInputs({}, {}, [], mask, student, None, topk)),
                       topk_kl(student, topk, mask))


# ---------------------------------------------------------------------------------------------------------------
# the files


def test_the_cache_holds_the_teachers_top_k_of_the_training_then_held_out_rows(tmp_path):
    _, teacher = _pair()
    ids, held = _ids(), _ids(3, seed=1)
    cache = write_teacher_cache(teacher, _config(teacher_cache=f"topk={K}"), tmp_path, (ids, held, None))
    assert cache.written and (tmp_path / CACHE_DIR / HEADER).is_file()
    assert torch.equal(cache.token_ids, ids) and torch.equal(cache.heldout_ids, held)
    with torch.no_grad():
        logits = teacher(input_ids=torch.cat([ids, held])).logits  # [15, seq, vocab]
    rows = torch.tensor([2, 13, 0])  # training rows 2 and 0, held-out row 1
    got = cache.targets(rows, torch.cat([ids, held])[rows], torch.ones(3, SEQ)).topk
    values, indices = logits[rows].topk(K, dim=-1)
    assert torch.allclose(got.logits, values, atol=1e-5) and torch.equal(got.indices, indices)
    rest = logits[rows].scatter(-1, indices, float("-inf")).logsumexp(-1)
    assert torch.allclose(got.rest_lse, rest, atol=1e-5)
    assert cache.arrays["indices"].dtype.name == "int32" and cache.report()["sequences"] == 15
    with pytest.raises(RuntimeError, match="other tokens"):  # a row mix-up fails, never trains on another row
        cache.targets(torch.tensor([1]), ids[:1], torch.ones(1, SEQ))


def test_a_later_run_of_the_same_teacher_and_tokens_copies_the_kept_cache_instead_of_running_the_teacher(
        tmp_path, monkeypatch, _kept_teacher_caches):
    """prune.ship runs the same teacher on the same calibration whatever its budget: the second run's work folder
    gets the first run's arrays (the teacher never runs), its own request in the header; another K, a cache over
    the size limit or LAYERCUT_KEEP_TEACHER_CACHE=0 compute it; only the latest KEPT_COUNT stay."""
    import distill.teacher_cache as module

    _, teacher = _pair()
    ids, held = _ids(), _ids(3, seed=1)
    first = prepare_cache(tmp_path / "run1", teacher, ids, held, K, precision="float32", request={"run": 1})
    assert first.written and len(list(_kept_teacher_caches.iterdir())) == 1
    calls = []
    teacher.register_forward_hook(lambda *_: calls.append(1))
    again = prepare_cache(tmp_path / "run2", teacher, ids, held, K, precision="float32", request={"run": 2})
    assert not again.written and not calls  # copied: the teacher did not run
    assert again.header["key"] == first.header["key"] and again.header["request"] == {"run": 2}
    assert again.header["kept_from"] == str(_kept_teacher_caches / first.header["key"])
    for name in ("logits", "indices", "rest_lse", "ids"):
        assert (again.arrays[name] == first.arrays[name]).all()
    other_k = prepare_cache(tmp_path / "run3", teacher, ids, held, 5, precision="float32")
    assert other_k.written and calls  # another K: the teacher ran
    monkeypatch.setenv(module.KEEP_ENV, "0")
    off = prepare_cache(tmp_path / "run4", teacher, ids, held, K, precision="float32")
    assert off.written  # the kept copy is not read, and nothing more is kept
    monkeypatch.delenv(module.KEEP_ENV)
    monkeypatch.setattr(module, "KEPT_MAX_BYTES", 1)
    prepare_cache(tmp_path / "run5", teacher, ids[:4], None, K, precision="float32")  # too large to keep
    assert len(list(_kept_teacher_caches.iterdir())) == 2
    monkeypatch.setattr(module, "KEPT_MAX_BYTES", 2**30)
    for count in range(2, 2 + module.KEPT_COUNT):
        prepare_cache(tmp_path / f"many{count}", teacher, ids[:count], None, K, precision="float32")
    assert len(list(_kept_teacher_caches.iterdir())) == module.KEPT_COUNT


def test_another_teacher_or_other_tokens_rewrite_the_cache_and_the_same_reuses_it(tmp_path):
    _, teacher = _pair()
    _, other = _pair(seed=1)
    config, ids = _config(teacher_cache=f"topk={K}"), _ids()
    first = write_teacher_cache(teacher, config, tmp_path, (ids, None, None))
    again = write_teacher_cache(teacher, config, tmp_path, (ids, None, None))
    assert first.written and not again.written and again.header["key"] == first.header["key"]
    changed = write_teacher_cache(other, config, tmp_path, (ids, None, None))
    assert changed.written and changed.header["key"] != first.header["key"]
    with torch.no_grad():
        top = other(input_ids=ids[:1]).logits.topk(K, dim=-1).values
    assert torch.allclose(changed.targets(torch.tensor([0]), ids[:1], torch.ones(1, SEQ)).topk.logits, top, atol=1e-5)
    fewer = write_teacher_cache(other, config, tmp_path, (ids[:8], None, None))
    assert fewer.written and fewer.rows == 8
    other_k = write_teacher_cache(other, _config(teacher_cache="topk=5"), tmp_path, (ids[:8], None, None))
    assert other_k.written and other_k.k == 5
    assert [p.name for p in tmp_path.iterdir()] == [CACHE_DIR]  # no staging folder left behind


def test_k_above_the_vocabulary_is_one_line(tmp_path):
    _, teacher = _pair()
    with pytest.raises(LayercutError, match=f"more classes than the vocabulary has \\({VOCAB}\\)"):
        prepare_cache(tmp_path, teacher, _ids(), None, VOCAB + 1, precision="no")


# ---------------------------------------------------------------------------------------------------------------
# training from the cache


@pytest.fixture
def online_topk_kl():
    """The cache's loss computed online from the teacher's logits (top K of them, at every step)."""

    @register_loss("online_topk_kl", needs_logits=True)
    def online(inputs: LossInputs) -> torch.Tensor:
        return topk_kl(inputs.student_logits, topk_targets(inputs.teacher_logits, K), inputs.mask)

    yield "online_topk_kl"
    unregister_loss("online_topk_kl")


def test_training_from_the_cache_gives_the_online_loss_curve_without_running_the_teacher(tmp_path, online_topk_kl):
    ids, held = _ids(), _ids(4, seed=1)
    student, teacher = _pair()
    online = distill(student, teacher, None, _config(losses={online_topk_kl: 1.0}), token_ids=ids, heldout_ids=held)
    student, teacher = _pair()
    config = _config(teacher_cache=f"topk={K}")
    cache = write_teacher_cache(teacher, config, tmp_path, (ids, held, None))
    cached = distill(student, None, None, config, teacher_cache=cache, layout=student.config.layercut_layout)
    # the cached run's KL goes through the head a chunk at a time (distill.head_kl): the same sums in another order
    assert cached.losses == pytest.approx(online.losses, rel=1e-3) and len(set(online.losses)) == 4  # every step trains
    assert max(online.losses) / min(online.losses) > 1.5  # the tolerance is far below a step's change
    for name in ("training", "held_out"):
        for when in ("before", "after"):
            assert cached.generalisation[name][when]["loss"] == pytest.approx(
                online.generalisation[name][when]["loss"], rel=1e-3)
    assert cached.teacher_cache["k"] == K and cached.report(config)["config"]["teacher_cache"] == f"topk={K}"


def test_a_resumed_run_reuses_the_cache_and_ends_where_a_straight_run_does(tmp_path):
    ids = _ids()
    config = _config(teacher_cache=f"topk={K}", steps=4, save_every=2)
    student, teacher = _pair()
    straight = distill(student, teacher, None, config, out=tmp_path / "straight", token_ids=ids)
    assert straight.teacher_cache["written"]
    student, teacher = _pair()
    forwards = []

    def crash_in_step_3(module, *args):
        forwards.append(module.training)  # the head's check before training runs in eval mode
        if forwards.count(True) == 3:
            raise KeyboardInterrupt

    student.register_forward_hook(crash_in_step_3)
    with pytest.raises(KeyboardInterrupt):
        distill(student, teacher, None, config, out=tmp_path / "run", token_ids=ids)
    student, teacher = _pair()
    calls = []
    teacher.register_forward_hook(lambda *args: calls.append(1))
    resumed = distill(student, teacher, None, config, out=tmp_path / "run", token_ids=ids, resume=True)
    assert not resumed.teacher_cache["written"] and calls == []  # fingerprinted, not run again
    assert resumed.start_step == 2 and resumed.losses == straight.losses[2:]


def test_layerwise_mse_with_a_cache_is_refused_in_one_line_naming_the_fix():
    with pytest.raises(LayercutError) as caught:
        _config(teacher_cache="topk=8", losses={"teacher_student_kl": 1.0, "layerwise_mse": 0.5})
    message = str(caught.value)
    assert "\n" not in message and "layerwise_mse" in message and "drop --teacher-cache" in message
    assert _config(teacher_cache="topk=8", losses={"consecutive_cosine_distance": 0.1, "teacher_student_kl": 1.0})


@pytest.mark.parametrize("spec", ["topk=0", "topk=-3", "top=8", "topk=8.5", "topk"])
def test_a_malformed_cache_option_is_one_line(spec):
    with pytest.raises(LayercutError, match="--teacher-cache takes topk=K"):
        _config(teacher_cache=spec)


# ---------------------------------------------------------------------------------------------------------------
# the command line


@pytest.fixture(scope="module")
def pair_folders(tmp_path_factory) -> dict[str, Path]:
    return make_student_pair(tmp_path_factory.mktemp("cache-pair"))


def _cli(folders: dict, out: Path, *extra: str) -> list[str]:
    return ["--student", str(folders["student"]), "--out", str(out), "--data", str(folders["data"]), "--seq-len",
            str(SEQ), "--samples", "8", "--heldout-samples", "2", "--batch-size", "4", "--steps", "2", "--train",
            "all", "--lr", "1e-3", "--teacher-cache", "topk=16", *extra]


def test_cli_trains_from_the_cache_and_a_resume_never_loads_the_teacher(pair_folders, tmp_path, capsys,
                                                                          monkeypatch):
    from distill.run import main

    out, work = tmp_path / "out", tmp_path / "work"
    assert main(_cli(pair_folders, out, "--work-dir", str(work), "--keep-checkpoints")) == 0
    assert "teacher cache: top-16 of 10 sequences" in capsys.readouterr().out
    section = json.loads((out / "layercut.json").read_text())["distill"]
    assert section["config"]["teacher_cache"] == "topk=16" and section["teacher_cache"]["written"]
    assert section["teacher"] == pair_folders["teacher"].name and section["layout"] == [[0], [3]]

    def no_teacher(*args, **kwargs):
        raise AssertionError("the teacher was loaded although its cache is valid")

    monkeypatch.setattr(job_module, "load_teacher", no_teacher)
    assert main(_cli(pair_folders, out, "--work-dir", str(work), "--resume", "--overwrite", "--steps", "3")) == 0
    section = json.loads((out / "layercut.json").read_text())["distill"]
    assert section["start_step"] == 2 and not section["teacher_cache"]["written"]
    assert section["teacher"] == pair_folders["teacher"].name and section["generalisation"]["held_out"]["after"]
    assert not cache_folder(work).exists()  # removed with the checkpoints once the export is written


def test_cli_refuses_layerwise_mse_with_a_cache_in_one_line(pair_folders, tmp_path, capsys):
    from distill.run import main

    assert main(_cli(pair_folders, tmp_path / "out", "--loss", "layerwise_mse=1")) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "layerwise_mse needs the teacher's hidden states" in errors[0]


def test_prune_run_distils_from_a_cache_with_the_teacher_freed(tiny_folder, tmp_path, monkeypatch):
    """``prune.run --distill-steps`` with ``teacher_cache``: the teacher writes the cache, then is gone."""
    from prune.checkpoint.load_config import LoadConfig
    from prune.data.calibration import DataConfig
    from prune.pipeline.config import PruneConfig
    from prune.pipeline.runner import run_prune

    text = tmp_path / "data.txt"
    text.write_text(_TEXT * 20, encoding="utf-8")
    seen = []
    real = distill

    def spy(student, teacher, *args, **kwargs):
        seen.append((teacher, kwargs.get("teacher_cache")))
        return real(student, teacher, *args, **kwargs)

    monkeypatch.setattr("distill.step.distill", spy)
    data = {"data": str(text), "samples": 8, "seq_len": 16, "heldout_samples": 0}
    config = PruneConfig(load=LoadConfig(model=str(tiny_folder)), data=DataConfig(data=str(text), samples=8,
                         seq_len=32, heldout_samples=0), drop=1, out=str(tmp_path / "out"),
                         distill={"steps": 2, "batch_size": 2, "teacher_cache": "topk=8", "data": data,
                                  "losses": {"teacher_student_kl": 1.0}, "train": "all", "lr": 1e-3})
    report = run_prune(config).report["distill"]
    assert seen and seen[0][0] is None and seen[0][1] is not None  # trained from the cache, no teacher
    assert report["teacher_cache"]["k"] == 8 and report["steps"] == 2 and report["final_loss"] > 0
