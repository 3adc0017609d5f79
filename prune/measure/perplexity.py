"""Perplexity of a causal LM over one token stream: the one implementation every tool uses.

The stream is cut into windows of ``seq_len`` tokens that start every ``stride`` tokens. Each token is
scored exactly once, by the first window that holds it with context:

* ``stride == seq_len`` (the default): non-overlapping windows; the first token of every window has
  no context and is not scored, so a window of ``seq_len`` tokens scores ``seq_len - 1`` of them.
  With ``drop_last=True`` (the default) only full windows are used, the convention of the pruning
  and quantisation papers (GPTQ, SparseGPT, Wanda, ShortGPT, SLEB: ``n_windows = n_tokens // seq_len``),
  so our numbers compare with their tables. Packed sequences ``[n, seq_len]`` are such a stream
  (:func:`prune.measure.heldout.packed_perplexity`).
* ``stride < seq_len``: a sliding window; after the first window, each window scores only its last
  ``stride`` tokens, which all have at least ``seq_len - stride`` tokens of context.

Perplexity is ``exp(total NLL / tokens scored)``; log-probabilities come from a float32
``log_softmax`` and are summed in float64. ``eval.quality.perplexity`` adds the WikiText-2 protocol on top.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from prune.errors import LayercutError
from prune.model.adapters import input_device, max_positions
from prune.model.head import HeadOutputs

logger = logging.getLogger(__name__)

DEFAULT_MAX_SEQ_LEN = 2048
# Positions of one row whose log-softmax is taken at once: bounds the float32 temporaries beside the logits. The
# chunks are a row's, contiguous in memory: torch's CPU log_softmax over a slice across the rows of a batch ran 6x
# slower (2026-12-05, float32 [4, 64, 262144] on 2 threads: 0.54 s, against 0.085 s a row at a time), which made
# the vocabulary-wide work most of Gemma-3-270M's held-out perplexity and shortlist measures.
LOGPROB_POSITIONS = 128
WIKITEXT2_DIR = "wikitext-2-raw-v1"
WIKITEXT2_TEST_FILE = "wiki.test.raw"


@dataclass
class PerplexityResult:
    """Outcome of :func:`perplexity`.

    Attributes:
        perplexity: ``exp(nll)``.
        nll: Mean negative log-likelihood per scored token, in nats.
        tokens_scored: Number of tokens whose log-probability entered the mean.
        seq_len: Window length used.
        stride: Step between window starts.
        windows: Number of forward passes (windows) run.
    """

    perplexity: float
    nll: float
    tokens_scored: int
    seq_len: int
    stride: int
    windows: int

    def to_dict(self) -> dict[str, float | int]:
        """Return the fields as a JSON-ready dict."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class Window:
    """One forward pass: tokens ``[begin, end)``; targets at positions ``[score_from, end)`` are scored."""

    begin: int
    end: int
    score_from: int


def default_seq_len(model: torch.nn.Module) -> int:
    """Return ``min(2048, model maximum positions)``."""
    limit = max_positions(model)
    return DEFAULT_MAX_SEQ_LEN if limit is None else min(DEFAULT_MAX_SEQ_LEN, limit)


def plan_windows(n_tokens: int, seq_len: int, stride: int, *, drop_last: bool = True) -> list[Window]:
    """Cut ``n_tokens`` into windows so that every scored token is scored exactly once.

    Args:
        n_tokens: Length of the token stream.
        seq_len: Window length.
        stride: Step between window starts, ``1 <= stride <= seq_len``.
        drop_last: Leave out the final window when it is shorter than ``seq_len``. A stream shorter
            than one window is always scored as a single window.

    Returns:
        Windows in order; targets scored are ``[score_from, end)`` of the stream.
    """
    if not 1 <= stride <= seq_len:
        raise LayercutError(f"stride must be between 1 and seq_len ({seq_len}), got {stride}")
    if n_tokens < 2:
        raise LayercutError(f"need at least 2 tokens to measure perplexity, got {n_tokens}")
    windows: list[Window] = []
    scored_until = 0  # every target before this position is already scored
    for begin in range(0, n_tokens - 1, stride):
        end = min(begin + seq_len, n_tokens)
        if end - begin < seq_len and drop_last and windows:
            break
        windows.append(Window(begin, end, max(scored_until, begin + 1)))
        scored_until = end
        if end == n_tokens:
            break
    return windows


def row_chunks(rows: int, positions: int, size: int = LOGPROB_POSITIONS) -> Iterator[tuple[int, slice]]:
    """``(row, positions)`` pieces covering ``rows`` x ``positions``, at most ``size`` positions of one row each.

    A piece of a ``[batch, n, vocab]`` tensor whose rows are contiguous is contiguous itself: the vocabulary-wide
    work on logits runs a piece at a time (:data:`LOGPROB_POSITIONS`).
    """
    for row in range(rows):
        for start in range(0, positions, size):
            yield row, slice(start, min(start + size, positions))


def log_prob_chunks(logits: torch.Tensor | HeadOutputs,
                    size: int = LOGPROB_POSITIONS) -> Iterator[tuple[int, slice, torch.Tensor]]:
    """``(row, positions, log-probabilities)`` of ``logits`` [batch, n, vocab], a row's chunk at a time, float32.

    Every chunk is written into one buffer: a caller is done with a chunk's log-probabilities when it asks for the
    next. A fresh vocabulary-wide tensor for each chunk cost more than the log-softmax itself on this project's
    2-core machine whenever the process held a few GB (its pages are faulted in anew each time: 13.3 ns an element
    against 0.58 written into one buffer, [128, 262144] float32, 2026-12-05); 16-bit logits are turned into float32
    in a second one. Logits left to the head (:class:`~prune.model.head.HeadOutputs`) are made a chunk at a time
    and land in that second one (a 16-bit head's product goes through a temporary of the chunk's size first): the
    batch's whole logits never exist. Not differentiable (``out=``): for measuring only.
    """
    rows, positions, vocab = logits.shape
    made = isinstance(logits, HeadOutputs)
    buffer = torch.empty(min(size, positions), vocab, dtype=torch.float32, device=logits.device)
    staging = None if logits.dtype == torch.float32 and not made else torch.empty_like(buffer)
    for row, span in row_chunks(rows, positions, size):
        out = buffer[: span.stop - span.start]
        if made:
            chunk = logits.chunk(row, span, staging[: span.stop - span.start])
        else:
            chunk = logits[row, span]
            if staging is not None:
                chunk = staging[: span.stop - span.start].copy_(chunk)
        torch.log_softmax(chunk, dim=-1, out=out)
        yield row, span, out


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of -log p(target) per row, float64 (log-softmax in float32, a row's chunk of positions at a time).

    No gradient flows through it (:func:`log_prob_chunks`).

    Args:
        logits: ``[batch, n, vocab]`` predictions for the targets.
        targets: ``[batch, n]`` token ids.

    Returns:
        ``[batch]`` summed NLL.
    """
    total = torch.zeros(logits.shape[0], dtype=torch.float64, device=logits.device)
    targets = targets.to(logits.device)
    for row, span, logprobs in log_prob_chunks(logits):
        total[row] += target_nll(logprobs[None], targets[row, span][None])[0]
    return total


def target_nll(logprobs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of -log p(target) per row, float64, from log-probabilities a caller already holds.

    Args:
        logprobs: ``[batch, n, vocab]`` float32 log-softmax of the predictions for the targets.
        targets: ``[batch, n]`` token ids.

    Returns:
        ``[batch]`` summed NLL.
    """
    picked = logprobs.gather(-1, targets.to(logprobs.device)[..., None]).squeeze(-1)  # [batch, n]
    return -picked.double().sum(dim=1)


def _batches(windows: list[Window], batch_size: int) -> list[list[Window]]:
    """Group consecutive windows of equal shape into batches of at most ``batch_size``."""
    batches: list[list[Window]] = []
    for window in windows:
        last = batches[-1] if batches else None
        same_shape = last is not None and (last[0].end - last[0].begin, last[0].end - last[0].score_from) == (
            window.end - window.begin,
            window.end - window.score_from,
        )
        if same_shape and len(last) < batch_size:
            last.append(window)
        else:
            batches.append([window])
    return batches


# no_grad rather than inference_mode: a prune run measures a model it goes on to train (distillation), and a
# tensor some module caches during an inference-mode pass could never be saved for backward afterwards
@torch.no_grad()
def _score_batch(model: torch.nn.Module, token_ids: torch.Tensor, batch: list[Window]) -> float:
    """Run one batch of equally shaped windows and return their summed NLL."""
    device = input_device(model)
    inputs = torch.stack([token_ids[w.begin : w.end] for w in batch]).to(device)  # [batch, window]
    logits = model(input_ids=inputs, use_cache=False).logits  # [batch, window, vocab]
    first = batch[0]
    # Position p predicts token p + 1: the logits for targets [score_from, end) sit at [score_from - 1, end - 1).
    lo, hi = first.score_from - 1 - first.begin, first.end - 1 - first.begin
    targets = inputs[:, lo + 1 : hi + 1]  # [batch, n_scored]
    return float(token_nll(logits[:, lo:hi], targets).sum())


def stream_nll(model: torch.nn.Module, token_ids: torch.Tensor, windows: list[Window], batch_size: int,
               on_batch: Callable[[int], object] | None = None) -> float:
    """Summed NLL of the targets ``windows`` score in ``token_ids`` [n_tokens], the model in eval mode meanwhile.

    Args:
        model: A causal LM returning ``.logits``.
        token_ids: The stream the windows index.
        windows: From :func:`plan_windows`.
        batch_size: Windows per forward pass (consecutive windows of equal shape share one).
        on_batch: Called with the number of windows after each forward pass (a progress bar's ``update``).
    """
    token_ids = token_ids.long().cpu()
    total = 0.0
    was_training = model.training
    model.eval()  # dropout would make the number random
    try:
        for batch in _batches(windows, batch_size):
            total += _score_batch(model, token_ids, batch)
            if on_batch is not None:
                on_batch(len(batch))
    finally:
        model.train(was_training)
    return total


def _checked_stream(token_ids: torch.Tensor, batch_size: int, max_tokens: int | None) -> torch.Tensor:
    """``token_ids`` cut to ``max_tokens``, after a one-line error for a bad argument of :func:`perplexity`."""
    if token_ids.dim() != 1:
        raise LayercutError(f"token_ids must be a 1-D tensor of token ids, got shape {tuple(token_ids.shape)}")
    if batch_size < 1:
        raise LayercutError(f"batch_size must be at least 1, got {batch_size}")
    if max_tokens is None:
        return token_ids
    if max_tokens < 2:
        raise LayercutError(f"max_tokens must be at least 2, got {max_tokens}")
    return token_ids[:max_tokens]


def perplexity(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    *,
    seq_len: int | None = None,
    stride: int | None = None,
    batch_size: int = 1,
    progress: bool = True,
    drop_last: bool = True,
    max_tokens: int | None = None,
) -> PerplexityResult:
    """Measure the perplexity of ``model`` on one token stream.

    Args:
        model: A causal LM returning ``.logits`` (any device, dtype or device map).
        token_ids: 1-D LongTensor, the whole tokenized text.
        seq_len: Window length; default ``min(2048, model maximum positions)``, clipped to the stream.
        stride: Step between windows; default ``seq_len`` (non-overlapping windows).
        batch_size: Windows per forward pass.
        progress: Show a tqdm bar.
        drop_last: Leave out a final partial window (see the module docstring).
        max_tokens: Score only the first this many tokens of the stream (None: all).

    Returns:
        The perplexity, mean NLL and counts.
    """
    token_ids = _checked_stream(token_ids, batch_size, max_tokens)
    n_tokens = token_ids.numel()
    seq_len = seq_len or default_seq_len(model)
    limit = max_positions(model)
    if limit is not None and seq_len > limit:
        raise LayercutError(f"seq_len {seq_len} exceeds the model's maximum of {limit} positions; lower it")
    stride = stride or seq_len
    if seq_len > n_tokens:
        logger.warning("text has only %d tokens, fewer than seq_len %d: using one window", n_tokens, seq_len)
        seq_len, stride = n_tokens, min(stride, n_tokens)
    windows = plan_windows(n_tokens, seq_len, stride, drop_last=drop_last)
    scored = sum(w.end - w.score_from for w in windows)
    with tqdm(total=len(windows), desc="perplexity", unit="window", disable=not progress) as bar:
        total_nll = stream_nll(model, token_ids, windows, batch_size, bar.update)
    nll = total_nll / scored
    logger.info("perplexity %.4f over %d tokens (%d windows of %d, stride %d)", math.exp(nll), scored, len(windows),
                seq_len, stride)
    return PerplexityResult(math.exp(nll), nll, scored, seq_len, stride, len(windows))
