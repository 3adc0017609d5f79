"""The traps a user met (issue 46): a report overwritten unasked, checks that came late, warnings, plots."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from matplotlib.container import BarContainer
from matplotlib.figure import Figure
from transformers import AutoConfig

from prune.checkpoint.load_config import LoadConfig
from prune.errors import EXIT_BAD_INPUT, LayercutError
from prune.pipeline.config import PruneConfig
from prune.pipeline.resolve import check_against_model
from tests.helpers import make_tiny_model, make_tiny_tokenizer
from tests.helpers import run_prune_cli as run_prune


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model fails the test: the check under test must come before it."""

    def refuse(self, model=None):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(LoadConfig, "load", refuse)


@pytest.fixture
def text_file(tmp_path, sample_text):
    path = tmp_path / "text.txt"
    path.write_text(sample_text)
    return path


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


# ---- eval.run: --out is never overwritten unasked, and --overwrite exists ----


def test_eval_run_refuses_a_non_empty_out_and_takes_overwrite(tiny_folder, text_file, tmp_path, capsys, one_thread):
    from eval.run import main

    out = tmp_path / "report"
    base = ["--model", str(tiny_folder), "--seq-len", "32", "--out", str(out), "--no-progress", "--threads", "1"]
    assert main([*base, "--tasks", f"ppl:{text_file}"]) == 0
    first = (out / "results.json").read_text()
    capsys.readouterr()
    other = tmp_path / "other.txt"
    other.write_text(text_file.read_text()[::-1])
    assert main([*base, "--tasks", f"ppl:{other}"]) == EXIT_BAD_INPUT
    line = one_error_line(capsys.readouterr().err)
    assert line == f"error: --out {out} exists and is not empty: pass --overwrite or choose another folder"
    assert (out / "results.json").read_text() == first  # the first results are still there
    assert main([*base, "--tasks", f"ppl:{other}", "--overwrite"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert "ppl:other/perplexity" in results["models"][0]["metrics"] and "overwrite" not in results["settings"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_eval_run_checks_out_before_loading_a_model(tiny_folder, text_file, tmp_path, capsys, no_model_load):
    from eval.run import main

    out = tmp_path / "taken"
    out.mkdir()
    (out / "results.json").write_text("{}")
    assert main(["--model", str(tiny_folder), "--tasks", f"ppl:{text_file}", "--out", str(out)]) == EXIT_BAD_INPUT
    assert "pass --overwrite" in one_error_line(capsys.readouterr().err)


# ---- prune.run: what is known from the flags and the config fails before the model loads ----


def test_too_few_calibration_tokens_fail_before_the_model_loads(tiny_folder, tmp_path, capsys, no_model_load):
    code, _, err = run_prune(capsys, "--model", tiny_folder, "--samples", "2", "--seq-len", "16", "--drop", "1",
                             "--out", tmp_path / "o")
    assert code == EXIT_BAD_INPUT
    assert one_error_line(err) == ("error: 32 calibration tokens are too few for hidden size 32: need at least 128 "
                                   "(4 x hidden); raise --samples or --seq-len")


def test_a_missing_data_file_fails_before_the_model_loads(tiny_folder, tmp_path, capsys, no_model_load):
    code, _, err = run_prune(capsys, "--model", tiny_folder, "--data", "builtin@0.5,missing.txt@0.5",
                             "--samples", "8", "--seq-len", "32", "--drop", "1", "--out", tmp_path / "o")
    assert code == EXIT_BAD_INPUT
    assert "data file 'missing.txt' not found" in one_error_line(err)


def test_too_large_a_drop_names_the_maximum_that_runs(tiny_folder, tmp_path, capsys, no_model_load):
    code, _, err = run_prune(capsys, "--model", tiny_folder, "--samples", "8", "--seq-len", "32", "--drop", "4",
                             "--out", tmp_path / "o")
    assert code == EXIT_BAD_INPUT
    assert one_error_line(err) == ("error: --drop 4 asks for 4 of the model's 4 blocks: drop at most 2 (blocks "
                                   "[0, 3] are protected; --protect none allows 3)")


def test_the_maximum_drop_named_is_accepted_on_a_30_block_model():
    config = AutoConfig.for_model("llama", hidden_size=64, num_hidden_layers=30, num_attention_heads=4,
                                  max_position_embeddings=512)

    def check(drop, protect="0,-1"):
        check_against_model(PruneConfig(drop=drop, protect=protect, out="o", data={"seq_len": 32}), config)

    with pytest.raises(LayercutError, match=r"drop at most 28 \(blocks \[0, 29\] are protected"):
        check(30)
    check(28)  # the maximum the message names runs
    with pytest.raises(LayercutError, match="only 28 of 30 are not protected"):
        check(29)
    with pytest.raises(LayercutError, match=r"drop at most 29$"):
        check(30, protect="none")
    check(29, protect="none")


# ---- no FutureWarning from the KV cache keyword ----


def test_decoding_with_the_cache_emits_no_future_warning(one_thread):
    from eval.speed.timing import SpeedOptions, greedy_decode, make_prompt
    from prune.data.calibration import sample_sequences

    model = make_tiny_model("llama")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens, _ = greedy_decode(model, make_prompt(320, SpeedOptions(prompt_len=8)), 4)
        sample_sequences(model, make_tiny_tokenizer(), 2, 6, seed=0)
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]
    reference = model.generate(make_prompt(320, SpeedOptions(prompt_len=8)), max_new_tokens=4, do_sample=False,
                               pad_token_id=0)
    assert torch.equal(tokens, reference[:, 8:])


def test_the_cache_keyword_follows_the_forward_signature():
    from prune.model.adapters import cache_keyword

    class Old(torch.nn.Module):  # transformers < 5: only past_key_values
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return input_ids

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None):
            return input_ids

    assert cache_keyword(Old()) == "past_key_values" and cache_keyword(New()) == "cache"


# ---- plots: error bars where lm-eval gives standard errors, each lens panel labelled with its k ----


@pytest.fixture
def drawn(monkeypatch):
    """The figures saved while the test runs, kept open for their artists to be read."""
    figures = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (figures.append(self), real(self, *a, **k))[1])
    return figures


def test_metrics_plot_draws_lm_eval_standard_errors(tmp_path, drawn):
    from eval.quality.report import plot_metrics

    models = [{"name": "base", "role": "baseline", "metrics": {"arc_easy/acc": 0.6, "arc_easy/acc_stderr": 0.02,
                                                               "wikitext/perplexity": 20.0}},
              {"name": "slim", "role": "candidate", "metrics": {"arc_easy/acc": 0.5, "arc_easy/acc_stderr": 0.03,
                                                                "wikitext/perplexity": 30.0}}]
    results = {"baseline": "base", "models": models,
               "primary_metrics": ["wikitext/perplexity", "arc_easy/acc"]}  # fmt: skip
    plot_metrics(results, tmp_path / "metrics.png")
    ppl, acc = drawn[0].axes
    bars = {ax: next(c for c in ax.containers if isinstance(c, BarContainer)) for ax in (ppl, acc)}
    assert bars[ppl].errorbar is None  # perplexity has no standard error
    segments = bars[acc].errorbar.lines[2][0].get_segments()  # (data line, caps, [bar lines])
    half_widths = [(seg[1][1] - seg[0][1]) / 2 for seg in segments]
    assert half_widths == pytest.approx([0.02, 0.03])


def test_lens_precision_panels_are_labelled_with_their_k(tmp_path, drawn):
    from eval.lens.plots import plot_precision

    ks = [1, 5, 10]
    results = {"model": "m", "num_blocks": 2, "layers": [0, 1, 2], "precision_ks": ks,
               "per_layer": {"id": {f"precision@{k}": [0.2, 0.5, 1.0] for k in ks}},
               "shortcuts": {"id": {"params_per_layer": 0}}}  # fmt: skip
    plot_precision(results, tmp_path / "precision.png")
    axes = drawn[0].axes
    assert [ax.get_ylabel() for ax in axes] == [f"Precision@{k}" for k in ks]
    assert [ax.get_title() for ax in axes] == [f"Precision@{k}" for k in ks]
