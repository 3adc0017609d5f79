"""Text to token windows: the one place text becomes the sequences a model reads.

Every tool goes through :func:`token_stream` (documents to one stream of ids) and :func:`text_windows`
(that stream cut into non-overlapping windows of ``seq_len``; a partial last window is left out).

The rule for special tokens:

* By default (``special_tokens=False``), a document is tokenized **without** the tokenizer's special
  tokens and followed by the EOS token (when the tokenizer has one). This is packed text: documents
  run into each other, EOS marks where one ends, and no BOS appears in the middle of a window.
  Calibration (``prune.data.calibration``), its held-out sequences and the lens read text this way.
* ``special_tokens=True`` tokenizes each document as ``tokenizer(text)`` does, with the tokenizer's own
  special tokens (a leading BOS for Llama-family tokenizers, nothing for GPT-2's), and adds no EOS.
  This is the WikiText-2 perplexity protocol (GPTQ, SparseGPT, Wanda and transformers' perplexity
  guide score ``tokenizer(text)``), used by ``eval.quality.perplexity``, and what ``eval.mapfit`` measures its
  ``--heldout`` texts on. Their reported figures were measured this way; switching them to the
  default rule would move every one of them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def encode(tokenizer, text: str, *, special_tokens: bool = False) -> list[int]:
    """Token ids of one document, with the tokenizer's special tokens or without (see the module docstring)."""
    # verbose=False: a whole book is longer than model_max_length by design; windows are cut afterwards
    return tokenizer(text, add_special_tokens=special_tokens, verbose=False)["input_ids"]


def token_stream(tokenizer, documents: Iterable[str], *, special_tokens: bool = False,
                 limit: int | None = None) -> torch.Tensor:
    """The documents, in the order given, as one stream of token ids.

    Args:
        tokenizer: the model's tokenizer.
        documents: texts, read lazily and in order.
        special_tokens: the module docstring's rule: False joins documents tokenized without special
            tokens by EOS; True keeps each document's own special tokens and adds no separator.
        limit: stop reading documents once the stream holds at least this many tokens (None: read all).

    Returns:
        ``[n_tokens]`` int64 token ids.
    """
    separator = []
    if not special_tokens and tokenizer.eos_token_id is not None:
        separator = [tokenizer.eos_token_id]
    stream: list[int] = []
    for document in documents:
        stream += encode(tokenizer, document, special_tokens=special_tokens) + separator
        if limit is not None and len(stream) >= limit:  # enough to choose from without reading everything
            break
    return torch.tensor(stream, dtype=torch.long)  # [n_tokens]


def cut_windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``stream`` [n_tokens] as ``[n_tokens // seq_len, seq_len]`` consecutive windows; the partial rest is left out."""
    windows = stream.numel() // seq_len
    return stream[: windows * seq_len].view(windows, seq_len)


def text_windows(tokenizer, documents: Iterable[str], seq_len: int, *, special_tokens: bool = False,
                 limit: int | None = None) -> torch.Tensor:
    """The documents as ``[windows, seq_len]`` token ids: :func:`token_stream` cut by :func:`cut_windows`."""
    return cut_windows(token_stream(tokenizer, documents, special_tokens=special_tokens, limit=limit), seq_len)
