"""``cosine``: ReplaceMe's map (arXiv 2505.02819) ``T`` on the previous block's MLP output, folded into it.

The kept block before the span outputs ``h = r + m``, ``m`` its MLP output. ReplaceMe replaces the span
by ``h' = r + m T`` with a d x d ``T``, then folds ``T`` into the MLP output projection (``W -> W T``,
bias ``b -> b T``), so the checkpoint stays vanilla. Two objectives:

* least squares, ``min_T ||r + m T - y||^2``: closed form (float64, no intercept), ``steps: 0``;
* cosine, ``max_T mean cos(r + m T, y)``: Adam on the cosine distance, started from the least-squares ``T``.

Reproduced: the map on the MLP output, both objectives, the fold into ``down_proj``. Approximated: the
cosine optimisation starts from the least-squares solution (our choice) and runs ``steps`` Adam steps
on captured calibration tokens (at most ``cache_bytes`` of them); the paper's step count and learning
rate were not tuned here. (``fold`` solves the less constrained ``W'`` directly, not ``W T``.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from prune.loading.offload import current_tensor
from prune.model.adapters import arch_spec
from prune.model.layouts import VANILLA
from prune.replace.capture import Recorder, SpanBatch
from prune.replace.fitter import CachingFitter, Replacement, WeightPatch
from prune.replace.fold import check_fold_architecture, check_foldable, mlp_output_projection
from prune.replace.options import MethodOptions, lr_option, ridge_option, steps_option
from prune.replace.registry import Method, register_method


@dataclass
class CosineOptions(MethodOptions):
    """``cosine`` takes ``ridge``, ``steps`` (0: the least-squares ``T`` only) and ``lr``."""

    ridge: float = ridge_option()
    steps: int = steps_option(100)
    lr: float = lr_option(1e-4)


def cosine_distance(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean ``1 - cos`` over tokens."""
    return (1 - F.cosine_similarity(pred.float(), target.float(), dim=-1)).mean()


class CosineFitter(CachingFitter):
    """Grams of (m, y - r) for the least-squares ``T``; cached (x, m, y) rows for the cosine steps."""

    def __init__(self, model, original, span, config):
        super().__init__(model, original, span, config, steps=config.options.steps, lr=config.options.lr)
        self.where = "fold"
        self.projection = mlp_output_projection(self.model, self.original[self.host])
        self.mm = torch.zeros(self.dim, self.dim, dtype=torch.float64)
        self.mt = torch.zeros(self.dim, self.dim, dtype=torch.float64)
        self.tokens = 0
        self.rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.row_bytes = 0

    def hook_inputs(self, recorder: Recorder) -> None:
        """Also capture the MLP output m of the host block."""
        super().hook_inputs(recorder)
        recorder.output_of(self.projection, f"{self.span}.m")

    def observe(self, batch: SpanBatch) -> None:
        """Accumulate ``m^T m`` and ``m^T (y - r)``; keep the rows for Adam while they fit in ``cache_bytes``."""
        x, y, m = (t.reshape(-1, self.dim) for t in (batch.x, batch.y, batch.m))  # OPT's MLP runs on rows
        m64 = m.double().cpu()
        self.mm += m64.T @ m64
        self.mt += m64.T @ (y - x + m).double().cpu()  # y - r, r = h - m
        self.tokens += m.shape[0]
        size = 3 * x.numel() * 4
        if self.steps and self.row_bytes + size <= self.config.cache_bytes:
            self.rows.append(tuple(t.detach().float().cpu() for t in (x, m, y)))
            self.row_bytes += size

    def least_squares(self) -> torch.Tensor:
        """``T = (m^T m + ridge)^+ m^T (y - r)`` in float64; ridge relative to the mean diagonal."""
        ridge = self.config.options.ridge * torch.diagonal(self.mm).mean()
        gram = self.mm + ridge * torch.eye(self.dim, dtype=torch.float64)
        return torch.linalg.lstsq(gram, self.mt).solution

    def cosine_steps(self, start: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Adam on the mean cosine distance between ``r + m T`` and ``y``, cosine learning rate to 0."""
        transform = start.float().clone().requires_grad_(True)
        optimizer = torch.optim.Adam([transform], lr=self.lr)
        generator = torch.Generator().manual_seed(self.config.seed)
        losses = []
        for step in range(self.steps):
            for group in optimizer.param_groups:
                group["lr"] = self.lr * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * step / self.steps)))
            x, m, y = self.rows[int(torch.randint(len(self.rows), (1,), generator=generator))]
            loss = cosine_distance(x - m + m @ transform, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        return transform.detach().double(), {"steps": self.steps, "lr": self.lr,
                                             "cosine_distance_start": losses[0] if losses else None,
                                             "cosine_distance_end": losses[-1] if losses else None}

    def finish(self) -> Replacement:
        """``T`` (least squares, then the cosine steps), folded into the host's MLP output projection."""
        from transformers.pytorch_utils import Conv1D  # here, not at the top: transformers takes seconds to import

        transform = self.least_squares()
        training = {"steps": 0}
        if self.steps and self.rows:
            transform, training = self.cosine_steps(transform)
        param = current_tensor(self.projection, "weight")  # a skeleton's is read from its checkpoint
        weight = param.data.double()
        transform = transform.to(weight.device)  # fitted from Grams kept on the CPU; the weight may be on a GPU
        if isinstance(self.projection, Conv1D):  # Conv1D stores [in, out]: m = z W + b
            new_weight = weight @ transform
        else:  # nn.Linear stores [out, in]: m = z W^T + b, so W^T T is stored transposed
            new_weight = transform.T @ weight
        bias = current_tensor(self.projection, "bias")
        new_bias = (bias.data.double() @ transform).to(dtype=param.dtype) if bias is not None else None
        patch = WeightPatch(self.projection, new_weight.to(dtype=param.dtype).contiguous(), new_bias)
        return Replacement(self.config.method, self.span, "fold", self.host, None, patch, record={
            "params": 0, "rewrites": arch_spec(self.model).mlp_out, "ridge": self.config.options.ridge,
            "tokens": self.tokens, "objective": "cosine" if training["steps"] else "least-squares", **training})


register_method(Method(
    "cosine", "ReplaceMe: T on the previous block's MLP output (cosine objective; steps 0: least squares), "
    "folded into it", serving=VANILLA, closed_form=True, offloadable=True, options=CosineOptions, fitter=CosineFitter,
    check_model=check_fold_architecture, check_spans=check_foldable,
    trained_module=lambda model, block, _record: mlp_output_projection(model, block),
    describe=lambda record: f"{record['objective']} T folded into the previous block's {record['rewrites']}",
))
