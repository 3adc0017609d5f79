"""``linearpatch``: LinearPatch (arXiv 2505.24680), ``P = H D H^T`` at each pruned interface, training-free.

At the interface the next block gets the span's input ``x`` instead of its output ``y``; their
per-channel magnitudes differ, and a few tokens carry outliers thousands of times larger than the
rest. The patch rotates the state by an orthonormal Hadamard matrix ``H`` (which spreads those
outliers over all channels), scales each rotated channel by ``D_j = mean |(y H)_j| / mean |(x H)_j|``
over calibration tokens, and rotates back: ``h -> h H D H^T``, one symmetric d x d matrix.

Reproduced: the Hadamard rotation, the per-channel scale from calibration magnitudes, training-free.
Approximated: a width that is not a power of two (SmolLM2's 576 = 64 x 9) uses ``H_{2^k} (x) Q_m``
with ``Q_m`` a fixed random orthogonal matrix (seed 0) in place of the paper's Hadamard sizes; the patch
rides as a map on the kept block (``replacements.safetensors``, like ``linear``) rather than being
fused into the next layer's weights; the paper's optional top-K-logit distillation is layercut's
distillation step (``distill: {train: replacements, kl_weight: ...}``, full logits).
Not for sandwich-norm architectures (Gemma-2/3, OLMo-2, ...: :func:`check_linearpatch_architecture`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from prune.errors import LayercutError
from prune.model.adapters import arch_spec
from prune.model.layouts import LAYERCUT
from prune.model.remote_code import LinearMap, build_map
from prune.replace.capture import SpanBatch
from prune.replace.fitter import Replacement, SpanFitter
from prune.replace.modules import map_on_block, parameter_count
from prune.replace.options import MethodOptions
from prune.replace.registry import Method, register_method


def orthonormal_hadamard(dim: int, seed: int = 0) -> torch.Tensor:
    """An orthonormal [dim, dim] float64 rotation that spreads outliers over every channel.

    Sylvester Hadamard of the largest power-of-two factor of ``dim``, Kronecker a seeded random
    orthogonal matrix of the odd rest (nothing when ``dim`` is a power of two).
    """
    power = dim & -dim  # largest power of two dividing dim
    hadamard = torch.ones(1, 1, dtype=torch.float64)
    while hadamard.shape[0] < power:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    hadamard = hadamard / math.sqrt(power)
    rest = dim // power
    if rest == 1:
        return hadamard
    gaussian = torch.randn(rest, rest, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    q = q * torch.sign(torch.diagonal(r))  # a unique, well-spread orthogonal matrix
    return torch.kron(hadamard.contiguous(), q.contiguous())


def check_linearpatch_architecture(model: nn.Module, method: str = "linearpatch") -> None:
    """Refuse models whose blocks normalise each sub-layer's output before the residual add.

    The rotation is meant for outliers at a few tokens. Gemma-3-270M, a sandwich-norm model (found by
    structure, as for ``fold`` and ``magcomp``), carries one channel on every token at ~5e3 where the
    others are ~1e2 (channel 163, blocks 8-17): the rotation spreads it over every rotated channel, and
    the uneven scales of ``H D H^T`` (0.7 to 2.1) mix it back into all of them. Calibration perplexity
    at drop 4 (blocks 8, 9, 14, 16): dense 29, removal 141, the patch 149,890; the same scales in the
    unrotated basis 125, least-squares scales in the rotated one 5,513.
    """
    normed = arch_spec(model).mlp_out_norm
    if normed:
        raise LayercutError(f"--replace {method}: '{model.config.model_type}' normalises each sub-layer's "
                            f"output ({normed}), and its Hadamard patch then mixes the massive channels into every "
                            "other one; use --replace linear or none")


@dataclass
class LinearPatchOptions(MethodOptions):
    """``linearpatch`` takes none of the generic options: the scales are ratios of calibration magnitudes."""


class LinearPatchFitter(SpanFitter):
    """Mean absolute value of every rotated channel of x and of y; the patch rescales one onto the other."""

    def __init__(self, *args):
        super().__init__(*args)
        self.rotation = orthonormal_hadamard(self.dim)
        self.abs_x = torch.zeros(self.dim, dtype=torch.float64)
        self.abs_y = torch.zeros(self.dim, dtype=torch.float64)
        self.tokens = 0

    def observe(self, batch: SpanBatch) -> None:
        """Accumulate |x H| and |y H| per rotated channel."""
        rotation = self.rotation.to(batch.x.device)
        for total, states in ((self.abs_x, batch.x), (self.abs_y, batch.y)):
            rows = states.reshape(-1, self.dim).double() @ rotation  # [tokens, d]
            total += rows.abs().sum(0).cpu()
        self.tokens += batch.x.shape[:-1].numel()

    def finish(self) -> Replacement:
        """``P = H diag(D) H^T`` as a :class:`LinearMap` with zero bias."""
        scale = self.abs_y / self.abs_x.clamp_min(1e-30)
        patch = self.rotation @ torch.diag(scale) @ self.rotation.T  # symmetric
        module = LinearMap(self.dim).to(device=self.device, dtype=self.dtype)
        with torch.no_grad():
            module.proj.weight.copy_(patch.T)  # nn.Linear stores [d_out, d_in]
            module.proj.bias.zero_()
        return self._replacement(module, params=parameter_count(module), tokens=self.tokens,
                                 scale_min=float(scale.min()), scale_max=float(scale.max()))


register_method(Method(
    "linearpatch", "LinearPatch: h -> h H D H^T, Hadamard rotation and channel scales from calibration",
    serving=LAYERCUT, closed_form=True, offloadable=True, options=LinearPatchOptions, fitter=LinearPatchFitter,
    check_model=check_linearpatch_architecture,
    # saved as the same module type as ``linear`` (a d x d map), so checkpoints load with either code path
    module=LinearMap, spec=lambda module: {"dim": module.proj.in_features},
    build=build_map, trained_module=map_on_block,
))
