"""What a speed comparison gives: spreads of repeated timings, speed-up ratios and the timings too noisy to trust."""

import pytest

from eval.speed.results import (
    ModelSpeed,
    SpeedComparison,
    Spread,
    attach_memory,
    ideal_speedup,
    noise_warnings,
    speed_ratio,
)
from eval.speed.timing import SpeedOptions
from prune.errors import LayercutError


def model(name, prefill, decode, blocks=2):
    return ModelSpeed(name, blocks, 10, 40, None, Spread.of(prefill), Spread.of(decode), [1.0] * len(prefill),
                      [1.0] * len(decode), None, None)


def test_spread_of_samples():
    spread = Spread.of([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (spread.median, spread.min, spread.max, spread.q1, spread.q3) == (3.0, 1.0, 5.0, 2.0, 4.0)
    assert Spread.of([7.0]) == Spread(7.0, 7.0, 7.0, 7.0, 7.0)


def test_ideal_speedup():
    assert ideal_speedup(30, 26) == pytest.approx(30 / 26)
    with pytest.raises(LayercutError):
        ideal_speedup(30, 0)


def test_noisy_timings_are_flagged():
    steady = model("base", [100, 101, 99], [50, 50, 51])
    wild = model("cut", [87, 292, 150], [60, 61, 60])  # 8.7-29.2-like spread
    ratio = speed_ratio(steady, wild)
    comparison = SpeedComparison(steady, [wild], [ratio], SpeedOptions(), "cpu", 2)
    lines = noise_warnings(comparison)
    assert any(line.startswith("cut prefill: 87.0-292.0 tokens/s") for line in lines)
    assert not any("decode" in line and line.startswith("cut decode:") for line in lines)
    steady_only = SpeedComparison(steady, [], [], SpeedOptions(), "cpu", 2)
    assert noise_warnings(steady_only) == []


def test_peak_memory_is_attached_and_the_ratios_follow():
    base, cut = model("base", [100.0], [50.0], blocks=4), model("cut", [150.0], [80.0], blocks=3)
    comparison = SpeedComparison(base, [cut], [speed_ratio(base, cut)], SpeedOptions(), "cpu", 2)
    ratio = comparison.ratios[0]
    assert (ratio.prefill, ratio.decode, ratio.ideal, ratio.peak_memory) == (1.5, 1.6, 4 / 3, None)
    attach_memory(comparison, {"base": (1000, "cpu: test"), "cut": (750, "cpu: test")})
    assert (cut.peak_memory_bytes, cut.memory_method) == (750, "cpu: test")
    assert comparison.ratios[0].peak_memory == 0.75
    assert comparison.to_dict()["ratios"][0]["peak_memory"] == 0.75
