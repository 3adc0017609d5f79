"""Shortcuts from an intermediate residual state to the last block's output (Jump to Conclusions, N-NJTC).

A shortcut maps state ``l`` (the residual stream after ``l`` blocks, before the final norm) to a guess
of state ``L`` (the last block's output), so the model's own final norm and LM head can read it:

* ``id``: no map, ``h_l`` itself (the "logit lens").
* ``mat``: the affine least-squares map ``h_l A + b``, closed form from streamed float64 moments
  (``prune.measure.moments`` / ``prune.measure.least_squares``), with a scale-free ridge.
* ``njtc``: a rank-r correction ``h_l + (h_l U) V`` trained by Adam on the MSE to ``h_L``.
* ``n-njtc``: the same with a ``BatchNorm1d`` in front: ``h_l + (BN(h_l) U) V``.

The low-rank maps predict the residual ``h_L - h_l`` by default (``residual=True``): a rank-5 map of
a 576-wide stream cannot carry ``h_L`` itself (most of it is ``h_l``), but it can carry the change.
``residual=False`` predicts ``h_L`` directly, as a plain ``U V`` product.

Training streams the calibration split: each forward pass gives one batch of states, the maps take a
few optimizer steps on random token minibatches of it, then the batch is dropped. Memory is one
batch of states, whatever the number of calibration tokens.

Shortcuts save to one safetensors file (with their settings as metadata) and reload with
:func:`load_shortcuts`.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from prune.errors import LayercutError
from prune.measure.least_squares import LinearFit, fit_linear_map
from prune.measure.moments import StateMoments
from prune.model.adapters import hidden_size, input_device, lm_head, num_blocks
from prune.model.capture import residual_states

logger = logging.getLogger(__name__)

SHORTCUTS_FILE = "shortcuts.safetensors"
_METADATA_KEY = "layercut_shortcuts"


@dataclass(frozen=True)
class ShortcutKind:
    """A registered kind of shortcut.

    Attributes:
        name: registry key and CLI value.
        description: one line for tables and help.
        fitted: "closed-form" (from moments), "gradient" (trained) or "none".
        batch_norm: whether the low-rank map normalises its input first.
    """

    name: str
    description: str
    fitted: str
    batch_norm: bool = False


SHORTCUTS: dict[str, ShortcutKind] = {
    "id": ShortcutKind("id", "no map: read h_l with the final norm and LM head (logit lens)", "none"),
    "mat": ShortcutKind("mat", "affine least squares h_l A + b, closed form from moments (ridge)", "closed-form"),
    "njtc": ShortcutKind("njtc", "rank-r map U V trained by Adam on MSE", "gradient"),
    "n-njtc": ShortcutKind("n-njtc", "BatchNorm then rank-r map U V, trained by Adam on MSE", "gradient", True),
}


def parse_shortcuts(spec: str | Sequence[str]) -> list[str]:
    """Shortcut names from ``"id,mat"`` or a list, in registry order; unknown names list the known ones."""
    names = [n.strip() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip()]
    unknown = [n for n in names if n not in SHORTCUTS]
    if unknown:
        raise LayercutError(f"unknown shortcut '{unknown[0]}': choose from {', '.join(SHORTCUTS)} (comma-separated)")
    if not names:
        raise LayercutError(f"--shortcuts is empty: give a comma-separated subset of {', '.join(SHORTCUTS)}")
    return [n for n in SHORTCUTS if n in names]


def default_rank(dim: int) -> int:
    """The N-NJTC rank: one hundredth of the hidden size, at least 1 (5 for SmolLM2's 576)."""
    return max(1, dim // 100)


class ShortcutBank(nn.Module):
    """One kind of shortcut for every source state ``0..num_layers-1``, stored as stacked tensors.

    Stacking keeps training to a handful of batched operations per step, whatever the depth.
    """

    def __init__(self, num_layers: int, dim: int):
        super().__init__()
        self.num_layers = num_layers
        self.dim = dim

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Predict the target state from state ``layer`` [..., d]."""
        raise NotImplementedError

    def parameters_per_layer(self) -> int:
        """Fitted values of one layer's shortcut (BatchNorm running statistics are not counted)."""
        return sum(p.numel() for p in self.parameters()) // max(1, self.num_layers)


class IdentityBank(ShortcutBank):
    """``id``: the state itself."""

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Return ``x`` unchanged."""
        return x


class AffineBank(ShortcutBank):
    """``mat``: ``x @ weight[l] + bias[l]``, kept in float64, applied in float32 (float64 for float64 inputs)."""

    def __init__(self, num_layers: int, dim: int):
        super().__init__(num_layers, dim)
        self.weight = nn.Parameter(torch.zeros(num_layers, dim, dim, dtype=torch.float64), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(num_layers, dim, dtype=torch.float64), requires_grad=False)

    @classmethod
    def from_fits(cls, fits: Sequence[LinearFit]) -> AffineBank:
        """Stack closed-form :class:`~prune.measure.least_squares.LinearFit` maps ([d_in, d_out]), one per layer."""
        bank = cls(len(fits), fits[0].weight.shape[0])
        for layer, fit in enumerate(fits):
            bank.weight.data[layer] = fit.weight.cpu()
            bank.bias.data[layer] = fit.bias.cpu()
        return bank

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Apply layer ``layer``'s map and return ``x``'s dtype."""
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        y = x.to(work) @ self.weight[layer].to(work) + self.bias[layer].to(work)
        return y.to(x.dtype)


class LowRankBank(ShortcutBank):
    """``njtc`` / ``n-njtc``: ``[x +] (BN_l(x) U_l) V_l`` with ``U_l`` [d, r], ``V_l`` [r, d] per layer.

    The BatchNorm is written out (per-layer batch statistics while training, running statistics
    with momentum 0.1 in eval mode, as ``nn.BatchNorm1d``) so all layers train in one batched call.
    ``V`` starts at zero, so a residual map starts as ``id`` and learns only the correction.
    """

    def __init__(self, num_layers: int, dim: int, rank: int, batch_norm: bool, residual: bool = True):
        super().__init__(num_layers, dim)
        self.rank, self.residual, self.batch_norm = rank, residual, batch_norm
        self.u = nn.Parameter(torch.randn(num_layers, dim, rank) / math.sqrt(dim))  # [L, d, r]
        self.v = nn.Parameter(torch.zeros(num_layers, rank, dim))  # [L, r, d]
        if batch_norm:
            self.norm_weight = nn.Parameter(torch.ones(num_layers, dim))  # [L, d]
            self.norm_bias = nn.Parameter(torch.zeros(num_layers, dim))
            self.register_buffer("running_mean", torch.zeros(num_layers, dim))
            self.register_buffer("running_var", torch.ones(num_layers, dim))

    def _normalise(self, x: torch.Tensor, layers: slice | int) -> torch.Tensor:
        """BatchNorm of [L', n, d] (or [n, d] for one layer) with the statistics of ``layers``."""
        if not self.batch_norm:
            return x
        if self.training:
            mean, var = x.mean(-2), x.var(-2, unbiased=False)
            with torch.no_grad():
                unbiased = var * x.shape[-2] / max(1, x.shape[-2] - 1)
                self.running_mean[layers] = 0.9 * self.running_mean[layers] + 0.1 * mean
                self.running_var[layers] = 0.9 * self.running_var[layers] + 0.1 * unbiased
        else:
            mean, var = self.running_mean[layers], self.running_var[layers]
        scale = self.norm_weight[layers] / torch.sqrt(var + _BN_EPS)
        return (x - mean.unsqueeze(-2)) * scale.unsqueeze(-2) + self.norm_bias[layers].unsqueeze(-2)

    def forward_all(self, x: torch.Tensor) -> torch.Tensor:
        """Every layer at once: [L, n, d] float32 states -> [L, n, d] predictions."""
        z = self._normalise(x, slice(None))
        y = torch.bmm(torch.bmm(z, self.u), self.v)
        return y + x if self.residual else y

    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Map [..., d] states of layer ``layer`` in float32; returns ``x``'s dtype."""
        flat = x.reshape(-1, x.shape[-1]).float()  # [n, d]
        z = self._normalise(flat, layer)
        y = (z @ self.u[layer]) @ self.v[layer]
        if self.residual:
            y = y + flat
        return y.reshape(x.shape).to(x.dtype)


_BN_EPS = 1e-5


@dataclass
class ShortcutSet:
    """Shortcuts from every state ``l < target`` to state ``target``, one bank per kind.

    Attributes:
        target: the state the shortcuts predict (the number of blocks L).
        dim: hidden size.
        maps: kind name -> :class:`ShortcutBank` over source states 0..target-1.
        settings: how they were made (ridge, rank, residual...), saved with them.
    """

    target: int
    dim: int
    maps: dict[str, ShortcutBank] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        """Kinds held, in registry order."""
        return [n for n in SHORTCUTS if n in self.maps]

    def apply(self, name: str, layer: int, state: torch.Tensor) -> torch.Tensor:
        """Predict state ``target`` from ``state`` = state ``layer`` (identity at ``layer == target``)."""
        if layer == self.target:
            return state
        return self.maps[name](layer, state)

    def parameters_per_layer(self, name: str) -> int:
        """Fitted values of one layer's shortcut of kind ``name``."""
        return self.maps[name].parameters_per_layer()

    def to(self, device) -> ShortcutSet:
        """Move every bank to ``device`` (in place); returns self."""
        for bank in self.maps.values():
            bank.to(device)
        return self

    def save(self, folder: str | Path) -> Path:
        """Write every shortcut and the settings to ``folder/shortcuts.safetensors``."""
        tensors = {
            f"{name}.{key}": value.detach().cpu().contiguous()
            for name, bank in self.maps.items()
            for key, value in bank.state_dict().items()
        }
        meta = {"target": self.target, "dim": self.dim, "names": self.names, "settings": self.settings}
        path = Path(folder) / SHORTCUTS_FILE
        save_file(tensors, str(path), metadata={_METADATA_KEY: json.dumps(meta)})
        return path


def empty_bank(name: str, num_layers: int, dim: int, rank: int = 1, residual: bool = True) -> ShortcutBank:
    """A fresh bank of kind ``name`` (identity, zero affine, or initialised low-rank)."""
    kind = SHORTCUTS[name]
    if kind.fitted == "none":
        return IdentityBank(num_layers, dim)
    if kind.fitted == "closed-form":
        return AffineBank(num_layers, dim)
    return LowRankBank(num_layers, dim, rank, kind.batch_norm, residual)


def load_shortcuts(folder: str | Path) -> ShortcutSet:
    """Reload a :class:`ShortcutSet` written by :meth:`ShortcutSet.save` (file or folder path)."""
    path = Path(folder)
    path = path / SHORTCUTS_FILE if path.is_dir() else path
    if not path.is_file():
        raise LayercutError(f"no {SHORTCUTS_FILE} in {folder}: pass the --out folder of a lens run")
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        meta = json.loads((handle.metadata() or {}).get(_METADATA_KEY) or "null")
    if meta is None:
        raise LayercutError(f"{path} has no layercut shortcut metadata: it was not written by eval.lens")
    tensors = load_file(str(path))
    settings = meta["settings"]
    shortcuts = ShortcutSet(meta["target"], meta["dim"], settings=settings)
    for name in meta["names"]:
        bank = empty_bank(name, meta["target"], meta["dim"], settings.get("rank", 1), settings.get("residual", True))
        prefix = f"{name}."
        bank.load_state_dict({k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)})
        shortcuts.maps[name] = bank.eval()
    return shortcuts


def mat_pairs(target: int) -> list[tuple[int, int]]:
    """The (l, target) state pairs whose cross Grams the ``mat`` shortcuts need."""
    return [(layer, target) for layer in range(target)]


def fit_mat_shortcuts(moments: StateMoments, target: int, ridge: float) -> AffineBank:
    """Closed-form ``mat`` shortcut from every state ``l < target`` to ``target``."""
    return AffineBank.from_fits([fit_linear_map(moments.pair(layer, target), ridge) for layer in range(target)])


@dataclass
class LowRankConfig:
    """How ``njtc`` / ``n-njtc`` are trained.

    Attributes:
        rank: r of ``U`` [d, r] and ``V`` [r, d]; None = ``max(1, d // 100)``.
        steps: total Adam steps.
        epochs: passes over the calibration split (the steps are spread evenly over the batches).
        lr: Adam learning rate.
        token_batch: tokens per step, drawn from the current forward batch.
        residual: predict ``h_L - h_l`` (True) or ``h_L`` itself (False).
        seed: initialisation and minibatch order.
    """

    rank: int | None = None
    steps: int = 300
    epochs: int = 2
    lr: float = 1e-2
    token_batch: int = 512
    residual: bool = True
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "epochs", "token_batch"):
            if getattr(self, name) <= 0:
                raise LayercutError(f"low-rank {name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.rank is not None and self.rank <= 0:
            raise LayercutError(f"--rank must be positive, got {self.rank}")
        if not self.lr > 0:
            raise LayercutError(f"--lr must be positive, got {self.lr}")


def batch_states(model: nn.Module, ids: torch.Tensor, count: int) -> list[torch.Tensor]:
    """All residual states of one forward pass, flattened to [tokens, d] float32 (detached)."""
    states: list[torch.Tensor | None] = [None] * (count + 1)

    def keep(index: int, h: torch.Tensor) -> None:
        states[index] = h.detach().reshape(-1, h.shape[-1]).float()

    with torch.no_grad(), residual_states(model, keep):
        model.base_model(input_ids=ids.to(input_device(model)), use_cache=False)
    return states  # type: ignore[return-value]


def train_low_rank(
    model: nn.Module,
    token_ids: torch.Tensor,
    names: Iterable[str],
    config: LowRankConfig,
    *,
    batch_size: int = 4,
    progress: bool = True,
) -> tuple[dict[str, LowRankBank], dict[str, list[float]]]:
    """Train low-rank shortcuts of each kind in ``names`` from every state to the last, on streamed batches.

    All layers train together (their parameters are disjoint, so the summed loss gives each its own
    gradient and Adam is per-parameter: the same as training each alone).

    Returns:
        kind -> :class:`LowRankBank` (eval mode), and kind -> the last step's MSE per layer.
    """
    names = [n for n in names if SHORTCUTS[n].fitted == "gradient"]
    if not names:
        return {}, {}
    count, dim = num_blocks(model), hidden_size(model)
    rank = config.rank or default_rank(dim)
    torch.manual_seed(config.seed)
    device = lm_head(model).weight.device
    banks = {n: empty_bank(n, count, dim, rank, config.residual).to(device).train() for n in names}
    optimizer = torch.optim.Adam([p for bank in banks.values() for p in bank.parameters()], lr=config.lr)
    starts = list(range(0, token_ids.shape[0], batch_size))
    per_batch = max(1, math.ceil(config.steps / (config.epochs * len(starts))))
    generator = torch.Generator().manual_seed(config.seed)
    losses: dict[str, list[float]] = {}
    bar = tqdm(total=config.steps, desc="train low-rank", unit="step", disable=not progress)
    step = 0
    while step < config.steps:
        for start in starts:
            states = batch_states(model, token_ids[start : start + batch_size], count)
            stacked = torch.stack([s.to(device) for s in states])  # [L + 1, n, d] float32
            del states
            for _ in range(min(per_batch, config.steps - step)):
                pick = torch.randint(0, stacked.shape[1], (config.token_batch,), generator=generator)
                losses = _low_rank_step(banks, stacked[:, pick.to(device)], optimizer)
                step += 1
                bar.update(1)
            if step >= config.steps:
                break
    bar.close()
    for bank in banks.values():
        bank.eval()
    logger.info("trained %s shortcuts (rank %d) for %d steps", ",".join(banks), rank, config.steps)
    return banks, losses


def _low_rank_step(banks: dict[str, LowRankBank], states: torch.Tensor, optimizer) -> dict[str, list[float]]:
    """One Adam step on the summed per-layer MSE of [L + 1, token_batch, d] states; each layer's loss per kind."""
    sources, target = states[:-1], states[-1:]  # [L, b, d], [1, b, d]
    optimizer.zero_grad(set_to_none=True)
    per_layer = {name: ((bank.forward_all(sources) - target) ** 2).mean(dim=(1, 2)) for name, bank in banks.items()}
    sum(v.sum() for v in per_layer.values()).backward()
    optimizer.step()
    return {name: v.detach().cpu().tolist() for name, v in per_layer.items()}


def build_shortcuts(
    names: Sequence[str],
    target: int,
    dim: int,
    *,
    moments: StateMoments | None = None,
    ridge: float = 0.0,
    low_rank: dict[str, LowRankBank] | None = None,
    settings: dict | None = None,
) -> ShortcutSet:
    """Assemble a :class:`ShortcutSet` from fitted pieces (``moments`` for ``mat``, trained low-rank maps)."""
    shortcuts = ShortcutSet(target, dim, settings=dict(settings or {}))
    for name in names:
        kind = SHORTCUTS[name]
        if kind.fitted == "none":
            shortcuts.maps[name] = empty_bank(name, target, dim)
        elif kind.fitted == "closed-form":
            if moments is None:
                raise ValueError("mat shortcuts need calibration moments")
            shortcuts.maps[name] = fit_mat_shortcuts(moments, target, ridge)
        else:
            shortcuts.maps[name] = (low_rank or {})[name]
    return shortcuts


def settings_dict(config: LowRankConfig, dim: int, ridge: float) -> dict:
    """JSON-ready settings saved with the shortcuts."""
    return {**asdict(config), "rank": config.rank or default_rank(dim), "ridge": ridge}
