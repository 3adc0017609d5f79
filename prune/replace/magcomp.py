"""``magcomp``: Prune&Comp's magnitude compensation (arXiv 2507.18212), one scalar per removed span.

Removing a span feeds the next block the span's input ``x`` where it used to get the span's output
``y``, whose norm differs (it grows with depth). The compensation factor is ``a = mean ||y|| / mean
||x||`` over calibration tokens. Rather than scaling the residual stream up by ``a`` (the paper
rescales the weights in front of the interface; with tied embeddings that would also scale the LM
head), every attention and MLP output projection *after* the span is scaled by ``1 / a``: blocks
normalise their input before reading it and the final norm removes the overall scale, so downstream
updates shrunk by ``1 / a`` against ``x`` act exactly like full updates against ``a x`` (up to the
norms' epsilon). The checkpoint stays vanilla. Several spans multiply their factors.

Reproduced: the scalar per removal from calibration norms, folded into weights, training-free.
Approximated: the paper's iterative prune-then-compensate loop re-scores the compensated model before
each removal; here the blocks are chosen first (any ``--select``) and every span's factor comes from
the original model's states (``--fit sequential`` takes them from the surgered model instead).
Pre-norm architectures only (post-layer-norm OPT and Gemma-2's post-norms would undo the scaling).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from prune.errors import LayercutError
from prune.model.adapters import arch_spec, get_blocks, get_submodule
from prune.model.layouts import VANILLA
from prune.replace.capture import SpanBatch
from prune.replace.fitter import Replacement, SpanFitter
from prune.replace.fold import mlp_output_projection
from prune.replace.options import MethodOptions
from prune.replace.registry import Method, register_method

# Names of the attention output projection, relative to the attention module (llama-like, OPT, GPT-2, NeoX).
ATTENTION_OUTPUT_NAMES = ("o_proj", "out_proj", "c_proj", "dense")


def attention_output_projection(model: nn.Module, block: nn.Module) -> nn.Module:
    """The dense layer through which ``block``'s attention writes the residual stream.

    Raises:
        LayercutError: none of :data:`ATTENTION_OUTPUT_NAMES` is a dense layer of the attention module.
    """
    from transformers.pytorch_utils import Conv1D  # here, not at the top: transformers takes seconds to import

    attention = get_submodule(block, arch_spec(model).attention)
    for name in ATTENTION_OUTPUT_NAMES:
        module = getattr(attention, name, None)
        if isinstance(module, (nn.Linear, Conv1D)) and module.weight.is_floating_point():
            return module
    raise LayercutError(f"--replace magcomp: no attention output projection ({', '.join(ATTENTION_OUTPUT_NAMES)}) "
                        f"in '{model.config.model_type}' blocks; use --replace none / linear")


def writers(model: nn.Module, block: nn.Module) -> list[nn.Module]:
    """The projections through which ``block`` adds to the residual stream (attention, then MLP)."""
    return [attention_output_projection(model, block), mlp_output_projection(model, block)]


def check_magcomp_architecture(model: nn.Module, method: str = "magcomp") -> None:
    """Fail before any calibration pass where scaling the output projections would not compensate."""
    model_type = model.config.model_type
    normed = arch_spec(model).mlp_out_norm  # sandwich norms (gemma2/3, olmo2/3, ...), found by structure
    if normed:
        raise LayercutError(f"--replace {method}: '{model_type}' normalises each sub-layer's output "
                            f"({normed}), which undoes the scaling; use --replace linear or none")
    if getattr(model.config, "do_layer_norm_before", True) is False:
        raise LayercutError(f"--replace {method} needs pre-norm blocks; this '{model_type}' normalises after the "
                            "residual add: use --replace linear or none")
    if getattr(model, "hf_quantizer", None) is not None:
        raise LayercutError(f"--replace {method} rewrites weights: load the model without "
                            "--load-in-4bit/--load-in-8bit")
    writers(model, get_blocks(model)[1][0])


@dataclass
class ScalePatch:
    """Multiply the weights (and biases) of ``modules`` by ``factor`` when applied; the undo restores them.

    Scaling what the modules hold at apply time (not a copy taken at fit time) lets several spans'
    patches compose on the same downstream projection.
    """

    modules: list[nn.Module]
    factor: float

    def apply(self) -> Callable[[], None]:
        """Scale in place (new tensors, so the originals can be put back).

        On a skeleton's blocks the scaling is what every later read of their tensors returns
        (``prune.loading.offload.rewrite_tensors``): no block is read for it.
        """
        if any(m.weight.is_meta for m in self.modules):
            from prune.loading.offload import rewrite_tensors

            return rewrite_tensors((m, attr, self._scaled) for m in self.modules for attr in ("weight", "bias")
                                   if getattr(m, attr, None) is not None)
        saved = [(m, m.weight.data, m.bias.data if m.bias is not None else None) for m in self.modules]
        for module, weight, bias in saved:
            module.weight.data = weight * self.factor
            if bias is not None:
                module.bias.data = bias * self.factor

        def undo() -> None:
            for module, weight, bias in saved:
                module.weight.data = weight
                if bias is not None:
                    module.bias.data = bias

        return undo

    def _scaled(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor * self.factor


@dataclass
class MagCompOptions(MethodOptions):
    """``magcomp`` takes none of the generic options: the factor is a ratio of calibration norms."""


class MagCompFitter(SpanFitter):
    """Streams the mean token norm of the span's input and output; the ratio scales every later block's writers."""

    def __init__(self, *args):
        super().__init__(*args)
        blocks = len(self.original)
        self.after = list(range(self.span[-1] + 1, blocks))
        # the patch is recorded on the first kept block it scales (the one before the span when none follows)
        self.where, self.host = "fold", self.after[0] if self.after else self.span[0] - 1
        self.norm_x = self.norm_y = 0.0
        self.tokens = 0

    def observe(self, batch: SpanBatch) -> None:
        """Add up token norms of x and y."""
        self.norm_x += float(batch.x.double().norm(dim=-1).sum())
        self.norm_y += float(batch.y.double().norm(dim=-1).sum())
        self.tokens += batch.x.shape[:-1].numel()

    def finish(self) -> Replacement:
        """The factor and the patch that scales every later block's output projections by its inverse."""
        factor = self.norm_y / max(self.norm_x, 1e-30)
        modules = [m for b in self.after for m in writers(self.model, self.original[b])]
        patch = ScalePatch(modules, 1.0 / factor)
        return Replacement(self.config.method, self.span, "fold", self.host, None, patch, record={
            "params": 0, "factor": factor, "scaled_blocks": len(self.after), "tokens": self.tokens})


register_method(Method(
    "magcomp", "Prune&Comp: later blocks' output projections scaled by mean|x| / mean|y| of the span",
    serving=VANILLA, closed_form=True, offloadable=True, options=MagCompOptions, fitter=MagCompFitter,
    check_model=check_magcomp_architecture,
    trained_module=lambda model, block, _record: mlp_output_projection(model, block),
    describe=lambda record: (f"magnitude factor {record['factor']:.3f} folded into "
                             f"{record['scaled_blocks']} later block(s)"),
))
