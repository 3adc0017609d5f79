"""Removal measurements kept on disk: read back on resume for the same model and calibration only."""

import json

import torch

import prune.selection.oracle as oracle_module
from eval.compare.cli import main
from eval.compare.measurements import MEASUREMENTS, MeasurementStore, calibration_digest


def test_store_round_trips_both_kinds_and_ignores_another_calibration(tmp_path):
    ids = torch.arange(64).reshape(4, 16)
    digest = calibration_digest("m", ids)
    memo = {"removal-ppl": {(3,): 9.5}}  # measured in this process before the store was attached
    store = MeasurementStore(tmp_path, digest)
    assert store.attach(memo) == 0
    memo["removal-ppl"][(1, 4)] = 12.25  # every new measurement is written at once
    memo["sublayer-removal-ppl"]["2.attention"] = 7.0
    saved = json.loads((tmp_path / MEASUREMENTS).read_text())
    assert saved["removal-ppl"] == {"3": 9.5, "1,4": 12.25} and saved["sublayer-removal-ppl"] == {"2.attention": 7.0}

    again = {}
    assert MeasurementStore(tmp_path, digest).attach(again) == 3
    assert again["removal-ppl"] == {(3,): 9.5, (1, 4): 12.25}
    assert again["sublayer-removal-ppl"] == {"2.attention": 7.0}
    # one token changed, another model, or another batch size: nothing is reused
    other = ids.clone()
    other[2, 5] += 1
    for digest_other in (calibration_digest("m", other), calibration_digest("n", ids),
                         calibration_digest("m", ids, {"batch_size": 8}), calibration_digest("m", ids.reshape(8, 8))):
        assert digest_other != digest
        fresh = {}
        assert MeasurementStore(tmp_path, digest_other).attach(fresh) == 0 and fresh["removal-ppl"] == {}


def test_a_resumed_sleb_measures_only_the_sets_it_has_not(tiny_folder, tmp_path, capsys, monkeypatch):
    passes = []  # model forwards that measure a loss (whole ones, and ones started behind a candidate)
    for name in ("batch_loss", "_loss_from"):
        real = getattr(oracle_module, name)
        monkeypatch.setattr(oracle_module, name, lambda *a, _real=real: passes.append(1) or _real(*a))
    common = ["--model", tiny_folder, "--samples", "8", "--seq-len", "32", "--speed-tokens", "0", "--threads", "1",
              "--methods", "sleb"]
    out = tmp_path / "cmp"
    assert main([str(a) for a in [*common, "--drop", "1", "--out", out]]) == 0
    first = len(passes)
    assert len(json.loads((out / MEASUREMENTS).read_text())["removal-ppl"]) == 4  # each of the 4 blocks alone
    passes.clear()
    # a later process (the same folder, one drop more): the first step is read back, only the second is measured
    assert main([str(a) for a in [*common, "--drop", "1,2", "--out", out]]) == 0
    capsys.readouterr()
    second = len(passes)
    assert len(json.loads((out / MEASUREMENTS).read_text())["removal-ppl"]) == 4 + 3
    resumed = json.loads((out / "results.json").read_text())["cells"]["sleb@2"]["dropped"]
    # against a run that measures everything afresh: the same choice, for the passes of both runs together
    passes.clear()
    fresh = tmp_path / "fresh"
    assert main([str(a) for a in [*common, "--drop", "2", "--out", fresh]]) == 0
    assert 0 < second < first and len(passes) == first + second
    assert json.loads((fresh / "results.json").read_text())["cells"]["sleb@2"]["dropped"] == resumed


def test_an_unreadable_file_is_measured_again_and_weights_change_the_digest(tmp_path):
    from tests.helpers import make_tiny_model

    ids = torch.arange(64).reshape(4, 16)
    model = make_tiny_model("llama", seed=0)
    digest = calibration_digest(model, ids)
    assert digest == calibration_digest(make_tiny_model("llama", seed=0), ids)
    assert digest != calibration_digest(make_tiny_model("llama", seed=1), ids)
    for text in ("[1, 2]", "{not json", json.dumps({"digest": digest, "removal-ppl": {"a,b": 3.0}})):
        (tmp_path / MEASUREMENTS).write_text(text)
        memo = {}
        assert MeasurementStore(tmp_path, digest).attach(memo) == 0 and memo["removal-ppl"] == {}


def test_a_comparison_stopped_in_the_oracle_resumes_with_its_measurements(tiny_folder, tmp_path, capsys, monkeypatch):
    from eval.compare import grid as compare_module

    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    common = ["--model", tiny_folder, "--samples", "8", "--seq-len", "32", "--speed-tokens", "0", "--threads", "1",
              "--methods", "shortgpt", "--drop", "1", "--oracle", "--out", tmp_path / "cmp"]
    monkeypatch.setattr(compare_module, "oracle_table", stop)  # after every removal is measured
    assert main([str(a) for a in common]) == 130
    assert len(json.loads((tmp_path / "cmp" / MEASUREMENTS).read_text())["removal-ppl"]) == 5  # dense + 4 blocks
    monkeypatch.undo()
    passes = []
    real = oracle_module._measure
    monkeypatch.setattr(oracle_module, "_measure", lambda *a: passes.append(1) or real(*a))
    assert main([str(a) for a in common]) == 0, capsys.readouterr().err
    assert not passes and json.loads((tmp_path / "cmp" / "results.json").read_text())["oracle"]["removed"]


def test_a_resumed_repaired_greedy_measures_only_the_steps_it_has_not(tiny_folder, tmp_path, capsys, monkeypatch):
    from prune.selection.repaired import RepairedCosts

    measured = []  # candidate sets measured (each removed, repaired and run on the measuring rows)
    real = RepairedCosts._measure_sets
    monkeypatch.setattr(RepairedCosts, "_measure_sets",
                        lambda self, base, sets, bar: measured.extend(sets) or real(self, base, sets, bar))
    recipe = tmp_path / "rg.yaml"
    recipe.write_text("method: repaired greedy\nscore: linearity\nselect: repaired-greedy-kl\nreplace: linear\n")
    common = ["--model", tiny_folder, "--samples", "8", "--seq-len", "32", "--speed-tokens", "0", "--threads", "1",
              "--methods", recipe]
    out = tmp_path / "cmp"
    assert main([str(a) for a in [*common, "--drop", "1", "--out", out]]) == 0
    assert sorted(measured) == [(1,), (2,)]  # the first and last block are kept
    (key, costs), = json.loads((out / MEASUREMENTS).read_text())["repaired-costs"].items()
    assert '"method": "linear"' in key and set(costs) == {"1", "2"} and set(costs["1"]) == {"ppl", "kl"}
    measured.clear()
    # a later process on the same folder, one drop more: the first step is read back, only the second measured
    assert main([str(a) for a in [*common, "--drop", "1,2", "--out", out]]) == 0
    capsys.readouterr()
    assert measured == [(1, 2)]
    resumed = json.loads((out / "results.json").read_text())["cells"]["rg@2"]["dropped"]
    measured.clear()
    fresh = tmp_path / "fresh"
    assert main([str(a) for a in [*common, "--drop", "2", "--out", fresh]]) == 0
    assert len(measured) == 2 + 1  # measured afresh: both steps
    assert json.loads((fresh / "results.json").read_text())["cells"]["rg@2"]["dropped"] == resumed
