"""How many blocks to remove to meet a budget: a parameter count or a speed-up, in place of ``--drop``.

``--target-params 110M`` (or ``1.2B``, ``110000000``, ``85%`` of the model's parameters) removes the
fewest blocks, as ranked by the run's score and selection, that bring the model's parameters to the
target. ``--target-speedup 1.25`` removes the fewest blocks whose ideal decode speed-up ``L / (L - K)``
(the ideal ``eval.bench speed`` reports) reaches it. Replacements add parameters (a linear map d^2 + d
per span); the run counts the model after surgery and refuses to export one above a parameter target.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

from prune.errors import LayercutError

_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_param_target(value: str | int, total: int) -> int:
    """``110M`` / ``1.2B`` / ``110000000`` / ``85%`` (of ``total``) as a parameter count below ``total``."""
    text = str(value).strip().upper().replace("_", "").replace(",", "")
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMBGT%]?)", text)
    if match is None:
        raise LayercutError(f"--target-params must be a count like 110M, 1.2B or 110000000, or a share like 85%; "
                            f"got {value!r}")
    number, suffix = float(match.group(1)), match.group(2)
    target = round(total * number / 100) if suffix == "%" else round(number * _SUFFIX[suffix])
    if target >= total:
        raise LayercutError(f"--target-params {value} is not below the model's {total:,} parameters "
                            f"({total / 1e6:.1f}M): ask for fewer")
    if target <= 0:
        raise LayercutError(f"--target-params {value} leaves no parameters: ask for more")
    return target


def blocks_for_speedup(speedup: float, num_blocks: int) -> int:
    """Fewest blocks K with ``num_blocks / (num_blocks - K) >= speedup``."""
    if not (math.isfinite(speedup) and speedup > 1):
        raise LayercutError(f"--target-speedup must be a number above 1 (1.25 = 25% faster), got {speedup}")
    count = math.ceil(num_blocks * (1 - 1 / speedup) - 1e-9)
    if count >= num_blocks:
        raise LayercutError(f"--target-speedup {speedup} needs all {num_blocks} blocks removed: ask for less")
    return count


def blocks_for_params(target: int, total: int, block_params: Sequence[int],
                      select: Callable[[int], list[int]], max_count: int, what: str = "unprotected block") -> int:
    """Fewest blocks K whose selection (``select(K)``) brings ``total`` parameters to ``target`` or below.

    Blocks may differ in size (dense first layers of an MoE), so each K is checked on the blocks the
    selection picks; K starts at the count that equal-sized blocks would need. Sub-layer runs pass
    their units' sizes and ``what`` names them in the error.
    """
    largest = max(block_params, default=0)
    start = max(1, math.ceil((total - target) / largest)) if largest else max_count + 1  # nothing can go
    for count in range(start, max_count + 1):
        removed = sum(block_params[b] for b in select(count))
        if total - removed <= target:
            return count
    smallest = total - sum(sorted(block_params, reverse=True)[:max_count])
    raise LayercutError(f"--target-params {target:,} is out of reach: removing every {what} leaves "
                        f"about {smallest:,} parameters (embeddings and head stay); ask for more or pass "
                        "--protect none")


def check_params_budget(after: int, budget: dict) -> None:
    """Refuse a surgered model of ``after`` parameters that its replacements carried back above the target."""
    if after > budget["target_params"]:
        raise LayercutError(f"--target-params {budget['target_params']:,}: removing {budget['drop']} blocks meets "
                            f"it, but the replacements bring the model back to {after:,} parameters; ask for "
                            f"{after - budget['target_params']:,} fewer or use --replace none / fold")
