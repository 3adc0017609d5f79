"""``eval.bench teacher-cache``: the runs it starts, the options it checks, and how it reads and reports them."""

import dataclasses
import json
from pathlib import Path

import pytest

from distill.run import build_parser, config_from_args
from eval.bench.teacher_cache import (
    KL_GAP_TARGET,
    STEP_RATIO_TARGET,
    CacheBenchOptions,
    _verdict,
    cache_markdown,
    choose_k,
    distill_config,
    distill_flags,
    step_seconds,
)
from prune.errors import LayercutError

OPTIONS = CacheBenchOptions(steps=7, batch_size=2, samples=40, seq_len=32, heldout_samples=4, selection_samples=4,
                            threads=1)


@pytest.mark.parametrize("train", ["replacements", "lora"])
@pytest.mark.parametrize("k", [None, 16])
def test_the_cache_writer_asks_for_the_config_the_distillation_child_builds(k, train):
    """The cache is keyed by the run's config: the writer's must be the one ``distill.run`` makes of the flags."""
    options = dataclasses.replace(OPTIONS, train=train)
    flags = distill_flags(options, Path("student"), Path("out"), k)
    assert flags[:2] == ["-m", "distill.run"] and ("--teacher-cache" in flags) == (k is not None)
    config = config_from_args(build_parser().parse_args(flags[2:]))
    assert config == distill_config(options, k) and config.train == train


@pytest.mark.parametrize("values,message", [
    (dict(k="0"), "--k must be a positive integer or auto"),
    (dict(k_candidates=[16, 0]), "--k-candidates must be positive integers"),
    (dict(heldout_samples=0), "--heldout-samples and --selection-samples must be positive"),
    (dict(samples=8, selection_samples=16), "--selection-samples (16) cannot exceed --samples (8)"),
])
def test_bad_options_are_one_line(values, message):
    with pytest.raises(LayercutError) as err:
        CacheBenchOptions(**values)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_given_k_is_taken_without_measuring():
    assert choose_k(CacheBenchOptions(k="32"), None, None, None) == (32, {"rule": "given (--k)"})


def test_step_times_verdict_and_table(tmp_path):
    log = tmp_path / "train_log.jsonl"
    log.write_text("".join(json.dumps({"step": i + 1, "seconds": s}) + "\n" for i, s in enumerate([1.0, 1.5, 2.5])))
    assert step_seconds(log) == [1.0, 0.5, 1.0]
    online = {"median_step_seconds": 1.0, "peak_memory_bytes": 400 * 2**20, "heldout_kl": 0.5}
    cached = {"median_step_seconds": 0.5, "peak_memory_bytes": 200 * 2**20, "heldout_kl": 0.51,
              "cache_write": {"seconds": 3.0}}
    verdict = _verdict(online, cached, {"online": 0.5, "cached": 0.51})
    assert verdict == {"step_ratio": 0.5, "kl_gap": 0.02, "memory_ratio": 0.5,
                       "meets": {"step_ratio": 0.5 <= STEP_RATIO_TARGET, "kl_gap": 0.02 <= KL_GAP_TARGET}}
    result = {"model": "tiny", "drop": 2, "k": 16, "options": {"steps": 7, "batch_size": 2, "seq_len": 32},
              "device": "cpu", "heldout_sequences": 4, "kl_before": 0.9, "online": online, "cached": cached,
              "k_selection": {"rule": "given (--k)"}, **verdict}
    table = cache_markdown(result).splitlines()
    assert "| online KD | 400 | 1.000 | - | 0.5000 |" in table
    assert "| cached top-16 | 200 | 0.500 | 3.0 | 0.5100 |" in table
    assert table[-1] == "K = 16: given (--k)" and "(target <= 0.6: met)" in table[-2]


def test_the_text_field_reaches_the_children_and_the_distillation(tmp_path):
    from eval.bench.cli import build_parser as bench_parser
    from eval.bench.registry import SUBCOMMANDS
    from eval.bench.teacher_cache import _data_flags, prune_student

    args = bench_parser().parse_args(["teacher-cache", "--data", "rows.jsonl", "--text-field", "body"])
    assert SUBCOMMANDS["teacher-cache"].parse(args).data.text_field == "body"
    options = CacheBenchOptions(data="rows.jsonl", text_field="body")
    flags = _data_flags(options)
    assert flags[flags.index("--text-field") + 1] == "body"
    assert distill_config(options, 16).data.text_field == "body"
    spawned = []
    import eval.bench.teacher_cache as bench

    original, bench._child = bench._child, lambda argv, what: spawned.append(argv)
    try:
        prune_student(options, tmp_path)
    finally:
        bench._child = original
    assert spawned[0][spawned[0].index("--text-field") + 1] == "body"
