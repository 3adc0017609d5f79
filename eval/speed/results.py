"""What a speed comparison gives: spreads of repeated timings, per-model figures and speed-up ratios.

Speed-ups are reported both as the ratio of medians and as the spread of per-repeat (paired) ratios,
which cancels slow drifts of a shared machine; :func:`noise_warnings` names the timings too noisy to trust.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from eval.speed.timing import SpeedOptions
from prune.errors import LayercutError


@dataclass
class Spread:
    """Median and spread of repeated measurements (float64)."""

    median: float
    min: float
    max: float
    q1: float
    q3: float

    @classmethod
    def of(cls, samples: list[float]) -> Spread:
        """Summarise samples; quartiles by the inclusive method (exact for 1 or 2 samples too)."""
        values = sorted(float(v) for v in samples)
        if len(values) == 1:
            return cls(values[0], values[0], values[0], values[0], values[0])
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(statistics.median(values), values[0], values[-1], q1, q3)


@dataclass
class ModelSpeed:
    """Measurements of one model.

    Attributes:
        name: Label (model name or folder).
        num_blocks: Decoder blocks in the model.
        params: Parameter count.
        weights_bytes: Bytes of parameters and buffers in memory.
        checkpoint_bytes: Bytes of weight files on disk, None for a model without a folder.
        prefill_tokens_per_s: Spread of prefill throughput.
        decode_tokens_per_s: Spread of decode throughput.
        prefill_s: Raw prefill seconds per repeat.
        decode_s: Raw decode seconds per repeat.
        peak_memory_bytes: Peak memory attributable to the model (see ``memory_method``), or None.
        memory_method: How the peak was measured.
    """

    name: str
    num_blocks: int
    params: int
    weights_bytes: int
    checkpoint_bytes: int | None
    prefill_tokens_per_s: Spread
    decode_tokens_per_s: Spread
    prefill_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    peak_memory_bytes: int | None = None
    memory_method: str | None = None


@dataclass
class SpeedRatio:
    """Candidate speed / baseline speed; ``ideal`` is ``L / (L - k)`` from the block counts."""

    name: str
    ideal: float
    prefill: float
    decode: float
    prefill_paired: Spread
    decode_paired: Spread
    params: float
    peak_memory: float | None


@dataclass
class SpeedComparison:
    """A baseline, its candidates and their ratios, with the settings used and the engine that ran them."""

    baseline: ModelSpeed
    candidates: list[ModelSpeed]
    ratios: list[SpeedRatio]
    options: SpeedOptions
    device: str
    torch_threads: int
    engine: str = "transformers"
    engine_version: str | None = None
    engine_settings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Return a JSON-ready dict."""
        return asdict(self)


def ideal_speedup(baseline_blocks: int, candidate_blocks: int) -> float:
    """``L / (L - k)``: the speed-up if all time were spent in the blocks."""
    if candidate_blocks < 1:
        raise LayercutError(f"a candidate with {candidate_blocks} blocks has no ideal speed-up; keep at least one")
    return baseline_blocks / candidate_blocks


def speed_ratio(base: ModelSpeed, cand: ModelSpeed) -> SpeedRatio:
    """Candidate / baseline throughput: ratio of medians, and the spread of per-repeat ratios."""
    paired_prefill = [b / c for b, c in zip(base.prefill_s, cand.prefill_s, strict=True)]
    paired_decode = [b / c for b, c in zip(base.decode_s, cand.decode_s, strict=True)]
    memory = None
    if base.peak_memory_bytes and cand.peak_memory_bytes:
        memory = cand.peak_memory_bytes / base.peak_memory_bytes
    return SpeedRatio(
        name=cand.name,
        ideal=ideal_speedup(base.num_blocks, cand.num_blocks),
        prefill=cand.prefill_tokens_per_s.median / base.prefill_tokens_per_s.median,
        decode=cand.decode_tokens_per_s.median / base.decode_tokens_per_s.median,
        prefill_paired=Spread.of(paired_prefill),
        decode_paired=Spread.of(paired_decode),
        params=cand.params / base.params,
        peak_memory=memory,
    )


# Spreads past these (max / min over the repeats) mean the machine, not the model, set the timing.
NOISY_RUN_SPREAD = 1.5
NOISY_RATIO_SPREAD = 1.25


def noise_warnings(comparison: SpeedComparison) -> list[str]:
    """One line per timing too noisy to trust: a model's throughput or a paired ratio that varied too much."""
    lines = []
    for model in [comparison.baseline, *comparison.candidates]:
        for phase, spread in (("prefill", model.prefill_tokens_per_s), ("decode", model.decode_tokens_per_s)):
            if spread.min > 0 and spread.max / spread.min > NOISY_RUN_SPREAD:
                lines.append(f"{model.name} {phase}: {spread.min:.1f}-{spread.max:.1f} tokens/s over the repeats "
                             f"(x{spread.max / spread.min:.2f}); the machine was busy, the figure is noise")
    for ratio in comparison.ratios:
        for phase, spread in (("prefill", ratio.prefill_paired), ("decode", ratio.decode_paired)):
            if spread.min > 0 and spread.max / spread.min > NOISY_RATIO_SPREAD:
                lines.append(f"{ratio.name} {phase} speed-up ranges x{spread.min:.3f}-x{spread.max:.3f} between "
                             "repeats: not a measurement; rerun on an idle machine, with --threads 1 or more --repeats")
    return lines


def attach_memory(comparison: SpeedComparison, peaks: dict[str, tuple[int | None, str]]) -> None:
    """Fill in peak memory (label -> (bytes, method)) and recompute the ratios."""
    for speed in [comparison.baseline, *comparison.candidates]:
        if speed.name in peaks:
            speed.peak_memory_bytes, speed.memory_method = peaks[speed.name]
    comparison.ratios = [speed_ratio(comparison.baseline, c) for c in comparison.candidates]

