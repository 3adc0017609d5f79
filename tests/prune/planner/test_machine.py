"""The planner's CPU rates follow this CPU's speed: measured by a probe, or fixed by ``$LAYERCUT_MACHINE_SPEED``."""

import math
import time

import pytest

from prune.errors import LayercutError
from prune.planner import machine
from prune.planner.inputs import Hardware, PlanInput
from prune.planner.rates import CPU_FLOPS, GPU_FLOPS, flop_rate


@pytest.fixture
def measured(monkeypatch):
    """``machine_speed`` measured afresh (tests fix it to 1 in conftest), its cache cleared before and after."""
    monkeypatch.delenv(machine.SPEED_ENV, raising=False)
    machine.machine_speed.cache_clear()
    yield monkeypatch
    machine.machine_speed.cache_clear()


def test_a_cpu_twice_as_fast_as_the_reference_plans_twice_the_rate(measured):
    measured.setattr(machine, "probe_seconds", lambda: machine.REFERENCE_SECONDS / 2)
    assert machine.machine_speed() == pytest.approx(2.0)
    assert flop_rate(PlanInput(model="m")) == pytest.approx(2 * CPU_FLOPS)
    measured.setattr(machine, "probe_seconds", lambda: 1 / 0)  # measured once per process: not called again
    assert machine.machine_speed() == pytest.approx(2.0)


def test_the_environment_fixes_the_speed_and_a_bad_value_is_refused(measured):
    measured.setattr(machine, "probe_seconds", lambda: 1 / 0)  # never measured when the environment says
    measured.setenv(machine.SPEED_ENV, "0.5")
    assert machine.machine_speed() == 0.5 and flop_rate(PlanInput(model="m")) == pytest.approx(CPU_FLOPS / 2)
    for bad in ("fast", "0", "-1", "nan", "inf"):
        machine.machine_speed.cache_clear()
        measured.setenv(machine.SPEED_ENV, bad)
        with pytest.raises(LayercutError, match="LAYERCUT_MACHINE_SPEED.*positive number"):
            machine.machine_speed()


def test_the_probe_reads_its_quicker_rounds_and_a_slowed_few_do_not_move_it():
    quiet = [0.08, 0.081, 0.079, 0.08, 0.082, 0.08, 0.081, 0.08, 0.079, 0.08, 0.081, 0.08]
    slowed = quiet[:4] + [0.2] * 8  # two thirds of the rounds behind another tenant
    assert machine.quick_rounds(quiet) == pytest.approx(0.08, abs=1e-3)
    assert machine.quick_rounds(slowed) == pytest.approx(0.08, abs=1e-3)
    assert machine.quick_rounds(list(range(1, 13))) == 3.25  # between the third and fourth quickest
    assert machine.quick_rounds([0.3, 0.1]) == 0.1


def test_the_probe_times_a_block_of_the_reference_widths_on_the_scoring_batch(monkeypatch):
    asked = []

    calls = []

    def forward(*widths):
        asked.append(widths)
        return (lambda: calls.append(1) or time.sleep(0.02)), 1
    monkeypatch.setattr(machine, "_block_forward", forward)
    monkeypatch.setattr(machine, "PROBE_WARMUP_SECONDS", 0.0)
    assert machine.probe_seconds(rounds=4) == pytest.approx(0.02, rel=0.4)  # one forward a round
    assert asked == [(576, 1536, 9, 4, 512)]  # SmolLM2-135M's widths, CPU_FLOPS's own batch
    assert len(calls) == 4  # no warm-up asked for: a forward each round


def test_the_probe_times_a_real_block():
    seconds = machine.probe_seconds(rounds=1)
    assert math.isfinite(seconds) and 0 < seconds < 30
    assert machine.REFERENCE_SECONDS > 0


def test_a_gpu_plan_does_not_use_the_cpu_speed(measured):
    measured.setenv(machine.SPEED_ENV, "3")
    gpu = PlanInput(model="m", hardware=Hardware(gpus=1, gpu_memory=80e9, host_memory=64e9))
    assert flop_rate(gpu) == GPU_FLOPS


@pytest.fixture
def shaped(monkeypatch):
    """``shape_speed`` measured afresh (the environment fixes it in tests), its cache cleared before and after."""
    monkeypatch.delenv(machine.SPEED_ENV, raising=False)
    machine.shape_speed.cache_clear()
    machine.machine_speed.cache_clear()
    yield monkeypatch
    machine.shape_speed.cache_clear()
    machine.machine_speed.cache_clear()  # measured here: later tests read the environment's 1 again


def test_a_model_s_widths_scale_the_cpu_rate_by_their_timed_block_against_the_reference_one(shaped):
    # a block twice the reference's FLOP rate: its call takes as long for twice the arithmetic
    asked = []

    def forward(hidden, intermediate, heads, sequences, seq_len):
        asked.append(hidden)
        return (lambda: time.sleep(0.002)), (2 * 1e9 if hidden != machine.REFERENCE_BLOCK[0] else 1e9)

    shaped.setattr(machine, "_block_forward", forward)
    assert machine.shape_speed(64, 256, 4, 1, 32) == pytest.approx(2.0, rel=0.5)
    assert set(asked) == {machine.REFERENCE_BLOCK[0], 64}  # both blocks were asked for, at their widths
    assert machine.shape_speed(*machine.REFERENCE_BLOCK[:2], 9) == 1.0  # the reference widths: nothing timed
    assert flop_rate(PlanInput(model="m", shape_speed=1.5)) == pytest.approx(1.5 * CPU_FLOPS * machine.machine_speed())
    shaped.setenv(machine.SPEED_ENV, "1")
    machine.shape_speed.cache_clear()
    assert machine.shape_speed(64, 256, 4, 1, 32) == 1.0  # fixed machine, fixed rates


def test_a_slowed_spell_of_reference_rounds_does_not_move_the_shape_s_factor(shaped):
    """Three turns and their median ratio read an 8B-shaped block 1.37-2.41x in fresh processes (2026-12-05)."""
    calls = []

    def forward(hidden, intermediate, heads, sequences, seq_len):
        def reference():
            calls.append(None)
            time.sleep(0.02 if len(calls) in (3, 4) else 0.002)  # the first two timed rounds slowed tenfold

        model = lambda: time.sleep(0.002)  # noqa: E731 - twice the arithmetic in the same time
        return (reference, 1e9) if hidden == machine.REFERENCE_BLOCK[0] else (model, 2e9)

    shaped.setattr(machine, "_block_forward", forward)
    assert machine.shape_speed(64, 256, 4, 1, 32) == pytest.approx(2.0, rel=0.3)
    assert len(calls) == 2 + machine.SHAPE_ROUNDS
    # a block whose turns outlast SHAPE_SECONDS stops at the fewest rounds a quartile is taken of
    calls.clear()
    machine.shape_speed.cache_clear()
    shaped.setattr(machine, "SHAPE_SECONDS", 0.0)
    machine.shape_speed(64, 256, 4, 1, 32)
    assert len(calls) == 2 + machine.SHAPE_MIN_ROUNDS < 2 + machine.SHAPE_ROUNDS


def test_the_shape_probe_times_real_blocks(shaped):
    run, flop = machine._block_forward(64, 256, 4, 2, 16)
    run()
    assert flop == 2 * (4 * 64 * 64 + 3 * 64 * 256 + 2 * 64) * 2 * 16  # 4 projections, 3 MLP matrices, 2 norms
    factor = machine.shape_speed(64, 256, 4, 1, 16)
    assert math.isfinite(factor) and factor > 0
