import hashlib
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from eval.quality.perplexity import (
    PerplexityResult,
    _hf_rows_from_raw,
    perplexity,
    plan_windows,
    text_perplexity,
    wikitext2_rows_from_jsonl,
    wikitext2_test_text,
)
from prune.errors import LayercutError
from prune.measure.heldout import batch_loss, packed_perplexity

DATA = Path(__file__).resolve().parents[4] / "shared" / "data"
VOCAB = 97


def tiny_llama(max_positions: int = 64, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
    )
    model = AutoModelForCausalLM.from_config(config)
    # Random init is close to uniform; scale the head so the test distinguishes positions.
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model.eval()


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def tokens():
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (50,), generator=generator)  # [n_tokens]


def reference_nll(model, tokens, seq_len, stride, n_scored_until):
    """Token by token: target t is predicted from a fresh forward over its window's prefix, no cache."""
    total, count = 0.0, 0
    for t in range(1, n_scored_until):
        # The window that scores t starts at 0 for t < seq_len, else at the k-th stride with k = (t - L) // s + 1.
        begin = 0 if t < seq_len else ((t - seq_len) // stride + 1) * stride
        if stride == seq_len and t % seq_len == 0:
            continue  # non-overlapping windows: a window's first token has no context and is not scored
        with torch.no_grad():
            logits = model(input_ids=tokens[None, begin:t], use_cache=False).logits[0, -1]  # [vocab]
        total -= float(torch.log_softmax(logits.float(), dim=-1)[tokens[t]])
        count += 1
    return total / count, count


@pytest.mark.parametrize(
    ("seq_len", "stride", "drop_last", "scored_until"),
    [(16, 16, True, 48), (16, 16, False, 50), (16, 5, True, 46), (16, 5, False, 50), (50, 50, True, 50)],
)
def test_perplexity_equals_token_by_token_reference(model, tokens, seq_len, stride, drop_last, scored_until):
    result = perplexity(model, tokens, seq_len=seq_len, stride=stride, drop_last=drop_last, progress=False)
    nll, count = reference_nll(model, tokens, seq_len, stride, scored_until)
    assert result.tokens_scored == count
    assert result.nll == pytest.approx(nll, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(nll), rel=1e-5)
    assert result.seq_len == seq_len and result.stride == stride


def test_non_overlapping_counts(model, tokens):
    result = perplexity(model, tokens, seq_len=16, progress=False)
    assert (result.windows, result.tokens_scored, result.stride) == (3, 3 * 15, 16)


def test_batching_does_not_change_the_number(model, tokens):
    one = perplexity(model, tokens, seq_len=8, stride=4, progress=False)
    many = perplexity(model, tokens, seq_len=8, stride=4, batch_size=3, progress=False)
    assert many.tokens_scored == one.tokens_scored == 47  # the partial window [44, 50) is dropped
    assert many.nll == pytest.approx(one.nll, rel=1e-6)


def test_default_seq_len_is_model_maximum_and_clipped_to_text(model, tokens):
    result = perplexity(tiny_llama(max_positions=32), tokens, progress=False)
    assert (result.seq_len, result.windows, result.tokens_scored) == (32, 1, 31)
    short = perplexity(model, tokens[:10], progress=False)
    assert (short.seq_len, short.tokens_scored) == (10, 9)


def test_plan_windows_scores_each_target_once():
    for n, seq_len, stride in [(100, 16, 16), (100, 16, 3), (37, 10, 7), (5, 10, 10)]:
        windows = plan_windows(n, seq_len, stride, drop_last=False)
        targets = [t for w in windows for t in range(w.score_from, w.end)]
        assert len(targets) == len(set(targets))
        if stride < seq_len:
            assert targets == list(range(1, n))
        assert all(w.end - w.begin <= seq_len and w.score_from > w.begin for w in windows)


def test_bad_arguments(model, tokens):
    with pytest.raises(LayercutError, match="stride"):
        perplexity(model, tokens, seq_len=8, stride=9, progress=False)
    with pytest.raises(LayercutError, match="maximum"):
        perplexity(model, tokens, seq_len=65, progress=False)
    with pytest.raises(LayercutError, match="1-D"):
        perplexity(model, tokens[None], progress=False)


def test_text_perplexity_uses_the_tokenizer(model, tokens):
    class CharTokenizer:
        def __call__(self, text, add_special_tokens, verbose):
            return {"input_ids": [ord(c) % VOCAB for c in text]}

    text = "".join(chr(int(t)) for t in tokens)  # ord(chr(t)) % VOCAB == t
    result = text_perplexity(model, CharTokenizer(), text, seq_len=16, progress=False)
    assert isinstance(result, PerplexityResult)
    assert result.nll == pytest.approx(perplexity(model, tokens, seq_len=16, progress=False).nll, rel=1e-12)


@pytest.mark.parametrize(("samples", "seq_len", "batch_size"), [(6, 16, 4), (5, 9, 2), (1, 50, 4)])
def test_packed_perplexity_is_the_stream_perplexity_and_transformers_loss(model, samples, seq_len, batch_size):
    generator = torch.Generator().manual_seed(2)
    rows = torch.randint(0, VOCAB, (samples, seq_len), generator=generator)  # [samples, seq_len]
    packed = packed_perplexity(model, rows, batch_size, progress=False)
    # one implementation: the rows end to end are a stream of non-overlapping windows
    stream = perplexity(model, rows.reshape(-1), seq_len=seq_len, batch_size=batch_size, progress=False)
    assert stream.tokens_scored == samples * (seq_len - 1)
    assert packed == pytest.approx(stream.perplexity, rel=1e-12)
    # the plain reference: transformers' own loss, what packed_perplexity and batch_loss computed before
    total = 0.0
    for start in range(0, samples, batch_size):
        batch = rows[start : start + batch_size]
        with torch.no_grad():
            loss = float(model(input_ids=batch, labels=batch, use_cache=False).loss)
        assert batch_loss(model, batch) == pytest.approx(loss, rel=1e-6)
        total += loss * batch.shape[0] * (seq_len - 1)
    assert packed == pytest.approx(math.exp(total / (samples * (seq_len - 1))), rel=1e-6)


def test_missing_wikitext_is_a_one_line_error(tmp_path):
    with pytest.raises(LayercutError, match="wiki.test.raw") as info:
        wikitext2_test_text(tmp_path)
    assert "\n" not in str(info.value)


def test_rows_rebuilt_from_raw():
    assert _hf_rows_from_raw(" \n = A = \n \n Text .\n") == ["", " = A = \n", "", " Text .\n"]


@pytest.mark.skipif(not (DATA / "wikitext-2-raw-v1").is_dir(), reason="shared data not present")
def test_wikitext2_text_equals_the_hf_rows_joined():
    text = wikitext2_test_text(DATA)
    rows = wikitext2_rows_from_jsonl(DATA / "wikitext-2-raw-v1" / "test.jsonl")
    assert text == "\n\n".join(rows)
    encoded = text.encode("utf-8")
    assert len(encoded) == 1_296_370
    assert hashlib.sha256(encoded).hexdigest().startswith("696cca6b65a171b0")
    assert wikitext2_test_text(DATA / "wikitext-2-raw-v1") == text
