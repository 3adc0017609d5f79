"""``ship.costs``: the planner's seconds for each of ship's stages, counted from the model's config alone."""

from __future__ import annotations

import dataclasses

import pytest

from prune.planner.inputs import Hardware, PlanInput
from prune.planner.shape import shape_of_model
from ship.costs import ShipWork, stage_seconds
from tests.helpers import make_tiny_model

STAGES = ["shortlist", "build", "heal", "export", "verify"]


@pytest.fixture(scope="module")
def shape():
    return shape_of_model(make_tiny_model("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=8))


def seconds(shape, work: ShipWork, **inputs) -> dict[str, float]:
    return stage_seconds(shape, PlanInput(model="tiny", samples=32, seq_len=512, **inputs), work)


def test_every_stage_is_costed_and_each_piece_of_work_costs_where_it_is_done(shape, monkeypatch):
    work = ShipWork(drop=2, repairs=(512, 768, 256))
    base = seconds(shape, work)
    assert list(base) == STAGES and all(base[s] > 0 for s in STAGES if s != "heal") and base["heal"] == 0
    # the model's own text, sampled for calibration, is the shortlist's
    sampled = seconds(shape, dataclasses.replace(work, self_rows=24))
    assert sampled["shortlist"] > base["shortlist"] and {s: sampled[s] for s in STAGES[1:]} == \
        {s: base[s] for s in STAGES[1:]}
    # another repair to fit and measure, more calibration, more held-out text: each where it is spent
    assert seconds(shape, dataclasses.replace(work, repairs=(*work.repairs, 768)))["shortlist"] > base["shortlist"]
    more = stage_seconds(shape, PlanInput(model="tiny", samples=64, seq_len=512), work)
    # the build fits nothing (the shortlist's fit is put in place); a skeleton's measures no held-out rows
    assert more["shortlist"] > base["shortlist"] and more["build"] == base["build"]
    assert seconds(shape, work, offload="sequential")["build"] < base["build"]
    texts = seconds(shape, dataclasses.replace(work, texts=4))
    assert texts["verify"] > base["verify"] and texts["shortlist"] == base["shortlist"]
    # the original's kept rows are not measured again; no checks, no verify; an engine serving folders: no export
    assert seconds(shape, dataclasses.replace(work, original_kept=True))["verify"] < base["verify"]
    assert seconds(shape, dataclasses.replace(work, verify=False))["verify"] == 0
    assert seconds(shape, dataclasses.replace(work, gguf=False))["export"] == 0
    assert seconds(shape, dataclasses.replace(work, heal_seconds=90.0))["heal"] == 90.0
    # generation fidelity decodes in memory only: a skeleton's verify is without it, by at least its two loads
    from ship.costs import _fidelity_seconds

    fidelity = _fidelity_seconds(shape, PlanInput(model="tiny", samples=32, seq_len=512), work)
    assert 0 < fidelity < base["verify"]
    # the original's side kept by an earlier run: only the checkpoint decodes, the original still judges it
    kept = _fidelity_seconds(shape, PlanInput(model="tiny", samples=32, seq_len=512),
                             dataclasses.replace(work, fidelity_kept=True))
    from prune.planner.machine import machine_speed
    from ship.costs import PROCESS_SECONDS

    assert 2 * PROCESS_SECONDS / machine_speed() < kept < fidelity  # both loads still paid for
    monkeypatch.setattr("ship.costs._fidelity_seconds", lambda *_: 1000.0)
    assert seconds(shape, work)["verify"] - base["verify"] == pytest.approx(1000.0 - fidelity)
    assert seconds(shape, work, offload="sequential")["verify"] < base["verify"]


def test_a_gpu_runs_the_passes_faster_and_the_files_as_slowly(shape):
    work = ShipWork(drop=2, repairs=(512,))
    cpu = seconds(shape, work)
    gpu = seconds(shape, work, hardware=Hardware(gpus=1, gpu_memory=80e9))
    assert gpu["shortlist"] < cpu["shortlist"] / 10
    assert gpu["export"] == cpu["export"] > 0  # llama.cpp's converter reads and writes files on the CPU
