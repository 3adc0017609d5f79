"""The perplexity oracle: what removing each block alone really costs, and how far each cheap score agrees.

SLEB's criterion, measured once per block: the calibration perplexity of the model with that block
removed (one pass per block; the block is skipped by a temporary surgery, no copy of the model).
Every registered score is then rated by the Spearman rank correlation of its removability with the
oracle's ranking (+1: the score orders blocks exactly as removing them hurts; 0: no better than chance).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from prune.measure.heldout import batch_loss, packed_perplexity
from prune.measure.perplexity import token_nll
from prune.measure.scores import get_score
from prune.model.adapters import get_blocks, input_device, num_blocks
from prune.model.capture import block_input, hooks_held
from prune.model.surgery import blocks_removed

logger = logging.getLogger(__name__)


@dataclass
class Oracle:
    """Single-block removal perplexities and each score's rank agreement with them.

    Attributes:
        dense: calibration perplexity of the whole model.
        removed: calibration perplexity with block ``i`` alone removed, for every block.
        spearman: score name -> Spearman correlation of its removability with ``-removed``.
        tokens: calibration tokens each pass saw.
    """

    dense: float
    removed: list[float]
    spearman: dict[str, float]
    tokens: int

    def as_dict(self) -> dict:
        """JSON-ready."""
        return {"dense": self.dense, "removed": self.removed, "spearman": self.spearman, "tokens": self.tokens}


def removal_perplexity(model: nn.Module, token_ids: torch.Tensor, removed: list[int], batch_size: int = 4,
                       cache: dict | None = None) -> float:
    """Calibration perplexity with the blocks ``removed`` skipped; ``cache`` remembers it by block set.

    The oracle and SLEB's greedy search measure the same sets (the oracle's single removals are SLEB's
    first step, and a drop of 4 starts with the drop of 2 on the same calibration), so a ``cache`` kept
    for one model and one calibration saves every repeat. A cache must never outlive either.
    """
    key = tuple(sorted(removed))
    if cache is not None and key in cache:
        return cache[key]
    with blocks_removed(model, list(key)):
        value = packed_perplexity(model, token_ids, batch_size, progress=False)
    if cache is not None:
        cache[key] = value
    return value


# Sets measured together: one pass per batch keeps the block inputs they share, and their results are
# in the cache (and on disk, see eval.compare.measurements) as soon as the chunk ends; a crash loses one chunk.
CHUNK = 8


class _Captured(BaseException):
    """Ends a forward pass once the block inputs it was run for are kept (no model code catches it)."""


def _keeping_states(blocks, states: list[list[torch.Tensor]], upto: int | None = None) -> list:
    """Hooks keeping the state entering each of ``blocks`` (copies; off the GPU), ``upto`` the last one needed."""

    def keeper(position: int):
        def keep(_module, args, kwargs):
            state = block_input(args, kwargs).detach()
            # a copy: some blocks add into their input in place; off the GPU: 80 states of a 70B model are ~10 GB
            states[position].append(state.to("cpu", copy=True) if state.device.type == "cuda" else state.clone())
            if position == upto:
                raise _Captured  # nothing behind it is needed: skip the rest and the LM head
        return keep

    return [blocks[i].register_forward_pre_hook(keeper(i), with_kwargs=True) for i in range(len(states))]


def _each_once(states: list[list[torch.Tensor]]) -> list[torch.Tensor] | None:
    return [kept[0] for kept in states] if all(len(kept) == 1 for kept in states) else None


def states_entering(model: nn.Module, batch: torch.Tensor, upto: int) -> list[torch.Tensor] | None:
    """The hidden state entering blocks ``0..upto`` on ``batch`` (copies; on the CPU when the model is on a GPU).

    None when a block did not run exactly once (the state could not be told apart).
    """
    _, blocks = get_blocks(model)
    states: list[list[torch.Tensor]] = [[] for _ in range(upto + 1)]
    with hooks_held(_keeping_states(blocks, states, upto)):
        try:
            model(input_ids=batch, use_cache=False)
        except _Captured:
            pass
    return _each_once(states)


def logits_and_states(model: nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """The logits of ``batch`` and the hidden state entering every block, from one pass.

    The states are kept as :func:`states_entering` keeps them; None when a block did not run exactly once.
    """
    _, blocks = get_blocks(model)
    states: list[list[torch.Tensor]] = [[] for _ in blocks]
    with hooks_held(_keeping_states(blocks, states)):
        logits = model(input_ids=batch, use_cache=False).logits
    return logits, _each_once(states)


def _loss_without(model: nn.Module, batch: torch.Tensor, position: int) -> float:
    with blocks_removed(model, [position]):
        return batch_loss(model, batch)


def logits_from(model: nn.Module, batch: torch.Tensor, start: int, state: torch.Tensor,
                extra: dict | None = None) -> torch.Tensor:
    """The logits of ``model`` on ``batch`` when ``state`` enters block ``start`` (blocks before it skipped).

    ``extra``: more keyword arguments for the forward (``logits_to_keep``).
    """

    def enter(_module, args, kwargs):
        if args:
            return (state.to(args[0].device), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": state.to(kwargs["hidden_states"].device)}

    with blocks_removed(model, list(range(start))):
        _, blocks = get_blocks(model)
        with hooks_held([blocks[0].register_forward_pre_hook(enter, with_kwargs=True)]):
            return model(input_ids=batch, use_cache=False, **(extra or {})).logits


def _loss_from(model: nn.Module, batch: torch.Tensor, start: int, state: torch.Tensor) -> float:
    """The loss of ``model`` on ``batch`` when ``state`` enters block ``start`` (blocks before it skipped)."""
    logits = logits_from(model, batch, start, state)  # [batch, seq_len, vocab]
    return float(token_nll(logits[:, :-1], batch[:, 1:]).sum()) / (batch.shape[0] * (batch.shape[1] - 1))


def _shortcut_holds(model: nn.Module, batch: torch.Tensor, position: int, state: torch.Tensor) -> bool:
    """Whether starting behind ``position`` gives the whole pass's loss (a block may pass on more than h)."""
    reference = _loss_without(model, batch, position)
    try:
        loss = _loss_from(model, batch, position + 1, state)
    except Exception as err:  # any failure of the shortcut means: use whole passes
        logger.warning("removal passes: starting behind block %d failed (%s); measuring every set with whole "
                       "passes", position, err)
        return False
    if math.isclose(loss, reference, rel_tol=1e-4, abs_tol=1e-6):
        return True
    logger.warning("removal passes: starting behind block %d gives loss %.6f, the whole model %.6f; measuring "
                   "every set with whole passes", position, loss, reference)
    return False


def _measure(model: nn.Module, token_ids: torch.Tensor, positions: list[int], batch_size: int,
             state: dict) -> list[float]:
    """Perplexity of ``model`` with each block ``positions[i]`` removed, measured together (see removal_perplexities).

    ``state["plain"]``: whole passes only (set once a check fails); ``state["checked"]``: the check ran.
    """
    last = len(get_blocks(model)[1]) - 1
    behind = [p for p in positions if p < last]  # the last block has nothing behind it to start from
    nll, count = [0.0] * len(positions), 0
    for start in range(0, token_ids.shape[0], batch_size):
        batch = token_ids[start : start + batch_size].to(input_device(model))  # [batch, seq_len]
        states = None
        if not state["plain"] and len(behind) > 1:  # one candidate alone: a whole pass costs less than a capture
            states = states_entering(model, batch, max(behind))
            if states is None:
                logger.warning("removal passes: a block ran more than once; measuring every set with whole passes")
                state["plain"] = True
            elif not state["checked"]:
                state["checked"] = True  # the deepest candidate: the most blocks skipped, the strictest check
                state["plain"] = not _shortcut_holds(model, batch, max(behind), states[max(behind)])
            if state["plain"]:
                states = None
        for i, position in enumerate(positions):
            if states is None or position == last:
                loss = _loss_without(model, batch, position)
            else:
                loss = _loss_from(model, batch, position + 1, states[position])
            nll[i] += loss * batch.shape[0] * (batch.shape[1] - 1)
        count += batch.shape[0] * (batch.shape[1] - 1)  # every position but the first is a target
    return [math.exp(total / count) for total in nll]


def removal_perplexities(model: nn.Module, token_ids: torch.Tensor, base: Sequence[int], candidates: Sequence[int],
                         batch_size: int = 4, cache: dict | None = None, bar=None) -> dict[int, float]:
    """Calibration perplexity with the blocks ``base`` and one of ``candidates`` removed: candidate -> perplexity.

    Every block in front of a candidate computes what it computes with ``base`` alone removed. So each
    batch runs that model once, keeping the state entering every block up to the deepest candidate, and
    each candidate's pass starts at the block after it from the state that entered the candidate:
    transformers' own forward with the blocks in front skipped, so masks and positions are its own. A
    candidate costs the blocks behind it and the LM head, on average about half a pass. The first such
    pass, at the deepest candidate (the most blocks skipped), is checked against a whole pass; where they
    differ or it fails (a block that passes on more than its hidden state), every pass is a whole one.

    ``cache``: see :func:`removal_perplexity`; sets in it are not measured again, and new ones are added
    every ``CHUNK`` candidates. ``bar``: a tqdm advanced by one per candidate.
    """
    blocks = num_blocks(model)
    base = sorted(set(base))
    candidates = list(dict.fromkeys(candidates))
    wrong = [b for b in candidates if b in base or not 0 <= b < blocks]
    if wrong or any(not 0 <= b < blocks for b in base):
        raise ValueError(f"removal candidates {wrong} must be blocks of 0..{blocks - 1} outside the base {base}")
    keys = {block: tuple(sorted([*base, block])) for block in candidates}
    found = {block: cache[keys[block]] for block in candidates if cache is not None and keys[block] in cache}
    todo = [block for block in candidates if block not in found]
    if bar is not None:
        bar.update(len(found))
    if todo:
        state = {"plain": False, "checked": False}
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), blocks_removed(model, base) as kept:
                position = {block: i for i, block in enumerate(kept)}
                order = sorted(todo, key=lambda b: -position[b])  # deepest first: the check skips the most blocks
                for first in range(0, len(order), CHUNK):
                    chunk = order[first : first + CHUNK]
                    measured = _measure(model, token_ids, [position[b] for b in chunk], batch_size, state)
                    for block, ppl in zip(chunk, measured, strict=True):
                        found[block] = ppl
                        if cache is not None:
                            cache[keys[block]] = ppl
                    if bar is not None:
                        bar.update(len(chunk))
        finally:
            model.train(was_training)
    return {block: found[block] for block in candidates}


def removal_cache(memo: dict | None) -> dict | None:
    """The block-set -> perplexity cache inside a run's memo (``prune.pipeline.runner.Scored.memo``)."""
    return None if memo is None else memo.setdefault("removal-ppl", {})


def single_removal_perplexities(model: nn.Module, token_ids: torch.Tensor, batch_size: int = 4,
                                progress: bool = True, cache: dict | None = None) -> list[float]:
    """Calibration perplexity with each block alone removed (the model restored after)."""
    blocks = range(num_blocks(model))
    with tqdm(total=len(blocks), desc="oracle: remove each block", unit="block", disable=not progress) as bar:
        found = removal_perplexities(model, token_ids, [], blocks, batch_size, cache, bar)
    return [found[block] for block in blocks]


def _ranks(values: list[float]) -> torch.Tensor:
    """Ranks 1..n, ties sharing their mean rank."""
    x = torch.tensor(values, dtype=torch.float64)
    order = torch.argsort(x)
    ranks = torch.empty_like(x)
    ranks[order] = torch.arange(1, len(values) + 1, dtype=torch.float64)
    for value in torch.unique(x):
        tied = x == value
        if int(tied.sum()) > 1:
            ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman rank correlation (Pearson on tie-averaged ranks); NaN when either side is constant."""
    if len(a) != len(b):
        raise ValueError(f"spearman of {len(a)} and {len(b)} values")
    ra, rb = _ranks(a), _ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = torch.sqrt((ra * ra).sum() * (rb * rb).sum())
    return float((ra * rb).sum() / denominator) if denominator > 0 else float("nan")


def score_agreement(scores: dict[str, list[float]], removed: list[float]) -> dict[str, float]:
    """Each score's removability against the oracle's (lower perplexity after removal = more removable)."""
    target = [-p for p in removed]
    return {name: spearman(get_score(name).removability(values), target) for name, values in scores.items()}


def run_oracle(model: nn.Module, token_ids: torch.Tensor, scores: dict[str, list[float]], batch_size: int = 4,
               progress: bool = True, cache: dict | None = None) -> Oracle:
    """Dense and single-removal calibration perplexities, and every score's Spearman with them.

    ``cache``: see :func:`removal_perplexity`.
    """
    dense = removal_perplexity(model, token_ids, [], batch_size, cache)
    removed = single_removal_perplexities(model, token_ids, batch_size, progress, cache)
    return Oracle(dense, removed, score_agreement(scores, removed), int(token_ids.numel()))


def oracle_table(oracle: Oracle, scores: dict[str, list[float]] | None = None, repaired: dict | None = None) -> str:
    """Markdown: the Spearman of every score, then the perplexity with each block removed (with the scores).

    ``repaired`` (``prune.selection.repaired_order.repaired_oracle``) adds the "repaired" column: each block's
    perplexity when it alone is removed and repaired, and each ranking's Spearman with that.
    """
    lines = [f"Oracle: calibration perplexity with each block alone removed ({oracle.tokens} tokens; dense "
             f"{oracle.dense:.3f}). Spearman rank correlation of each score with it (+1 = ranks blocks as "
             "removal really hurts):", ""]
    if repaired is None:
        lines += ["| score | Spearman |", "|---|---:|"]
        lines += [f"| {name} | {rho:+.3f} |" for name, rho in sorted(oracle.spearman.items(), key=lambda kv: -kv[1])]
    else:
        dense = f"; dense {repaired['dense']:.3f} on them" if repaired.get("dense") else ""
        lines[0] += (f" The repaired column: the perplexity on the measuring rows (one calibration row in 8{dense}) "
                     f"with the block alone removed and repaired by --replace {repaired['method']}, fitted on the "
                     "other rows. Spearman with each:")
        lines[0] = lines[0].replace(" Spearman rank correlation of each score with it (+1 = ranks blocks as removal "
                                    "really hurts):", "")
        lines += ["| score | Spearman with removal | Spearman with repaired |", "|---|---:|---:|"]
        names = sorted(set(oracle.spearman) | set(repaired["spearman"]),
                       key=lambda n: -repaired["spearman"].get(n, float("-inf")))
        lines += [f"| {name} | {_signed(oracle.spearman.get(name))} | {_signed(repaired['spearman'].get(name))} |"
                  for name in names]
        lines.append(f"| removal (this oracle) | +1.000 | {_signed(repaired['spearman'].get('removal'))} |")
    names = list(scores or {})
    extra = " repaired ppl | map error |" if repaired is not None else ""
    lines += ["", "| block | ppl without it | x dense |" + extra + " " + " | ".join(names) + (" |" if names else ""),
              "|---:|---:|---:|" + ("---:|---:|" if repaired is not None else "") + "---:|" * len(names)]
    for block, ppl in enumerate(oracle.removed):
        cells = "".join(f" {scores[n][block]:.4f} |" for n in names)
        more = f" {repaired['ppl'][block]:.3f} | {repaired['map_error'][block]:.4f} |" if repaired is not None else ""
        lines.append(f"| {block} | {ppl:.3f} | {ppl / oracle.dense:.3f} |{more}{cells}")
    return "\n".join(lines)


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3f}"
