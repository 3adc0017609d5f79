"""Sub-module stand-ins (section 6 of Jump to Conclusions): how linear each part of a block is.

For block b and one part (attention, FFN, or the block's layer norms), a closed-form affine map from
the part's input to its output is fitted on the calibration split; the model then runs with that part
replaced by its map (one part of one block at a time, restored in ``finally``), and its final
predictions are compared with the original model's top-1 tokens: Precision@1 and surprisal.

A part spans from an entry module (whose input is taken) to an exit module (whose output is
replaced). Usually both are the same sub-module; for OPT, whose feed-forward is two linears in the
block itself (``fc1`` ... ``fc2``), the span runs from ``fc1``'s input to ``fc2``'s output.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from eval.lens.metrics import score_states
from prune.errors import LayercutError
from prune.measure.least_squares import LinearFit, fit_linear_map
from prune.measure.moments import StateMoments
from prune.model.adapters import arch_spec, get_blocks, get_submodule, input_device, lm_head, num_blocks
from prune.model.capture import block_input, block_output, residual_states, with_block_output

logger = logging.getLogger(__name__)

SUBMODULE_PARTS = ("attention", "mlp", "norms")


def part_spans(model: nn.Module, part: str) -> list[tuple[str, str]]:
    """(entry path, exit path) inside a block for each module that ``part`` replaces."""
    spec = arch_spec(model)
    if part == "attention":
        return [(spec.attention, spec.attention)]
    if part == "mlp":
        # a mixture of experts has no single output projection (mlp_out ""): the MLP module is the exit
        inside = not spec.mlp_out or spec.mlp_out.startswith(spec.mlp + ".")
        return [(spec.mlp, spec.mlp if inside else spec.mlp_out)]
    if part == "norms":
        return [(norm, norm) for norm in spec.norms]
    raise LayercutError(f"unknown sub-module part '{part}': choose from {', '.join(SUBMODULE_PARTS)}")


def parse_blocks(spec: str | None, count: int) -> list[int]:
    """Blocks from ``"all"``/None, ``"0,5,-1"`` or ``"0-9"`` (ranges inclusive, negatives from the end)."""
    if spec is None or spec.strip() in ("", "all"):
        return list(range(count))
    blocks: set[int] = set()
    for item in spec.split(","):
        match = re.fullmatch(r"\s*(-?\d+)\s*(?:-\s*(-?\d+)\s*)?", item)
        if match is None:
            raise LayercutError(f"--submodule-blocks '{spec}': use a list like 0,5,-1 or a range like 0-9")
        first, last = (int(g) if g else None for g in match.groups())
        for b in range(first, (first if last is None else last) + 1):
            if not -count <= b < count:
                raise LayercutError(f"--submodule-blocks '{spec}' names block {b}: the model has blocks 0..{count - 1}")
            blocks.add(b % count)
    return sorted(blocks)


@dataclass(frozen=True)
class _Span:
    block: int
    part: str
    entry: nn.Module
    exit: nn.Module


def _spans(model: nn.Module, blocks: Sequence[int]) -> list[_Span]:
    _, modules = get_blocks(model)
    return [
        _Span(b, part, get_submodule(modules[b], entry), get_submodule(modules[b], exit_))
        for b in blocks for part in SUBMODULE_PARTS for entry, exit_ in part_spans(model, part)
    ]  # fmt: skip


@contextmanager
def _span_hooks(spans: Sequence[_Span], on_output) -> Iterator[None]:
    """Hand ``on_output(k, input, output)`` each span's entry input and exit output; may replace the output."""
    inputs: dict[int, torch.Tensor] = {}
    handles = []

    def entry_hook(k):
        def hook(_module, args, kwargs):
            inputs[k] = block_input(args, kwargs)

        return hook

    def exit_hook(k):
        def hook(_module, _args, _kwargs, output):
            return on_output(k, inputs.pop(k), output)

        return hook

    try:
        for k, span in enumerate(spans):
            handles.append(span.entry.register_forward_pre_hook(entry_hook(k), with_kwargs=True))
            handles.append(span.exit.register_forward_hook(exit_hook(k), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def fit_stand_ins(
    model: nn.Module,
    blocks: Sequence[int],
    token_ids: torch.Tensor,
    *,
    ridge: float = 0.0,
    batch_size: int = 4,
    progress: bool = True,
) -> dict[tuple[int, str], list[LinearFit]]:
    """Closed-form input -> output maps of every part of ``blocks``, from one streamed pass over ``token_ids``."""
    spans = _spans(model, blocks)
    # Span k's input and output are "states" 2k and 2k+1 of a StateMoments: same float64 streaming.
    moments = StateMoments(2 * len(spans), [(2 * k, 2 * k + 1) for k in range(len(spans))], cosine_pairs="none")

    def observe(k, entry_input, output):
        moments.observe(2 * k, entry_input)
        moments.observe(2 * k + 1, block_output(output))

    device = input_device(model)
    with _span_hooks(spans, observe):
        for start in tqdm(range(0, token_ids.shape[0], batch_size), desc="fit stand-ins", unit="batch",
                          disable=not progress):  # fmt: skip
            moments.begin_batch(None)
            model.base_model(input_ids=token_ids[start : start + batch_size].to(device), use_cache=False)
    fits: dict[tuple[int, str], list[LinearFit]] = {}
    for k, span in enumerate(spans):
        fits.setdefault((span.block, span.part), []).append(fit_linear_map(moments.pair(2 * k, 2 * k + 1), ridge))
    return fits


@contextmanager
def stand_in(model: nn.Module, block: int, part: str, fits: Sequence[LinearFit]) -> Iterator[None]:
    """Temporarily replace ``part`` of ``block`` by its fitted maps (its modules still run; outputs are swapped)."""
    spans = [s for s in _spans(model, [block]) if s.part == part]

    def replace(k, entry_input, output):
        original = block_output(output)
        mapped = fits[k](entry_input).reshape(original.shape).to(original.dtype)
        return with_block_output(output, mapped)

    with _span_hooks(spans, replace):
        yield


@torch.no_grad()
def final_predictions(
    model: nn.Module, token_ids: torch.Tensor, reference: torch.Tensor, *, batch_size: int = 4
) -> tuple[float, float]:
    """Precision@1 and mean surprisal (nats) of the model's output against ``reference`` [samples, seq]."""
    count = num_blocks(model)
    device = lm_head(model).weight.device
    hits = surprisal = 0.0
    last: list[torch.Tensor] = []

    def keep(index, h):
        if index == count:
            last.append(h.detach().reshape(-1, h.shape[-1]))

    with residual_states(model, keep):
        for start in range(0, token_ids.shape[0], batch_size):
            last.clear()
            model.base_model(input_ids=token_ids[start : start + batch_size].to(input_device(model)), use_cache=False)
            scores = score_states(model, last[0].to(device), reference[start : start + batch_size].reshape(-1))
            hits += float(scores.correct.double().sum())
            surprisal += float(scores.surprisal.double().sum())
    return hits / reference.numel(), surprisal / reference.numel()


def evaluate_stand_ins(
    model: nn.Module,
    fits: dict[tuple[int, str], list[LinearFit]],
    token_ids: torch.Tensor,
    reference: torch.Tensor,
    *,
    batch_size: int = 4,
    progress: bool = True,
) -> list[dict]:
    """One row per block: Precision@1 and surprisal with each part replaced by its map (one at a time)."""
    rows: dict[int, dict] = {}
    for (block, part), maps in tqdm(fits.items(), desc="stand-ins", unit="part", disable=not progress):
        with stand_in(model, block, part, maps):
            precision, surprisal = final_predictions(model, token_ids, reference, batch_size=batch_size)
        rows.setdefault(block, {"block": block})[part] = {"precision@1": precision, "surprisal": surprisal}
    return [rows[b] for b in sorted(rows)]
