"""Streamed second-moment statistics of residual states: everything the scores and maps need.

Memory is independent of the number of calibration tokens: per state a mean and a Gram matrix,
per requested pair of states a cross Gram, per pair running sums of the cosine and angle over every token
and of the angle at each sequence's last token. Never the states themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from tqdm.auto import tqdm

from prune.errors import LayercutError
from prune.model.adapters import input_device, is_offloaded, num_blocks
from prune.model.capture import residual_states

logger = logging.getLogger(__name__)


@dataclass
class PairMoments:
    """Centred second moments of a pair (X, Y) of [n, d] activations, summed over n tokens (float64).

    ``cxx = (X - mean_x)^T (X - mean_x)`` and likewise ``cxy``, ``cyy``; nothing is divided by n.
    Where X and Y have one width, ``cxu`` and ``tuu`` are the cross Gram of X with the update U = Y - X
    and the trace of U's Gram, accumulated from U itself: the update is often ~10x smaller than the
    states, and recovering it from ``cyy - cxy - cxy^T + cxx`` would cancel away all but a few digits.
    """

    n: int
    mean_x: torch.Tensor  # [d]
    mean_y: torch.Tensor  # [d]
    cxx: torch.Tensor  # [d, d]
    cxy: torch.Tensor  # [d, d]
    cyy: torch.Tensor  # [d, d]
    cxu: torch.Tensor | None = None  # [d, d]
    tuu: float | None = None
    # eigh(cxx) on demand from the producer's cache: every score and span starting at X shares one
    eigh_source: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None

    def cxx_eigh(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``torch.linalg.eigh(cxx)``, computed once per state where the moments come from a :class:`StateMoments`."""
        return self.eigh_source() if self.eigh_source is not None else torch.linalg.eigh(self.cxx)

    def update_moments(self) -> tuple[torch.Tensor, float]:
        """``(Cxu, tr Cuu)`` of the update U = Y - X: accumulated ones if kept, else from the Grams."""
        if self.cxu is not None:
            return self.cxu, self.tuu
        return self.cxy - self.cxx, float(torch.trace(self.cyy - self.cxy - self.cxy.T + self.cxx))


PRECISIONS = ("float32", "float64")


class StateMoments:
    """Accumulates per-state Grams, cross Grams for chosen (i, j) pairs, and pairwise cosines.

    Feed it states through :meth:`observe` (``prune.model.capture.residual_states`` calls it from hooks).
    Next to the token-averaged cosines, the angle between each sequence's last (counted) token in two
    states is summed for the same pairs: Gromov et al. compare states there alone (one row per sequence).
    Each state is shifted by its first batch's mean before any product, so centring at the end does not
    cancel large means away (massive activations reach 1e3 against spreads of ~10). The products of one
    batch are taken in ``precision`` and summed across batches in float64: with "float32" (the default,
    about twice as fast on a CPU) the only rounding beyond float64 is one float32 GEMM per batch, a
    relative error of about 1e-6 of each entry's sum of absolute products; "float64" is the exact
    reference. States that arrive in float64 are multiplied in float64 either way. Measured on SmolLM2-135M
    (32k tokens): every linearity score within 1.7e-7 of the float64 one, and a 4-block span map's held-out
    R^2 equal to 9 digits.

    Args:
        num_states: number of residual states (blocks + 1).
        pairs: (i, j) with i < j whose cross Gram X_i^T X_j is kept.
        cosine_pairs: "adjacent" (i, i+1), "all" (every i < j, for span scores) or "none".
        device: where the statistics live; ``None`` keeps each state's on the device it arrives on.
        precision: "float32" or "float64", the dtype of each batch's products.
    """

    def __init__(
        self,
        num_states: int,
        pairs: Iterable[tuple[int, int]],
        cosine_pairs: str = "adjacent",
        device: torch.device | str | None = None,
        precision: str = "float32",
        shifts_from: StateMoments | None = None,
    ):
        self.num_states = num_states
        self.pairs = sorted(set(pairs))
        if any(not 0 <= i < j < num_states for i, j in self.pairs):
            raise ValueError(f"pairs must satisfy 0 <= i < j < {num_states}")
        if cosine_pairs not in ("adjacent", "all", "none"):
            raise ValueError(f"cosine_pairs must be adjacent, all or none, got {cosine_pairs!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.cosine_pairs = cosine_pairs
        self.precision = precision
        self.device = torch.device(device) if device is not None else None
        self.counts = [0] * num_states
        self.shifts: list[torch.Tensor | None] = [None] * num_states  # [d] first batch's mean
        self.sums: list[torch.Tensor | None] = [None] * num_states  # [d] float64 sum of shifted rows
        self.grams: list[torch.Tensor | None] = [None] * num_states  # [d, d] float64 Gram of shifted rows
        # (i, j) -> [d_i, d_j] float64 cross Gram of shifted rows of i with those of the update j - i (one width)
        # or of j (widths differ), and the sum of the update's squared norms
        self.cross: dict[tuple[int, int], torch.Tensor] = {}
        self.update_sq: dict[tuple[int, int], float] = {}
        self.cos_sum = torch.zeros(num_states, num_states, dtype=torch.float64)
        self.angle_sum = torch.zeros(num_states, num_states, dtype=torch.float64)
        self.last_angle_sum = torch.zeros(num_states, num_states, dtype=torch.float64)
        self.sequences = 0  # sequences seen (each gives state 0 one last token)
        self._partners = {j: [i for i, jj in self.pairs if jj == j] for j in range(num_states)}
        self._keep_until = {i: max([j for ii, j in self.pairs if ii == i], default=i) for i in range(num_states)}
        if cosine_pairs != "none":
            for i in range(num_states):
                self._keep_until[i] = max(self._keep_until[i], num_states - 1 if cosine_pairs == "all" else i + 1)
        # state -> (shifted rows, float32 rows, norms, float32 last token of each sequence [batch, d], its norms)
        self._batch: dict[int, tuple[torch.Tensor, ...]] = {}
        self._mask: torch.Tensor | None = None
        self._eigh: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # state -> eigh of its centred Gram
        # score -> each block's value, taken while a block-by-block pass still held the block's statistics
        # (prune.measure.blockwise); the statistics themselves were released
        self.early_scores: dict[str, list[float]] = {}
        # the statistics of some rows alone, kept beside these by the same pass (stream_moments' held_rows)
        self.held: HeldRows | None = None
        # shifting each state as another accumulator does keeps the raw sums of the two subtractable (minus)
        self._shifts_from = shifts_from

    @property
    def n(self) -> int:
        """Tokens seen so far (by every state observed: a block-by-block fit may observe only its spans' ends)."""
        return max(self.counts)

    def begin_batch(self, mask: torch.Tensor | None) -> None:
        """Start a batch; ``mask`` [batch, seq] marks the tokens that count (None: all)."""
        self._batch.clear()
        self._mask = None if mask is None else mask.bool()

    def observe(self, index: int, state: torch.Tensor) -> None:
        """Fold state ``index`` [batch, seq, d] of the current batch into the statistics."""
        flat = self._rows(state)  # [n_batch, d] in the model's dtype
        wide = self.precision == "float64" or flat.dtype == torch.float64
        rows = flat.to(device=self.device or flat.device, dtype=torch.float64 if wide else torch.float32)
        if self.shifts[index] is None:
            self.shifts[index] = (rows.mean(0, dtype=torch.float64).to(rows.dtype) if self._shifts_from is None
                                  else self._shifts_from.shifts[index].to(rows.device))
            self.sums[index] = torch.zeros(rows.shape[1], dtype=torch.float64, device=rows.device)
            self.grams[index] = torch.zeros(rows.shape[1], rows.shape[1], dtype=torch.float64, device=rows.device)
        shifted = rows - self.shifts[index]
        self._eigh.pop(index, None)
        self.counts[index] += shifted.shape[0]
        self.sums[index] += shifted.sum(0, dtype=torch.float64)
        self.grams[index] += shifted.T @ shifted
        for i in self._partners[index]:
            earlier = self._batch[i][0]
            other = shifted.to(earlier.device)
            if other.shape[1] == earlier.shape[1]:
                other = other - earlier  # the update, shifted by s_index - s_i
                self.update_sq[(i, index)] = self.update_sq.get((i, index), 0.0) + float(
                    other.pow(2).sum(dtype=torch.float64))
            product = earlier.T @ other
            if (i, index) in self.cross:
                self.cross[(i, index)] += product
            else:
                self.cross[(i, index)] = product.to(torch.float64)
        entry = self._entry(state, flat, shifted)
        if self.cosine_pairs != "none":
            self.sequences += entry[3].shape[0] if index == 0 else 0
            self._update_cosines(index, *entry[1:])
        self._batch[index] = entry
        for i in [i for i in self._batch if self._keep_until[i] <= index and i != index]:
            del self._batch[i]

    def release(self, index: int) -> None:
        """Free state ``index``'s Gram, its eigendecomposition and the cross Grams it starts.

        A block-by-block pass that has already taken every score of the blocks reading this state calls it,
        so it holds three d x d matrices at a time instead of 2L + 1. Means and cosine sums stay.
        """
        self.grams[index] = None
        self._eigh.pop(index, None)
        for pair in [pair for pair in self.cross if pair[0] == index]:
            del self.cross[pair]
            self.update_sq.pop(pair, None)

    def recall(self, index: int, state: torch.Tensor) -> None:
        """Hold state ``index`` of the current batch for the later states paired with it, counting nothing.

        A layer-by-layer pass (``prune.measure.blockwise``) meets each state twice, as one block's output and as
        the next one's input: it observes the first time and recalls the second.
        """
        flat = self._rows(state)
        wide = self.precision == "float64" or flat.dtype == torch.float64
        rows = flat.to(device=self.device or flat.device, dtype=torch.float64 if wide else torch.float32)
        self._batch[index] = self._entry(state, flat, rows - self.shifts[index])

    def _entry(self, state: torch.Tensor, flat: torch.Tensor, shifted: torch.Tensor) -> tuple:
        """What later states of the batch read of this one: (shifted rows, rows, norms, last rows, their norms)."""
        # Cosines need ~1e-6 only: the model's own rows (float32 or lower) are enough and half the traffic.
        flat = flat.float()
        norms = flat.norm(dim=1)  # [n_batch]
        last = last_norms = None
        if self.cosine_pairs != "none":  # the fits' moments compare no states: nothing to keep per sequence
            last = self._last_rows(state).float()  # [sequences, d]
            last_norms = last.norm(dim=1)
        return shifted, flat, norms, last, last_norms

    def _rows(self, state: torch.Tensor) -> torch.Tensor:
        flat = state.detach().reshape(-1, state.shape[-1])
        if self._mask is not None:
            flat = flat[self._mask.reshape(-1).to(flat.device)]
        return flat

    def _last_rows(self, state: torch.Tensor) -> torch.Tensor:
        """The last counted token of each sequence of ``state`` [batch, seq, d] (sequences with none left out).

        A [seq, d] state is one sequence.
        """
        state = state.detach().reshape(-1, *state.shape[-2:])  # [batch, seq, d]
        if self._mask is None:
            return state[:, -1]
        mask = self._mask.reshape(state.shape[:2]).to(state.device)
        last = mask.shape[1] - 1 - mask.flip(1).int().argmax(1)  # [batch] position of the last True
        return state[torch.arange(state.shape[0], device=state.device), last][mask.any(1)]

    def _update_cosines(self, index: int, rows: torch.Tensor, norms: torch.Tensor, last: torch.Tensor,
                        last_norms: torch.Tensor) -> None:
        earlier = [index - 1] if self.cosine_pairs == "adjacent" else list(range(index))
        for i in earlier:
            if i not in self._batch:
                continue
            _, other, other_norms, other_last, other_last_norms = self._batch[i]
            cos = _cosines(other, other_norms, rows, norms)
            self.cos_sum[i, index] += cos.sum().cpu()
            self.angle_sum[i, index] += (torch.arccos(cos) / torch.pi).sum().cpu()
            last_cos = _cosines(other_last, other_last_norms, last, last_norms)
            self.last_angle_sum[i, index] += (torch.arccos(last_cos) / torch.pi).sum().cpu()

    def _offset(self, index: int) -> torch.Tensor:
        return self.sums[index] / self.counts[index]  # mean of the shifted rows

    def mean(self, index: int) -> torch.Tensor:
        """Mean of state ``index`` over all tokens seen [d] (float64)."""
        return self.shifts[index].to(torch.float64) + self._offset(index)

    def centred_gram(self, index: int) -> torch.Tensor:
        """Sum over tokens of (x - mean)(x - mean)^T for state ``index`` [d, d]."""
        offset = self._offset(index)
        return self.grams[index] - self.counts[index] * torch.outer(offset, offset)

    def gram_eigh(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``torch.linalg.eigh`` of state ``index``'s centred Gram, computed once.

        Every score of a block and every span starting there solves against it; on a CPU each costs
        ~35 ms at d = 576.
        """
        if index not in self._eigh:
            self._eigh[index] = torch.linalg.eigh(self.centred_gram(index))
        return self._eigh[index]

    def pair(self, i: int, j: int) -> PairMoments:
        """The centred moments of (state i, state j); (i, j) must have been requested."""
        if i == j:
            gram = self.centred_gram(i)
            return PairMoments(self.n, self.mean(i), self.mean(i), gram, gram, gram,
                               eigh_source=partial(self.gram_eigh, i))
        oi, oj = self._offset(i), self._offset(j).to(self.grams[i].device)
        cxx, cyy = self.centred_gram(i), self.centred_gram(j).to(oi.device)
        mean_x, mean_y = self.mean(i), self.mean(j).to(oi.device)
        if (i, j) not in self.update_sq:
            cxy = self.cross[(i, j)] - self.n * torch.outer(oi, oj)
            return PairMoments(self.n, mean_x, mean_y, cxx, cxy, cyy, eigh_source=partial(self.gram_eigh, i))
        ou = oj - oi
        cxu = self.cross[(i, j)] - self.n * torch.outer(oi, ou)
        tuu = self.update_sq[(i, j)] - self.n * float(ou @ ou)
        return PairMoments(self.n, mean_x, mean_y, cxx, cxx + cxu, cyy, cxu, tuu, partial(self.gram_eigh, i))

    def minus(self, part: StateMoments) -> StateMoments:
        """The Grams and cross Grams of the tokens these statistics saw and ``part``'s did not (no cosines).

        ``part`` must have shifted every state as these did (``shifts_from=self``): the raw sums are then sums
        over tokens, and the difference is those of the other tokens, as a pass over them alone would give
        (within each batch product's float32 rounding, :class:`StateMoments`).
        """
        if part.num_states != self.num_states or not set(part.pairs) >= set(self.pairs) or any(
                a is not None and b is not None and not torch.equal(a, b.to(a.device))
                for a, b in zip(self.shifts, part.shifts, strict=True)):
            raise ValueError("minus takes statistics of the same states and pairs, shifted alike (shifts_from)")
        rest = StateMoments(self.num_states, self.pairs, "none", self.device, self.precision)
        rest.counts = [a - b for a, b in zip(self.counts, part.counts, strict=True)]
        rest.shifts = list(self.shifts)
        for index in range(self.num_states):
            # a block-by-block pass frees a state's Gram once no later block reads it (release): none left here
            if self.sums[index] is not None and self.grams[index] is not None:
                known = part.sums[index] is not None
                rest.sums[index] = self.sums[index] - (part.sums[index].to(self.sums[index].device) if known else 0)
                rest.grams[index] = self.grams[index] - (part.grams[index].to(self.grams[index].device)
                                                         if known else 0)
        rest.cross = {pair: gram - part.cross[pair].to(gram.device) if pair in part.cross else gram.clone()
                      for pair, gram in self.cross.items()}
        rest.update_sq = {pair: value - part.update_sq.get(pair, 0.0) for pair, value in self.update_sq.items()}
        return rest

    def mean_cosine(self, i: int, j: int) -> float:
        """Token-averaged cosine similarity between states i and j."""
        return float(self.cos_sum[i, j] / self.n)

    def mean_angular_distance(self, i: int, j: int) -> float:
        """Token-averaged angular distance arccos(cos)/pi between states i and j."""
        return float(self.angle_sum[i, j] / self.n)

    def last_token_angular_distance(self, i: int, j: int) -> float:
        """Angular distance arccos(cos)/pi between states i and j at each sequence's last token, averaged."""
        return float(self.last_angle_sum[i, j] / self.sequences)


@dataclass
class HeldRows:
    """The statistics of some calibration rows alone, streamed in the pass that took every row's.

    ``token_ids`` is the [samples, seq] tensor that pass read (the same object, so a caller can tell which
    calibration these describe) and ``rows`` the rows kept apart; ``moments`` shift each state as the whole
    pass's do, so ``whole.minus(moments)`` are the statistics of the other rows.
    """

    token_ids: torch.Tensor
    rows: tuple[int, ...]
    moments: StateMoments


def _cosines(rows: torch.Tensor, norms: torch.Tensor, other: torch.Tensor, other_norms: torch.Tensor) -> torch.Tensor:
    """Row-wise cosine of ``rows`` and ``other`` [n, d] from their norms [n], on ``rows``' device, in [-1, 1]."""
    dots = torch.linalg.vecdot(rows, other.to(rows.device))
    return (dots / (norms * other_norms.to(rows.device)).clamp_min(1e-30)).clamp(-1, 1)


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
    precision: str = "float32",
    mlp_contribution: str | None = None,
    held_rows: Sequence[int] | None = None,
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
        precision: dtype of each batch's products (:class:`StateMoments`).
        mlp_contribution: with the path in a block of the module whose output is the MLP's contribution
            (``prune.selection.sublayers.contribution_path``), also each block's middle state (after attention,
            before the MLP): 2L + 1 states, 2i + 1 between block i's attention and MLP, so every
            score's value ``u`` rates sub-layer ``u``.
        held_rows: rows of ``token_ids`` whose statistics are also kept alone (``moments.held``, a
            :class:`HeldRows` without cosines): a repair measured on those rows and fitted on the others
            (``prune.selection.map_errors.map_errors``) reads both from this one pass.
    """
    if is_offloaded(model):
        raise LayercutError("this pass runs the whole model, and its blocks are offloaded: use "
                            "prune.measure.blockwise.stream_moments_blockwise, or --offload none")
    count = num_blocks(model) * (1 if mlp_contribution is None else 2)
    moments = StateMoments(count + 1, adjacent_pairs(count) if pairs is None else pairs, cosine_pairs, stats_device,
                           precision)
    held = None
    if held_rows is not None:
        held = StateMoments(count + 1, moments.pairs, "none", stats_device, precision, shifts_from=moments)
        moments.held = HeldRows(token_ids, tuple(sorted(set(held_rows))), held)
    holding = False  # whether the current batch has held rows

    def observe(index: int, state: torch.Tensor) -> None:
        moments.observe(index, state)
        if holding:
            held.observe(index, state)

    device = input_device(model)
    starts = range(0, token_ids.shape[0], batch_size)
    with residual_states(model, observe, mlp_contribution):
        for start in tqdm(starts, desc="capture", unit="batch", disable=not progress):
            batch = token_ids[start : start + batch_size].to(device)  # [batch, seq]
            moments.begin_batch(None)
            if held is not None:
                mine = torch.tensor([start + row in moments.held.rows for row in range(batch.shape[0])])
                holding = bool(mine.any())
                if holding:
                    held.begin_batch(mine[:, None].expand(batch.shape))
            # The base model stops before the LM head: [batch, seq, vocab] logits would cost more than the stats.
            model.base_model(input_ids=batch, use_cache=False)
    logger.info("streamed statistics of %d states over %d tokens", count + 1, moments.n)
    return moments
