import json

import pytest
import torch

from prune.data.calibration import DataConfig, calibration_data, default_corpus_text, load_documents
from prune.errors import LayercutError
from tests.helpers import make_tiny_tokenizer


def test_builtin_corpus_is_real_english_text():
    text = default_corpus_text()
    assert len(text) > 500_000 and "Elizabeth" in text and "Darcy" in text


def test_same_seed_same_tokens_other_seed_other_tokens(tokenised_novel, novel_stream):
    tok = tokenised_novel  # the novel tokenised once a session (conftest), not once per call
    a = calibration_data(tok, DataConfig("builtin", samples=6, seq_len=64, seed=3)).token_ids
    b = calibration_data(tok, DataConfig("builtin", samples=6, seq_len=64, seed=3)).token_ids
    c = calibration_data(tok, DataConfig("builtin", samples=6, seq_len=64, seed=4)).token_ids
    assert a.shape == (6, 64) and a.dtype == torch.long
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # Packed windows are distinct slices of the token stream.
    assert len({tuple(row.tolist()) for row in a}) == 6
    windows = {tuple(row.tolist()) for row in novel_stream[: novel_stream.numel() // 64 * 64].view(-1, 64)}
    assert {tuple(row.tolist()) for row in a} <= windows


def test_local_files(tmp_path):
    tok = make_tiny_tokenizer()
    rows = [{"text": f"Document number {i}. " * 30, "other": i} for i in range(20)]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows))
    docs, source = load_documents(str(jsonl))
    assert len(docs) == 20 and source.endswith("docs.jsonl")
    data = calibration_data(tok, DataConfig(data=str(jsonl), samples=4, seq_len=32))
    assert data.describe() == {"source": source, "samples": 4, "seq_len": 32, "tokens": 128}
    txt = tmp_path / "one.txt"
    txt.write_text("plain text " * 200)
    assert load_documents(str(txt))[0] == ["plain text " * 200]
    with pytest.raises(LayercutError, match="no column 'body'"):
        load_documents(str(jsonl), text_field="body")


def test_missing_file_and_too_little_text(tmp_path):
    with pytest.raises(LayercutError, match="data file 'nope.txt' not found"):
        load_documents("nope.txt")
    small = tmp_path / "small.txt"
    small.write_text("only a few words here")
    with pytest.raises(LayercutError, match="sequences of 64; 10 were asked for"):
        calibration_data(make_tiny_tokenizer(), DataConfig(data=str(small), samples=10, seq_len=64))


def test_config_validation():
    with pytest.raises(LayercutError, match="--samples"):
        DataConfig(samples=0)
    with pytest.raises(LayercutError, match="--seq-len"):
        DataConfig(seq_len=1)
