"""Streamed second-moment statistics of residual states: everything the scores and maps need.

Memory is independent of the number of calibration tokens: per state a mean and a Gram matrix,
per requested pair of states a cross Gram, per pair a running cosine sum. Never the states themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from prune.adapters import input_device, num_blocks
from prune.capture import residual_states

logger = logging.getLogger(__name__)


@dataclass
class PairMoments:
    """Centred second moments of a pair (X, Y) of [n, d] activations, summed over n tokens (float64).

    ``cxx = (X - mean_x)^T (X - mean_x)`` and likewise ``cxy``, ``cyy``; nothing is divided by n.
    """

    n: int
    mean_x: torch.Tensor  # [d]
    mean_y: torch.Tensor  # [d]
    cxx: torch.Tensor  # [d, d]
    cxy: torch.Tensor  # [d, d]
    cyy: torch.Tensor  # [d, d]


class StateMoments:
    """Accumulates per-state Grams, cross Grams for chosen (i, j) pairs, and pairwise cosines.

    Feed it states through :meth:`observe` (``prune.capture.residual_states`` calls it from hooks).
    Each state's tokens are extended by a constant 1 column before the Gram product, so one GEMM
    yields the Gram, the column sums and the token count (raw moments, centred at the end). Raw
    float64 moments are safe here: even massive activations (means ~1e3 against spreads ~10) lose
    only ~1e-12 relative precision to the centring.

    Args:
        num_states: number of residual states (blocks + 1).
        pairs: (i, j) with i < j whose cross Gram X_i^T X_j is kept.
        cosine_pairs: "adjacent" (i, i+1), "all" (every i < j, for span scores) or "none".
        device: where the statistics live; ``None`` keeps each state's on the device it arrives on.
    """

    def __init__(
        self,
        num_states: int,
        pairs: Iterable[tuple[int, int]],
        cosine_pairs: str = "adjacent",
        device: torch.device | str | None = None,
    ):
        self.num_states = num_states
        self.pairs = sorted(set(pairs))
        if any(not 0 <= i < j < num_states for i, j in self.pairs):
            raise ValueError(f"pairs must satisfy 0 <= i < j < {num_states}")
        if cosine_pairs not in ("adjacent", "all", "none"):
            raise ValueError(f"cosine_pairs must be adjacent, all or none, got {cosine_pairs!r}")
        self.cosine_pairs = cosine_pairs
        self.device = torch.device(device) if device is not None else None
        self.grams: list[torch.Tensor | None] = [None] * num_states  # [d+1, d+1] augmented raw Grams
        self.cross: dict[tuple[int, int], torch.Tensor] = {}  # [d+1, d+1] augmented raw cross Grams
        self.cos_sum = torch.zeros(num_states, num_states, dtype=torch.float64)
        self.angle_sum = torch.zeros(num_states, num_states, dtype=torch.float64)
        self._partners = {j: [i for i, jj in self.pairs if jj == j] for j in range(num_states)}
        self._keep_until = {i: max([j for ii, j in self.pairs if ii == i], default=i) for i in range(num_states)}
        if cosine_pairs != "none":
            for i in range(num_states):
                self._keep_until[i] = max(self._keep_until[i], num_states - 1 if cosine_pairs == "all" else i + 1)
        self._batch: dict[int, tuple[torch.Tensor, ...]] = {}  # state -> (augmented f64 rows, f32 rows, norms)
        self._mask: torch.Tensor | None = None

    @property
    def n(self) -> int:
        """Tokens seen so far."""
        return 0 if self.grams[0] is None else int(self.grams[0][-1, -1])

    def begin_batch(self, mask: torch.Tensor | None) -> None:
        """Start a batch; ``mask`` [batch, seq] marks the tokens that count (None: all)."""
        self._batch.clear()
        self._mask = None if mask is None else mask.bool()

    def observe(self, index: int, state: torch.Tensor) -> None:
        """Fold state ``index`` [batch, seq, d] of the current batch into the statistics."""
        flat = self._rows(state)  # [n_batch, d] in the model's dtype
        x = self._augmented(flat)  # [n_batch, d + 1] float64, last column 1
        if self.grams[index] is None:
            self.grams[index] = torch.zeros(x.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
        self.grams[index].addmm_(x.T, x)
        for i in self._partners[index]:
            earlier = self._batch[i][0]
            if (i, index) not in self.cross:
                self.cross[(i, index)] = torch.zeros_like(self.grams[index], device=earlier.device)
            self.cross[(i, index)].addmm_(earlier.T, x.to(earlier.device))
        # Cosines need ~1e-6 only: the model's own rows (float32 or lower) are enough and half the traffic.
        flat = flat.float()
        norms = flat.norm(dim=1)  # [n_batch]
        self._update_cosines(index, flat, norms)
        self._batch[index] = (x, flat, norms)
        for i in [i for i in self._batch if self._keep_until[i] <= index and i != index]:
            del self._batch[i]

    def _rows(self, state: torch.Tensor) -> torch.Tensor:
        flat = state.detach().reshape(-1, state.shape[-1])
        if self._mask is not None:
            flat = flat[self._mask.reshape(-1).to(flat.device)]
        return flat

    def _augmented(self, flat: torch.Tensor) -> torch.Tensor:
        device = self.device if self.device is not None else flat.device
        rows = torch.empty(flat.shape[0], flat.shape[1] + 1, dtype=torch.float64, device=device)
        rows[:, :-1].copy_(flat)
        rows[:, -1] = 1.0
        return rows

    def _update_cosines(self, index: int, rows: torch.Tensor, norms: torch.Tensor) -> None:
        if self.cosine_pairs == "none":
            return
        earlier = [index - 1] if self.cosine_pairs == "adjacent" else list(range(index))
        for i in earlier:
            if i not in self._batch:
                continue
            _, other, other_norms = self._batch[i]
            dots = torch.linalg.vecdot(other, rows.to(other.device))
            cos = (dots / (other_norms * norms.to(other.device)).clamp_min(1e-30)).clamp(-1, 1)
            self.cos_sum[i, index] += cos.sum().cpu()
            self.angle_sum[i, index] += (torch.arccos(cos) / torch.pi).sum().cpu()

    def mean(self, index: int) -> torch.Tensor:
        """Mean of state ``index`` over all tokens seen [d]."""
        return self.grams[index][:-1, -1] / self.n

    def centred_gram(self, index: int) -> torch.Tensor:
        """Sum over tokens of (x - mean)(x - mean)^T for state ``index`` [d, d]."""
        m = self.mean(index)
        return self.grams[index][:-1, :-1] - self.n * torch.outer(m, m)

    def pair(self, i: int, j: int) -> PairMoments:
        """The centred moments of (state i, state j); (i, j) must have been requested."""
        if i == j:
            gram = self.centred_gram(i)
            return PairMoments(self.n, self.mean(i), self.mean(i), gram, gram, gram)
        mi, mj = self.mean(i), self.mean(j).to(self.grams[i].device)
        cross = self.cross[(i, j)][:-1, :-1] - self.n * torch.outer(mi, mj)
        return PairMoments(self.n, mi, mj, self.centred_gram(i), cross, self.centred_gram(j).to(cross.device))

    def mean_cosine(self, i: int, j: int) -> float:
        """Token-averaged cosine similarity between states i and j."""
        return float(self.cos_sum[i, j] / self.n)

    def mean_angular_distance(self, i: int, j: int) -> float:
        """Token-averaged angular distance arccos(cos)/pi between states i and j."""
        return float(self.angle_sum[i, j] / self.n)


def adjacent_pairs(num_blocks: int) -> list[tuple[int, int]]:
    """(input, output) state pairs of every block."""
    return [(i, i + 1) for i in range(num_blocks)]


def span_pairs(blocks: Sequence[int]) -> list[tuple[int, int]]:
    """(input, output) state pairs of every maximal run of consecutive block indices."""
    runs: list[tuple[int, int]] = []
    for b in sorted(blocks):
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return runs


@torch.no_grad()
def stream_moments(
    model: nn.Module,
    token_ids: torch.Tensor,
    *,
    pairs: Iterable[tuple[int, int]] | None = None,
    cosine_pairs: str = "adjacent",
    batch_size: int = 4,
    stats_device: torch.device | str | None = None,
    progress: bool = True,
) -> StateMoments:
    """Run ``model`` over ``token_ids`` [samples, seq] and stream the residual-state moments.

    Args:
        model: a supported ``*ForCausalLM`` model (any device map).
        token_ids: packed calibration sequences, all tokens count.
        pairs: cross Grams to keep; default the (input, output) pair of every block.
        cosine_pairs: see :class:`StateMoments`.
        batch_size: sequences per forward pass.
        stats_device: where statistics live (default: where each state is produced).
        progress: show a tqdm bar.
    """
    count = num_blocks(model)
    moments = StateMoments(count + 1, adjacent_pairs(count) if pairs is None else pairs, cosine_pairs, stats_device)
    device = input_device(model)
    starts = range(0, token_ids.shape[0], batch_size)
    with residual_states(model, moments.observe):
        for start in tqdm(starts, desc="capture", unit="batch", disable=not progress):
            batch = token_ids[start : start + batch_size].to(device)  # [batch, seq]
            moments.begin_batch(None)
            # The base model stops before the LM head: [batch, seq, vocab] logits would cost more than the stats.
            model.base_model(input_ids=batch, use_cache=False)
    logger.info("streamed statistics of %d states over %d tokens", count + 1, moments.n)
    return moments
