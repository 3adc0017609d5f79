"""Tests for the top-K KL through the LM head a chunk at a time: its loss and gradient, and when a run uses it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from distill.config import DistillConfig
from distill.forward import head_for_losses
from distill.head_kl import topk_kl_through_head
from distill.losses import topk_kl, topk_targets
from distill.train import distill, write_teacher_cache
from prune.model.adapters import lm_head
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


def test_bfloat16_states_and_head_give_the_float32_loss_within_their_rounding():
    head, hidden, teacher, mask = _case(50, 8)
    want = topk_kl(head(hidden), teacher, mask)
    got = topk_kl_through_head(hidden.bfloat16(), copy.deepcopy(head).bfloat16(), *_teacher(teacher), mask)
    assert float(got) == pytest.approx(float(want), rel=2e-2) and float(want) > 0.01


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


def test_a_head_whose_output_the_model_changes_keeps_its_whole_logits():
    student, _ = _student()
    lm_head(student).register_forward_hook(lambda _m, _a, out: out * 2)  # something after the matmul, unnamed
    assert head_for_losses(student, {"teacher_student_kl": 1.0}, sharded=False) is None


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
