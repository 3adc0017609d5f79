"""The LM head left to the caller: the final norm's output kept, the head applied a chunk of positions at a time.

At a large vocabulary a pass's logits are the largest tensor it makes: Gemma-3-270M's 262,144 tokens give 2.1 GB in
float32 for 4 x 512 positions, new at every pass. Where a model's logits are its head's matmul of the final norm's
output and nothing more, the model can apply its head to the last position alone (``logits_to_keep=1``) while a
hook keeps the norm's output: a caller then makes the logits of a row's few positions at a time, into buffers it
reuses (``prune.measure.perplexity.log_prob_chunks``; distillation's KL, ``distill.head_kl``).

    apart = head_apart(model)        # {"logits_to_keep": 1}, or None: take the model's logits
    with normed_output(model) as kept:
        model(input_ids=ids, use_cache=False, **apart)
    outputs = HeadOutputs(kept["hidden"], lm_head(model))   # [batch, seq, vocab] logits, not made yet
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from prune.errors import LayercutError
from prune.model.adapters import changes_logits_after_head, final_norm, input_device, lm_head


@dataclass
class HeadOutputs:
    """A batch's logits as the final norm's output ``hidden`` [batch, seq, hidden] and the ``head`` that makes them.

    ``shape`` is the logits'; :meth:`chunk` makes the logits of one row's positions, :meth:`logits` a few rows'.
    """

    hidden: torch.Tensor
    head: nn.Linear

    @property
    def shape(self) -> torch.Size:
        """The logits' shape, [batch, seq, vocab]."""
        return torch.Size((*self.hidden.shape[:-1], self.head.weight.shape[0]))

    @property
    def device(self) -> torch.device:
        """Where the logits are made: the head's device."""
        return self.head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The head's dtype, the logits' before a caller's float32 copy."""
        return self.head.weight.dtype

    def positions(self, span: slice) -> HeadOutputs:
        """The outputs at positions ``span`` of every row (``[:, span]`` of the logits)."""
        return HeadOutputs(self.hidden[:, span], self.head)

    def logits(self, rows: int | None = None) -> torch.Tensor:
        """The first ``rows`` rows' logits [rows, seq, vocab] (None: every row) in the head's dtype."""
        return self._apply(self.hidden[:rows])

    def chunk(self, row: int, span: slice, out: torch.Tensor) -> torch.Tensor:
        """Row ``row``'s logits at positions ``span`` written into ``out`` [positions, vocab] float32; returns it."""
        hidden = self.hidden[row, span].to(self.device)
        if hidden.dtype == self.dtype == out.dtype == torch.float32 and self.head.bias is None:
            with torch.no_grad():  # measuring only: a head that requires grad is read, not trained
                return torch.mm(hidden, self.head.weight.t(), out=out)  # no [positions, vocab] tensor but ``out``
        return out.copy_(self._apply(hidden))

    def _apply(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return F.linear(hidden.to(self.device, self.dtype), self.head.weight, self.head.bias)


def skip_head_kwargs(model: nn.Module) -> dict:
    """``{"logits_to_keep": 1}`` where ``model``'s forward can apply its head to the last position alone, else {}."""
    forward = getattr(model, "forward", None)
    if forward is None or "logits_to_keep" not in inspect.signature(forward).parameters:
        return {}
    return {"logits_to_keep": 1}


@contextmanager
def normed_output(model: nn.Module) -> Iterator[dict]:
    """Inside the ``with``, ``kept["hidden"]`` is the final norm's output of the model's last forward.

    A norm that returns more than a tensor leaves nothing kept (it is not the head's input).
    """
    kept: dict[str, torch.Tensor] = {}

    def keep(_module, _args, output) -> None:
        if isinstance(output, torch.Tensor):
            kept["hidden"] = output

    handle = final_norm(model).register_forward_hook(keep)
    try:
        yield kept
    finally:
        handle.remove()


def kept_hidden(kept: dict, model: nn.Module) -> torch.Tensor:
    """``kept["hidden"]`` of :func:`normed_output`.

    Raises:
        LayercutError: the final norm gave no tensor in the forward (a caller that did not ask :func:`head_apart`).
    """
    if "hidden" not in kept:
        raise LayercutError(f"{type(model).__name__}'s final norm gave no tensor in its forward: its head cannot be "
                            "applied apart (a bug: head_apart should have refused it)")
    return kept["hidden"]


def plain_linear_head(model: nn.Module, head: nn.Module, norm: nn.Module) -> bool:
    """Whether ``head`` is a plain ``Linear`` whose weight is whole here and ``norm`` one of ``model``'s modules.

    A sharded (DTensor) or meta weight is not whole outside the model's forward, and a norm missing from the model
    (an ``Identity`` stand-in) is never called.
    """
    weight = getattr(head, "weight", None)
    return (type(head) is nn.Linear and isinstance(weight, torch.Tensor) and weight.device.type != "meta"
            and not hasattr(weight, "to_local") and any(module is norm for module in model.modules()))


def head_agrees(hidden: torch.Tensor, head: nn.Module, logits: torch.Tensor) -> bool:
    """Whether ``head(hidden)`` [.., vocab] is the model's own ``logits`` (no soft-capping or scale after the head).

    Within 1e-4 of the largest logit in float32, 2e-2 in 16 bits (the same matmul in another shape rounds
    otherwise): a soft-capped or scaled head misses by far more.
    """
    if hidden.shape[-1] != head.weight.shape[1]:  # something between the norm and the head (OPT's project_out)
        return False
    with torch.no_grad():  # a teacher's head may require grad; this check is no part of any graph
        ours = F.linear(hidden.to(head.weight.device, head.weight.dtype), head.weight, head.bias).float()
    theirs = logits.to(ours.device).float()
    if not bool(torch.isfinite(theirs).all()):  # masked logits (-inf) would make any difference pass the scale below
        return False
    scale = float(theirs.abs().max().clamp_min(1.0))
    tolerance = 1e-4 if logits.dtype == head.weight.dtype == torch.float32 else 2e-2
    return ours.shape == theirs.shape and float((ours - theirs).abs().max()) <= tolerance * scale


# each model's last answer of head_apart, while its head and final norm are the same modules with the same hooks: a
# skeleton's short forward reads every block from disk, and the shortlist asks once per repair, the heal twice
_ASKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def head_apart(model: nn.Module) -> dict | None:
    """The keyword arguments under which ``model`` leaves its head to the caller (:func:`normed_output`), or None.

    None unless the model can skip its head (``logits_to_keep``), no config field scales or caps the logits after
    it, and the head is a plain ``Linear`` after a final norm the model calls; then one short forward checks that
    the norm's output covers every position and the head's matmul alone gives the model's logits (its answer kept
    while the head, the norm and their hooks stay). Call it before accelerate wraps the model.
    """
    kwargs = skip_head_kwargs(model)
    # a config that caps or scales the logits keeps them whole, whatever a short forward shows (small logits are
    # hardly capped)
    if not kwargs or changes_logits_after_head(model):
        return None
    head, norm = lm_head(model), final_norm(model)
    if not plain_linear_head(model, head, norm):
        return None
    key = (weakref.ref(head), weakref.ref(norm), len(head._forward_hooks), len(norm._forward_hooks))
    asked = _ASKED.get(model)
    if asked is not None and asked[0] == key:
        return asked[1]
    ids = torch.arange(8, device=input_device(model)).unsqueeze(0) % model.get_input_embeddings().weight.shape[0]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), normed_output(model) as kept:
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **kwargs).logits
    finally:
        model.train(was_training)
    hidden = kept.get("hidden")  # none: the norm found is not called, or returns more than a tensor
    agrees = (hidden is not None and tuple(hidden.shape[:2]) == tuple(ids.shape)  # not a norm after the slice
              and head_agrees(hidden[:, -1:], head, logits[:, -1:]))
    _ASKED[model] = (key, kwargs if agrees else None)
    return kwargs if agrees else None


def outputs_apart(model: nn.Module, apart: dict | None, run) -> torch.Tensor | HeadOutputs:
    """``run(extra)``'s logits, or with ``apart`` the final norm's output and the head, the logits not made.

    ``run`` calls the model's forward with ``extra`` keyword arguments added and returns its logits; ``apart``:
    :func:`head_apart`'s answer for ``model`` (None: the whole logits).
    """
    if apart is None:
        return run({})
    with normed_output(model) as kept:
        run(apart)
    return HeadOutputs(kept_hidden(kept, model), lm_head(model))


def but_last(logits: torch.Tensor | HeadOutputs) -> torch.Tensor | HeadOutputs:
    """The logits at every position but the last (the predictions of the next tokens)."""
    return logits.positions(slice(None, -1)) if isinstance(logits, HeadOutputs) else logits[:, :-1]
