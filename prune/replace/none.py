"""``none``: the removed blocks are only removed; nothing takes their place (the checkpoint stays vanilla)."""

from __future__ import annotations

from dataclasses import dataclass

from prune.model.layouts import VANILLA
from prune.replace.options import MethodOptions
from prune.replace.registry import Method, register_method


@dataclass
class NoneOptions(MethodOptions):
    """Removal reads none of the replacement options."""


# no fitter: the driver only removes the blocks; one fit, because there is nothing to fit in sequence
register_method(Method("none", "remove the blocks", serving=VANILLA, offloadable=True, options=NoneOptions,
                       fits=("independent",)))
