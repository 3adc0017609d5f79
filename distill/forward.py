"""Forward passes that collect a model's residual states, and the losses of a student against its teacher.

Training (``distill.loop``) and the before/after measurements (``distill.generalisation``) run the models
the same way: hooks on the blocks record the states a loss compares, and the LM head is mostly skipped
when no loss reads the logits. The teacher's side of a batch comes from a :class:`TeacherSource`: the
teacher run online (:class:`OnlineTeacher`) or its top-K logits cache (``distill.teacher_cache``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from distill.config import DistillConfig
from distill.layout import Layout, resolve_layout, teacher_targets
from distill.losses import LOSSES, NEEDS_LOGITS, HeadInputs, LossInputs, TeacherTopK, total_loss
from prune.model.adapters import input_device, lm_head
from prune.model.capture import residual_states
from prune.model.head import head_apart, kept_hidden, normed_output, skip_head_kwargs


def logits_kwargs(model: nn.Module, want_logits: bool) -> dict:
    """Skip most of the LM head when no loss needs logits (``logits_to_keep=1``), if the model supports it."""
    return {} if want_logits else skip_head_kwargs(model)


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


def forward_head(call, hooked: nn.Module, input_ids, mask, keep: set[int] | None, extra: dict):
    """:func:`forward_states` with the LM head left to the losses: (states, :class:`HeadInputs`, the model's logits).

    ``extra`` holds ``logits_to_keep=1``: the model applies its head to the last position only (the logits
    returned, [batch, 1, vocab]); the final norm's output, the head's input at every position, is kept for the
    losses (``LossInputs.student_head``).
    """
    with normed_output(hooked) as kept:
        states, logits = forward_states(call, hooked, input_ids, mask, keep, True, extra)
    return states, HeadInputs(kept_hidden(kept, hooked), lm_head(hooked)), logits


def head_for_losses(student: nn.Module, weights: dict[str, float], sharded: bool) -> dict | None:
    """:func:`prune.model.head.head_apart` for training, where the losses take the head (``LossInputs.student_head``).

    None too unless every loss on the logits reads the head (registered ``from_head``), the head is frozen (its own
    gradient is not carried; distillation never trains it) and the student is not sharded.
    """
    on_logits = [name for name in weights if name in NEEDS_LOGITS]
    trained = any(p.requires_grad for p in lm_head(student).parameters())
    if sharded or trained or not on_logits or not all(LOSSES.get(name).from_head for name in on_logits):
        return None
    return head_apart(student)


@dataclass
class TeacherTargets:
    """What the losses read of the teacher for one micro-batch (see :class:`~distill.losses.LossInputs`)."""

    states: dict[int, torch.Tensor]
    logits: torch.Tensor | None = None
    topk: TeacherTopK | None = None


class TeacherSource(Protocol):
    """Where a run's teacher targets come from: the teacher run online, or its cache (``distill.teacher_cache``).

    Rows are indices into the run's sequences, training rows first and held-out rows after them
    (``len(token_ids) + i`` is held-out row ``i``); ``ids`` are those rows' tokens.
    """

    def targets(self, rows: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> TeacherTargets:
        """The teacher's side of the losses for ``ids`` [batch, seq] (rows ``rows`` [batch])."""


class OnlineTeacher:
    """The teacher run forward (eval mode, no grad) on each batch: the states the losses compare, and its logits."""

    def __init__(self, teacher: nn.Module, targets: list[int], want_logits: bool):
        self.teacher, self.keep, self.want_logits = teacher, set(targets), want_logits
        self.kwargs = logits_kwargs(teacher, want_logits)
        teacher.eval()

    @torch.no_grad()
    def targets(self, rows: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> TeacherTargets:
        """Run the teacher on ``ids``; ``rows`` is not needed."""
        device = input_device(self.teacher)
        states, logits = forward_states(self.teacher, self.teacher, ids.to(device), mask.to(device), self.keep,
                                        self.want_logits, self.kwargs)
        return TeacherTargets(states, logits)


@torch.no_grad()
def evaluate_losses(student: nn.Module, teacher: nn.Module | None, token_ids: torch.Tensor, config: DistillConfig,
                    layout: Layout | None = None, *, source: TeacherSource | None = None,
                    rows: torch.Tensor | None = None) -> dict[str, float]:
    """Each loss term of ``config`` (unweighted) and their weighted total ``loss``, averaged over ``token_ids``.

    ``token_ids`` is [samples, seq_len]; nothing is trained. ``loss`` is what training minimises.
    Runs both models in eval mode in batches of ``config.batch_size``; for before/after comparisons. The
    teacher's side comes from ``source`` when given (``rows`` [samples] are ``token_ids``' rows in it; the
    teacher may then be None), else from running ``teacher``.
    """
    layout = layout or resolve_layout(student, teacher)
    targets = teacher_targets(layout)
    weights = config.loss_weights()
    want_logits = bool(NEEDS_LOGITS & set(weights))
    was_training, teacher_was_training = student.training, teacher is not None and teacher.training
    student.eval()
    source = source or OnlineTeacher(teacher, targets, want_logits)
    rows = torch.arange(token_ids.shape[0]) if rows is None else rows
    sums: dict[str, float] = {}
    try:
        for index in torch.split(torch.arange(token_ids.shape[0]), config.batch_size):
            ids = token_ids[index]
            mask = torch.ones_like(ids)
            teacher_side = source.targets(rows[index], ids, mask)
            s_dev = input_device(student)
            s_states, s_logits = forward_states(student, student, ids.to(s_dev), mask.to(s_dev), None, want_logits)
            inputs = LossInputs(s_states, teacher_side.states, targets, mask.to(s_dev), s_logits, teacher_side.logits,
                                teacher_side.topk)
            total, terms = total_loss(inputs, weights)
            for name, value in {"loss": float(total), **terms}.items():
                sums[name] = sums.get(name, 0.0) + value * ids.shape[0]
    finally:
        student.train(was_training)
        if teacher is not None:
            teacher.train(teacher_was_training)
    return {name: value / token_ids.shape[0] for name, value in sums.items()}
