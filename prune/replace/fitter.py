"""Fitters: one per span; they observe calibration batches, then produce a :class:`Replacement`.

:class:`SpanFitter` is the base every method's fitter derives from; :class:`CachingFitter` adds the
Adam steps of the methods that train (it keeps captured batches on the CPU, up to ``cache_bytes``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from prune.measure.moments import PairMoments
from prune.model.adapters import hidden_size, input_device
from prune.model.remote_code import float_param
from prune.replace.capture import Recorder, SpanBatch, move
from prune.replace.options import MethodOptions

logger = logging.getLogger(__name__)


class FitSettings(Protocol):
    """What a fitter reads of the run's replacement settings (``prune.replace.config.ReplaceConfig`` has them).

    ``options`` is the method's own options class: a fitter reads the options its method declares there.
    """

    method: str
    options: MethodOptions
    seed: int
    cache_bytes: int
    progress: bool


@dataclass
class WeightPatch:
    """New weights for an existing module (``fold``); :meth:`apply` swaps them in and returns an undo."""

    module: nn.Module
    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def apply(self) -> Callable[[], None]:
        """Write the new weights; the returned function restores the old ones.

        On a skeleton's block (weights on the meta device) the new weights are what every later read of
        the module's tensors returns (``prune.loading.offload.rewrite_tensors``).
        """
        if self.module.weight.is_meta:
            from prune.loading.offload import rewrite_tensors

            changes = [(self.module, "weight", lambda old: self.weight.to(old))]
            if self.bias is not None:
                changes.append((self.module, "bias", lambda old: self.bias.to(old)))
            return rewrite_tensors(changes)
        old_weight = self.module.weight.data
        old_bias = self.module.bias.data if self.bias is not None else None
        self.module.weight.data = self.weight
        if self.bias is not None:
            self.module.bias.data = self.bias

        def undo() -> None:
            self.module.weight.data = old_weight
            if old_bias is not None:
                self.module.bias.data = old_bias

        return undo


@dataclass
class Replacement:
    """One fitted replacement of a span of blocks (positions are those before this surgery).

    Attributes:
        method: the registered method.
        span: positions of the removed blocks.
        where: "after" / "before" (a map on block ``host``), "fold" (a patch of ``host``) or "block"
            (``module`` stands at the span's place).
        host: position of the kept block carrying the replacement (None for "block").
        module: the map or the new block; None for "fold".
        patch: new weights of a module of ``host`` ("fold"); a patch that also changes weights upstream of the
            cut offers ``hosted()``, the same function as a change of ``host`` alone.
        record: JSON-ready description for ``layercut.json`` and ``config.layercut_replacements``.
    """

    method: str
    span: tuple[int, ...]
    where: str
    host: int | None
    module: nn.Module | None = None
    patch: WeightPatch | None = None
    record: dict = field(default_factory=dict)


class SpanFitter:
    """Base class: accumulates what one span's fit needs over calibration batches.

    Subclasses set ``needs_call`` (the block's call arguments) and implement :meth:`observe` and
    :meth:`finish`; those that need more activations extend :meth:`hook_inputs`.
    """

    needs_call = False
    # the fit needs nothing but the span's (input, output) moments, which use_moments takes
    from_moments = False

    def __init__(self, model: nn.Module, original: Sequence[nn.Module], span: tuple[int, ...], config: FitSettings):
        self.model = model
        self.original = original
        self.span = span
        self.config = config
        self.dim = hidden_size(model)
        self.where = "before" if span[0] == 0 else "after"
        self.host = span[-1] + 1 if self.where == "before" else span[0] - 1
        param = float_param(original[self.host])  # a span never covers every block
        # a skeleton's blocks stay on the meta device: its maps live where its blocks run
        self.dtype, self.device = param.dtype, input_device(model) if param.is_meta else param.device

    def hook_inputs(self, recorder: Recorder) -> None:
        """Hooks that capture the span's input (and what the method needs besides)."""
        recorder.input_of(self.original[self.span[0]], f"{self.span}.x", with_call=self.needs_call)

    def hook_target(self, recorder: Recorder) -> None:
        """Hook that captures the span's output."""
        recorder.output_of(self.original[self.span[-1]], f"{self.span}.y")

    def batch(self, inputs: dict, targets: dict) -> SpanBatch:
        """Assemble a :class:`SpanBatch` from the recorded values."""
        key = str(self.span)
        args, kwargs = inputs.get(f"{key}.x.call", ((), {}))
        return SpanBatch(inputs[f"{key}.x"], targets[f"{key}.y"], args, kwargs,
                         inputs.get(f"{key}.z"), inputs.get(f"{key}.m"))

    def use_moments(self, moments: PairMoments) -> bool:
        """Take the span's (input, output) moments from the scoring pass instead of observing batches.

        Returns whether they are all this fit needs; the default (a method that needs more) is False.
        """
        return False

    def observe(self, batch: SpanBatch) -> None:
        """Fold one batch in."""
        raise NotImplementedError

    def finish(self) -> Replacement:
        """The fitted replacement."""
        raise NotImplementedError

    def _replacement(self, module: nn.Module | None, **record) -> Replacement:
        return Replacement(self.config.method, self.span, self.where, self.host, module, record=record)


class CachingFitter(SpanFitter):
    """Keeps captured batches (on the CPU, up to ``cache_bytes``) for Adam steps in :meth:`finish`.

    ``steps`` and ``lr`` are the Adam steps and learning rate: the subclass passes its method's options of
    those names (their defaults differ from method to method).
    """

    def __init__(self, model: nn.Module, original: Sequence[nn.Module], span: tuple[int, ...], config: FitSettings,
                 *, steps: int, lr: float):
        super().__init__(model, original, span, config)
        self.steps, self.lr = steps, lr
        self.cache: list[SpanBatch] = []
        self.cached_bytes = 0
        self.dropped_batches = 0

    def remember(self, batch: SpanBatch) -> None:
        """Keep a CPU copy of ``batch`` if there are Adam steps to run and it fits in the budget."""
        if not self.steps:
            return
        size = batch.x.numel() * batch.x.element_size() * 2
        if self.cached_bytes + size > self.config.cache_bytes and self.cache:
            self.dropped_batches += 1
            return
        self.cached_bytes += size
        self.cache.append(move(batch, torch.device("cpu")))

    def train(self, module: nn.Module, forward: Callable[[nn.Module, SpanBatch], torch.Tensor]) -> dict:
        """Adam on the MSE between ``forward(module, batch)`` and ``batch.y``, relative to removal's MSE.

        Returns the relative loss before and after (1.0 = as bad as removing the span). The module is
        trained in float32 and in eval mode (no dropout; the norm keeps its calibration statistics).
        """
        if self.dropped_batches:
            logger.info("span %s: training on the first %d batches (cache limit %d bytes)",
                        list(self.span), len(self.cache), self.config.cache_bytes)
        module.to(device=self.device, dtype=torch.float32).eval()
        params = list(module.parameters())
        flags = [p.requires_grad for p in params]
        for p in params:
            p.requires_grad_(True)
        losses = self._adam(module, params, forward)
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)
        module.to(self.dtype)
        first, last = (losses[0], sum(losses[-10:]) / len(losses[-10:])) if losses else (None, None)
        return {"steps": self.steps, "lr": self.lr, "train_loss_start": first, "train_loss_end": last}

    def _adam(self, module: nn.Module, params: list, forward: Callable) -> list[float]:
        """The Adam steps on random cached batches (:func:`adam_steps`)."""
        return adam_steps(params, self.cache, lambda batch: forward(module, batch), steps=self.steps, lr=self.lr,
                          seed=self.config.seed, device=self.device,
                          desc=f"train {self.config.method} {list(self.span)}", progress=self.config.progress)


def adam_steps(params: list, batches: Sequence[SpanBatch], forward: Callable[[SpanBatch], torch.Tensor], *,
               steps: int, lr: float, seed: int, device: torch.device | str, desc: str,
               progress: bool = True, loss: Callable[[torch.Tensor, SpanBatch], torch.Tensor] | None = None
               ) -> list[float]:
    """Adam on the MSE between ``forward(batch)`` and ``batch.y`` (relative to removal's, :func:`relative_mse`).

    Each step takes one of ``batches`` at random (seeded), moved to ``device`` in float32; the learning rate
    decays from ``lr`` to 0 on a cosine and gradients are clipped to norm 1. Returns each step's loss. What a
    trained repair fits to its span (:class:`CachingFitter`) and what the heal block by block fits to the
    original's stream (``distill.local_heal``) both take these steps. ``loss(output, batch)`` replaces that MSE.
    """
    optimizer = torch.optim.Adam(params, lr=lr)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    bar = tqdm(range(steps), desc=desc, disable=not progress)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))  # cosine decay to 0
        index = int(torch.randint(len(batches), (1,), generator=generator))
        batch = move(batches[index], device, torch.float32)
        output = forward(batch)
        value = loss(output, batch) if loss is not None else relative_mse(output, batch.y, batch.x)
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(float(value.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    return losses


def relative_mse(pred: torch.Tensor, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """MSE(pred, y) / MSE(x, y) in float32: 1.0 is what removing the span costs."""
    return ((pred.float() - y.float()) ** 2).mean() / ((x.float() - y.float()) ** 2).mean().clamp_min(1e-12)
