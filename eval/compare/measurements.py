"""Calibration perplexities with blocks or sub-layers removed, kept on disk so no run measures a set twice.

SLEB's search (``greedy-ppl``), the oracle and the measured sub-layer ranking pay one calibration pass
for every set they try: on SmolLM2-135M with 32 x 512 calibration tokens that is 40 s a pass on a
2-core CPU, and SLEB at drops 2-8 alone is 212 passes. Within one process ``prune.pipeline.runner.Scored.memo``
already shares them; this store also keeps them across processes, so a comparison resumed after a
crash, a Ctrl-C or the end of a session continues where it stopped instead of measuring again.

A measurement is valid only for the model and the exact calibration tokens it was taken on. The file
holds a digest of both; a file with another digest is ignored and replaced, never reused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from pathlib import Path

import torch
from torch import nn

from prune.atomic import write_file_atomic
from prune.selection.repaired import COSTS_STORE
from prune.stamps import weights_fingerprint

logger = logging.getLogger(__name__)

MEASUREMENTS = "measurements.json"


def _block_set(key: tuple[int, ...]) -> str:
    return ",".join(str(block) for block in key)


def _parse_block_set(text: str) -> tuple[int, ...]:
    return tuple(int(block) for block in text.split(",")) if text else ()


# memo entry -> how its keys are written and read back (prune.selection.oracle.removal_cache; sub-layers)
KINDS = {"removal-ppl": (_block_set, _parse_block_set), "sublayer-removal-ppl": (str, str)}


FORMAT = 1  # bumped when what a measurement means changes
# the section of the file keeping a repaired selection's costs: repair key -> block set -> {"ppl": .., "kl": ..}
REPAIRED = "repaired-costs"


def calibration_digest(model: nn.Module | str, token_ids: torch.Tensor, extra: object = None) -> str:
    """A digest of what a measurement depends on.

    The model (its weights' fingerprint, or a name), the calibration tokens (shape and values) and ``extra``.
    """
    ids = token_ids.detach().to("cpu", torch.int64).contiguous()
    stamp = model if isinstance(model, str) else weights_fingerprint(model)
    if stamp is None:  # weights offloaded to meta: nothing to tell two models apart, so nothing is reused
        stamp = uuid.uuid4().hex
    digest = hashlib.sha256(json.dumps([FORMAT, stamp, list(ids.shape), extra], default=str).encode())
    digest.update(ids.numpy().tobytes())
    return digest.hexdigest()[:32]


class _SavedCache(dict):
    """A memo cache whose file is rewritten after every new measurement (a pass costs far more than the write)."""

    def __init__(self, store: MeasurementStore, items: dict) -> None:
        super().__init__(items)
        self._store = store

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self._store.save()


class MeasurementStore:
    """The measurements of one model and calibration, in ``folder/measurements.json``."""

    def __init__(self, folder: str | Path, digest: str) -> None:
        self.path = Path(folder) / MEASUREMENTS
        self.digest = digest
        self.caches: dict[str, _SavedCache] = {}
        self.repaired: dict[str, _SavedCache] = {}  # repair key -> its costs (prune.selection.repaired)
        self._saved_repaired: dict[str, dict] = {}

    def attach(self, memo: dict) -> int:
        """Put the saved caches into ``memo`` (entries measured in this process are kept); how many were read."""
        saved = self._read()
        for kind in KINDS:
            items = {**saved.get(kind, {}), **memo.get(kind, {})}
            self.caches[kind] = memo[kind] = _SavedCache(self, items)
        self._saved_repaired = saved.get(REPAIRED, {})
        memo[COSTS_STORE] = self._repaired_costs
        return sum(len(saved.get(kind, {})) for kind in KINDS) + sum(map(len, self._saved_repaired.values()))

    def count(self) -> int:
        """The sets measured in the attached memo: removals, sub-layer removals and repaired sets."""
        repaired = {**self._saved_repaired, **self.repaired}
        return sum(map(len, self.caches.values())) + sum(map(len, repaired.values()))

    def _repaired_costs(self, key: str) -> _SavedCache:
        """The costs of one repair (``prune.selection.repaired.RepairedCosts.key``), read back and kept saved."""
        if key not in self.repaired:
            self.repaired[key] = _SavedCache(self, self._saved_repaired.get(key, {}))
        return self.repaired[key]

    def _read(self) -> dict:
        """The saved measurements by kind, keys parsed; empty when there are none for this digest."""
        if not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if data.get("digest") != self.digest:
                logger.info("%s was measured on another model or calibration: not reused", self.path)
                return {}
            saved = {kind: {parse(key): float(value) for key, value in data.get(kind, {}).items()}
                     for kind, (_, parse) in KINDS.items()}
            saved[REPAIRED] = {repair: {_parse_block_set(blocks): {name: float(v) for name, v in cost.items()}
                                        for blocks, cost in costs.items()}
                               for repair, costs in data.get(REPAIRED, {}).items()}
            return saved
        except (ValueError, TypeError, AttributeError) as err:
            logger.warning("%s cannot be read (%s): measuring again", self.path, err)
            return {}

    def save(self) -> None:
        """Write every cache, atomically."""
        data = {"digest": self.digest}
        for kind, cache in self.caches.items():
            write, _ = KINDS[kind]
            data[kind] = {write(key): value for key, value in cache.items()}
        # a repair not touched by this process keeps what an earlier one saved
        repaired = {**self._saved_repaired, **self.repaired}
        if repaired:
            data[REPAIRED] = {repair: {_block_set(key): cost for key, cost in costs.items()}
                              for repair, costs in repaired.items()}
        text = json.dumps(data, indent=1, sort_keys=True) + "\n"
        write_file_atomic(self.path, lambda path: path.write_text(text, encoding="utf-8"))
