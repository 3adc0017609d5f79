"""``prune.data.windows``: one way text becomes token windows, and every caller's windows as they were before it.

Each reference below is the tokenizing code a caller ran before it went through ``prune.data.windows``,
kept here as the plain reference the shared function must reproduce token for token.
"""

import json
import random

import pytest
import torch
from tokenizers.processors import TemplateProcessing

from eval.lens.pipeline import LensConfig, _token_windows
from eval.mapfit import text_sequences
from eval.quality.perplexity import tokenize_text
from prune.data.calibration import _pack
from prune.data.windows import cut_windows, encode, text_windows, token_stream
from tests.helpers import make_tiny_tokenizer

DOCUMENTS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune. " * 3,
    "However little known the feelings or views of such a man may be. " * 5,
    "This truth is so well fixed in the minds of the surrounding families. " * 2,
    "He is considered the rightful property of some one or other of their daughters. " * 4,
]


def bos_tokenizer():
    """The tiny tokenizer, made to put BOS first as Llama's does (the conftest one adds no special token)."""
    tokenizer = make_tiny_tokenizer()
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tokenizer.bos_token_id)])
    return tokenizer


@pytest.fixture(params=["plain", "bos"], scope="module")
def tokenizer(request):
    return make_tiny_tokenizer() if request.param == "plain" else bos_tokenizer()


def old_pack(documents, tokenizer, samples, heldout_samples, seq_len, seed):
    """``prune.data.calibration._pack`` before ``prune.data.windows``."""
    rng = random.Random(seed)
    order = list(range(len(documents)))
    rng.shuffle(order)
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream = []
    for index in order:
        stream += tokenizer(documents[index], add_special_tokens=False, verbose=False)["input_ids"] + separator
        if len(stream) >= 2 * samples * seq_len:
            break
    windows = len(stream) // seq_len
    chosen = sorted(rng.sample(range(windows), samples))
    rest = sorted(set(range(windows)) - set(chosen))
    heldout = sorted(rng.sample(rest, min(heldout_samples, len(rest))))
    ids = torch.tensor(stream[: windows * seq_len], dtype=torch.long).view(windows, seq_len)
    return ids[chosen], ids[heldout]


def old_lens_windows(documents, tokenizer, seq_len, limit):
    """``eval.lens.pipeline._token_windows`` before ``prune.data.windows`` (after reading the documents)."""
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream = []
    for document in documents:
        stream += tokenizer(document, add_special_tokens=False, verbose=False)["input_ids"] + separator
        if len(stream) >= limit:
            break
    windows = len(stream) // seq_len
    return torch.tensor(stream[: windows * seq_len], dtype=torch.long).view(windows, seq_len)


def old_mapfit_sequences(documents, tokenizer, seq_len, max_tokens):
    """``eval.mapfit.text_sequences`` before ``prune.data.windows`` (after reading the documents)."""
    sequences, total = [], 0
    if len(documents) == 1:
        ids = torch.tensor(tokenizer(documents[0])["input_ids"], dtype=torch.long)
        for start in range(0, ids.numel() - seq_len + 1, seq_len):
            if total >= max_tokens:
                break
            sequences.append(ids[start : start + seq_len])
            total += seq_len
    else:
        for document in documents:
            if total >= max_tokens:
                break
            ids = torch.tensor(tokenizer(document)["input_ids"][:seq_len], dtype=torch.long)
            if ids.numel() >= 2:
                sequences.append(ids)
                total += ids.numel()
    return sequences


def old_tokenize_text(tokenizer, text):
    """``eval.quality.perplexity.tokenize_text`` before ``prune.data.windows``."""
    return tokenizer(text, return_tensors="pt", verbose=False)["input_ids"][0]


@pytest.mark.parametrize(("samples", "heldout", "seq_len", "seed"), [(4, 2, 16, 0), (3, 8, 7, 5), (1, 0, 32, "x")])
def test_calibration_windows_are_those_of_before(tokenizer, samples, heldout, seq_len, seed):
    new = _pack(DOCUMENTS, tokenizer, samples, heldout, seq_len, seed, "calibration text")
    old = old_pack(DOCUMENTS, tokenizer, samples, heldout, seq_len, seed)
    assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])
    assert new[0].shape == (samples, seq_len) and new[0].dtype == torch.long


@pytest.mark.parametrize(("seq_len", "limit"), [(16, 40), (9, 10**9), (32, 1)])
def test_lens_windows_are_those_of_before(tokenizer, tmp_path, seq_len, limit):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCUMENTS), encoding="utf-8")
    new, _ = _token_windows(str(path), tokenizer, LensConfig(seq_len=seq_len), limit)
    assert torch.equal(new, old_lens_windows(DOCUMENTS, tokenizer, seq_len, limit))
    assert new.shape[0] > 0


@pytest.mark.parametrize(("seq_len", "max_tokens"), [(16, 40), (8, 10**6), (16, 0), (20, 16)])
def test_mapfit_sequences_are_those_of_before(tokenizer, tmp_path, seq_len, max_tokens):
    one = tmp_path / "one.txt"
    one.write_text("".join(DOCUMENTS), encoding="utf-8")
    several = tmp_path / "several.jsonl"
    several.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCUMENTS), encoding="utf-8")
    for path, documents in ((one, ["".join(DOCUMENTS)]), (several, DOCUMENTS)):
        old = old_mapfit_sequences(documents, tokenizer, seq_len, max_tokens)
        if not old:  # then as before: a one-line error
            with pytest.raises(Exception, match="gives no sequence"):
                text_sequences(tokenizer, str(path), seq_len, max_tokens)
            continue
        new, _ = text_sequences(tokenizer, str(path), seq_len, max_tokens)
        assert len(new) == len(old) and all(torch.equal(a, b) for a, b in zip(new, old, strict=True))


def test_perplexity_stream_is_that_of_before(tokenizer):
    text = "\n\n".join(DOCUMENTS)
    new = tokenize_text(tokenizer, text)
    assert torch.equal(new, old_tokenize_text(tokenizer, text)) and new.dtype == torch.long


def test_the_special_token_rule():
    tokenizer = bos_tokenizer()
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    plain = [tokenizer(d, add_special_tokens=False)["input_ids"] for d in DOCUMENTS[:2]]
    # packed text (the default): no BOS, EOS after every document, the last included
    assert token_stream(tokenizer, DOCUMENTS[:2]).tolist() == plain[0] + [eos] + plain[1] + [eos]
    # the tokenizer's own special tokens: BOS before each document, no EOS added
    assert token_stream(tokenizer, DOCUMENTS[:2], special_tokens=True).tolist() == [bos] + plain[0] + [bos] + plain[1]
    assert encode(tokenizer, DOCUMENTS[0], special_tokens=True) == [bos] + plain[0]
    # limit: documents stop once the stream holds that many tokens, the one crossing it kept whole
    assert token_stream(tokenizer, DOCUMENTS, limit=1).tolist() == plain[0] + [eos]


def test_windows_are_consecutive_and_drop_the_partial_rest():
    stream = torch.arange(23)
    windows = cut_windows(stream, 5)
    assert windows.shape == (4, 5) and torch.equal(windows.reshape(-1), stream[:20])
    assert cut_windows(torch.arange(3), 5).shape == (0, 5)
    tokenizer = make_tiny_tokenizer()
    expected = cut_windows(token_stream(tokenizer, DOCUMENTS), 6)
    assert torch.equal(text_windows(tokenizer, DOCUMENTS, 6), expected)
