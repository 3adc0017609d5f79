"""The top-K KL through the LM head a chunk of positions at a time, never holding the student's whole logits.

With a teacher cache (``--teacher-cache topk=K``) the heal's loss is :func:`distill.losses.topk_kl` on the student's
``[batch, seq, vocab]`` logits. At a large vocabulary those logits, and the half dozen vocabulary-wide tensors its
forward and backward make of them, are most of a step: on Gemma-3-270M (262,144 tokens, 4 x 128 positions) the head
and the loss took about 8 of a step's 11 s on two CPU cores, their tensors new at every step. Here the head is applied
to the final norm's output ``LOGPROB_POSITIONS`` positions at a time into one buffer, the loss and its gradient
with respect to those logits are read off in place (``q - p`` on the top K, ``q (1 - p_rest / q_rest)`` on the
rest), and the gradient is carried back through the head at once: backward only scales the stored gradient of the
hidden states. The same loss as ``topk_kl`` (to float32 rounding) and the same gradient, for a frozen head; a head
that is trained, sharded or followed by more than its matmul (soft-capping, logit scales) runs as before
(:func:`distill.forward.head_for_losses`; distillation never trains the head: ``distill.trainable``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from prune.measure.perplexity import LOGPROB_POSITIONS


class _TopkKLThroughHead(torch.autograd.Function):
    """Forward: the masked mean top-K KL; the gradient of ``hidden`` computed in forward and scaled in backward.

    The work runs on the head's device (under a device map a tied head may sit away from the final norm: the
    states go to it, not the [vocab, hidden] weight to them); the gradient and the loss come back to the states'.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, t_top, indices, t_rest, token_weights, chunk):
        # hidden [n, h]; weight [vocab, h]; bias [vocab] float32 or None; t_top [n, K] and t_rest [n]: the teacher's
        # log-probabilities of its top K and of the rest (-inf: no rest); token_weights [n]: mask / its sum. Every
        # tensor but hidden is on the weight's device.
        n, vocab, device = hidden.shape[0], weight.shape[0], weight.device
        wanted = ctx.needs_input_grad[0]
        logits = torch.empty(min(chunk, n), vocab, device=device, dtype=torch.float32)  # reused by every chunk
        grad_hidden = torch.zeros_like(hidden)
        loss = torch.zeros((), device=device, dtype=torch.float32)
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            buf = logits[: stop - start]
            h = hidden[start:stop].detach().to(device)
            if h.dtype == weight.dtype == torch.float32 and not torch.is_autocast_enabled(device.type):
                torch.matmul(h, weight.t(), out=buf)
            else:  # 16 bits, or autocast's: the head's own product, then in float32
                buf.copy_(F.linear(h.to(weight.dtype), weight))
            if bias is not None:
                buf.add_(bias)
            idx = indices[start:stop]
            s_top = buf.gather(1, idx)  # [c, K] the student's top-K logits
            buf.scatter_(1, idx, float("-inf"))  # the rest alone
            m_rest = buf.amax(dim=1, keepdim=True)  # [c, 1]
            has_rest = torch.isfinite(m_rest)
            m_rest = torch.where(has_rest, m_rest, torch.zeros_like(m_rest))
            buf.sub_(m_rest).exp_()  # exp(s - m_rest) on the rest, 0 on the top K
            z_rest = buf.sum(dim=1, keepdim=True)  # >= 1 wherever there is a rest: no underflow
            rest_lse = torch.where(has_rest, m_rest + z_rest.log(), torch.full_like(m_rest, float("-inf")))
            lse = torch.logaddexp(torch.logsumexp(s_top, dim=1, keepdim=True), rest_lse)  # [c, 1]
            s_top_log = s_top - lse  # log q on the top K
            s_rest_log = rest_lse - lse  # log q of the rest
            p_top = t_top[start:stop].exp()
            t_rest_c = t_rest[start:stop].unsqueeze(1)
            p_rest = t_rest_c.exp()
            w = token_weights[start:stop].unsqueeze(1)
            zero = torch.zeros_like(p_rest)
            per_token = (p_top * (t_top[start:stop] - s_top_log)).sum(dim=1, keepdim=True)
            per_token = per_token + torch.where(p_rest > 0, p_rest * (t_rest_c - s_rest_log), zero)
            loss += (per_token * w).sum()
            if not wanted:
                continue
            # d/ds_j: q_j - p_j on the top K; q_j (1 - p_rest / q_rest) on the rest, where q_j = e_j exp(m_rest - lse)
            # and q_j / q_rest = e_j / z_rest (no rest: nothing but the top K, written below)
            rest_scale = torch.where(has_rest, (m_rest - lse).exp() - torch.where(p_rest > 0, p_rest / z_rest, zero),
                                     zero)
            buf.mul_(rest_scale * w)
            buf.scatter_(1, idx, (s_top_log.exp() - p_top) * w)
            grad = buf if weight.dtype == torch.float32 else buf.to(weight.dtype)
            grad_hidden[start:stop] = (grad @ weight).to(hidden.device, hidden.dtype)
        ctx.save_for_backward(grad_hidden)
        return loss.to(hidden.device)

    @staticmethod
    def backward(ctx, grad_loss):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), None, None, None, None, None, None, None


def topk_kl_through_head(hidden: torch.Tensor, head: nn.Module, top_logits: torch.Tensor, top_ids: torch.Tensor,
                         rest_lse: torch.Tensor, mask: torch.Tensor, chunk: int = LOGPROB_POSITIONS) -> torch.Tensor:
    """:func:`distill.losses.topk_kl` of ``head(hidden)`` without its whole logits (the head frozen).

    Args:
        hidden: [batch, seq, hidden] the final norm's output, the head's input.
        head: the LM head (a Linear: ``weight`` [vocab, hidden], maybe ``bias``), frozen.
        top_logits: the teacher's top-K logits [batch, seq, K] (``distill.losses.TeacherTopK``).
        top_ids: their vocabulary ids [batch, seq, K].
        rest_lse: the log-sum-exp of the teacher's other logits [batch, seq] (-inf: none).
        mask: [batch, seq], 1 for tokens that count.
        chunk: positions whose [chunk, vocab] float32 logits exist at once.

    Raises:
        ValueError: the states and the teacher's targets cover other positions.
    """
    if tuple(hidden.shape[:-1]) != tuple(top_ids.shape[:-1]):
        raise ValueError(f"the head's input covers positions {tuple(hidden.shape[:-1])}, the teacher's targets "
                         f"{tuple(top_ids.shape[:-1])}")
    weight = head.weight.detach()
    device = weight.device
    bias = None if getattr(head, "bias", None) is None else head.bias.detach().float()
    flat = hidden.reshape(-1, hidden.shape[-1])
    t_values = top_logits.to(device).float().reshape(flat.shape[0], -1)
    t_rest_lse = rest_lse.to(device).float().reshape(-1)
    t_lse = torch.logaddexp(torch.logsumexp(t_values, dim=-1), t_rest_lse)
    mask = mask.to(device).float().reshape(-1)
    token_weights = mask / mask.sum().clamp_min(1.0)
    indices = top_ids.to(device, torch.long).reshape(flat.shape[0], -1)
    return _TopkKLThroughHead.apply(flat, weight, bias, t_values - t_lse.unsqueeze(-1), indices,
                                    t_rest_lse - t_lse, token_weights, chunk)


def topk_through_head(hidden: torch.Tensor, head: nn.Module, k: int,
                      chunk: int = LOGPROB_POSITIONS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`distill.losses.topk_targets` of ``head(hidden)`` without its whole logits (no gradient).

    Returns the top-``k`` logits [batch, seq, k] and their ids, and the log-sum-exp of the rest [batch, seq] (-inf
    where ``k`` is the vocabulary), float32; ``chunk`` positions' [chunk, vocab] logits exist at once, in one buffer.
    """
    weight, bias = head.weight, head.bias
    flat = hidden.reshape(-1, hidden.shape[-1]).to(weight.device)
    n = flat.shape[0]
    buf = torch.empty(min(chunk, n), weight.shape[0], device=weight.device, dtype=torch.float32)
    values = torch.empty(n, k, device=weight.device, dtype=torch.float32)
    indices = torch.empty(n, k, device=weight.device, dtype=torch.long)
    rest = torch.empty(n, device=weight.device, dtype=torch.float32)
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        logits = buf[: stop - start]
        logits.copy_(F.linear(flat[start:stop].to(weight.dtype), weight, bias))
        top, ids = logits.topk(k, dim=-1)
        values[start:stop], indices[start:stop] = top, ids
        logits.scatter_(1, ids, float("-inf"))  # the rest alone
        rest[start:stop] = torch.logsumexp(logits, dim=-1)  # all -inf gives -inf: no rest
    shape = hidden.shape[:-1]
    return values.reshape(*shape, k), indices.reshape(*shape, k), rest.reshape(shape)
