"""Extra measurements a comparison can take of every model, registered by name (``--metrics weights-mb``).

The comparison always measures parameters, held-out perplexity per domain, lm-eval tasks and decode
time. A metric is anything else measured on the model in memory: it writes its fields into the row and
shows as one leaderboard column. Adding one is a function here (or in any imported module) decorated
with :func:`register_metric`, plus its test; asking for it later measures it on the cells whose weights
were kept, as tasks are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from eval.speed.peak_memory import weights_bytes
from prune.registry import Registry

MeasureFn = Callable[..., dict]  # (model, tokenizer) -> the row fields it adds


@dataclass(frozen=True)
class Metric:
    """A registered metric.

    Attributes:
        name: what ``--metrics`` calls it.
        head: its leaderboard column's head.
        field: the row field its column shows (the first it writes).
        measure: ``(model, tokenizer) -> dict``, the fields it adds to a row.
        cell: ``(value) -> str``, how its column shows a value.
    """

    name: str
    head: str
    field: str
    measure: MeasureFn
    cell: Callable[[object], str] = str


METRICS: Registry[Metric] = Registry("metric", "--metrics")


def register_metric(name: str, head: str, field: str, cell: Callable[[object], str] = str):
    """Decorator registering a ``(model, tokenizer) -> dict`` measurement as the metric ``name``."""
    return METRICS.decorator(name, lambda fn: Metric(name, head, field, fn, cell))


def measure_metrics(model, tokenizer, names: list[str], row: dict) -> None:
    """Put every metric of ``names`` that ``row`` lacks into it."""
    for name in names:
        metric = METRICS.get(name)
        if metric.field not in row:
            row.update(metric.measure(model, tokenizer))


def has_metrics(row: dict | None, names: list[str]) -> bool:
    """Whether ``row`` holds every metric of ``names``."""
    return row is not None and all(METRICS.get(name).field in row for name in names)


@register_metric("weights-mb", head="weights MB", field="weights_mb", cell=lambda value: f"{value:.1f}")
def _weights_mb(model, tokenizer) -> dict:
    """Bytes of parameters and buffers in memory, in MiB: what a server holds for the weights."""
    return {"weights_mb": weights_bytes(model) / 2**20}
