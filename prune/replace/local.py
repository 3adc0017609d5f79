"""``local``: the kept block before each cut, retrained block-locally to do what the span's map does.

The closed-form map of a span (``linear``) is the best-measured repair, but no engine runs a map between
blocks. ``local`` keeps the checkpoint plain by making the kept block ``p`` before the cut produce the map's
output itself: the teacher is the model with the map, ``T = map(h)`` (``h``: ``p``'s output, the span's input),
and a copy of ``p`` learns ``x_p -> T`` from its own recorded inputs ``x_p``. One block's forward and backward per
step, on batches recorded in one pass: it costs a few seconds on SmolLM2-135M, runs on one block at a time on a
large model, and needs nothing of the architecture but the block itself, so sandwich-norm blocks (Gemma-2/3),
where no map folds, take it too.

The copy starts from the least-squares fold of the map into its MLP output projection (``fold`` towards
``T``) where the block's MLP writes into the stream unnormalised, else from ``p`` itself. Global healing
(``--train``, distillation against the original's logits) can run after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from prune.errors import LayercutError
from prune.loading.offload import materialized
from prune.measure.least_squares import fit_linear_map, scale_update
from prune.model.adapters import arch_spec, get_submodule
from prune.model.capture import block_output
from prune.model.layouts import VANILLA
from prune.replace.capture import PairAccumulator, Recorder, SpanBatch, move
from prune.replace.config import ReplaceConfig
from prune.replace.fitter import CachingFitter, Replacement, relative_mse
from prune.replace.fold import uncentred
from prune.replace.options import LeastSquaresOptions, lr_option, steps_option
from prune.replace.registry import Method, register_method


@dataclass
class LocalOptions(LeastSquaresOptions):
    """``local``: the map as ``linear`` fits it (0.7 of its update), then 200 Adam steps at lr 1e-4 on the block."""

    steps: int = steps_option(200)
    lr: float = lr_option(1e-4)


class StatePatch:
    """Trained weights for a kept block; :meth:`apply` swaps them in and returns an undo (as a fold's patch)."""

    def __init__(self, block: nn.Module, trained: nn.Module):
        self.block, self.trained = block, trained

    def apply(self):
        """Put the trained weights into the block; the returned function puts the old ones back.

        On a skeleton's block (weights on the meta device) the trained weights are what every later read of
        the block returns (``prune.loading.offload.rewrite_tensors``).
        """
        if any(param.is_meta for param in self.block.parameters()):
            from prune.loading.offload import rewrite_tensors

            trained = dict(self.trained.named_parameters())
            return rewrite_tensors((self.block.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2],
                                    _replaced_by(trained[name])) for name, _ in self.block.named_parameters())
        pairs = list(zip(self.block.parameters(), self.trained.parameters(), strict=True))
        old = [param.data for param, _ in pairs]
        for param, new in pairs:
            param.data = new.data.to(dtype=param.dtype, device=param.device)

        def undo() -> None:
            for (param, _), value in zip(pairs, old, strict=True):
                param.data = value

        return undo


def _replaced_by(new: torch.Tensor):
    """A tensor change (``rewrite_tensors``) that returns ``new`` in the read tensor's dtype and device."""
    return lambda old: new.detach().to(old)


def measured_as_map(config: ReplaceConfig) -> ReplaceConfig:
    """The map ``local`` trains towards (``linear`` with its ridge and share, fitted on whole sequences, as here).

    A repaired selection measures each candidate set through it: a block retrained for every one of a greedy
    loop's candidate sets would cost 200 steps each, and the trained block is fitted to give this map's output.
    """
    return ReplaceConfig(method="linear", ridge=config.options.ridge, update_scale=config.options.update_scale,
                         short=config.short or 0, batch_size=config.batch_size, seed=config.seed)


def check_local_spans(_model: nn.Module, spans, method: str = "local") -> None:
    """A span from block 0 has no block before it to retrain."""
    for span in spans:
        if span[0] == 0:
            raise LayercutError(f"--replace {method} retrains the block before the span, and blocks {list(span)} start "
                                "at block 0: protect block 0 (--protect 0,-1) or use --replace linear / block")


class LocalFitter(CachingFitter):
    """Records the host block's inputs and the span's input and output; fits the map, then trains the host's copy."""

    needs_call = True

    def __init__(self, model, original, span, config):
        super().__init__(model, original, span, config, steps=config.options.steps, lr=config.options.lr)
        self.where = "fold"  # a patch of the host block, as fold's
        self.moments = PairAccumulator()

    def hook_inputs(self, recorder: Recorder) -> None:
        """The span's input and the host block's input with its call arguments."""
        recorder.input_of(self.original[self.span[0]], f"{self.span}.x")
        recorder.input_of(self.original[self.host], f"{self.span}.host", with_call=True)

    def batch(self, inputs: dict, targets: dict) -> SpanBatch:
        """``x``: the span's input (removal's baseline); ``z``, ``args``, ``kwargs``: the host's input and call."""
        key = str(self.span)
        args, kwargs = inputs[f"{key}.host.call"]
        return SpanBatch(inputs[f"{key}.x"], targets[f"{key}.y"], args, kwargs, inputs[f"{key}.host"])

    def observe(self, batch: SpanBatch) -> None:
        """The map's moments, and the batch kept for the steps."""
        d = batch.x.shape[-1]
        self.moments.update(batch.x.reshape(-1, d), batch.y.reshape(-1, d))
        self.remember(batch)

    def finish(self) -> Replacement:
        """The map, its outputs as the targets, the fold towards them, then Adam on the host's copy."""
        options = self.config.options
        fit = scale_update(fit_linear_map(self.moments.moments(), options.ridge), options.update_scale)
        weight, bias = fit.weight.float(), fit.bias.float()
        for i, batch in enumerate(self.cache):  # the teacher's state after the cut replaces the span's output
            self.cache[i] = SpanBatch(batch.x, (batch.x.float() @ weight.to(batch.x.device) + bias.to(batch.x.device)
                                                ).to(batch.x.dtype), batch.args, batch.kwargs, batch.z)
        host = self.original[self.host]
        module = materialized(host)  # a skeleton's block is read from its checkpoint; any other is copied
        folded = self._fold_towards_targets(module)

        def forward(block: nn.Module, batch: SpanBatch) -> torch.Tensor:
            return block_output(block(batch.z, *batch.args, **batch.kwargs))

        start = self._relative_error(module, forward)
        training = self.train(module, forward) if self.steps else {"steps": 0}
        module.to(device=self.device, dtype=self.dtype).eval()
        self.cache.clear()
        return Replacement(self.config.method, self.span, "fold", self.host, None, StatePatch(host, module), record={
            "params": 0, "retrains": "the block before the span", "teacher": "linear map",
            "update_scale": options.update_scale, "ridge": options.ridge, "fold_init": folded,
            "relative_error_start": start, "tokens": self.moments.n, **training})

    def _fold_towards_targets(self, module: nn.Module) -> bool:
        """Least squares of the MLP write into the host copy's output projection, towards the map's outputs.

        Skipped (False) where the MLP's write is normalised before the residual add (sandwich norms).
        """
        spec = arch_spec(self.model)
        if spec.mlp_out_norm or not spec.mlp_out or not self.cache:
            return False
        projection = get_submodule(module, spec.mlp_out)
        if not isinstance(projection, nn.Linear) or projection.bias is not None:
            return False
        moments = PairAccumulator()
        seen = {}
        handles = [projection.register_forward_pre_hook(lambda _m, a: seen.__setitem__("z", a[0])),
                   projection.register_forward_hook(lambda _m, _a, out: seen.__setitem__("m", out))]
        try:
            with torch.no_grad():
                for batch in self.cache:
                    batch = move(batch, self.device)
                    out = block_output(module(batch.z, *batch.args, **batch.kwargs))
                    d = out.shape[-1]
                    rest = (out - seen["m"]).reshape(-1, d)  # what the block writes besides its MLP
                    moments.update(seen["z"].reshape(-1, seen["z"].shape[-1]), batch.y.reshape(-1, d) - rest)
        finally:
            for handle in handles:
                handle.remove()
        fitted = fit_linear_map(uncentred(moments.moments()), self.config.options.ridge).weight.T  # [d, intermediate]
        projection.weight.data = fitted.to(projection.weight)
        return True

    @torch.no_grad()
    def _relative_error(self, module: nn.Module, forward) -> float | None:
        """MSE to the targets over removal's, on the kept batches, before any step."""
        if not self.cache:
            return None
        module.to(device=self.device, dtype=torch.float32)
        losses = [float(relative_mse(forward(module, b), b.y, b.x))
                  for b in (move(c, self.device, torch.float32) for c in self.cache)]
        return round(sum(losses) / len(losses), 6)


register_method(Method(
    "local", "the block before each span retrained block-locally to give the span's linear map's output (plain "
    "checkpoint; any block layout)", serving=VANILLA, offloadable=True, options=LocalOptions, fitter=LocalFitter,
    check_spans=check_local_spans, measured_as=measured_as_map,
    # the retrained block is what further training trains
    trained_module=lambda _model, block, _record: block,
    describe=lambda record: "the block before the span retrained towards its linear map",
))
