"""``eval.bench heal-cost``: block-local distillation against global healing, stopped where global matches local."""

import copy
from types import SimpleNamespace

import pytest

from eval.bench import heal_cost as bench
from eval.bench.cli import main
from eval.bench.heal_cost import HealCostOptions, heal_cost, heal_cost_markdown, plot_heal_cost
from eval.quality.perplexity import perplexity, tokenize_text
from prune.data.calibration import CalibrationData, DataConfig
from prune.errors import EXIT_BAD_INPUT, LayercutError
from prune.loading.loader import LoadedModel
from prune.pipeline.config import PruneConfig
from prune.replace import ReplaceConfig, replace_blocks_
from tests.helpers import make_tiny_model


@pytest.fixture(scope="module")
def setup(tiny_tokenizer, sample_text):
    loaded = LoadedModel(make_tiny_model("llama"), tiny_tokenizer, "tiny", "tiny")
    ids = tokenize_text(tiny_tokenizer, sample_text)
    calibration = CalibrationData(ids[: 16 * 32].view(16, 32).clone(), "sample")
    heldout = tokenize_text(tiny_tokenizer, sample_text[-2000:])
    return loaded, calibration, heldout


def options(steps, **kwargs):
    prune = PruneConfig(data=DataConfig(samples=16, seq_len=32), protect="0", batch_size=4, drop=2)
    distill = {"batch_size": 2, "data": {"data": "builtin", "samples": 8, "seq_len": 32}}
    return HealCostOptions(prune, "unused", steps=steps, distill=distill, **kwargs)


def test_the_local_row_is_the_local_repair_and_global_runs_stop_once_they_match_it(setup, one_thread, tmp_path,
                                                                                  monkeypatch):
    loaded, calibration, heldout = setup
    results = heal_cost(loaded, calibration, heldout, options((1, 2, 3)))
    local = results["local"]
    # the local row is --replace local on the chosen blocks, nothing more
    student = copy.deepcopy(loaded.model)
    replace_blocks_(student, results["dropped"], calibration.token_ids, ReplaceConfig(method="local", progress=False))
    assert local["perplexity"] == pytest.approx(perplexity(student, heldout, seq_len=32, progress=False).perplexity,
                                                rel=1e-4)
    assert local["seconds"] > 0 and local["peak_rss_bytes"] > 0
    rows = results["global"]
    assert [r["steps"] for r in rows] == [1, 2, 3][: len(rows)] and all(r["peak_rss_bytes"] > 0 for r in rows)
    reached = [r["perplexity"] <= local["perplexity"] for r in rows]
    # every run before the last fell short; the last one matched, or every step count was tried
    assert not any(reached[:-1]) and (reached[-1] or len(rows) == 3)
    assert results["matched_steps"] == (rows[-1]["steps"] if reached[-1] else None)
    table = heal_cost_markdown(results)
    assert table.count("\n| ") == 2 + len(rows) and "| local | 0 |" in table
    assert ("first reached local's perplexity" in table) == reached[-1]
    assert plot_heal_cost(results, tmp_path / "heal.png").read_bytes()[:4] == b"\x89PNG"
    # a global run that matches at once ends the ladder there: every distilled student scored as perfect
    import distill.train

    trained = distill.train.distill

    def marking(student, *args, **kwargs):
        result = trained(student, *args, **kwargs)
        student.healed = True
        return result

    monkeypatch.setattr(distill.train, "distill", marking)
    monkeypatch.setattr(bench, "perplexity", lambda model, *a, **k: SimpleNamespace(perplexity=1.0) if getattr(
        model, "healed", False) else perplexity(model, *a, **k))
    early = heal_cost(loaded, calibration, heldout, options((1, 2, 3)))
    assert early["matched_steps"] == 1 and len(early["global"]) == 1
    assert early["local"]["perplexity"] == pytest.approx(local["perplexity"], rel=1e-4)
    assert early["ratios"]["seconds"] == pytest.approx(early["global"][0]["seconds"] / early["local"]["seconds"])


def test_bad_options_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(LayercutError, match="--steps"):
        options((0,))
    with pytest.raises(LayercutError, match="--start local"):
        options((1,), start="local")
    text = tmp_path / "held.txt"
    text.write_text("some held-out words " * 50, encoding="utf-8")
    code = main(["heal-cost", "--heldout", str(text), "--steps", "ten"])
    assert code == EXIT_BAD_INPUT and "--steps takes step counts" in capsys.readouterr().err


def test_the_command_writes_its_table_and_plot(tiny_folder, sample_text, tmp_path, capsys, one_thread, monkeypatch):
    text = tmp_path / "held.txt"
    text.write_text(sample_text, encoding="utf-8")
    out = tmp_path / "bench"
    # the global runs' text: the calibration's file, not distillation's default (which samples from the model)
    real = bench.HealCostOptions

    def small(*args, **kwargs):
        return real(*args, distill={"batch_size": 2, "data": {"data": str(text), "samples": 8, "seq_len": 32}})

    monkeypatch.setattr(bench, "HealCostOptions", small)
    code = main(["heal-cost", "--model", str(tiny_folder), "--heldout", str(text), "--heldout-chars", "2000",
                 "--drop", "2", "--steps", "1", "--data", str(text), "--samples", "8", "--seq-len", "32",
                 "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    assert {p.name for p in out.iterdir()} == {"heal_cost.json", "heal_cost.md", "heal_cost.png"}
    assert "| local | 0 |" in (out / "heal_cost.md").read_text()
