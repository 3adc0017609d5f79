"""Tokenizer checks that read no weights: which files make a saved tokenizer, and the pad token batching needs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from prune.errors import LayercutError

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedTokenizerBase

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def set_pad_token(tokenizer: PreTrainedTokenizerBase) -> None:
    """Give the tokenizer a pad token (batching needs one): its EOS token, else UNK/BOS."""
    if tokenizer.pad_token is not None:
        return
    fallback = tokenizer.eos_token or tokenizer.unk_token or tokenizer.bos_token
    if fallback is None:
        raise LayercutError("the tokenizer has no pad, eos, unk or bos token: save one with a pad token set")
    tokenizer.pad_token = fallback


def has_tokenizer_files(folder: str | Path) -> bool:
    """Whether ``folder`` holds a saved tokenizer."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def check_tokenizer(name: str, tokenizer: str | None = None) -> None:
    """Fail in one line when ``name`` is a folder without tokenizer files and no ``tokenizer`` is given."""
    folder = Path(name).expanduser()
    if tokenizer is None and folder.is_dir() and not has_tokenizer_files(folder):
        raise LayercutError(
            f"model folder {name} has no tokenizer files; save one with tokenizer.save_pretrained(folder) "
            "or pass --tokenizer NAME"
        )



def check_vocabulary(tokenizer: PreTrainedTokenizerBase, model: nn.Module) -> None:
    """Refuse a tokenizer whose ids run past the model's embedding rows, in one line before any pass.

    Such ids index outside the embedding: an ``IndexError`` deep in torch on the first batch (or, on a GPU, a device
    assert). A model may hold more rows than its tokenizer has tokens (padded for speed); fewer is another
    model's tokenizer.
    """
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embedding, "num_embeddings", None)
    try:
        size = len(tokenizer)
    except TypeError:  # not a transformers tokenizer: nothing to count
        return
    if isinstance(rows, int) and size > rows:
        raise LayercutError(f"the tokenizer has {size:,} tokens and the model's embedding {rows:,} rows (ids "
                            f"{rows:,} and above would index past it): pass the model's own tokenizer")
