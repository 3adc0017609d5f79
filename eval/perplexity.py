"""Perplexity of a causal LM over one long token stream (the WikiText-2 protocol).

The text is tokenized once and cut into windows of ``seq_len`` tokens that start every ``stride``
tokens. Each token is scored exactly once, by the first window that holds it with context:

* ``stride == seq_len`` (the default): non-overlapping windows; the first token of every window has
  no context and is not scored, so a window of ``seq_len`` tokens scores ``seq_len - 1`` of them.
  With ``drop_last=True`` (the default) only full windows are used, the convention of the pruning
  and quantisation papers (GPTQ, SparseGPT, Wanda, ShortGPT, SLEB: ``n_windows = n_tokens // seq_len``),
  so our numbers compare with their tables.
* ``stride < seq_len``: a sliding window; after the first window, each window scores only its last
  ``stride`` tokens, which all have at least ``seq_len - stride`` tokens of context.

Perplexity is ``exp(total NLL / tokens scored)``; log-probabilities come from a float32
``log_softmax`` and are summed in float64.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from prune.adapters import input_device, max_positions
from prune.errors import LayercutError

logger = logging.getLogger(__name__)

DEFAULT_MAX_SEQ_LEN = 2048
# Positions whose log-softmax is taken at once: bounds the float32 copy of the logits.
_LOGPROB_CHUNK = 512
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
class _Window:
    """One forward pass: tokens ``[begin, end)``; targets at positions ``[score_from, end)`` are scored."""

    begin: int
    end: int
    score_from: int


def default_seq_len(model: torch.nn.Module) -> int:
    """Return ``min(2048, model maximum positions)``."""
    limit = max_positions(model)
    return DEFAULT_MAX_SEQ_LEN if limit is None else min(DEFAULT_MAX_SEQ_LEN, limit)


def plan_windows(n_tokens: int, seq_len: int, stride: int, *, drop_last: bool = True) -> list[_Window]:
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
    windows: list[_Window] = []
    scored_until = 0  # every target before this position is already scored
    for begin in range(0, n_tokens - 1, stride):
        end = min(begin + seq_len, n_tokens)
        if end - begin < seq_len and drop_last and windows:
            break
        windows.append(_Window(begin, end, max(scored_until, begin + 1)))
        scored_until = end
        if end == n_tokens:
            break
    return windows


def _window_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of -log p(target) per row, float64.

    Args:
        logits: ``[batch, n, vocab]`` predictions for the targets.
        targets: ``[batch, n]`` token ids.

    Returns:
        ``[batch]`` summed NLL.
    """
    total = torch.zeros(logits.shape[0], dtype=torch.float64, device=logits.device)
    targets = targets.to(logits.device)
    for start in range(0, logits.shape[1], _LOGPROB_CHUNK):
        chunk = logits[:, start : start + _LOGPROB_CHUNK].float()  # [batch, chunk, vocab]
        logprobs = torch.log_softmax(chunk, dim=-1)
        picked = logprobs.gather(-1, targets[:, start : start + _LOGPROB_CHUNK, None]).squeeze(-1)  # [batch, chunk]
        total -= picked.double().sum(dim=1)
    return total


def _batches(windows: list[_Window], batch_size: int) -> list[list[_Window]]:
    """Group consecutive windows of equal shape into batches of at most ``batch_size``."""
    batches: list[list[_Window]] = []
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


@torch.inference_mode()
def _score_batch(model: torch.nn.Module, token_ids: torch.Tensor, batch: list[_Window]) -> float:
    """Run one batch of equally shaped windows and return their summed NLL."""
    device = input_device(model)
    inputs = torch.stack([token_ids[w.begin : w.end] for w in batch]).to(device)  # [batch, window]
    logits = model(input_ids=inputs, use_cache=False).logits  # [batch, window, vocab]
    first = batch[0]
    # Position p predicts token p + 1: the logits for targets [score_from, end) sit at [score_from - 1, end - 1).
    lo, hi = first.score_from - 1 - first.begin, first.end - 1 - first.begin
    targets = inputs[:, lo + 1 : hi + 1]  # [batch, n_scored]
    return float(_window_nll(logits[:, lo:hi], targets).sum())


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
    if token_ids.dim() != 1:
        raise LayercutError(f"token_ids must be a 1-D tensor of token ids, got shape {tuple(token_ids.shape)}")
    if batch_size < 1:
        raise LayercutError(f"batch_size must be at least 1, got {batch_size}")
    if max_tokens is not None:
        if max_tokens < 2:
            raise LayercutError(f"max_tokens must be at least 2, got {max_tokens}")
        token_ids = token_ids[:max_tokens]
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
    token_ids = token_ids.long().cpu()
    total_nll, scored = 0.0, sum(w.end - w.score_from for w in windows)
    was_training = model.training
    model.eval()  # dropout would make the number random
    try:
        bar = tqdm(total=len(windows), desc="perplexity", unit="window", disable=not progress)
        for batch in _batches(windows, batch_size):
            total_nll += _score_batch(model, token_ids, batch)
            bar.update(len(batch))
        bar.close()
    finally:
        model.train(was_training)
    nll = total_nll / scored
    logger.info(
        "perplexity %.4f over %d tokens (%d windows of %d, stride %d)",
        math.exp(nll),
        scored,
        len(windows),
        seq_len,
        stride,
    )
    return PerplexityResult(math.exp(nll), nll, scored, seq_len, stride, len(windows))


def tokenize_text(tokenizer, text: str) -> torch.Tensor:
    """Tokenize a long text the standard way (the tokenizer's own special tokens, e.g. a leading BOS).

    Returns:
        1-D LongTensor of token ids.
    """
    # verbose=False: the "longer than model_max_length" warning is expected, we cut windows ourselves.
    encoded = tokenizer(text, return_tensors="pt", verbose=False)
    return encoded["input_ids"][0]  # [n_tokens]


def text_perplexity(model: torch.nn.Module, tokenizer, text: str, **kw) -> PerplexityResult:
    """Tokenize ``text`` and return :func:`perplexity` over it; ``kw`` goes to :func:`perplexity`."""
    if not text:
        raise LayercutError("the text to score is empty; pass a non-empty text")
    return perplexity(model, tokenize_text(tokenizer, text), **kw)


def _hf_rows_from_raw(raw: str) -> list[str]:
    """Rebuild the rows of the HF ``wikitext`` dataset from a ``.raw`` file.

    The HF loader yields one row per line; a blank line (a single space in the ``.raw`` file) becomes
    ``""`` and every other line keeps its trailing newline. Checked byte for byte against the HF rows.
    """
    lines = raw.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the file ends with a newline
    return ["" if not line.strip() else line + "\n" for line in lines]


def wikitext2_test_text(data_dir: str | Path) -> str:
    r"""Return the WikiText-2 raw test text as the standard protocol joins it.

    The standard text (GPTQ, SparseGPT, Wanda, HF's perplexity guide) is ``"\n\n".join(rows)`` of the
    HF ``wikitext-2-raw-v1`` test rows, which differs from the ``.raw`` file itself (blank lines and
    the joiner). We rebuild the rows from ``wikitext-2-raw-v1/wiki.test.raw`` and join them, giving the
    same 1,296,370 bytes as the HF route.

    Args:
        data_dir: The data root holding ``wikitext-2-raw-v1/``, or that folder itself.

    Returns:
        The joined test text.
    """
    root = Path(data_dir)
    candidates = [root / WIKITEXT2_DIR / WIKITEXT2_TEST_FILE, root / WIKITEXT2_TEST_FILE]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise LayercutError(
            f"no {WIKITEXT2_DIR}/{WIKITEXT2_TEST_FILE} under {root}; put the WikiText-2 raw test file there "
            "or leave out --data-dir to load it through the datasets library"
        )
    raw = path.read_text(encoding="utf-8")
    return "\n\n".join(_hf_rows_from_raw(raw))


def wikitext2_rows_from_jsonl(path: str | Path) -> list[str]:
    """Read HF-style rows (``{"text": ...}`` per line), e.g. ``wikitext-2-raw-v1/test.jsonl``."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line)["text"] for line in handle if line.strip()]


def load_wikitext2_test(data_dir: str | Path | None = None) -> str:
    """Return the joined WikiText-2 test text from ``data_dir``, or through ``datasets`` when it is None."""
    if data_dir is not None:
        return wikitext2_test_text(data_dir)
    try:
        import datasets

        rows = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"]
    except Exception as err:  # offline, no cache, hub error: all mean "give us the file"
        raise LayercutError(
            f"could not load wikitext-2-raw-v1 through datasets ({type(err).__name__}); "
            f"pass --data-dir pointing at a folder with {WIKITEXT2_DIR}/{WIKITEXT2_TEST_FILE}"
        ) from err
    return "\n\n".join(rows)
