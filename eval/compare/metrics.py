"""Extra measurements a comparison can take of every model, registered by name (``--metrics weights-mb``).

The comparison always measures parameters, held-out perplexity per domain, lm-eval tasks and decode
time. A metric is anything else measured on the model in memory: it writes its fields into the row and
shows as one leaderboard column. Adding one is a function here (or in any imported module) decorated
with :func:`register_metric`, plus its test; asking for it later measures it on the cells whose weights
were kept, as tasks are. A metric that judges a model against the original it was cut from declares
``against_original=True`` where it registers and is handed an :class:`Original` as its third argument.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from eval.quality.fidelity import FidelityOptions, Reference, prompts_from_streams
from eval.speed.peak_memory import weights_bytes
from prune.errors import LayercutError
from prune.registry import Registry

MeasureFn = Callable[..., dict]  # (model, tokenizer[, original]) -> the row fields it adds


class Original:
    """The model a comparison cuts from, and the held-out text, for metrics that judge against it.

    Args:
        model: the original model in memory (never a cell's copy).
        streams: held-out token streams, one per text, that prompts are cut from.
    """

    def __init__(self, model, streams: list[torch.Tensor]):
        self.model = model
        self.streams = streams
        self._references: dict[FidelityOptions, Reference] = {}

    def reference(self, options: FidelityOptions | None = None) -> Reference:
        """The original's greedy side of generation fidelity, decoded once per settings and shared by every cell."""
        options = options or FidelityOptions()
        if options not in self._references:
            self._references[options] = Reference(self.model, prompts_from_streams(self.streams, options), options)
        return self._references[options]


@dataclass(frozen=True)
class Metric:
    """A registered metric.

    Attributes:
        name: what ``--metrics`` calls it.
        head: its leaderboard column's head.
        field: the row field its column shows (the first it writes).
        measure: ``(model, tokenizer) -> dict``, the fields it adds to a row; with ``against_original``,
            ``(model, tokenizer, original: Original) -> dict``.
        cell: ``(value) -> str``, how its column shows a value.
        against_original: whether it needs the original model beside the measured one.
        note: ``(the dense row's value) -> str``, the leaderboard's sentence on what the column measured.
    """

    name: str
    head: str
    field: str
    measure: MeasureFn
    cell: Callable[[object], str] = str
    against_original: bool = False
    note: Callable[[object], str] | None = None


METRICS: Registry[Metric] = Registry("metric", "--metrics")


def register_metric(name: str, head: str, field: str, cell: Callable[[object], str] = str,
                    against_original: bool = False, note: Callable[[object], str] | None = None):
    """Decorator registering a ``(model, tokenizer[, original]) -> dict`` measurement as the metric ``name``."""
    return METRICS.decorator(name, lambda fn: Metric(name, head, field, fn, cell, against_original, note))


def measure_metrics(model, tokenizer, names: list[str], row: dict, original: Original | None = None) -> None:
    """Put every metric of ``names`` that ``row`` lacks into it.

    ``original``: what metrics declared ``against_original`` judge ``model`` against (``model`` itself for
    the original's own row).
    """
    for name in names:
        metric = METRICS.get(name)
        if metric.field in row:
            continue
        if not metric.against_original:
            row.update(metric.measure(model, tokenizer))
        elif original is None:  # a caller's slip, not a user's: every comparison path hands the original
            raise LayercutError(f"the metric '{name}' judges a model against its original, and none was given")
        else:
            row.update(metric.measure(model, tokenizer, original))


def has_metrics(row: dict | None, names: list[str]) -> bool:
    """Whether ``row`` holds every metric of ``names``."""
    return row is not None and all(METRICS.get(name).field in row for name in names)


@register_metric("weights-mb", head="weights MB", field="weights_mb", cell=lambda value: f"{value:.1f}")
def _weights_mb(model, tokenizer) -> dict:
    """Bytes of parameters and buffers in memory, in MiB: what a server holds for the weights."""
    return {"weights_mb": weights_bytes(model) / 2**20}


def _fidelity_cell(value: dict) -> str:
    spread = f" ± {value['nll_stderr']:.2f}" if value.get("nll_stderr") else ""  # rows measured before it: none
    return f"{value['kept']:.2f} / {value['nll']:.2f}{spread}"


def _fidelity_note(dense: dict) -> str:
    return (f"Greedy kept / NLL by original: each model writes {dense['new_tokens']} greedy tokens after each of "
            f"{dense['prompts']} held-out prompts of {dense['prompt_tokens']} tokens, cut evenly through the texts; "
            "\"kept\" is the share of the original's own greedy tokens it writes the same before the first that "
            "differs, \"NLL\" the original's mean negative log-likelihood per token of what it wrote (the dense "
            "row: of its own text, the floor).")


@register_metric("fidelity", head="greedy kept / NLL by original", field="fidelity", cell=_fidelity_cell,
                 against_original=True, note=_fidelity_note)
def _fidelity(model, tokenizer, original: Original) -> dict:
    """Generation fidelity (``eval.quality.fidelity``) on held-out prompts.

    The share of the original's greedy tokens kept before the first divergence, and the original's NLL per
    token of what the model writes.
    """
    return {"fidelity": original.reference().measure(model)}
