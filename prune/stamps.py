"""Stamps of a model's weights, for files that are valid only for the weights they were made with."""

from __future__ import annotations

import hashlib

import torch
from torch import nn


def weights_fingerprint(model: nn.Module, sums: bool = False) -> str | None:
    """A cheap stamp of the weights: every tensor's name, shape, dtype and first values.

    A checkpoint re-exported to the same path, or a hub model updated since, differs in them. ``sums`` adds
    each tensor's sum, one pass over the weights on their own devices, so weights changed only past their
    first values (a merged adapter that left them, a weight edited in place) differ too. ``None`` when a
    tensor is not in memory (offloaded to the meta device): there is nothing to stamp.
    """
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_meta:
                return None
            flat = tensor.detach().reshape(-1)
            head = flat[:16].to("cpu", torch.float64)
            digest.update(f"{name}{list(tensor.shape)}{tensor.dtype}".encode() + head.numpy().tobytes())
            if sums:
                # 12 significant digits: an edited weight still shows, while the last bits of a float64 sum,
                # which depend on how many threads reduced it, do not make one model look like two
                digest.update(f"{flat.sum(dtype=torch.float64).item():.12e}".encode())
    return digest.hexdigest()[:32]
