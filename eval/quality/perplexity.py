"""The WikiText-2 perplexity protocol: the text tokenized once as the papers do, scored by ``prune.measure.perplexity``.

The windows, the scoring and :class:`PerplexityResult` are :mod:`prune.measure.perplexity`'s (described in its
module docstring) and are imported from here as before. The text is tokenized with the tokenizer's own
special tokens (a leading BOS for Llama-family tokenizers): ``special_tokens=True`` in
:mod:`prune.data.windows`, the protocol of GPTQ, SparseGPT, Wanda and transformers' perplexity guide.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from prune.data.windows import token_stream
from prune.errors import LayercutError
from prune.measure.perplexity import DEFAULT_MAX_SEQ_LEN, PerplexityResult, default_seq_len, perplexity, plan_windows

__all__ = [
    "DEFAULT_MAX_SEQ_LEN",
    "PerplexityResult",
    "default_seq_len",
    "load_wikitext2_test",
    "perplexity",
    "plan_windows",
    "text_perplexity",
    "tokenize_text",
    "wikitext2_rows_from_jsonl",
    "wikitext2_test_text",
]

WIKITEXT2_DIR = "wikitext-2-raw-v1"
WIKITEXT2_TEST_FILE = "wiki.test.raw"


def tokenize_text(tokenizer, text: str) -> torch.Tensor:
    """Tokenize a long text the standard way (the tokenizer's own special tokens, e.g. a leading BOS).

    Returns:
        1-D LongTensor of token ids.
    """
    # special tokens kept: the published WikiText-2 figures score tokenizer(text), BOS included
    return token_stream(tokenizer, [text], special_tokens=True)  # [n_tokens]


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
