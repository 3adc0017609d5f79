"""Layer-by-layer calibration: one block in memory at a time, run over every calibration token.

This is the sequential pass GPTQ, SparseGPT and llm-compressor use. One cheap forward with every block
stubbed out records the embeddings of the calibration tokens (state 0) and the arguments each block is
called with (positions, rotary embeddings, masks: per block, since hybrids such as Gemma-3 give
sliding-window and global layers different ones). Then block ``b`` alone runs on state ``b`` of every
batch, its output becomes state ``b + 1``, and the statistics see both before the next block runs.

With :func:`load_offloaded` the model is a skeleton: every block's weights stay on the meta device and
:class:`CheckpointBlocks` reads one block at a time from the checkpoint's safetensors (memory-mapped,
so only that block's bytes are read) and puts it back on the meta device after its pass. Peak memory is
the embeddings, one block, one state buffer [calibration tokens, hidden] in the model's dtype and one
batch of the next (each batch of a state goes once its output is folded in), one sequence's activations,
plus the statistics; a 70B model scores on one 24 GB GPU, or on a CPU with less RAM than the model.

The statistics equal the in-memory pass's (``prune.measure.moments.stream_moments``): each state is folded in
batch by batch in the same order, and a block called on the states it would have been called on
inside the model gives the same values (``tests/prune/measure/test_blockwise.py``).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from prune.errors import LayercutError
from prune.loading.offload import CheckpointBlocks
from prune.measure.moments import HeldRows, StateMoments, adjacent_pairs, stream_moments
from prune.measure.scores import get_score
from prune.memory import return_freed_memory
from prune.model.adapters import OFFLOAD_ATTR, get_blocks, input_device, is_offloaded, num_blocks
from prune.model.capture import block_input, block_output

logger = logging.getLogger(__name__)

@dataclass
class BlockCall:
    """The arguments a block is called with for one batch, besides its hidden state."""

    args: tuple
    kwargs: dict


@contextmanager
def _blocks_stubbed(blocks: nn.ModuleList, calls: list[list[BlockCall]], states: list[torch.Tensor]) -> Iterator[None]:
    """Every block records its arguments and returns its input unchanged; block 0 also keeps its input.

    Nothing of a block runs, so the forward costs the embeddings, masks and rotary tables alone, and no
    block's weights need to be in memory.
    """

    def stub(index: int) -> Callable:
        def forward(*args, **kwargs):
            hidden = block_input(args, kwargs)
            rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            calls[index].append(BlockCall(tuple(args[1:]), rest))
            if index == 0:
                states.append(hidden)
            return hidden

        return forward

    try:
        for index, block in enumerate(blocks):
            block.forward = stub(index)
        yield
    finally:
        for block in blocks:
            block.__dict__.pop("forward", None)


@torch.no_grad()
def block_inputs(model: nn.Module, batches: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
    """State 0 of each batch [batch, seq, hidden] and, per block, the arguments of its call for each batch."""
    _, blocks = get_blocks(model)
    calls: list[list[BlockCall]] = [[] for _ in blocks]
    states: list[torch.Tensor] = []
    device = input_device(model)
    with _blocks_stubbed(blocks, calls, states):
        for batch in batches:
            model.base_model(input_ids=batch.to(device), use_cache=False)
    return states, calls


def split_batches(token_ids: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """[samples, seq] tokens as the [batch, seq] batches an in-memory pass would run."""
    return [token_ids[start : start + batch_size] for start in range(0, token_ids.shape[0], batch_size)]


class ResidentBlocks:
    """Blocks whose weights are already in memory: nothing to load or free."""

    @contextmanager
    def loaded(self, _index: int, block: nn.Module) -> Iterator[nn.Module]:
        """``block`` as it is."""
        yield block








def block_weights(model: nn.Module) -> CheckpointBlocks | ResidentBlocks:
    """Where ``model``'s block weights come from: its checkpoint (an offloaded skeleton) or memory."""
    return getattr(model, OFFLOAD_ATTR, None) or ResidentBlocks()


def _partners(pairs: list[tuple[int, int]], cosine_pairs: str, count: int) -> dict[int, list[int]]:
    """For each state, the earlier states its statistics are taken against (pairs and cosines)."""
    partners = {j: {i for i, jj in pairs if jj == j} for j in range(count + 1)}
    if cosine_pairs == "adjacent":
        for j in range(1, count + 1):
            partners[j].add(j - 1)
    return {j: sorted(found) for j, found in partners.items()}


@torch.no_grad()
def stream_moments_blockwise(
    model: nn.Module,
    token_ids: torch.Tensor | None = None,
    *,
    batches: list[torch.Tensor] | None = None,
    pairs: Iterable[tuple[int, int]] | None = None,
    cosine_pairs: str = "adjacent",
    batch_size: int = 4,
    stats_device: torch.device | str | None = None,
    progress: bool = True,
    precision: str = "float32",
    scores: list[str] | None = None,
    after_block: Callable[[StateMoments, int], None] | None = None,
    observed: set[int] | None = None,
    after_call: Callable[[int, int], None] | None = None,
    rows: int | None = 1,
    upto: int | None = None,
    held_rows: Sequence[int] | None = None,
) -> StateMoments:
    """``prune.measure.moments.stream_moments``, block by block: the same statistics with one block in memory.

    States are kept only while a later state is paired with them, so the default (adjacent) pairs hold
    one state buffer and a batch. Cosines between every pair of states (``cosine_pairs="all"``, span selection by a
    score of states) would hold every state at once and are refused. ``batches`` [batch, seq] (of any
    lengths) replace ``token_ids`` cut into ``batch_size`` rows.

    ``scores``: the registered scores to take of each block as soon as its statistics are complete
    (``StateMoments.early_scores``, returned by ``prune.measure.scores.block_scores``); each state's statistics are
    then released, so the pass holds three d x d matrices instead of 2L + 1 (86 GB for a 70B model). Only
    adjacent pairs can be released this way. ``after_block(moments, b)`` is called once block ``b``'s output
    (state ``b + 1``) has been folded in for every batch: what it reads of the moments is then complete.
    ``observed``: the only states whose statistics are taken (None: all); a fit reads its spans' ends alone.
    ``after_call(b, k)`` is called as soon as block ``b`` has run on batch ``k`` (forward hooks on the
    block's modules have fired for that batch).
    ``rows``: the sequences of a batch one block call runs (None: the whole batch). A block's activations
    are most of the pass's transient memory (SmolLM2-135M, 4 x 512 tokens: about 190 MiB against a 13.5
    MiB block), so by default each sequence runs alone and the outputs are put back together before the
    statistics see them (:func:`_in_rows`). Hooks see one call per batch, so ``after_call`` runs whole
    batches. ``upto``: only blocks ``0..upto-1`` run (a fit needs nothing behind its last span).
    ``held_rows``: rows of ``token_ids`` whose statistics are also kept alone (``moments.held``), as
    ``stream_moments`` keeps them; released with the whole pass's, so what reads both (``after_block``, which
    runs before a block's early scores free its input) reads them block by block.
    """
    if scores and pairs is not None and any(j != i + 1 for i, j in pairs):
        raise ValueError("early scores release each state's statistics: pass adjacent pairs only")
    if cosine_pairs == "all":
        raise LayercutError("--offload sequential keeps two states at a time, and span scores compare every pair: "
                            "use --select topk (or greedy), or --offload none")
    if held_rows is not None and (batches is not None or token_ids is None):
        raise ValueError("held_rows are rows of token_ids: pass token_ids, not batches")
    count = num_blocks(model)
    pairs = adjacent_pairs(count) if pairs is None else sorted(set(pairs))
    moments = StateMoments(count + 1, pairs, cosine_pairs, stats_device, precision)
    masks = _held_masks(moments, token_ids, held_rows, batch_size)  # per batch: its held rows, or None
    held = moments.held.moments if held_rows is not None else None
    partners = _partners(pairs, cosine_pairs, count)
    last_use = {i: max([j for j in partners if i in partners[j]], default=i) for i in range(count + 1)}
    states, calls = block_inputs(model, batches if batches is not None else split_batches(token_ids, batch_size))
    kept = {0: states}
    del states  # state 0 goes once block 0 no longer needs it
    return_freed_memory()
    for b, batch in enumerate(kept[0] if observed is None or 0 in observed else ()):
        moments.begin_batch(None)
        moments.observe(0, batch)
        if masks[b] is not None:
            held.begin_batch(masks[b])
            held.observe(0, batch)
    weights = block_weights(model)
    _, blocks = get_blocks(model)
    for index in tqdm(range(count if upto is None else min(upto, count)), desc="capture (block by block)",
                      unit="block", disable=not progress):
        # states no later block reads: each batch of them goes as soon as its output is folded in, so the
        # pass holds one state buffer and a batch, not two buffers
        spent = [i for i in kept if last_use[i] <= index + 1 and i <= index]
        # without hooks holding a block's input (a fit's), a spent input's memory takes its output: fresh
        # tensors per batch would be carved from a heap the block's activations fragment, and grow it
        overwrite = after_call is None and index in spent
        kept[index + 1] = []
        with weights.loaded(index, blocks[index]) as block:
            for b, call in enumerate(calls[index]):
                output = _in_rows(block, kept[index][b], call, None if after_call is not None else rows)
                if after_call is not None:
                    after_call(index, b)
                if observed is None or index + 1 in observed:
                    moments.begin_batch(None)
                    for earlier in partners[index + 1]:
                        moments.recall(earlier, kept[earlier][b])
                    moments.observe(index + 1, output)
                    if masks[b] is not None:
                        held.begin_batch(masks[b])
                        for earlier in partners[index + 1]:
                            held.recall(earlier, kept[earlier][b])
                        held.observe(index + 1, output)
                if overwrite and output.shape == kept[index][b].shape and output.dtype == kept[index][b].dtype:
                    output = kept[index][b].copy_(output)
                kept[index + 1].append(output)
                for i in spent:
                    kept[i][b] = None
        for i in spent:
            del kept[i]
        if after_block is not None:
            after_block(moments, index)
        if scores:
            _score_block(moments, index, scores)
            if held is not None:
                held.release(index)
        return_freed_memory()
    if moments.n:
        logger.info("streamed statistics of %d states over %d tokens, one block at a time", count + 1, moments.n)
    return moments


def _in_rows(block: nn.Module, hidden: torch.Tensor, call: BlockCall, rows: int | None) -> torch.Tensor:
    """``block``'s output on ``hidden`` [batch, seq, d], ``rows`` sequences per call, put back together.

    A call argument with the batch's leading size (a padding mask [batch, 1, seq, seq], per-sequence
    positions) is cut with the rows; one of size 1 is broadcast and passed whole, as is everything else.
    Sequences do not mix inside a block, so the output is the batch's; on CPU it is bit for bit the
    same (``tests/prune/measure/test_blockwise.py``).
    """
    size = hidden.shape[0]
    if rows is None or rows >= size:
        return block_output(block(hidden, *call.args, **call.kwargs))

    def cut(value, start: int):
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == size:
            return value[start : start + rows]
        if isinstance(value, (tuple, list)):
            return type(value)(cut(item, start) for item in value)
        return value

    parts = [block_output(block(hidden[start : start + rows], *cut(call.args, start),
                                **{key: cut(value, start) for key, value in call.kwargs.items()}))
             for start in range(0, size, rows)]
    return torch.cat(parts)


def _held_masks(moments: StateMoments, token_ids: torch.Tensor | None, held_rows: Sequence[int] | None,
                batch_size: int) -> list[torch.Tensor | None] | dict:
    """Per batch of :func:`split_batches`: the [batch, seq] mask of its held rows (None: it has none).

    With ``held_rows``, ``moments.held`` is set to a :class:`HeldRows` shifted as ``moments``, as
    ``stream_moments`` sets it. Without, every batch's entry is None.
    """
    if held_rows is None:
        return defaultdict(lambda: None)
    rows = tuple(sorted(set(held_rows)))
    held = StateMoments(moments.num_states, moments.pairs, "none", moments.device, moments.precision,
                        shifts_from=moments)
    moments.held = HeldRows(token_ids, rows, held)
    masks = []
    for batch in split_batches(token_ids, batch_size):
        start = len(masks) * batch_size
        mine = torch.tensor([start + row in rows for row in range(batch.shape[0])])
        masks.append(mine[:, None].expand(batch.shape) if mine.any() else None)
    return masks


def _score_block(moments: StateMoments, block: int, names: list[str]) -> None:
    """Take every score of ``block`` (its input and output statistics are complete), then free its input's."""
    for name in names:
        moments.early_scores.setdefault(name, []).append(get_score(name).compute(moments, block))
    moments.release(block)


def stream_any(model: nn.Module, token_ids: torch.Tensor, **options) -> StateMoments:
    """Statistics of ``model`` over ``token_ids``: block by block for a skeleton, else in one pass per batch."""
    if is_offloaded(model):
        return stream_moments_blockwise(model, token_ids, **options)
    return stream_moments(model, token_ids, **options)
