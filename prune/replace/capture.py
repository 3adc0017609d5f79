"""What a fit needs from forward passes: hooks that record activations, batches around a span, moments."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from prune.adapters import input_device
from prune.capture import block_input, block_output
from prune.stats import PairMoments


class PairAccumulator:
    """Streamed float64 moments of paired activations (X [n, d_x], Y [n, d_y]; widths may differ).

    Rows are shifted by the first batch's means before squaring, so centring at the end does not
    cancel large means away (massive activations reach 1e3 against spreads of ~10).
    """

    def __init__(self):
        self.n = 0
        self._shift: tuple[torch.Tensor, torch.Tensor] | None = None
        self._sums: list[torch.Tensor] = []  # sum x', sum y', x'^T x', x'^T y', y'^T y'

    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Add the tokens of ``x`` [..., d_x] and ``y`` [..., d_y] (same leading shape)."""
        x = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)  # [tokens, d_x]
        y = y.detach().reshape(-1, y.shape[-1]).to(device=x.device, dtype=torch.float64)  # [tokens, d_y]
        if self._shift is None:
            self._shift = (x.mean(0), y.mean(0))
        x, y = x - self._shift[0], y - self._shift[1]
        terms = [x.sum(0), y.sum(0), x.T @ x, x.T @ y, y.T @ y]
        self._sums = terms if not self._sums else [a + b for a, b in zip(self._sums, terms, strict=True)]
        self.n += x.shape[0]

    def moments(self) -> PairMoments:
        """Centred moments (sums over tokens, not divided by n)."""
        if not self.n:
            raise ValueError("no tokens observed")
        sx, sy, xx, xy, yy = self._sums
        mx, my = sx / self.n, sy / self.n
        n = self.n
        return PairMoments(n, self._shift[0] + mx, self._shift[1] + my, xx - n * torch.outer(mx, mx),
                           xy - n * torch.outer(mx, my), yy - n * torch.outer(my, my))


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


class Recorder:
    """Forward hooks that store named activations of one forward pass; handles removed on close."""

    def __init__(self):
        self.values: dict[str, object] = {}
        self._handles = []

    def input_of(self, module: nn.Module, key: str, with_call: bool = False) -> None:
        """Store ``module``'s input hidden state under ``key`` (and its other call arguments under ``key.call``)."""

        def hook(_m, args, kwargs):
            self.values[key] = block_input(args, kwargs).detach()
            if with_call:
                rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                self.values[key + ".call"] = (tuple(args[1:]), rest)

        self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def output_of(self, module: nn.Module, key: str) -> None:
        """Store ``module``'s output hidden state under ``key``."""

        def hook(_m, _args, output):
            self.values[key] = block_output(output).detach()

        self._handles.append(module.register_forward_hook(hook))

    def close(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@torch.no_grad()
def record(model: nn.Module, batch: torch.Tensor, setup: Callable[[Recorder], None]) -> dict[str, object]:
    """Run the base model (no LM head, no cache) on ``batch`` with hooks from ``setup``; their values."""
    recorder = Recorder()
    try:
        setup(recorder)
        model.base_model(input_ids=batch.to(input_device(model)), use_cache=False)
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
