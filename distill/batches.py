"""Which calibration sequences go into each micro-batch: a pure function of (seed, batch index).

Batch ``b`` takes rows ``b * batch_size ... (b + 1) * batch_size - 1`` of an endless stream that walks
through the sequences in a fresh seeded permutation per epoch. Because nothing but the index decides a
batch, resuming at step ``s`` needs no data-loader state, and the order is the same with or without
an interruption.
"""

from __future__ import annotations

import torch


class BatchOrder:
    """Seeded, epoch-shuffled batches of row indices into a ``[samples, seq_len]`` token tensor."""

    def __init__(self, samples: int, batch_size: int, seed: int):
        self.samples = samples
        self.batch_size = batch_size
        self.seed = seed
        self._cached: tuple[int, torch.Tensor] | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._cached is None or self._cached[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._cached = (epoch, torch.randperm(self.samples, generator=generator))
        return self._cached[1]

    def rows(self, batch_index: int) -> torch.Tensor:
        """Row indices [batch_size] of batch ``batch_index`` (0-based, across epochs)."""
        start = batch_index * self.batch_size
        positions = range(start, start + self.batch_size)
        return torch.stack([self._permutation(p // self.samples)[p % self.samples] for p in positions])

    def batch(self, token_ids: torch.Tensor, batch_index: int) -> torch.Tensor:
        """Token ids [batch_size, seq_len] of batch ``batch_index``."""
        return token_ids[self.rows(batch_index)]
