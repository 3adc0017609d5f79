"""Tests for the top-K KL through the LM head a chunk at a time: its loss and gradient, and when a run uses it."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from distill.config import DistillConfig
from distill.forward import head_for_losses
from distill.head_kl import topk_kl_through_head, topk_through_head
from distill.losses import topk_kl, topk_targets
from distill.train import distill, write_teacher_cache
from prune.model.adapters import lm_head
from prune.model.head import head_apart
from prune.model.surgery import drop_blocks_
from tests.helpers import VOCAB, make_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _case(vocab: int, k: int, bias: bool = False, scale: float = 1.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(12, vocab, bias=bias).requires_grad_(False)
    head.weight.copy_(torch.randn(vocab, 12, generator=g) * scale)
    if bias:
        head.bias.copy_(torch.randn(vocab, generator=g))
    hidden = torch.randn(3, 7, 12, generator=g)
    teacher = topk_targets(torch.randn(3, 7, vocab, generator=g) * 3, k)
    mask = torch.ones(3, 7)
    mask[2, 4:] = 0  # padding: neither counted nor given a gradient
    return head, hidden, teacher, mask


def _teacher(topk):
    return topk.logits, topk.indices, topk.rest_lse


def _loss_and_grad(fn, hidden):
    hidden = hidden.clone().requires_grad_(True)
    loss = fn(hidden)
    (3.0 * loss).backward()  # backward scales the stored gradient by the upstream one
    return loss.detach(), hidden.grad


@pytest.mark.parametrize(("vocab", "k", "bias", "scale", "chunk"), [
    (50, 8, False, 1.0, 128),  # the top K and a rest
    (50, 8, True, 1.0, 5),  # a bias, and chunks that split the rows unevenly
    (50, 50, False, 1.0, 4),  # K = vocabulary: no rest
    (50, 3, False, 30.0, 6),  # logits spread over hundreds: the rest far below the top, no underflow
])
def test_the_loss_and_gradient_are_topk_kls_of_the_heads_logits(vocab, k, bias, scale, chunk):
    head, hidden, teacher, mask = _case(vocab, k, bias, scale)
    want, want_grad = _loss_and_grad(lambda h: topk_kl(head(h), teacher, mask), hidden)
    got, got_grad = _loss_and_grad(lambda h: topk_kl_through_head(h, head, *_teacher(teacher), mask, chunk=chunk),
                                   hidden)
    assert torch.isfinite(got) and float(want) > 0.01
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    assert torch.allclose(got_grad, want_grad, rtol=1e-4, atol=1e-7 * float(want_grad.abs().max()))
    assert float(want_grad.abs().max()) > 1e-3 and bool((got_grad[2, 4:] == 0).all())


@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_states_and_head_give_the_float32_loss_and_gradient_within_their_rounding(bias):
    head, hidden, teacher, mask = _case(50, 8, bias)
    want, want_grad = _loss_and_grad(lambda h: topk_kl(head(h), teacher, mask), hidden)
    half = copy.deepcopy(head).bfloat16()  # a 16-bit head with its bias (Phi's) in 16 bits too
    got, got_grad = _loss_and_grad(lambda h: topk_kl_through_head(h, half, *_teacher(teacher), mask),
                                   hidden.bfloat16())
    assert float(got) == pytest.approx(float(want), rel=2e-2) and float(want) > 0.01
    assert got_grad.dtype == torch.bfloat16
    assert float((got_grad.float() - want_grad).norm() / want_grad.norm()) < 3e-2


def test_targets_for_other_positions_are_refused():
    head, hidden, teacher, mask = _case(50, 8)
    with pytest.raises(ValueError, match="covers positions"):
        topk_kl_through_head(hidden[:, -1:], head, *_teacher(teacher), mask)  # the head's input sliced to the last


@pytest.mark.parametrize(("k", "chunk", "bias"), [(8, 128, False), (8, 5, True), (50, 4, False)])
def test_the_top_k_through_the_head_is_the_top_k_of_its_logits(k, chunk, bias):
    head, hidden, _, _ = _case(50, k, bias)
    want = topk_targets(head(hidden), k)
    values, ids, rest = topk_through_head(hidden, head, k, chunk=chunk)
    assert torch.equal(ids, want.indices) and torch.allclose(values, want.logits, rtol=1e-6, atol=1e-6)
    assert torch.allclose(rest, want.rest_lse, rtol=1e-5) if k < 50 else bool(torch.isneginf(rest).all())


def _student(**overrides):
    teacher = make_tiny_model("llama", seed=0, **overrides)
    student = copy.deepcopy(teacher)
    kept = drop_blocks_(student, [1, 2])
    student.config.layercut_layout = [[k] for k in kept]
    return student.requires_grad_(False), teacher


def test_a_frozen_plain_head_is_left_to_the_kl_and_other_heads_are_not():
    student, _ = _student()
    assert head_for_losses(student, {"teacher_student_kl": 1.0}, sharded=False) == {"logits_to_keep": 1}
    assert head_for_losses(student, {"teacher_student_kl": 1.0}, sharded=True) is None  # FSDP: no whole weight
    assert head_for_losses(student, {"layerwise_mse": 1.0}, sharded=False) is None  # no loss on the logits
    lm_head(student).weight.requires_grad_(True)
    assert head_for_losses(student, {"teacher_student_kl": 1.0}, sharded=False) is None  # its own gradient needed
    lm_head(student).weight.requires_grad_(False)
    student.config.logit_scale = 0.0625  # Cohere's scale after the head
    assert head_for_losses(student, {"teacher_student_kl": 1.0}, sharded=False) is None


def test_a_head_whose_output_the_model_changes_keeps_its_whole_logits(monkeypatch):
    student, teacher = _student()
    with warnings.catch_warnings():  # a teacher's head may require grad: it is never trained, nor its check a graph
        warnings.simplefilter("error")
        assert head_apart(teacher) == {"logits_to_keep": 1}
    lm_head(student).register_forward_hook(lambda _m, _a, out: out * 2)  # something after the matmul, unnamed
    assert head_for_losses(student, {"teacher_student_kl": 1.0}, sharded=False) is None
    # a "norm" whose output is a tuple (an attention block's), not the head's input: refused, not a crash
    monkeypatch.setattr("prune.model.head.final_norm", lambda model: model.model.layers[0].self_attn)
    assert head_apart(teacher) is None


def test_a_cache_written_through_the_head_holds_the_whole_logits_top_k(tmp_path, monkeypatch):
    import distill.teacher_cache as teacher_cache

    monkeypatch.setenv(teacher_cache.KEEP_ENV, "0")  # each cache computed here, none copied from an earlier run

    ids = torch.randint(3, VOCAB, (6, 16), generator=torch.Generator().manual_seed(2))
    config = DistillConfig(steps=1, batch_size=4, data={"seq_len": 16}, teacher_cache="topk=24")
    _, teacher = _student()
    widths = {"through": [], "whole": []}
    run = ["through"]
    lm_head(teacher).register_forward_hook(lambda _m, args, _o: widths[run[0]].append(args[0].shape[1]))
    through = write_teacher_cache(teacher, config, tmp_path / "through", (ids, None, None))
    run[0] = "whole"
    original = teacher_cache.head_apart
    teacher_cache.head_apart = lambda _model: None  # the whole logits, as before the head was left apart
    try:
        whole = write_teacher_cache(teacher, config, tmp_path / "whole", (ids, None, None))
    finally:
        teacher_cache.head_apart = original
    assert set(widths["through"]) == {1} and set(widths["whole"]) == {16}  # the model's own head: last position only
    rows = torch.arange(6)
    a, b = through.targets(rows, ids, torch.ones_like(ids)).topk, whole.targets(rows, ids, torch.ones_like(ids)).topk
    assert torch.equal(a.indices, b.indices) and torch.allclose(a.logits, b.logits, atol=1e-5)
    assert torch.allclose(a.rest_lse, b.rest_lse, atol=1e-5)


def test_training_from_a_cache_skips_the_students_head_but_for_one_position(tmp_path):
    ids = torch.randint(3, VOCAB, (8, 16), generator=torch.Generator().manual_seed(0))
    config = DistillConfig(steps=3, lr=1e-2, batch_size=4, data={"seq_len": 16}, log_every=1, save_every=0,
                           train="lora", lora_r=4, teacher_cache="topk=24")
    runs = {}
    for through_head in (True, False):
        student, teacher = _student()
        if not through_head:
            student.config.logit_scale = 1.0 + 1e-9  # a scale the check must respect: whole logits, same numbers
        widths = []
        lm_head(student).register_forward_hook(lambda _m, args, _o, widths=widths: widths.append(args[0].shape[1]))
        cache = write_teacher_cache(teacher, config, tmp_path / str(through_head), (ids, None, None))
        result = distill(student, None, None, config, teacher_cache=cache, layout=student.config.layercut_layout)
        runs[through_head] = (result.losses, widths)
    (head_losses, head_widths), (plain_losses, plain_widths) = runs[True], runs[False]
    assert set(head_widths) == {1} and set(plain_widths) == {16}
    assert head_losses == pytest.approx(plain_losses, rel=1e-3) and head_losses[0] > 1.5 * head_losses[-1]
