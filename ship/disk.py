"""The disk a ship run writes, counted from the model's shape before anything loads.

A Llama-3-8B shape in float32 is 32 GB; its run writes the slim checkpoint (25 GB at a quarter of the depth), for
llama.cpp the GGUF's float16 conversion before the quantizer (13 GB) and the quantized file, and for the speed
check the original's file of the same type (its own float16 conversion first). Found full at the export, such a
run has spent an hour: it is refused up front instead, naming what it writes where.

The peak on each filesystem is every file the run keeps there plus the largest of its passing ones (the
float16 conversions, each deleted once quantized); a file an earlier run left (a resumed run, the original's
cached engine file) is not counted again.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from prune.atomic import nearest_existing
from prune.checkpoint.gguf import OUTTYPE_BITS, QUANTIZER_TYPES
from prune.errors import LayercutError
from prune.planner.memory import weight_bytes
from prune.planner.shape import ModelShape
from ship.work import CHECKPOINT, HEALED

SLACK = 1.05  # file systems' blocks, the cards and the work folder's figures


@dataclass(frozen=True)
class DiskNeed:
    """One file (or folder) the run writes: where, how large, and whether it is gone before the run ends."""

    what: str
    where: Path
    bytes: float
    passing: bool = False


def gguf_bytes(shape: ModelShape, blocks: int, gguf_type: str) -> float:
    """Bytes of a GGUF of ``blocks`` blocks of ``shape`` in ``gguf_type`` (a tied head stored once)."""
    params = shape.block_params * blocks + shape.embed_params + shape.head_params + shape.other_params
    return params * OUTTYPE_BITS[gguf_type] / 8


def ship_needs(config, shape: ModelShape, inp, drop: int, original_file: Path | None,
               heal_kept: bool | None = None) -> list[DiskNeed]:
    """The files a ship run of ``config`` writes at ``drop`` blocks removed, those already written left out.

    ``original_file``: where the original's engine file for the speed check is cached (None: no such check).
    ``heal_kept``: whether a resumed run's finished heal kept its copy (None: the heal is still to run, and its copy
    is counted where ``config`` heals).
    """
    work = Path(config.work)
    kept = shape.layers - drop
    heals = bool(config.heal_steps) if heal_kept is None else heal_kept
    needs = []
    if not (work / CHECKPOINT).is_dir():
        needs.append(DiskNeed("the slim checkpoint", work, weight_bytes(shape, inp, kept)))
    if heals and not (work / HEALED).is_dir():
        needs.append(DiskNeed("its healed copy", work, weight_bytes(shape, inp, kept)))
    if config.gguf:
        quantized = config.gguf_type in QUANTIZER_TYPES  # the quantizer reads the converter's float16 file
        shipped = HEALED if heals else CHECKPOINT  # the folder that ships: a GGUF of the other one is not shipped
        if not any((work / shipped).glob(f"gguf/*-{config.gguf_type}.gguf")):
            needs.append(DiskNeed(f"the {config.gguf_type} GGUF", work, gguf_bytes(shape, kept, config.gguf_type)))
            if quantized:
                needs.append(DiskNeed("its float16 conversion", work, gguf_bytes(shape, kept, "f16"), passing=True))
        if config.verify and original_file is not None and not original_file.is_file():
            needs.append(DiskNeed(f"the original's {config.gguf_type} GGUF for the speed check", original_file,
                                  gguf_bytes(shape, shape.layers, config.gguf_type)))
            if quantized:
                needs.append(DiskNeed("its float16 conversion", original_file,
                                      gguf_bytes(shape, shape.layers, "f16"), passing=True))
    return needs


def check_disk(needs: list[DiskNeed]) -> None:
    """Refuse, in one line, a run whose files do not fit the free space of the filesystem they go to."""
    groups: dict[int, tuple[Path, list[DiskNeed]]] = {}
    for need in needs:
        existing = nearest_existing(need.where)
        groups.setdefault(os.stat(existing).st_dev, (existing, []))[1].append(need)
    for existing, group in groups.values():
        kept = sum(need.bytes for need in group if not need.passing)
        passing = max((need.bytes for need in group if need.passing), default=0.0)
        needed, free = (kept + passing) * SLACK, shutil.disk_usage(existing).free
        if needed > free:
            parts = ", ".join(f"{need.what} {need.bytes / 1e9:.1f} GB" for need in group)
            raise LayercutError(f"this run writes about {needed / 1e9:.1f} GB at its peak on the disk of {existing} "
                                f"({parts}) and it has {free / 1e9:.1f} GB free: free space, point --out or "
                                "$LAYERCUT_CACHE at a larger disk, or write fewer files: --repeats 0 (no speed "
                                "check), --heal-steps 0, --no-verify or --engine transformers")
