"""Replace removed blocks instead of only dropping them.

Each maximal run (span) of removed blocks gets one replacement, fitted to reproduce the span's output
from its input on calibration text:

* ``linear``: ``h -> h A + b``, closed-form least squares (float64) from streamed moments.
* ``lowrank``: ``h -> h + up(down(BatchNorm(h)))`` with rank ``max(1, d // 100)``, started at the
  closed-form reduced-rank least-squares solution (the exact MSE optimum of this family on the
  calibration tokens), then Adam steps on the MSE. Residual form, because at tiny rank a map that must
  rebuild the whole state loses it: on SmolLM2-135M (blocks 12-15, rank 5, 16k calibration tokens,
  held-out Emma) the residual form gives perplexity 42.3, the direct form 892. Adam adds little after
  the closed-form start (100 or 300 steps: 42.27 / 42.25); from a zero start it needs ~300 steps at
  lr 1e-2 to get there (42.22).
* ``fold``: the map is folded into the previous kept block's MLP output projection (``prune.fold``);
  the checkpoint stays a vanilla architecture.
* ``block``: one standard block of the architecture per span, a copy of the span's first block,
  trained with Adam on the MSE to the span's output; a vanilla checkpoint. (First rather than last:
  on the same SmolLM2 setting 41.96 vs 43.96 untrained, 38.05 vs 38.82 after 200 steps.)

``fit="independent"`` fits every span on the original model's states (one streamed pass);
``fit="sequential"`` fits span by span, each on the inputs the already-surgered model produces
(targets are always the original model's span outputs), which corrects the drift earlier spans cause.
Adam-trained kinds keep the captured activations of at most ``cache_bytes`` (on the CPU) and train on
them; closed-form kinds keep only float64 moments, so their memory does not grow with the data.

``linear`` and ``lowrank`` maps ride on a kept block inside a :class:`ReplacedBlock` (the block, then
the map; the map first when the span starts at block 0), so the block list keeps the config's length
and every ``layer_idx`` / KV-cache slot stays valid. ``prune.checkpoint`` saves them next to a vanilla
checkpoint and ``prune.load`` puts them back.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from tqdm.auto import tqdm

from prune.adapters import get_blocks, hidden_size, input_device
from prune.capture import block_input, block_output
from prune.errors import LayercutError
from prune.linear_fit import LinearFit, fit_linear_map
from prune.stats import PairMoments, span_pairs
from prune.surgery import (
    RECORDS_ATTR,
    block_layout,
    blocks_replaced,
    check_block_indices,
    drop_blocks_,
    host_position,
    replacement_records,
    set_blocks_,
)

logger = logging.getLogger(__name__)

__all__ = [
    "FITS",
    "REPLACEMENTS",
    "LinearMap",
    "LowRankMap",
    "ReplaceConfig",
    "ReplacedBlock",
    "block_layout",
    "default_rank",
    "replace_blocks_",
    "replacement_modules",
    "replacement_records",
]

FITS = ("independent", "sequential")
# Bound on the captured (input, target) pairs kept for Adam; beyond it only the first batches are used.
DEFAULT_CACHE_BYTES = 1 << 30


def default_rank(dim: int) -> int:
    """Rank of a ``lowrank`` map: ``max(1, d // 100)`` (N-NJTC)."""
    return max(1, dim // 100)


@dataclass
class ReplaceConfig:
    """How removed blocks are replaced.

    Attributes:
        kind: none | linear | lowrank | fold | block (see ``REPLACEMENTS``).
        fit: independent (original model's inputs) | sequential (the surgered model's inputs).
        rank: rank of ``lowrank`` maps; None = ``max(1, d // 100)``.
        ridge: ridge of the closed-form fits, relative to the mean diagonal of the input Gram (0 = pseudo-inverse).
        steps: Adam steps for ``lowrank`` (after its closed-form start) and ``block``; 0 skips training.
        lr: Adam learning rate for those steps.
        batch_size: sequences per forward pass while capturing.
        cache_bytes: most bytes of captured activations kept for the Adam steps.
        seed: seeds the Adam batch order.
        progress: show tqdm bars.
    """

    kind: str = "linear"
    fit: str = "independent"
    rank: int | None = None
    ridge: float = 0.0
    steps: int | None = None
    lr: float | None = None
    batch_size: int = 4
    cache_bytes: int = DEFAULT_CACHE_BYTES
    seed: int = 0
    progress: bool = True

    def __post_init__(self):
        if self.kind not in REPLACEMENTS:
            raise LayercutError(f"unknown replacement '{self.kind}': choose one of {', '.join(REPLACEMENTS)}")
        if self.fit not in FITS:
            raise LayercutError(f"unknown --fit '{self.fit}': choose one of {', '.join(FITS)}")
        if self.rank is not None and (not isinstance(self.rank, int) or self.rank <= 0):
            raise LayercutError(f"--rank must be a positive integer, got {self.rank}")
        if self.rank is not None and self.kind != "lowrank":
            raise LayercutError(f"--rank applies to --replace lowrank only (got --replace {self.kind}); drop --rank")
        if not (math.isfinite(self.ridge) and self.ridge >= 0):
            raise LayercutError(f"--ridge must be a finite number >= 0, got {self.ridge}")
        if self.steps is not None and self.steps < 0:
            raise LayercutError(f"--replace-steps must be >= 0, got {self.steps}")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise LayercutError(f"replacement lr must be a positive number, got {self.lr}")
        if self.batch_size <= 0:
            raise LayercutError(f"--batch-size must be positive, got {self.batch_size}")
        spec = REPLACEMENTS[self.kind]
        self.steps = spec.default_steps if self.steps is None else self.steps
        self.lr = spec.default_lr if self.lr is None else self.lr


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


# ----------------------------------------------------------------------------------------------------------------
# Replacement modules


class LinearMap(nn.Module):
    """``h -> h A + b`` on the residual stream; ``d^2 + d`` parameters."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    @classmethod
    def from_fit(cls, fit: LinearFit, dtype: torch.dtype, device: torch.device) -> LinearMap:
        """The module computing ``fit`` (float64 weights cast to ``dtype``)."""
        module = cls(fit.weight.shape[0]).to(device=device, dtype=dtype)
        with torch.no_grad():
            module.proj.weight.copy_(fit.weight.T)  # nn.Linear stores [d_out, d_in]
            module.proj.bias.copy_(fit.bias)
        return module

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Map [..., d] states."""
        return self.proj(hidden)


class LowRankMap(nn.Module):
    """``h -> h + up(down(BatchNorm(h)))`` (residual) or ``h -> up(down(BatchNorm(h)))``.

    Parameters: ``2 r d`` (down, up) ``+ d`` (up's bias) ``+ 2 d`` (the norm's affine), plus the norm's
    ``2 d`` running statistics (buffers).
    """

    def __init__(self, dim: int, rank: int, residual: bool = True):
        super().__init__()
        self.residual = residual
        self.norm = nn.BatchNorm1d(dim)
        self.down = nn.Linear(dim, rank, bias=False)
        self.up = nn.Linear(rank, dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Map [..., d] states; the norm sees them as a [tokens, d] batch."""
        flat = hidden.reshape(-1, hidden.shape[-1])  # [tokens, d]
        out = self.up(self.down(self.norm(flat))).view_as(hidden)
        return hidden + out if self.residual else out


class ReplacedBlock(nn.Module):
    """A kept block with replacement maps for the removed spans next to it.

    ``before`` runs on the block's input (a span that started at block 0), ``after`` on its output.
    Attribute lookups it does not know fall through to the wrapped block, so code that reaches into
    blocks by name (``self_attn``, ``mlp.down_proj``, ``attention_type``) sees the same parts.
    """

    def __init__(self, block: nn.Module, before: nn.Module | None = None, after: nn.Module | None = None):
        super().__init__()
        self.block = block
        self.before = before
        self.after = after

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            block = self.__dict__["_modules"].get("block")
            if block is None:
                raise
            return getattr(block, name)

    def maps(self) -> list[nn.Module]:
        """The replacement maps (before, after) present."""
        return [m for m in (self.before, self.after) if m is not None]

    def forward(self, *args, **kwargs):
        """Run ``before``, the block, then ``after``; returns what the block returns (tensor or tuple)."""
        hidden = block_input(args, kwargs)
        if self.before is not None:
            hidden = self.before(hidden)
        if args:
            output = self.block(hidden, *args[1:], **kwargs)
        else:
            output = self.block(**{**kwargs, "hidden_states": hidden})
        if self.after is None:
            return output
        if isinstance(output, (tuple, list)):
            return (self.after(output[0]), *output[1:])
        return self.after(output)


def parameter_count(module: nn.Module) -> int:
    """Number of trainable-or-not parameters (buffers excluded)."""
    return sum(p.numel() for p in module.parameters())


# ----------------------------------------------------------------------------------------------------------------
# What a fit produces, and how it is put into the model


@dataclass
class WeightPatch:
    """New weights for an existing module (``fold``); :meth:`apply` swaps them in and returns an undo."""

    module: nn.Module
    weight: torch.Tensor
    bias: torch.Tensor | None = None

    def apply(self) -> Callable[[], None]:
        """Write the new weights; the returned function restores the old ones."""
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
        kind: the registered kind.
        span: positions of the removed blocks.
        where: "after" / "before" (a map on block ``host``), "fold" (a patch of ``host``) or "block"
            (``module`` stands at the span's place).
        host: position of the kept block carrying the replacement (None for "block").
        module: the map or the new block; None for "fold".
        patch: the new MLP output weights for "fold".
        record: JSON-ready description for ``layercut.json`` and ``config.layercut_replacements``.
    """

    kind: str
    span: tuple[int, ...]
    where: str
    host: int | None
    module: nn.Module | None = None
    patch: WeightPatch | None = None
    record: dict = field(default_factory=dict)


def _assemble(original: Sequence[nn.Module], layout: list[list[int]], done: Sequence[Replacement]):
    """The block list with ``done`` spans replaced: (blocks, per-layer sources, layout)."""
    removed = {i for r in done for i in r.span}
    before = {r.host: r.module for r in done if r.where == "before"}
    after = {r.host: r.module for r in done if r.where == "after"}
    absorbed: dict[int, list[int]] = {}  # host -> original indices it now covers besides its own
    for r in done:
        if r.where != "block":
            absorbed.setdefault(r.host, []).extend(i for k in r.span for i in layout[k])
    new_blocks = {r.span[0]: r for r in done if r.where == "block"}
    blocks, sources, new_layout = [], [], []
    for i, block in enumerate(original):
        if i in new_blocks:
            r = new_blocks[i]
            blocks.append(r.module)
            sources.append(r.record["init_block_position"])
            new_layout.append([k for j in r.span for k in layout[j]])
        if i in removed:
            continue
        if i in before or i in after:
            block = ReplacedBlock(block, before.get(i), after.get(i))
        blocks.append(block)
        sources.append(i)
        new_layout.append(layout[i] + absorbed.get(i, []))
    return blocks, sources, new_layout


@contextmanager
def _surgered_view(model: nn.Module, original: Sequence[nn.Module], done: Sequence[Replacement]) -> Iterator[None]:
    """The model with the ``done`` replacements in place, for the length of a ``with``."""
    if not done:
        yield
        return
    blocks, sources, layout = _assemble(original, block_layout(model), done)
    with ExitStack() as stack:
        stack.enter_context(blocks_replaced(model, blocks, sources, layout))
        for r in done:
            if r.patch is not None:
                stack.callback(r.patch.apply())
        yield


# ----------------------------------------------------------------------------------------------------------------
# Capture: what a fitter needs from one forward pass


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


class _Recorder:
    """Forward hooks that store named activations of one forward pass; handles removed on close."""

    def __init__(self):
        self.values: dict[str, object] = {}
        self._handles = []

    def input_of(self, module: nn.Module, key: str, with_call: bool = False) -> None:
        def hook(_m, args, kwargs):
            self.values[key] = block_input(args, kwargs).detach()
            if with_call:
                rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
                self.values[key + ".call"] = (tuple(args[1:]), rest)

        self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def output_of(self, module: nn.Module, key: str) -> None:
        def hook(_m, _args, output):
            self.values[key] = block_output(output).detach()

        self._handles.append(module.register_forward_hook(hook))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


@torch.no_grad()
def _record(model: nn.Module, batch: torch.Tensor, setup: Callable[[_Recorder], None]) -> dict[str, object]:
    """Run the base model (no LM head, no cache) on ``batch`` with hooks from ``setup``; their values."""
    recorder = _Recorder()
    try:
        setup(recorder)
        model.base_model(input_ids=batch.to(input_device(model)), use_cache=False)
    finally:
        recorder.close()
    return recorder.values


# ----------------------------------------------------------------------------------------------------------------
# Fitters: one per span; observe batches, then produce a Replacement


class SpanFitter:
    """Base class: accumulates what one span's fit needs over calibration batches.

    Subclasses set ``needs_call`` (the block's call arguments) / ``needs_mlp`` (the host block's MLP
    activations) and implement :meth:`observe` and :meth:`finish`.
    """

    needs_call = False
    needs_mlp = False

    def __init__(self, model: nn.Module, original: Sequence[nn.Module], span: tuple[int, ...], config: ReplaceConfig):
        self.model = model
        self.original = original
        self.span = span
        self.config = config
        self.dim = hidden_size(model)
        self.where = "before" if span[0] == 0 else "after"
        self.host = span[-1] + 1 if self.where == "before" else span[0] - 1
        param = next(original[self.host].parameters())  # a span never covers every block
        self.dtype, self.device = param.dtype, param.device
        self.seconds = 0.0

    def hook_inputs(self, recorder: _Recorder) -> None:
        """Hooks that capture the span's input (and what the kind needs besides)."""
        recorder.input_of(self.original[self.span[0]], f"{self.span}.x", with_call=self.needs_call)

    def hook_target(self, recorder: _Recorder) -> None:
        """Hook that captures the span's output."""
        recorder.output_of(self.original[self.span[-1]], f"{self.span}.y")

    def batch(self, inputs: dict, targets: dict) -> SpanBatch:
        """Assemble a :class:`SpanBatch` from the recorded values."""
        key = str(self.span)
        args, kwargs = inputs.get(f"{key}.x.call", ((), {}))
        return SpanBatch(inputs[f"{key}.x"], targets[f"{key}.y"], args, kwargs,
                         inputs.get(f"{key}.z"), inputs.get(f"{key}.m"))

    def observe(self, batch: SpanBatch) -> None:
        """Fold one batch in."""
        raise NotImplementedError

    def finish(self) -> Replacement:
        """The fitted replacement."""
        raise NotImplementedError

    def _replacement(self, module: nn.Module | None, **record) -> Replacement:
        return Replacement(self.config.kind, self.span, self.where, self.host, module, record=record)


class LinearFitter(SpanFitter):
    """Closed-form ``A, b`` from streamed float64 moments of (span input, span output)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.moments = PairAccumulator()

    def observe(self, batch: SpanBatch) -> None:
        """Accumulate the Grams of (x, y)."""
        self.moments.update(batch.x, batch.y)

    def finish(self) -> Replacement:
        """Solve the least squares and build the :class:`LinearMap`."""
        fit = fit_linear_map(self.moments.moments(), self.config.ridge)
        module = LinearMap.from_fit(fit, self.dtype, self.device)
        return self._replacement(module, params=parameter_count(module), ridge=self.config.ridge,
                                 tokens=self.moments.n)


class _CachingFitter(SpanFitter):
    """Keeps captured batches (on the CPU, up to ``cache_bytes``) for Adam steps in :meth:`finish`."""

    def __init__(self, *args):
        super().__init__(*args)
        self.cache: list[SpanBatch] = []
        self.cached_bytes = 0
        self.dropped_batches = 0

    def remember(self, batch: SpanBatch) -> None:
        """Keep a CPU copy of ``batch`` if there are Adam steps to run and it fits in the budget."""
        if not self.config.steps:
            return
        size = batch.x.numel() * batch.x.element_size() * 2
        if self.cached_bytes + size > self.config.cache_bytes and self.cache:
            self.dropped_batches += 1
            return
        self.cached_bytes += size
        self.cache.append(_move(batch, torch.device("cpu")))

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
        optimizer = torch.optim.Adam(params, lr=self.config.lr)
        generator = torch.Generator().manual_seed(self.config.seed)
        steps = self.config.steps
        losses = []
        bar = tqdm(range(steps), desc=f"train {self.config.kind} {list(self.span)}", disable=not self.config.progress)
        for step in bar:
            lr = self.config.lr * 0.5 * (1 + math.cos(math.pi * step / steps))  # cosine decay to 0
            for group in optimizer.param_groups:
                group["lr"] = lr
            index = int(torch.randint(len(self.cache), (1,), generator=generator))
            batch = _move(self.cache[index], self.device, torch.float32)
            loss = _relative_mse(forward(module, batch), batch.y, batch.x)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            losses.append(float(loss.detach()))
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
        for p, flag in zip(params, flags, strict=True):
            p.requires_grad_(flag)
        module.to(self.dtype)
        first, last = (losses[0], sum(losses[-10:]) / len(losses[-10:])) if losses else (None, None)
        return {"steps": steps, "lr": self.config.lr, "train_loss_start": first, "train_loss_end": last}


def _relative_mse(pred: torch.Tensor, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """MSE(pred, y) / MSE(x, y) in float32: 1.0 is what removing the span costs."""
    return ((pred.float() - y.float()) ** 2).mean() / ((x.float() - y.float()) ** 2).mean().clamp_min(1e-12)


def _move(obj, device: torch.device, dtype: torch.dtype | None = None):
    """Move tensors (floating ones cast to ``dtype``) inside a SpanBatch / tuple / dict to ``device``."""
    if isinstance(obj, torch.Tensor):
        cast = dtype if dtype is not None and obj.is_floating_point() else obj.dtype
        return obj.to(device=device, dtype=cast)
    if isinstance(obj, SpanBatch):
        return SpanBatch(*(_move(getattr(obj, f), device, dtype) for f in ("x", "y", "args", "kwargs", "z", "m")))
    if isinstance(obj, tuple):
        return tuple(_move(v, device, dtype) for v in obj)
    if isinstance(obj, list):
        return [_move(v, device, dtype) for v in obj]
    if isinstance(obj, dict):
        return {k: _move(v, device, dtype) for k, v in obj.items()}
    return obj


def reduced_rank_fit(moments: PairMoments, rank: int, ridge: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Best rank-``rank`` affine map in least squares: ``y ~ (x - mean_x) B P P^T + mean_y``.

    The ordinary solution B is projected on the top ``rank`` principal directions of its fitted values
    (eigenvectors of ``B^T Cxx B``), which is the exact rank-constrained optimum (reduced-rank regression).

    Returns:
        ``B P`` [d_in, rank] and ``P`` [d_out, rank], float64.
    """
    full = fit_linear_map(moments, ridge).weight  # [d_in, d_out]
    fitted = full.T @ moments.cxx @ full  # [d_out, d_out] covariance of the fitted values
    _, vectors = torch.linalg.eigh((fitted + fitted.T) / 2)
    top = vectors[:, -rank:]  # [d_out, rank]
    return full @ top, top


class LowRankFitter(_CachingFitter):
    """Residual low-rank map: closed-form reduced-rank start, then Adam on MSE."""

    def __init__(self, *args):
        super().__init__(*args)
        self.rank = self.config.rank or default_rank(self.dim)
        self.moments = PairAccumulator()

    def observe(self, batch: SpanBatch) -> None:
        """Accumulate the moments of (x, y - x) and keep the batch for training."""
        self.moments.update(batch.x, batch.y - batch.x)
        self.remember(batch)

    def finish(self) -> Replacement:
        """Build the map from the reduced-rank solution and train it."""
        moments = self.moments.moments()
        down, up = reduced_rank_fit(moments, self.rank, self.config.ridge)
        module = LowRankMap(self.dim, self.rank, residual=True)
        variance = torch.diagonal(moments.cxx) / moments.n
        with torch.no_grad():
            module.norm.running_mean.copy_(moments.mean_x)
            module.norm.running_var.copy_(variance)
            # BatchNorm divides by sqrt(var + eps); scaling the down projection undoes it
            module.down.weight.copy_((torch.sqrt(variance + module.norm.eps)[:, None] * down).T)
            module.up.weight.copy_(up)
            module.up.bias.copy_(moments.mean_y)
        training = self.train(module, lambda map_, batch: map_(batch.x)) if self.config.steps else {"steps": 0}
        module.to(device=self.device, dtype=self.dtype).eval()
        return self._replacement(module, params=parameter_count(module), rank=self.rank, residual=True,
                                 linear_params=self.dim * self.dim + self.dim, tokens=self.moments.n, **training)


class BlockFitter(_CachingFitter):
    """A copy of the span's first block, trained with Adam to reproduce the span's output."""

    needs_call = True

    def __init__(self, *args):
        super().__init__(*args)
        self.where, self.host = "block", None
        param = next(self.original[self.span[0]].parameters())
        self.dtype, self.device = param.dtype, param.device

    def observe(self, batch: SpanBatch) -> None:
        """Keep the batch (and the block's call arguments) for training."""
        self.remember(batch)

    def finish(self) -> Replacement:
        """Train the copy."""
        module = copy.deepcopy(self.original[self.span[0]])

        def forward(block: nn.Module, batch: SpanBatch) -> torch.Tensor:
            return block_output(block(batch.x, *batch.args, **batch.kwargs))

        training = self.train(module, forward) if self.config.steps else {"steps": 0}
        module.to(device=self.device, dtype=self.dtype).eval()
        return Replacement(self.config.kind, self.span, "block", None, module, record={
            "params": parameter_count(module), "init_block_position": self.span[0], **training})


def _fold_fitter(*args) -> SpanFitter:
    from prune.fold import FoldFitter  # fold builds on this module's base class

    return FoldFitter(*args)


@dataclass(frozen=True)
class ReplacementSpec:
    """A registered replacement kind: its fitter, defaults, and whether it keeps the architecture vanilla."""

    fitter: Callable[..., SpanFitter] | None
    vanilla: bool
    default_steps: int = 0
    default_lr: float = 1e-3
    description: str = ""


REPLACEMENTS: dict[str, ReplacementSpec] = {
    "none": ReplacementSpec(None, True, description="remove the blocks"),
    "linear": ReplacementSpec(LinearFitter, False, description="closed-form h -> h A + b per span"),
    "lowrank": ReplacementSpec(LowRankFitter, False, default_steps=100, default_lr=1e-3,
                               description="h -> h + BN(h) U V, rank max(1, d // 100)"),
    "fold": ReplacementSpec(_fold_fitter, True, description="linear map folded into the previous block's MLP"),
    "block": ReplacementSpec(BlockFitter, True, default_steps=200, default_lr=1e-4,
                             description="one trained block of the architecture per span"),
}


# ----------------------------------------------------------------------------------------------------------------
# Driver


def spans_of(dropped: Sequence[int]) -> list[tuple[int, ...]]:
    """Maximal runs of consecutive positions, as tuples."""
    return [tuple(range(start, stop)) for start, stop in span_pairs(dropped)]


def _batches(token_ids: torch.Tensor, config: ReplaceConfig, desc: str):
    starts = range(0, token_ids.shape[0], config.batch_size)
    for start in tqdm(starts, desc=desc, unit="batch", disable=not config.progress):
        yield token_ids[start : start + config.batch_size]  # [batch, seq]


def _fit_independent(model, fitters: list[SpanFitter], token_ids, config) -> list[Replacement]:
    """One pass of the original model feeds every span's fitter."""
    started = time.perf_counter()

    def setup(recorder: _Recorder) -> None:
        for fitter in fitters:
            _hook_both(fitter, recorder)

    for batch in _batches(token_ids, config, f"fit {config.kind}"):
        values = _record(model, batch, setup)
        for fitter in fitters:
            fitter.observe(fitter.batch(values, values))
    shared = (time.perf_counter() - started) / len(fitters)
    results = []
    for fitter in fitters:
        begun = time.perf_counter()
        results.append(fitter.finish())
        results[-1].record["fit_seconds"] = round(shared + time.perf_counter() - begun, 2)
    return results


def _hook_both(fitter: SpanFitter, recorder: _Recorder) -> None:
    fitter.hook_inputs(recorder)
    fitter.hook_target(recorder)


def _fit_sequential(model, fitters: list[SpanFitter], token_ids, config) -> list[Replacement]:
    """Span by span: inputs from the model with the earlier spans already replaced, targets from the original."""
    original = fitters[0].original
    done: list[Replacement] = []
    for fitter in fitters:
        begun = time.perf_counter()
        for batch in _batches(token_ids, config, f"fit {config.kind} {list(fitter.span)}"):
            if done:
                targets = _record(model, batch, fitter.hook_target)
                with _surgered_view(model, original, done):
                    inputs = _record(model, batch, fitter.hook_inputs)
            else:  # nothing replaced yet: one pass of the original model gives inputs and targets
                inputs = targets = _record(model, batch, partial(_hook_both, fitter))
            fitter.observe(fitter.batch(inputs, targets))
        done.append(fitter.finish())
        done[-1].record["fit_seconds"] = round(time.perf_counter() - begun, 2)
    return done


def check_replacement_supported(model: nn.Module, kind: str) -> None:
    """Architecture-level checks for ``kind`` that need no calibration pass (run them before scoring)."""
    if kind == "fold":
        from prune.fold import check_fold_architecture

        check_fold_architecture(model)


def fit_replacements(model: nn.Module, dropped: Sequence[int], token_ids: torch.Tensor,
                     config: ReplaceConfig) -> list[Replacement]:
    """Fit one replacement per span of ``dropped`` (current positions) without changing the model.

    Args:
        model: a supported model, not yet surgered for ``dropped``.
        dropped: positions of the blocks to replace.
        token_ids: [samples, seq] calibration tokens.
        config: the kind and fitting options.
    """
    spec = REPLACEMENTS[config.kind]
    original = list(get_blocks(model)[1])
    spans = spans_of(check_block_indices(dropped, len(original)))
    if config.kind == "fold":
        from prune.fold import check_foldable

        check_foldable(model, spans)
    fitters = [spec.fitter(model, original, span, config) for span in spans]
    if config.fit == "sequential":
        return _fit_sequential(model, fitters, token_ids, config)
    return _fit_independent(model, fitters, token_ids, config)


def install_replacements_(model: nn.Module, replacements: Sequence[Replacement]) -> list[dict]:
    """Put fitted replacements into the model for good; records them on the config and returns the records."""
    original = list(get_blocks(model)[1])
    layout = block_layout(model)
    blocks, sources, new_layout = _assemble(original, layout, replacements)
    for r in replacements:
        if r.patch is not None:
            r.patch.apply()
    records = replacement_records(model)
    set_blocks_(model, blocks, sources, new_layout)
    new = [{"kind": r.kind, "replaces": [i for k in r.span for i in layout[k]], "where": r.where, **r.record}
           for r in replacements]
    for record in new:
        record.pop("init_block_position", None)
    # keep the earlier records whose host survived (set_blocks_ filtered against the new layout)
    kept = [r for r in records if host_position(new_layout, r["replaces"]) is not None]
    setattr(model.config, RECORDS_ATTR, kept + new)
    return new


def replace_blocks_(model: nn.Module, dropped: Sequence[int], token_ids: torch.Tensor | None,
                    config: ReplaceConfig) -> list[dict]:
    """Remove blocks ``dropped`` (current positions) and put fitted replacements in their place.

    Args:
        model: a supported model; changed in place.
        dropped: block positions to remove.
        token_ids: [samples, seq] calibration tokens (unused for ``kind="none"``).
        config: the kind and fitting options.

    Returns:
        One record per replacement (kind, replaces, params, fit, fit_seconds, ...).
    """
    if config.kind == "none":
        drop_blocks_(model, dropped)
        return []
    started = time.perf_counter()
    replacements = fit_replacements(model, dropped, token_ids, config)
    for r in replacements:
        r.record["fit"] = config.fit
    records = install_replacements_(model, replacements)
    logger.info("replaced %d span(s) by %s (%s fit) in %.1f s", len(records), config.kind, config.fit,
                time.perf_counter() - started)
    return records


def replacement_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that ``--train replacements`` trains, in block order.

    Linear / low-rank maps, the blocks that replaced spans, and the MLP output projections that
    absorbed a folded map.
    """
    from prune.fold import mlp_output_projection

    _, blocks = get_blocks(model)
    layout = block_layout(model)
    modules: list[nn.Module] = []
    for record in replacement_records(model):
        position = host_position(layout, record["replaces"])
        block = blocks[position]
        if record["kind"] == "fold":
            modules.append(mlp_output_projection(model, block))
        elif record["kind"] == "block":
            modules.append(block)
        elif isinstance(block, ReplacedBlock):
            modules.append(block.before if record["where"] == "before" else block.after)
        else:
            logger.warning("block %d should carry a %s map but has none (loaded without prune.load?)",
                           position, record["kind"])
    return modules
