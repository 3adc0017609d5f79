"""The wrapper that carries replacement maps on a kept block, and what methods share about modules.

``ReplacedBlock`` is defined once, in the modeling code a checkpoint with maps carries
(``prune.model.remote_code``), so ``trust_remote_code`` loading computes exactly what layercut does.
"""

from __future__ import annotations

from torch import nn

from prune.model.remote_code import ReplacedBlock

__all__ = ["ReplacedBlock", "map_on_block", "parameter_count"]


def parameter_count(module: nn.Module) -> int:
    """Number of trainable-or-not parameters (buffers excluded)."""
    return sum(p.numel() for p in module.parameters())


def map_on_block(_model: nn.Module, block: nn.Module, record: dict) -> nn.Module | None:
    """The map a record's replacement put on ``block`` (its ``before`` or ``after``); None if it carries none."""
    if not isinstance(block, ReplacedBlock):
        return None
    return block.before if record["where"] == "before" else block.after
