"""How ``--data`` is spelled: one source or a weighted mixture, parsed into :class:`Source` entries.

``prune.data.calibration`` reads and packs what these name; its module docstring describes the sources.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from prune.errors import LayercutError

BUILTIN = "builtin"
SELF = "self"
# sampling for ``--data self``: the model's own distribution, its long unlikely tail cut off
SELF_DEFAULTS = {"temperature": 1.0, "top_p": 0.95}
MIXTURE_EXAMPLE = "emma.txt@0.5,wikitext:wikitext-2-raw-v1:train@0.5"


@dataclass(frozen=True)
class Source:
    """One calibration source and its share of the sequences.

    Attributes:
        spec: what ``load_documents`` reads (None: the built-in corpus), or ``self``.
        weight: share of the sequences, the weights of a mixture summing to one.
        sampling: temperature, top_p and (when given) batch and chat of a ``self`` source (empty for text
            sources).
    """

    spec: str | None
    weight: float = 1.0
    sampling: tuple[tuple[str, float | int], ...] = ()

    @property
    def is_self(self) -> bool:
        """Text sampled from the model rather than read."""
        return self.spec == SELF

    def label(self) -> str:
        """How reports name the source before it is read."""
        if self.is_self:
            return "self(" + ", ".join(f"{k}={v:g}" for k, v in self.sampling) + ")"
        return BUILTIN if self.spec is None else self.spec


def parse_sources(spec: str | None) -> list[Source]:
    """``--data`` -> its sources with weights summing to one; a bad spelling is a one-line error.

    A path that exists is one source even if its name holds ``,`` or ``@``.
    """
    if spec is None:
        return [Source(None)]
    if not isinstance(spec, str) or not spec.strip():
        raise LayercutError(f"--data is empty: pass a file, a datasets spec, self, or a mixture like {MIXTURE_EXAMPLE}")
    if Path(spec).expanduser().exists():
        return [Source(spec)]
    items = [item.strip() for item in spec.split(",")]
    if any(not item for item in items):
        raise LayercutError(f"--data '{spec}' has an empty entry: separate sources by single commas, e.g. "
                            f"{MIXTURE_EXAMPLE}")
    parsed = [_split_weight(item) for item in items]
    given = [weight is not None for _, weight in parsed]
    if any(given) and not all(given):
        raise LayercutError(f"--data '{spec}' weights some sources and not others: give every source a weight "
                            f"({MIXTURE_EXAMPLE}) or none (equal shares)")
    weights = [weight if weight is not None else 1.0 for _, weight in parsed]
    total = sum(weights)
    sources = [_source(name, weight / total) for (name, _), weight in zip(parsed, weights, strict=True)]
    labels = [source.label() for source in sources]
    for label in labels:
        if labels.count(label) > 1:
            raise LayercutError(f"--data names '{label}' twice: give it once with the sum of its weights")
    return sources


def _split_weight(item: str) -> tuple[str, float | None]:
    """``"emma.txt@0.5"`` -> ``("emma.txt", 0.5)``; ``"emma.txt"`` -> ``("emma.txt", None)``."""
    if "@" not in item or Path(item).expanduser().exists():
        return item, None
    name, text = item.rsplit("@", 1)
    try:
        weight = float(text)
    except ValueError:
        raise LayercutError(f"--data entry '{item}' has weight '{text}': write SOURCE@WEIGHT with a positive "
                            "number, e.g. emma.txt@0.5") from None
    if not name.strip():
        raise LayercutError(f"--data entry '{item}' names no source before '@': write SOURCE@WEIGHT, e.g. emma.txt@0.5")
    if not math.isfinite(weight) or weight <= 0:
        raise LayercutError(f"--data entry '{item}' has weight {text}: weights must be positive numbers; leave a "
                            "source out rather than weigh it 0")
    return name.strip(), weight


def _source(name: str, weight: float) -> Source:
    if name == BUILTIN:
        return Source(None, weight)
    if name != SELF and not name.startswith(SELF + ":"):
        return Source(name, weight)
    options: dict[str, float | int] = dict(SELF_DEFAULTS)
    for part in name.split(":")[1:]:
        key, _, text = part.partition("=")
        if key == "chat":
            # only when given, as batch: a plain sample's cache key and tokens stay those of every earlier run
            if text not in ("", "1"):
                raise LayercutError(f"--data '{name}': chat takes no value; write self:chat")  # (chat=1 reads the same)
            options[key] = 1
            continue
        if key == "batch":
            # only when given: the default's cache key and tokens stay those of every earlier run
            if not text.isdecimal() or int(text) < 1:
                raise LayercutError(f"--data '{name}': batch must be a whole number of sequences, e.g. self:batch=64")
            options[key] = int(text)
            continue
        if key not in SELF_DEFAULTS:
            raise LayercutError(f"--data '{name}': unknown sampling option '{key}'; write self or "
                                "self:temperature=1.0:top_p=0.95:batch=8:chat")
        try:
            options[key] = float(text)
        except ValueError:
            raise LayercutError(f"--data '{name}': {key} must be a number, e.g. self:{key}=0.9") from None
    if not options["temperature"] > 0 or not 0 < options["top_p"] <= 1:
        raise LayercutError(f"--data '{name}': temperature must be > 0 and top_p in (0, 1], e.g. "
                            "self:temperature=1.0:top_p=0.95")
    return Source(SELF, weight, tuple(options.items()))


def shares(total: int, weights: list[float]) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainders, ties to the earlier source)."""
    exact = [total * w for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts
