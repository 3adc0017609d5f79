"""Forward passes that collect residual states, and the losses of a student against its teacher's side."""

import copy

import pytest
import torch

from distill.config import DistillConfig
from distill.forward import OnlineTeacher, evaluate_losses, forward_states, logits_kwargs
from distill.layout import resolve_layout, teacher_targets
from prune.model.surgery import drop_blocks_
from tests.helpers import make_tiny_model


def tokens(samples=2, seq=8):
    return torch.randint(3, 320, (samples, seq), generator=torch.Generator().manual_seed(0))


def test_states_are_the_residual_stream_and_logits_come_only_when_asked():
    model = make_tiny_model("llama")
    assert logits_kwargs(model, want_logits=False) == {"logits_to_keep": 1} and logits_kwargs(model, True) == {}
    ids = tokens()
    mask = torch.ones_like(ids)
    kept, logits = forward_states(model, model, ids, mask, {0, 2}, want_logits=False)
    assert sorted(kept) == [0, 2] and logits is None
    every, logits = forward_states(model, model, ids, mask, None, want_logits=True)
    with torch.no_grad():
        reference = model(ids, output_hidden_states=True)
    assert sorted(every) == [0, 1, 2, 3, 4] and logits.shape == (2, 8, 320)
    for index in range(4):  # the last hidden state transformers returns is normed; the residual one is not
        torch.testing.assert_close(every[index], reference.hidden_states[index])
    torch.testing.assert_close(logits, reference.logits)


def test_losses_are_the_same_from_the_teacher_or_from_a_source_of_its_targets():
    teacher = make_tiny_model("llama")
    student = copy.deepcopy(teacher)
    drop_blocks_(student, [1, 2])
    student.train()
    ids = tokens(3)
    config = DistillConfig(batch_size=2, losses={"layerwise_mse": 1.0, "teacher_student_kl": 0.5})
    online = evaluate_losses(student, teacher, ids, config)
    assert online["loss"] == pytest.approx(online["layerwise_mse"] + 0.5 * online["teacher_student_kl"], rel=1e-5)
    assert online["layerwise_mse"] > 0 and student.training  # measured in eval mode, left as it was
    layout = resolve_layout(student, teacher)
    source = OnlineTeacher(teacher, teacher_targets(layout), want_logits=True)
    from_source = evaluate_losses(student, None, ids, config, layout, source=source)
    assert from_source == pytest.approx(online, rel=1e-6)
