"""``fold``: a span's linear replacement folded into the previous kept block's MLP output projection.

The kept block before the span outputs ``h = r + m``: ``r`` is its input plus its attention part,
``m = z W`` the MLP output, with ``z`` the MLP's hidden activations (width = intermediate size) and
``W`` the output projection (``down_proj``, ``fc2``, ``c_proj``, ``dense_4h_to_h``). A vanilla block
can only change ``W``, so the fold solves, exactly in least squares over calibration tokens,

    min_{W', b'} || r + z W' + b' - y ||^2,   i.e. regress  t = y - r = y - h + m  on  z,

where ``y`` is the span's output. That is ReplaceMe's idea (fold a map into ``down_proj``) without its
restriction ``W' = W T``: the streamed Gram of ``z`` is intermediate x intermediate in float64 (1536^2
= 19 MB for SmolLM2-135M; 11008^2 = 1 GB for a 7B Llama, acceptable). Projections without a bias
(Llama family) are fitted without intercept (uncentred least squares); those with one (OPT, GPT-2,
GPT-NeoX) also get a new bias. The checkpoint stays a plain ``AutoModelForCausalLM``. Unless
``update_scale`` says otherwise only 0.7 of the way from ``W`` to ``W'`` is taken (:class:`FoldOptions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from prune.errors import LayercutError
from prune.loading.offload import current_tensor
from prune.measure.least_squares import LinearFit, fit_linear_map, scale_update
from prune.measure.moments import PairMoments
from prune.model.adapters import arch_spec, get_blocks, get_submodule
from prune.model.layouts import VANILLA
from prune.replace.capture import PairAccumulator, Recorder, SpanBatch
from prune.replace.fitter import Replacement, SpanFitter, WeightPatch
from prune.replace.options import LeastSquaresOptions
from prune.replace.registry import Method, register_method


def mlp_output_projection(model: nn.Module, block: nn.Module) -> nn.Module:
    """The MLP output projection of ``block`` (an ``nn.Linear`` or GPT-2's ``Conv1D``).

    Raises:
        LayercutError: the architecture has no known projection, or it is not a plain dense layer.
    """
    from transformers.pytorch_utils import Conv1D  # here, not at the top: transformers takes seconds to import

    spec = arch_spec(model)
    model_type = model.config.model_type
    if not spec.mlp_out:
        raise LayercutError(
            f"--replace fold needs the MLP output projection, which is unknown for '{model_type}': set mlp_out in "
            "prune.model.adapters.ARCHITECTURES or use --replace linear / block"
        )
    try:
        module = get_submodule(block, spec.mlp_out)
    except AttributeError:
        raise LayercutError(
            f"--replace fold: '{model_type}' blocks have no '{spec.mlp_out}' (the MLP output projection in "
            "prune.model.adapters.ARCHITECTURES); fix that entry or use --replace linear / block"
        ) from None
    if not isinstance(module, (nn.Linear, Conv1D)) or not module.weight.is_floating_point():
        raise LayercutError(
            f"--replace fold writes into {spec.mlp_out}, a {type(module).__name__}, not a dense float layer: "
            "load the model unquantized or use --replace linear"
        )
    return module


def check_fold_architecture(model: nn.Module, method: str = "fold") -> None:
    """Fail early when no block of this model can absorb a fold (before any calibration pass).

    ``method``: the ``--replace`` the one-line error names (the registry passes each folding method's name).
    """
    model_type = model.config.model_type
    normed = arch_spec(model).mlp_out_norm  # found by structure: gemma2/3, olmo2/3, glm4, ...
    if normed:
        raise LayercutError(
            f"--replace {method}: '{model_type}' normalises the MLP output ({normed}) before "
            "the residual add, so no linear map folds into it; use --replace local (a plain checkpoint; recipe "
            "layercut-local-heal), linear or block"
        )
    if getattr(model, "hf_quantizer", None) is not None:
        raise LayercutError(f"--replace {method} rewrites weights: load the model without "
                            "--load-in-4bit/--load-in-8bit")
    mlp_output_projection(model, get_blocks(model)[1][0])


def check_foldable(model: nn.Module, spans: Sequence[tuple[int, ...]], method: str = "fold") -> None:
    """Fail before any heavy work when a fold is impossible for this model or these spans."""
    check_fold_architecture(model, method)
    for span in spans:
        if span[0] == 0:
            raise LayercutError(
                f"--replace {method} cannot replace blocks {list(span)}: a span starting at block 0 has no previous "
                "block to fold into; protect block 0 (--protect 0,-1) or use --replace linear / block"
            )
    _, blocks = get_blocks(model)
    for span in spans:
        mlp_output_projection(model, blocks[span[0] - 1])


def fold_default(model: nn.Module) -> int:
    """``--replace auto``'s rank of fold: 1 wherever it applies.

    On SmolLM2-135M's selection split it beat removal of the same blocks on every text at drops 4 and 8
    (``reports/smollm2-135m-mapfit/selection-fold-scale``).
    """
    try:
        check_fold_architecture(model)
    except LayercutError:
        return 0
    return 1


@dataclass
class FoldOptions(LeastSquaresOptions):
    """``fold`` takes ``ridge`` and ``update_scale``; it applies 0.7 of its fitted update unless told otherwise.

    It overshoots as ``linear`` does. On SmolLM2-135M's selection split 0.7 beat the whole fit at both
    drops (geometric-mean perplexity relative to removal 0.830 against 0.847 at drop 4, 0.872 against 1.155
    at drop 8, ``reports/smollm2-135m-mapfit/selection-fold-scale``); the best share depends on the span (0.3
    at drop 8), so one default is a compromise that is never worse than least squares there.
    """


class FoldFitter(SpanFitter):
    """Streams the moments of (z, t = y - h + m) for the host block and solves for its new projection."""

    def __init__(self, *args):
        super().__init__(*args)
        self.where = "fold"
        self.projection = mlp_output_projection(self.model, self.original[self.host])
        self.intercept = self.projection.bias is not None
        self.moments = PairAccumulator()

    def hook_inputs(self, recorder: Recorder) -> None:
        """Also capture the projection's input z and output m."""
        super().hook_inputs(recorder)
        recorder.input_of(self.projection, f"{self.span}.z")
        recorder.output_of(self.projection, f"{self.span}.m")

    def observe(self, batch: SpanBatch) -> None:
        """Accumulate the Grams of (z, y - r)."""
        # OPT runs its MLP on [tokens, d] rows: flatten everything to rows before combining
        rows = [t.reshape(-1, t.shape[-1]) for t in (batch.y, batch.x, batch.m)]  # [tokens, d]
        self.moments.update(batch.z.reshape(-1, batch.z.shape[-1]), rows[0] - rows[1] + rows[2])  # y - r, r = h - m

    def finish(self) -> Replacement:
        """Least squares for the new weights; a :class:`WeightPatch` of the projection."""
        from transformers.pytorch_utils import Conv1D

        options = self.config.options
        moments = self.moments.moments()
        if not self.intercept:
            moments = uncentred(moments)
        fit = fit_linear_map(moments, options.ridge)  # weight [intermediate, d]
        conv = isinstance(self.projection, Conv1D)  # Conv1D stores [in, out], Linear [out, in]
        param = current_tensor(self.projection, "weight")  # a skeleton's is read from its checkpoint
        if options.update_scale != 1:
            # the projection's own weights give the span's input: a share of the way from them is a share
            # of the fitted update, as with ``linear``
            own = param.detach().to(device=fit.weight.device, dtype=fit.weight.dtype)
            bias = current_tensor(self.projection, "bias")
            fit = scale_update(fit, options.update_scale, LinearFit(
                own if conv else own.T,
                bias.detach().to(fit.bias) if bias is not None else torch.zeros_like(fit.bias)))
        weight = fit.weight if conv else fit.weight.T
        patch = WeightPatch(
            self.projection,
            weight.to(device=param.device, dtype=param.dtype).contiguous(),
            fit.bias.to(device=param.device, dtype=param.dtype) if self.intercept else None,
        )
        return Replacement(self.config.method, self.span, "fold", self.host, None, patch, record={
            "params": 0, "rewrites": arch_spec(self.model).mlp_out,
            "intercept": self.intercept, "ridge": options.ridge, "update_scale": options.update_scale,
            "tokens": moments.n})


def uncentred(moments: PairMoments) -> PairMoments:
    """The same moments about the origin: a least-squares fit through zero (no intercept)."""
    n, mx, my = moments.n, moments.mean_x, moments.mean_y.to(moments.mean_x.device)
    zeros_x, zeros_y = torch.zeros_like(mx), torch.zeros_like(my)
    return PairMoments(
        n,
        zeros_x,
        zeros_y,
        moments.cxx + n * torch.outer(mx, mx),
        moments.cxy + n * torch.outer(mx, my),
        moments.cyy + n * torch.outer(my, my),
    )


register_method(Method(
    "fold", "linear map folded into the previous block's MLP", serving=VANILLA, closed_form=True, offloadable=True,
    options=FoldOptions,
    fitter=FoldFitter, check_model=check_fold_architecture, check_spans=check_foldable,
    # the folded map lives in the host block's projection: training that trains the map
    trained_module=lambda model, block, _record: mlp_output_projection(model, block),
    describe=lambda record: f"folded into the previous block's {record['rewrites']}",
    default_for=fold_default, fit_width=lambda _hidden, intermediate: intermediate,
))
