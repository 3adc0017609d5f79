"""Distillation losses, registered by name and computed in float32.

Every loss takes one :class:`LossInputs` (the residual states and logits of one micro-batch) and
returns a scalar. A run's losses are ``DistillConfig.losses``, ``{name: weight}`` (a recipe's
``distill: {losses: {...}}``, ``distill.run --loss NAME=WEIGHT``): a new loss is one function here
decorated with :func:`register_loss`, which is all that the config, the recipes and the flags read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from distill.head_kl import topk_kl_through_head
from prune.errors import LayercutError
from prune.registry import Registry


@dataclass
class LossInputs:
    """What the losses see for one micro-batch.

    Attributes:
        student_states: student residual states by index (``i`` = input of student block ``i``,
            ``i + 1`` = its output), each [batch, seq, hidden].
        teacher_states: teacher residual states by index (same convention, original numbering).
        targets: ``targets[j]`` is the teacher state student block ``j``'s output is matched to
            (``max(layout[j]) + 1``).
        mask: [batch, seq], 1 for tokens that count, 0 for padding.
        student_logits: [batch, seq, vocab] or None when no loss needs them.
        teacher_logits: [batch, seq, vocab] or None (None too when the teacher's logits come from a
            top-K cache, ``teacher_topk``).
        teacher_topk: the teacher's top-K logits and the log-sum-exp of the rest (``distill.teacher_cache``),
            or None when the teacher runs online.
        student_head: the student's final norm output and its frozen LM head, in place of ``student_logits``
            (the losses registered ``from_head``: their vocabulary-wide work a chunk of positions at a time).
    """

    student_states: dict[int, torch.Tensor]
    teacher_states: dict[int, torch.Tensor]
    targets: list[int]
    mask: torch.Tensor
    student_logits: torch.Tensor | None = None
    teacher_logits: torch.Tensor | None = None
    teacher_topk: TeacherTopK | None = None
    student_head: HeadInputs | None = None


@dataclass
class HeadInputs:
    """The student's logits not yet made: the LM head's input and the head (frozen).

    Attributes:
        hidden: [batch, seq, hidden] the final norm's output.
        head: the LM head (a ``Linear``); ``head(hidden)`` are the logits.
    """

    hidden: torch.Tensor
    head: nn.Module

    def logits(self) -> torch.Tensor:
        """The [batch, seq, vocab] logits, for a loss that needs them whole."""
        return self.head(self.hidden.to(self.head.weight.device))


@dataclass
class TeacherTopK:
    """The teacher's K largest next-token logits per token and the log-sum-exp of all the others.

    With the rest's log-sum-exp the teacher's probability of every top-K class and of the "rest" bucket is
    exact (:func:`topk_kl`), whatever K.

    Attributes:
        logits: [batch, seq, K] float32, in decreasing order.
        indices: [batch, seq, K] their vocabulary ids (int32 on disk, int64 here).
        rest_lse: [batch, seq] float32 log-sum-exp of the logits outside the top K (-inf when K = vocabulary).
    """

    logits: torch.Tensor
    indices: torch.Tensor
    rest_lse: torch.Tensor


def topk_targets(logits: torch.Tensor, k: int) -> TeacherTopK:
    """The top-``k`` of ``logits`` [batch, seq, vocab] and the log-sum-exp of the rest, in float32."""
    logits = logits.float()
    values, indices = logits.topk(k, dim=-1)  # [batch, seq, K]
    rest = logits.scatter(-1, indices, float("-inf"))  # [batch, seq, vocab], the top K masked out
    return TeacherTopK(values, indices, torch.logsumexp(rest, dim=-1))  # all -inf gives -inf: no rest


LossFn = Callable[[LossInputs], torch.Tensor]


@dataclass(frozen=True)
class Loss:
    """A registered loss.

    Attributes:
        fn: ``(LossInputs) -> scalar tensor``.
        needs_logits: it reads the logits of both models (the others skip the LM heads).
        from_cache: it runs when the teacher's side is a top-K logits cache (``--teacher-cache``): it reads
            no teacher state, and reads the teacher's logits only as :class:`TeacherTopK`.
        help: what it computes, for ``--help``.
        key: the older recipe key of its weight (``mse_weight``), also a ``distill.run`` flag
            (``--mse-weight``), for the losses that had a weight field of their own before ``losses``
            became a mapping; a new loss needs none (``losses:`` / ``--loss`` name it).
        from_head: it reads ``LossInputs.student_head`` when ``student_logits`` is None: a run whose every loss
            on the logits says so leaves the student's head to them (``distill.loop``).
    """

    fn: LossFn
    needs_logits: bool = False
    help: str = ""
    key: str | None = None
    from_cache: bool = False
    from_head: bool = False

    def __call__(self, inputs: LossInputs) -> torch.Tensor:
        """The loss of one micro-batch."""
        return self.fn(inputs)


LOSSES: Registry[Loss] = Registry("loss", flag="--loss")
# Losses that need the logits of both models (the others skip the LM head); kept by register_loss.
NEEDS_LOGITS: set[str] = set()


def register_loss(name: str, *, needs_logits: bool = False, help: str | None = None,
                  key: str | None = None, from_cache: bool = False,
                  from_head: bool = False) -> Callable[[LossFn], LossFn]:
    """Decorator adding a loss to :data:`LOSSES` under ``name`` (see :class:`Loss` for the arguments).

    ``help`` defaults to the first line of the function's docstring.

    Raises:
        ValueError: ``name``, or ``key`` as another loss's key, is already registered.
    """

    def add(fn: LossFn) -> LossFn:
        if key is not None and key in legacy_keys():
            raise ValueError(f"loss key '{key}' is already the key of loss '{legacy_keys()[key]}'")
        summary = help or (fn.__doc__ or name).strip().splitlines()[0]
        LOSSES.register(name, Loss(fn, needs_logits, summary, key, from_cache, from_head))
        if needs_logits:
            NEEDS_LOGITS.add(name)
        return fn

    return add


def cache_refusal(names) -> str | None:
    """Why the losses ``names`` cannot run from a teacher logits cache (one line naming the fix), or None."""
    refused = [name for name in names if not get_loss(name).from_cache]
    if not refused:
        return None
    return (f"--teacher-cache keeps only the teacher's top-K logits, and {', '.join(refused)} needs the teacher's "
            "hidden states: drop --teacher-cache, or keep only losses on the logits (--loss teacher_student_kl=1)")


def unregister_loss(name: str) -> None:
    """Undo :func:`register_loss` (tests)."""
    LOSSES.unregister(name)
    NEEDS_LOGITS.discard(name)


def get_loss(name: str) -> Loss:
    """The registered loss ``name``; an unknown name lists the known ones."""
    return LOSSES.get(name)


def legacy_keys() -> dict[str, str]:
    """The older weight keys (recipe keys, and ``distill.run`` flags spelled with dashes) -> loss name."""
    return {loss.key: name for name, loss in LOSSES.items() if loss.key is not None}


def masked_token_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of per-token ``values`` [batch, seq] over the tokens where ``mask`` is 1."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def state_mse(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean squared error per hidden coordinate, averaged over unmasked tokens (float32)."""
    diff = student.float() - teacher.to(student.device).float()  # [batch, seq, hidden]
    return masked_token_mean(diff.pow(2).mean(dim=-1), mask.to(student.device))


@register_loss("layerwise_mse", key="mse_weight",
               help="the layerwise block-output MSE, Secretly Linear's objective")
def layerwise_mse(inputs: LossInputs) -> torch.Tensor:
    """Sum over student blocks ``j`` of the MSE between their output and teacher state ``targets[j]``."""
    terms = [
        state_mse(inputs.student_states[j + 1], inputs.teacher_states[target], inputs.mask)
        for j, target in enumerate(inputs.targets)
    ]
    return torch.stack(terms).sum()


@register_loss("teacher_student_kl", needs_logits=True, key="kl_weight", from_cache=True, from_head=True,
               help="KL(teacher || student) on the logits, float32")
def teacher_student_kl(inputs: LossInputs) -> torch.Tensor:
    """KL(teacher || student) of the next-token distributions, summed over the vocabulary, averaged over tokens.

    Both log-softmaxes are taken in float32 (bf16 logits would round the small probabilities away). From a
    teacher cache (``inputs.teacher_topk``) it is :func:`topk_kl`, over the top K classes and the rest: through
    the head a chunk at a time (:func:`distill.head_kl.topk_kl_through_head`) when given ``student_head``.
    """
    student_logits = inputs.student_logits
    if student_logits is None and inputs.student_head is not None:
        if inputs.teacher_logits is None and inputs.teacher_topk is not None:
            topk = inputs.teacher_topk
            return topk_kl_through_head(inputs.student_head.hidden, inputs.student_head.head, topk.logits, topk.indices,
                                        topk.rest_lse, inputs.mask)
        student_logits = inputs.student_head.logits()
    if student_logits is not None and inputs.teacher_logits is None and inputs.teacher_topk is not None:
        return topk_kl(student_logits, inputs.teacher_topk, inputs.mask)
    if student_logits is None or inputs.teacher_logits is None:
        raise ValueError("teacher_student_kl needs the logits of both models")
    student = F.log_softmax(student_logits.float(), dim=-1)  # [batch, seq, vocab]
    teacher = F.log_softmax(inputs.teacher_logits.to(student.device).float(), dim=-1)  # [batch, seq, vocab]
    per_token = (teacher.exp() * (teacher - student)).sum(dim=-1)  # [batch, seq]
    return masked_token_mean(per_token, inputs.mask.to(student.device))


def topk_kl(student_logits: torch.Tensor, topk: TeacherTopK, mask: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) over the teacher's top K classes plus one "rest" bucket, averaged over tokens.

    The teacher's probabilities are exact (its rest's log-sum-exp is cached); the student's rest is the
    log-sum-exp of its logits outside the top K, not ``log(1 - sum)``, which loses every digit when the top K
    hold nearly all its mass. Float32 throughout; with K = vocabulary it is the full KL.
    """
    student = student_logits.float()  # [batch, seq, vocab]
    s_lse = torch.logsumexp(student, dim=-1)  # [batch, seq]
    indices = topk.indices.to(student.device, torch.long)  # [batch, seq, K]
    s_top = student.gather(-1, indices) - s_lse.unsqueeze(-1)  # [batch, seq, K] log q
    # a finite fill, not -inf: with K = vocabulary an all -inf row would give NaN gradients (masked below)
    s_rest = torch.logsumexp(student.scatter(-1, indices, torch.finfo(student.dtype).min), dim=-1) - s_lse
    t_values = topk.logits.to(student.device).float()  # [batch, seq, K]
    t_rest_lse = topk.rest_lse.to(student.device).float()  # [batch, seq]
    t_lse = torch.logaddexp(torch.logsumexp(t_values, dim=-1), t_rest_lse)  # [batch, seq]
    t_top = t_values - t_lse.unsqueeze(-1)  # [batch, seq, K] log p
    t_rest = t_rest_lse - t_lse  # [batch, seq] log p of the rest, -inf when there is none
    per_token = (t_top.exp() * (t_top - s_top)).sum(dim=-1)  # [batch, seq]
    p_rest = t_rest.exp()
    rest_term = torch.where(p_rest > 0, p_rest * (t_rest - s_rest), torch.zeros_like(p_rest))  # 0 log 0 = 0
    return masked_token_mean(per_token + rest_term, mask.to(student.device))


@register_loss("consecutive_cosine_distance", key="cosine_reg", from_cache=True,
               help="the sum of 1 - cos(h_i, h_{i-1}) over consecutive student states")
def consecutive_cosine_distance(inputs: LossInputs) -> torch.Tensor:
    """Secretly Linear's regulariser: sum over consecutive student states of ``1 - cos(h_i, h_{i-1})``.

    The cosine is taken per token over the hidden dimension and averaged over unmasked tokens.
    Minimising it pulls each block's output towards the direction of its input (the paper's form,
    ``lambda * sum(1 - cos(h_i, h_{i-1}))``); the paper reports that this regulariser, used in
    pretraining, lowers its measured linearity scores.
    """
    indices = sorted(inputs.student_states)
    terms = []
    for previous, current in zip(indices[:-1], indices[1:], strict=True):
        h_prev = inputs.student_states[previous].float()  # [batch, seq, hidden]
        h_cur = inputs.student_states[current].float()
        cos = F.cosine_similarity(h_cur, h_prev, dim=-1, eps=1e-8)  # [batch, seq]
        terms.append(masked_token_mean(1.0 - cos, inputs.mask.to(cos.device)))
    return torch.stack(terms).sum()


def total_loss(inputs: LossInputs, weights: dict[str, float]) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted sum of the named losses, and each (unweighted) term as a float for the log."""
    total = None
    terms: dict[str, float] = {}
    for name, weight in weights.items():
        value = get_loss(name)(inputs)
        terms[name] = float(value.detach())
        total = weight * value if total is None else total + weight * value
    if total is None:
        raise LayercutError("no loss term has a positive weight: give one, e.g. --loss teacher_student_kl=1")
    return total, terms
