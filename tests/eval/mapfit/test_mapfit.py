"""``python -m eval.mapfit``: a span's map fitted on calibration and measured on other texts."""

import json

import pytest
import torch

from eval.mapfit import (
    Captured,
    error_report,
    fit_variants,
    logit_report,
    parse_span,
    span_replaced,
    token_sensitivity,
    weighted_moments,
)
from eval.mapfit.cli import main
from prune.errors import LayercutError
from prune.measure.heldout import packed_perplexity
from prune.measure.least_squares import LinearFit, fit_linear_map
from prune.model.adapters import get_blocks
from prune.model.capture import block_output, hooks_held, with_block_output
from prune.model.surgery import blocks_removed
from prune.replace.capture import PairAccumulator
from tests.helpers import make_tiny_model


def test_relative_error_is_one_for_removal_and_zero_for_an_exact_map():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(200, 6, generator=generator)
    a = torch.randn(6, 6, generator=generator) / 3
    y = x @ a + 0.5
    data = Captured(x, y, torch.arange(200) % 10)
    fits = fit_variants(data, skips=[1], shrinks=[1.0], scales=[0.5])
    assert error_report(None, data, 1e9)["relative"] == pytest.approx(1.0)
    # half the update of an exact map leaves half the update's error: a quarter of removal's squared error
    assert error_report(fits["ls*0.5"], data, 1e9)["relative"] == pytest.approx(0.25, rel=1e-6)
    assert error_report(fits["ls"], data, 1e9)["relative"] < 1e-10
    assert error_report(fits["ls-skip-1"], data, 1e9)["relative"] < 1e-10  # a linear y needs no position 0
    # a heavy ridge on the update lands between the exact map and removal
    assert 1e-6 < error_report(fits["shrink-1"], data, 1e9)["relative"] < 1.0
    share = error_report(None, data, 1e9)
    assert share["share_position0"] == pytest.approx(float((x - y)[::10].pow(2).sum() / (x - y).pow(2).sum()))
    assert share["massive_tokens"] == 0


def test_a_massive_first_token_carries_the_least_squares_error():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(400, 4, generator=generator)
    x[::20] *= 50  # position 0 of every sequence: a sink
    y = torch.tanh(x) + x  # not linear: the fit must trade errors between sinks and the rest
    data = Captured(x, y, torch.arange(400) % 20)
    fits = fit_variants(data, skips=[1], shrinks=[])
    rest = Captured(x[data.position > 0], y[data.position > 0], data.position[data.position > 0])
    # fitted without the sinks, the map is better on every other token
    assert error_report(fits["ls-skip-1"], rest, 1e9)["relative"] < error_report(fits["ls"], rest, 1e9)["relative"]
    assert error_report(None, data, 10.0)["massive_tokens"] == 20


@torch.no_grad()
def test_hooked_removal_is_the_model_without_the_blocks_and_kl_is_relative_to_it(one_thread):
    model = make_tiny_model("llama").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with span_replaced(model, (1, 2), None):
        hooked = model(input_ids=ids).logits
    with blocks_removed(model, [1, 2]):
        removed = model(input_ids=ids).logits
    assert torch.allclose(hooked, removed, atol=1e-5)
    assert not torch.allclose(model(input_ids=ids).logits, removed, atol=1e-3)  # the hooks are gone again
    hidden = model.config.hidden_size
    identity = LinearFit(torch.eye(hidden, dtype=torch.float64), torch.zeros(hidden, dtype=torch.float64))
    doubled = LinearFit(2 * torch.eye(hidden, dtype=torch.float64), torch.zeros(hidden, dtype=torch.float64))
    report = logit_report(model, list(ids), (1, 2), {"removal": None, "identity": identity, "doubled": doubled})
    assert report["removal"]["kl_relative"] == pytest.approx(1.0)
    assert report["identity"]["kl"] == pytest.approx(report["removal"]["kl"], rel=1e-5)  # the identity map is removal
    assert report["removal"]["kl"] > 0 and report["doubled"]["kl"] != pytest.approx(report["removal"]["kl"])
    assert report["removal"]["tokens"] == 2 * 11 and 0 <= report["removal"]["top1_agreement"] <= 1
    # 11 predictions per sequence, all of them "early" (positions below 32)
    assert report["removal"]["early_tokens"] == 22 and report["removal"]["kl_late"] is None
    assert report["removal"]["kl_early"] == pytest.approx(report["removal"]["kl"])
    log_probs = torch.log_softmax(removed[:, :-1], -1).gather(-1, ids[:, 1:, None])
    assert report["removal"]["ppl"] == pytest.approx(float((-log_probs.mean()).exp()), rel=1e-4)
    # the one perplexity: the model without the span, measured as a prune run's held-out text is
    with blocks_removed(model, [1, 2]):
        assert report["removal"]["ppl"] == pytest.approx(packed_perplexity(model, ids, progress=False), rel=1e-9)


def test_a_token_weighted_fit_counts_each_token_its_weight_times():
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(60, 5, generator=generator)
    y = torch.tanh(x @ torch.randn(5, 5, generator=generator)) + 0.3  # not linear: the weights change the fit
    counts = torch.randint(1, 4, (60,), generator=generator)
    repeated = PairAccumulator(precision="float64")
    repeated.update(x.repeat_interleave(counts, 0), y.repeat_interleave(counts, 0))
    expected, weighted = fit_linear_map(repeated.moments()), fit_linear_map(weighted_moments(x, y, counts.float()))
    torch.testing.assert_close(weighted.weight, expected.weight, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(weighted.bias, expected.bias, rtol=1e-8, atol=1e-10)
    plain = PairAccumulator(precision="float64")
    plain.update(x, y)
    assert not torch.allclose(weighted.weight, fit_linear_map(plain.moments()).weight, atol=1e-3)
    data = Captured(x, y, torch.arange(60) % 10)
    fits = fit_variants(data, skips=[], shrinks=[], sensitivity=counts.float())
    torch.testing.assert_close(fits["ls-grad"].weight, expected.weight, rtol=1e-8, atol=1e-10)
    assert not torch.allclose(fits["ls-grad-sqrt"].weight, expected.weight, atol=1e-3)


def test_token_sensitivity_is_the_squared_gradient_of_the_loss_at_the_span_output(one_thread):
    model = make_tiny_model("llama").double().eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    weights = token_sensitivity(model, list(ids), (1, 2), batch_size=2)
    assert weights.shape == (20,) and weights[9] == 0 and weights[19] == 0 and bool((weights[:9] > 0).all())
    assert all(p.requires_grad for p in model.parameters())  # handed back as it was
    _, blocks = get_blocks(model)

    def loss_with(delta, row, position):  # the loss with block 2's output moved by delta at one token
        def shift(_module, _args, output):
            hidden = block_output(output).clone()
            hidden[row, position] += delta
            return with_block_output(output, hidden)

        with hooks_held([blocks[2].register_forward_hook(shift)]), torch.no_grad():
            logits = model(input_ids=ids).logits[:, :-1]
            return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                           reduction="sum"))

    hidden, step = model.config.hidden_size, 1e-5
    # central differences, one coordinate at a time (to 1e-3: Llama's RMSNorm computes in float32 even here)
    for row, position in ((0, 3), (1, 0)):
        grad = [(loss_with(step * e, row, position) - loss_with(-step * e, row, position)) / (2 * step)
                for e in torch.eye(hidden, dtype=torch.float64)]
        assert float(weights[10 * row + position]) == pytest.approx(sum(g * g for g in grad), rel=1e-3)


def test_parse_span():
    assert parse_span("12-15", 30) == (12, 15) and parse_span("3", 30) == (3, 3)
    with pytest.raises(LayercutError, match="blocks 0..29"):
        parse_span("28-31", 30)
    with pytest.raises(LayercutError, match="like 12-15"):
        parse_span("a-b", 30)


def test_cli_writes_the_table(tiny_folder, tmp_path, capsys, one_thread):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"text": f"Question {i}: which way is the wind blowing today?"})
                                 for i in range(6)))
    novel = tmp_path / "novel.txt"
    novel.write_text("It is a truth universally acknowledged, that a single man in possession. " * 40)
    out = tmp_path / "mapfit"
    code = main(["--model", str(tiny_folder), "--span", "1-2", "--samples", "16", "--seq-len", "32",
                 "--heldout-samples", "2", "--heldout", f"novel={novel},prompts={prompts}", "--heldout-tokens", "256",
                 "--logits", "--short", "8", "--update-scale", "0.5", "--grad-weight", "--out", str(out),
                 "--threads", "1"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert set(results["errors"]) == {"calibration", "calibration held-out", "novel", "prompts"}
    for text in results["errors"].values():
        assert text["removal"]["relative"] == pytest.approx(1.0)
        assert set(text) == {"removal", "ls", "ls-skip-1", "ls-skip-4", "shrink-0.01", "shrink-0.1", "shrink-1",
                             "ls-short-8", "ls-mixed-8", "ls-mixed-8*0.5", "ls-mixed-8-grad", "ls-mixed-8-grad-sqrt"}
    # least squares is the best linear map on the tokens it was fitted on
    calibration = results["errors"]["calibration"]
    assert calibration["ls"]["relative"] <= min(v["relative"] for v in calibration.values()) + 1e-9
    novel = results["logits"]["novel"]["removal"]  # 32-token windows: positions 0-30 predict, all early
    assert novel["early_tokens"] == novel["tokens"] and novel["kl_late_relative"] is None
    assert results["errors"]["prompts"]["ls"]["tokens"] < 6 * 32  # one short sequence per document
    assert set(results["logits"]) == set(results["errors"])
    for text in results["logits"].values():
        assert text["removal"]["kl_relative"] == pytest.approx(1.0) and set(text) == set(results["errors"]["novel"])
        assert all(v["kl"] >= 0 for v in text.values())
    readme = (out / "README.md").read_text()
    assert "| variant |" in readme and "| KL ls |" in readme


@pytest.mark.parametrize("args,message", [
    (["--heldout", "novel.txt"], "NAME=FILE"),
    (["--heldout", "calibration=novel.txt"], "as the calibration text"),
    (["--skip", "0"], "--skip takes position counts from 1"),
    (["--shrink", "0"], "--shrink takes ridges above 0"),
    (["--short", "512"], "--short takes a sequence length from 2 to 511"),
    (["--update-scale", "0.5,1"], "--update-scale takes shares between 0 and 1"),
])
def test_bad_input_is_one_line_exit_2(tiny_folder, tmp_path, capsys, args, message):
    (tmp_path / "novel.txt").write_text("words " * 100)
    code = main(["--model", str(tiny_folder), "--span", "1-2", *args, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err and err.count("error") == 1, err


def test_an_existing_out_is_kept_without_overwrite(tiny_folder, tmp_path, capsys):
    out = tmp_path / "results"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    code = main(["--model", str(tiny_folder), "--span", "1-2", "--out", str(out)])
    assert code == 2 and "--overwrite" in capsys.readouterr().err and (out / "mine.txt").exists()
