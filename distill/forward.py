"""Forward passes that collect a model's residual states, and the losses of a student against its teacher.

Training (``distill.loop``) and the before/after measurements (``distill.generalisation``) run the models
the same way: hooks on the blocks record the states a loss compares, and the LM head is mostly skipped
when no loss reads the logits.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from distill.config import DistillConfig
from distill.layout import Layout, resolve_layout, teacher_targets
from distill.losses import NEEDS_LOGITS, LossInputs, total_loss
from prune.adapters import input_device
from prune.capture import residual_states


def logits_kwargs(model: nn.Module, want_logits: bool) -> dict:
    """Skip most of the LM head when no loss needs logits (``logits_to_keep=1``), if the model supports it."""
    if want_logits or "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return {}
    return {"logits_to_keep": 1}


def forward_states(call, hooked: nn.Module, input_ids, mask, keep: set[int] | None, want_logits: bool,
                   extra: dict | None = None):
    """Run ``call`` (the model or its accelerate wrapper) and collect ``hooked``'s residual states.

    Args:
        call: what to call with the token ids (the model, or its accelerate-prepared wrapper).
        hooked: the plain model whose blocks get the hooks.
        input_ids: [batch, seq] token ids on the model's input device.
        mask: [batch, seq] attention mask.
        keep: state indices to keep (None: all).
        want_logits: return the logits.
        extra: more keyword arguments for ``call`` (default: ``logits_to_keep=1`` when logits are not wanted).

    Returns:
        (states by index, logits [batch, seq, vocab] or None).
    """
    states: dict[int, torch.Tensor] = {}

    def record(index: int, hidden: torch.Tensor) -> None:
        if keep is None or index in keep:
            states[index] = hidden

    with residual_states(hooked, record):
        kwargs = logits_kwargs(hooked, want_logits) if extra is None else extra
        output = call(input_ids=input_ids, attention_mask=mask, use_cache=False, **kwargs)
    return states, output.logits if want_logits else None


@torch.no_grad()
def evaluate_losses(student: nn.Module, teacher: nn.Module, token_ids: torch.Tensor, config: DistillConfig,
                    layout: Layout | None = None) -> dict[str, float]:
    """Each loss term of ``config`` (unweighted) and their weighted total ``loss``, averaged over ``token_ids``.

    ``token_ids`` is [samples, seq_len]; nothing is trained. ``loss`` is what training minimises.
    Runs both models in eval mode in batches of ``config.batch_size``; for before/after comparisons.
    """
    layout = layout or resolve_layout(student, teacher)
    targets = teacher_targets(layout)
    weights = config.loss_weights()
    want_logits = bool(NEEDS_LOGITS & set(weights))
    was_training, teacher_was_training = student.training, teacher.training
    student.eval()
    teacher.eval()
    sums: dict[str, float] = {}
    try:
        for rows in torch.split(token_ids, config.batch_size):
            mask = torch.ones_like(rows)
            t_dev, s_dev = input_device(teacher), input_device(student)
            t_states, t_logits = forward_states(teacher, teacher, rows.to(t_dev), mask.to(t_dev), set(targets),
                                                want_logits)
            s_states, s_logits = forward_states(student, student, rows.to(s_dev), mask.to(s_dev), None, want_logits)
            total, terms = total_loss(LossInputs(s_states, t_states, targets, mask.to(s_dev), s_logits, t_logits),
                                      weights)
            for name, value in {"loss": float(total), **terms}.items():
                sums[name] = sums.get(name, 0.0) + value * rows.shape[0]
    finally:
        student.train(was_training)
        teacher.train(teacher_was_training)
    return {name: value / token_ids.shape[0] for name, value in sums.items()}
