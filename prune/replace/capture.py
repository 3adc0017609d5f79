"""What a fit needs from forward passes: hooks that record activations, batches around a span, moments."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from prune.measure.moments import PairMoments, StateMoments
from prune.model.adapters import input_device
from prune.model.capture import block_input, block_output


class PairAccumulator:
    """Streamed moments of paired activations (X [n, d_x], Y [n, d_y]; widths may differ).

    The same arithmetic as the scoring pass (:class:`prune.measure.moments.StateMoments`, of which this is the
    two-state case): shifted by the first batch's means, each batch's products in ``precision``, sums in
    float64.
    """

    def __init__(self, precision: str = "float32"):
        self._states = StateMoments(2, [(0, 1)], cosine_pairs="none", precision=precision)

    @property
    def n(self) -> int:
        """Tokens seen so far."""
        return self._states.n

    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the tokens of ``x`` [..., d_x] and ``y`` [..., d_y] (same leading shape)."""
        self._states.begin_batch(None)
        self._states.observe(0, x.reshape(-1, x.shape[-1]))
        self._states.observe(1, y.reshape(-1, y.shape[-1]).to(x.device))

    def moments(self) -> PairMoments:
        """Centred moments (sums over tokens, not divided by n)."""
        if not self.n:
            raise ValueError("no tokens observed")
        return self._states.pair(0, 1)


@dataclass
class SpanBatch:
    """Activations of one calibration batch around one span.

    Attributes:
        x: [batch, seq, d] the span's input, as the (surgered, in sequential fits) model feeds it.
        y: [batch, seq, d] the span's output in the original model.
        args: positional arguments (after the hidden state) of the span's first block.
        kwargs: keyword arguments of the span's first block (masks, rotary embeddings).
        z: [batch, seq, intermediate] input of the host block's MLP output projection (fold).
        m: [batch, seq, d] output of that projection (fold).
    """

    x: torch.Tensor
    y: torch.Tensor
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    z: torch.Tensor | None = None
    m: torch.Tensor | None = None


class _Complete(Exception):  # noqa: N818 - control flow, not an error
    """Raised by the last hook of a :class:`Recorder`: nothing after it is needed."""


class Recorder:
    """Forward hooks that store named activations of one forward pass; handles removed on close.

    With ``stop_early`` the pass ends as soon as every hook has fired once: a fit of the middle blocks
    does not pay for the blocks after its span.
    """

    def __init__(self, stop_early: bool = False):
        self.values: dict[str, object] = {}
        self.stop_early = stop_early
        self._handles = []
        self._pending: set[int] = set()

    def _new_hook_id(self) -> int:
        hook_id = len(self._handles)  # the hook's handle is appended next
        self._pending.add(hook_id)
        return hook_id

    def _fired(self, hook_id: int) -> None:
        self._pending.discard(hook_id)
        if self.stop_early and not self._pending:
            raise _Complete

    def input_of(self, module: nn.Module, key: str, with_call: bool = False) -> None:
        """Store ``module``'s input hidden state under ``key`` (and its other call arguments under ``key.call``)."""
        hook_id = self._new_hook_id()

        def hook(_m, args, kwargs):
            self.values[key] = block_input(args, kwargs).detach()
            if with_call:
                rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                self.values[key + ".call"] = (tuple(args[1:]), rest)
            self._fired(hook_id)

        self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def output_of(self, module: nn.Module, key: str) -> None:
        """Store ``module``'s output hidden state under ``key``."""
        hook_id = self._new_hook_id()

        def hook(_m, _args, output):
            self.values[key] = block_output(output).detach()
            self._fired(hook_id)

        self._handles.append(module.register_forward_hook(hook))

    def close(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@torch.no_grad()
def record(model: nn.Module, batch: torch.Tensor, setup: Callable[[Recorder], None],
           stop_early: bool = True) -> dict[str, object]:
    """Run the base model (no LM head, no cache) on ``batch`` with hooks from ``setup``; their values.

    The pass stops once every hook has fired (``stop_early``), so it costs only up to the last block a hook needs.
    """
    recorder = Recorder(stop_early)
    try:
        setup(recorder)
        model.base_model(input_ids=batch.to(input_device(model)), use_cache=False)
    except _Complete:
        pass
    finally:
        recorder.close()
    return recorder.values


def move(obj, device: torch.device, dtype: torch.dtype | None = None):
    """Move tensors (floating ones cast to ``dtype``) inside a SpanBatch / tuple / dict to ``device``."""
    if isinstance(obj, torch.Tensor):
        cast = dtype if dtype is not None and obj.is_floating_point() else obj.dtype
        return obj.to(device=device, dtype=cast)
    if isinstance(obj, SpanBatch):
        return SpanBatch(*(move(getattr(obj, f), device, dtype) for f in ("x", "y", "args", "kwargs", "z", "m")))
    if isinstance(obj, tuple):
        return tuple(move(v, device, dtype) for v in obj)
    if isinstance(obj, list):
        return [move(v, device, dtype) for v in obj]
    if isinstance(obj, dict):
        return {k: move(v, device, dtype) for k, v in obj.items()}
    return obj
