"""``eval.bench replace``: every variant on one scoring pass, rows that match separate runs."""

import copy

import pytest
import torch

from distill.config import DistillConfig
from eval.bench import replace as replace_compare
from eval.bench.cli import main
from eval.bench.replace import (
    VARIANTS,
    CompareOptions,
    Variant,
    compare_markdown,
    compare_replacements,
    parse_variants,
    plot_compare,
)
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
    return loaded, calibration


def compare(setup, sample_text, variants, drops=(1, 2), distill=None):
    loaded, calibration = setup
    prune = PruneConfig(data=DataConfig(samples=16, seq_len=32), protect="0", batch_size=4)
    options = CompareOptions(list(drops), variants, prune, distill, seq_len=32)
    return compare_replacements(loaded, calibration, sample_text[:2000], options)


def test_rows_equal_separate_surgery_and_leave_the_original_untouched(setup, sample_text, tmp_path):
    loaded, calibration = setup
    before = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    results = compare(setup, sample_text, ["remove", "linear", "fold"])
    assert [(r["drop"], r["variant"]) for r in results["rows"]] == [
        (1, "remove"), (1, "linear"), (1, "fold"), (2, "remove"), (2, "linear"), (2, "fold")]
    assert all(torch.equal(before[k], v) for k, v in loaded.model.state_dict().items())
    heldout = tokenize_text(loaded.tokenizer, sample_text[:2000])
    assert results["dense"]["perplexity"] == pytest.approx(perplexity(loaded.model, heldout, seq_len=32,
                                                                      progress=False).perplexity)
    for row in results["rows"]:
        assert len(row["dropped"]) == row["drop"] and 0 not in row["dropped"]
        student = copy.deepcopy(loaded.model)
        method = {"remove": "none"}.get(row["variant"], row["variant"])
        replace_blocks_(student, row["dropped"], calibration.token_ids, ReplaceConfig(method=method, progress=False))
        expected = perplexity(student, heldout, seq_len=32, progress=False).perplexity
        assert row["perplexity"] == pytest.approx(expected, rel=1e-6)
    linear = [r for r in results["rows"] if r["variant"] == "linear"]
    assert all(r["params"] > 0 and r["params"] % (32 * 32 + 32) == 0 for r in linear)  # one map per span
    # the closed-form rows name the share of the update they applied (the methods' default), removal none
    assert {r["variant"]: r.get("update_scale") for r in results["rows"]} == {"remove": None, "linear": 0.7,
                                                                              "fold": 0.7}
    table = compare_markdown(results)
    assert table.count("\n| ") == 2 + 6 and "| 0 | dense |" in table
    assert table.count("| linear (0.7 of the update) |") == 2 and "| remove |" in table
    assert plot_compare(results, tmp_path / "replace.png").read_bytes()[:4] == b"\x89PNG"


def test_distilled_variant_reports_its_training(setup, sample_text):
    distill = DistillConfig(steps=2, batch_size=2, data=DataConfig(samples=8, seq_len=32))
    results = compare(setup, sample_text, ["linear+distill"], drops=(1,), distill=distill)
    row = results["rows"][0]
    assert row["distill"]["steps"] == 2 and row["distill"]["steps_per_second"] > 0
    assert row["distill"]["trainable_parameters"] == row["params"] == 32 * 32 + 32


def test_unknown_variant_and_missing_distill_config(setup, sample_text, capsys, monkeypatch):
    with pytest.raises(LayercutError, match="unknown variant"):
        parse_variants("linear,magic")
    with pytest.raises(LayercutError, match="DistillConfig"):
        compare(setup, sample_text, ["linear+distill"], drops=(1,))
    # a lone block would get a copy of itself: refused before the first variant runs, not half-way
    ran = []
    monkeypatch.setattr(replace_compare, "_run_variant", lambda *args: ran.append(args))
    with pytest.raises(LayercutError, match=r"left \[\[\d+\]\] shorter: block\+distill cannot replace them at drop 1; "
                                            r"pass --select span, or leave block\+distill out of --variants"):
        compare(setup, sample_text, ["remove", "block+distill"], drops=(1,))
    assert ran == []
    code = main(["replace", "--heldout", "x.txt", "--variants", "nope"])
    assert code == EXIT_BAD_INPUT and "unknown variant(s) nope" in capsys.readouterr().err
    code = main(["replace", "--heldout", "x.txt", "--variants", "linear,linear+distill", "--distill-steps", "0"])
    assert code == EXIT_BAD_INPUT and "linear+distill distil: give --distill-steps > 0" in capsys.readouterr().err


def test_variants_come_from_the_method_registry():
    assert list(VARIANTS) == ["remove", "linear", "linear+sequential", "fold", "lowrank", "linear+distill",
                              "block+distill", "cosine", "linearpatch", "local", "magcomp", "fold-rotate"]
    assert parse_variants("block, lowrank+sequential+distill,remove+distill") == [
        "block", "lowrank+sequential+distill", "remove+distill"]
    assert VARIANTS["lowrank+sequential+distill"] == Variant("lowrank", "sequential", True)
    assert VARIANTS["remove"] == Variant("none")
    for bad in ("none", "remove+sequential", "linear+distill+sequential", "linear+linear", "block+block"):
        with pytest.raises(LayercutError, match=r"unknown variant\(s\) " + bad.replace("+", r"\+")):
            parse_variants(bad)


def test_the_command_runs_end_to_end_and_writes_its_table(tiny_folder, sample_text, tmp_path, capsys, one_thread):
    text = tmp_path / "held.txt"
    text.write_text(sample_text, encoding="utf-8")
    out = tmp_path / "bench"
    code = main(["replace", "--model", str(tiny_folder), "--heldout", str(text), "--heldout-chars", "2000",
                 "--drop", "1", "--variants", "remove,linear", "--data", str(text), "--samples", "8",
                 "--seq-len", "32", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    assert {p.name for p in out.iterdir()} == {"replace.json", "replace.md", "replace.png"}
    assert "| 1 | linear (0.7 of the update) |" in (out / "replace.md").read_text()
