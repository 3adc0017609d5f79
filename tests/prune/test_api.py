"""``prune.slim`` / ``prune.score`` / ``prune.save`` refuse what they cannot take in one line, before any work."""

import pytest

import prune
from prune.errors import LayercutError
from tests.helpers import make_tiny_model

SMALL = {"samples": 8, "seq_len": 32, "heldout_samples": 0, "replace": "none"}


def _one_line(call) -> str:
    with pytest.raises(LayercutError) as caught:
        call()
    message = str(caught.value)
    assert "\n" not in message
    return message


def _no_pass(monkeypatch):
    """Any calibration pass fails the test: each refusal comes before one."""
    import prune.pipeline.runner

    def no_pass(*args, **kwargs):
        raise AssertionError("the run started before the input was checked")

    monkeypatch.setattr(prune.pipeline.runner, "run_prune", no_pass)
    monkeypatch.setattr(prune.pipeline.runner, "score_model", no_pass)


@pytest.mark.parametrize(("make", "tokenizer", "named"), [
    # each was a traceback from inside the run: an AttributeError, an IndexError in the embedding, or (on meta)
    # a run that computed nothing
    (lambda: make_tiny_model("llama").to("meta"), "tiny", "tensors (model.embed_tokens.weight, ...) are on the meta"),
    (lambda: make_tiny_model("llama"), None, "needs the model's tokenizer to read calibration text, got None"),
    (lambda: "/some/folder", "tiny", "takes a model in memory (a transformers *ForCausalLM), got a str"),
    (lambda: make_tiny_model("llama", vocab_size=100), "tiny",
     "the tokenizer has 320 tokens and the model's embedding 100 rows"),
])  # fmt: skip
def test_slim_and_score_refuse_what_they_cannot_run(monkeypatch, tiny_tokenizer, make, tokenizer, named):
    _no_pass(monkeypatch)
    tokenizer = tiny_tokenizer if tokenizer == "tiny" else tokenizer
    assert named in _one_line(lambda: prune.slim(make(), tokenizer, drop=1, **SMALL))
    assert named in _one_line(lambda: prune.score(make(), tokenizer, samples=8, seq_len=32))


def test_protect_as_a_number_is_one_line(monkeypatch, tiny_tokenizer):
    _no_pass(monkeypatch)
    message = _one_line(lambda: prune.slim(make_tiny_model("llama"), tiny_tokenizer, drop=1, protect=5, **SMALL))
    assert message.startswith("protect must be text or a list (or none), got 5 (int): write block indices")


@pytest.mark.parametrize("args", [("x", "out/"), ("x",)])
def test_save_of_something_else_says_what_it_takes(tmp_path, args):
    message = _one_line(lambda: prune.save(*args))
    assert message.startswith("prune.save takes the result of prune.slim and a folder, save(result, 'out/'), or a "
                              "model, its tokenizer, a folder and a report dict")
    assert not (tmp_path / "out").exists()


def test_save_of_a_model_without_its_report_says_what_it_takes(tmp_path):
    message = _one_line(lambda: prune.save(make_tiny_model("llama"), tmp_path / "out"))
    assert "save(model, tokenizer, 'out/', report)" in message and "missing a required argument" in message
