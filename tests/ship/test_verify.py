"""``ship.verify``: the engine checks load the models as the run did (its ``--dtype`` and ``--device``)."""

from __future__ import annotations

import pytest

import ship.verify as verify_stage
from eval.bench.checks import FidelityCheck, ServingCheck, SpeedCheck, kept_row_path
from prune.pipeline.config import PruneConfig
from ship.config import ShipConfig


@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_the_checks_take_the_run_s_dtype_and_device(tmp_path, monkeypatch, engine):
    sent = []
    monkeypatch.setattr(verify_stage, "run_in_child", lambda check, log: sent.append(check) or {})
    config = ShipConfig(PruneConfig(load={"model": "org/model", "dtype": "bfloat16", "device": "cuda"}, drop=2),
                        out=str(tmp_path / "slim"), engine=engine)
    checkpoint = tmp_path / "slim.work" / "checkpoint"
    checkpoint.mkdir(parents=True)
    verify_stage.verify(config, checkpoint, None, [f"rows={tmp_path / 'heldout.txt'}"], tmp_path / "verify",
                        say=lambda _: None)
    serving, fidelity, speed = sent
    assert isinstance(serving, ServingCheck) and isinstance(speed, SpeedCheck)
    assert isinstance(fidelity, FidelityCheck) and fidelity.model == str(checkpoint)
    assert (serving.dtype, serving.device) == (fidelity.dtype, fidelity.device) == (speed.dtype, speed.device) \
        == ("bfloat16", "cuda")
    assert [engine_ for _, _, engine_ in serving.models] == ["transformers"] * 2 + (
        [engine] if engine != "transformers" else [])


def test_a_kept_row_is_kept_per_dtype_and_device(tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERCUT_CACHE", str(tmp_path / "cache"))
    windows = [[1, 2, 3, 4]]
    on_cpu = kept_row_path(str(tiny_folder), "transformers", windows, 4)
    assert on_cpu == kept_row_path(str(tiny_folder), "transformers", windows, 4, dtype="auto", device="cpu")
    assert len({on_cpu, kept_row_path(str(tiny_folder), "transformers", windows, 4, dtype="bfloat16"),
                kept_row_path(str(tiny_folder), "transformers", windows, 4, device="cuda")}) == 3


def test_a_speed_check_loads_both_models_in_its_dtype_and_device(monkeypatch):
    import eval.bench.speed as speed

    loads = []
    monkeypatch.setattr(speed, "measure_speed", lambda engine, baseline, models, load, **options: loads.append(load))
    SpeedCheck(baseline="org/model", model="slim/", engine="transformers", dtype="bfloat16", device="cuda").run()
    assert (loads[0].model, loads[0].dtype, loads[0].device) == ("org/model", "bfloat16", "cuda")
