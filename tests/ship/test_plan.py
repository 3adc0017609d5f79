"""``ship.plan.make_plan``: the run's memory is the most any one stage holds, and the plan names that stage.

The models are configs alone, written to a folder (no weight anywhere): a Llama-3-8B shape, planned on one GPU as
it ran on an H200 on 2026-12-04 (reports/gpu-ship/h200-2026-12-04b), and SmolLM2-135M on this CPU.
"""

import logging
import re

import pytest
from transformers import LlamaConfig

from prune.errors import LayercutError
from prune.pipeline.config import PruneConfig
from ship.config import ShipConfig
from tests.prune.planner.test_planner import LLAMA3_8B, SMOLLM2_135M


@pytest.fixture(autouse=True)
def _plenty_of_disk(monkeypatch):
    """The 8B shape's plans here are of memory and time: the machine's free disk is not theirs to refuse on."""
    _disk(monkeypatch, 1e12)


def _plan(folder, config: dict, tmp_path, **data):
    from ship.plan import make_plan

    LlamaConfig(**config).save_pretrained(folder)
    prune = PruneConfig(load={"model": str(folder)}, data={"data": "builtin", **data}, drop=8)
    return make_plan(ShipConfig(prune=prune, out=str(tmp_path / "slim"), engine="transformers"))


def test_the_8b_shapes_plan_peaks_in_the_shortlist_and_names_it(tmp_path, monkeypatch, caplog):
    """Before: prune.run's plan of --replace none, 26.3 GB, the whole run's (61.3 GB measured in the shortlist)."""
    monkeypatch.setattr("prune.planner.estimate.local_gpus", lambda device: (1, 141e9))
    plan = _plan(tmp_path / "llama-3-8b", LLAMA3_8B, tmp_path, samples=32, heldout_samples=4)
    peaks = plan.planned_stage_peaks
    assert list(peaks) == ["shortlist", "build", "heal"]
    # what ship planned for that run (26,341,337,600 bytes), less the held-out logits' third copy (2026-12-05)
    assert peaks["build"]["cuda:0"] == pytest.approx(26_341_337_600 * 0.993, rel=0.001)
    assert plan.planned_peak_stage["cuda:0"] == "shortlist"
    assert plan.planned_peak["cuda:0"] == peaks["shortlist"]["cuda:0"] == max(p["cuda:0"] for p in peaks.values())
    # before the scoring pass the plan guesses three block sets of two spans, each repair fitting all six at once:
    # above the 61.3 GB the run's two sets of one span took (tests/prune/planner/test_shortlist_memory.py has them)
    assert peaks["shortlist"]["cuda:0"] == pytest.approx(95.1e9, rel=0.002)
    assert plan.planned_heal_peak == peaks["heal"] and peaks["heal"]["cuda:0"] < peaks["shortlist"]["cuda:0"]
    # on an 80 GB GPU the shortlist may not fit: said, not refused (the block sets are a guess)
    monkeypatch.setattr("prune.planner.estimate.local_gpus", lambda device: (1, 80e9))
    with caplog.at_level(logging.WARNING, logger="ship.plan"):
        _plan(tmp_path / "llama-3-8b", LLAMA3_8B, tmp_path, samples=32, heldout_samples=4)
    assert "the shortlist is planned at 95.1 GB on cuda:0, which has 80.0 GB" in caplog.text


def test_smollm2s_cpu_plan_stays_below_what_a_whole_ship_measured(tmp_path, monkeypatch):
    """SmolLM2-135M drop 4 and 8 on the CPU: a whole ship's peak RSS was 6.3-6.8 GB (reports/ship-defaults), against
    2.41-2.47 GB planned before the shortlist had a peak of its own."""
    monkeypatch.setattr("prune.planner.estimate.local_gpus", lambda device: (0, 0.0))
    plan = _plan(tmp_path / "smollm2-135m", SMOLLM2_135M, tmp_path)
    assert plan.planned_peak_stage["cpu"] == "shortlist"  # its measuring's vocabulary-wide logits
    assert 2.4e9 < plan.planned_peak["cpu"] < 4e9
    assert plan.planned_peak["cpu"] == pytest.approx(2.80e9, rel=0.01)  # 0.08 GB of it the KL's chunks


def test_the_8b_shapes_shortlist_memory_once_its_sets_are_known_is_near_what_the_h200_measured(tmp_path, monkeypatch):
    """The H200 run's selections chose two sets of one span each: 63.25 GB counted with them (61.3 GB measured),
    where the guess before loading (three sets of two spans) was 95.1 GB."""
    import torch
    from transformers import LlamaForCausalLM

    from ship.plan import memory_words, replanned_shortlist_peak

    monkeypatch.setattr("prune.planner.estimate.local_gpus", lambda device: (1, 141e9))
    folder = tmp_path / "llama-3-8b"
    LlamaConfig(**LLAMA3_8B).save_pretrained(folder)
    prune = PruneConfig(load={"model": str(folder)}, data={"data": "builtin", "samples": 32, "heldout_samples": 4},
                        drop=8)
    config = ShipConfig(prune=prune, out=str(tmp_path / "slim"), engine="transformers")
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA3_8B))
    known = replanned_shortlist_peak(config, model, 8, [list(range(20, 28)), list(range(21, 29))])
    assert known["cuda:0"] == pytest.approx(63.25e9, rel=0.002)
    assert abs(known["cuda:0"] / 61_330_509_824 - 1) < 0.3
    # one set counted once, however often the selections chose it; a scattered set fits each of its spans
    assert replanned_shortlist_peak(config, model, 8, [list(range(20, 28))] * 2)["cuda:0"] < known["cuda:0"]
    scattered = replanned_shortlist_peak(config, model, 8, [[2, 4, 6, 8, 20, 22, 24, 26]])
    assert scattered["cuda:0"] > known["cuda:0"]
    assert replanned_shortlist_peak(config, model, 8, []) is None
    assert memory_words(known).endswith(", 63.2 GB on cuda:0")  # beside the host's share (the CPU's rows)
    assert memory_words({"cpu": 3.13e9}) == "3.1 GB"
    assert memory_words({"cuda:0": 31.6e9, "cuda:1": 30.2e9}) == "31.6 GB on cuda:0, 30.2 GB on cuda:1"


def _disk(monkeypatch, free: float):
    import collections

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr("ship.disk.shutil.disk_usage", lambda path: usage(2 * free, free, free))


def test_a_run_the_disk_cannot_hold_is_refused_before_loading_naming_what_it_writes(tmp_path, monkeypatch):
    """The 8B shape in float32 at drop 8 on this CPU, for llama.cpp at q4_k_m: 25.1 GB of checkpoint, 3.8 GB of
    GGUF after its 12.6 GB float16 conversion, and the speed check's 4.9 GB of the original after its own 16.1 GB
    (2026-12-06: the disk here had 46 GB free beside the 32.1 GB original)."""
    from ship.disk import ship_needs
    from ship.plan import make_plan

    monkeypatch.setattr("prune.planner.estimate.local_gpus", lambda device: (0, 0.0))
    monkeypatch.setattr("ship.plan.check_engine", lambda config: None)
    monkeypatch.setenv("LAYERCUT_CACHE", str(tmp_path / "cache"))
    LlamaConfig(**LLAMA3_8B).save_pretrained(tmp_path / "llama-3-8b")

    def config(**ship):
        prune = PruneConfig(load={"model": str(tmp_path / "llama-3-8b"), "offload": "sequential"},
                            data={"data": "builtin", "samples": 32}, drop=8)
        return ShipConfig(prune=prune, out=str(tmp_path / "slim"), engine="llamacpp", gguf_type="q4_k_m", **ship)

    _disk(monkeypatch, 46e9)
    with pytest.raises(LayercutError, match=r"writes about 52\.5 GB at its peak .*\(the slim checkpoint 25\.1 GB, "
                                            r"the q4_k_m GGUF 3\.8 GB, its float16 conversion 12\.6 GB, the "
                                            r"original's q4_k_m GGUF for the speed check 4\.9 GB, its float16 "
                                            r"conversion 16\.1 GB\) and it has 46\.0 GB free"):
        make_plan(config(heal_steps=0))
    # a healed copy of the checkpoint is another 25.1 GB; without the speed check (--repeats 0) the original's
    # files are not written: 25.1 + 3.8 + 12.6 GB, 43.6 GB with the slack
    with pytest.raises(LayercutError, match=r"writes about 78\.9 GB"):
        make_plan(config())
    assert make_plan(config(heal_steps=0, speed_repeats=0)).drop == 8
    _disk(monkeypatch, 43e9)
    with pytest.raises(LayercutError, match=r"writes about 43\.6 GB"):
        make_plan(config(heal_steps=0, speed_repeats=0))
    # what a stopped run has written is not counted again: the checkpoint, then its GGUF
    (tmp_path / "slim.work" / "checkpoint" / "gguf").mkdir(parents=True)
    assert make_plan(config(heal_steps=0, speed_repeats=0)).drop == 8
    from prune.planner.estimate import hardware_for, plan_config

    planned = plan_config(config().prune, hardware_for("cpu"))
    needs = ship_needs(config(heal_steps=0, speed_repeats=0), planned.shape, planned.inp, 8, None)
    assert [need.what for need in needs] == ["the q4_k_m GGUF", "its float16 conversion"]
    (tmp_path / "slim.work" / "checkpoint" / "gguf" / "slim-q4_k_m.gguf").write_bytes(b"GGUF")
    assert ship_needs(config(heal_steps=0, speed_repeats=0), planned.shape, planned.inp, 8, None) == []
    # a healed run ships the healed copy's GGUF: the checkpoint's, from a run without the heal, is not it
    (tmp_path / "slim.work" / "healed").mkdir()
    healed = ship_needs(config(speed_repeats=0), planned.shape, planned.inp, 8, None)
    assert [need.what for need in healed] == ["the q4_k_m GGUF", "its float16 conversion"]
    # a resumed run whose heal was not kept ships the checkpoint: its GGUF is there, nothing is left to write
    assert ship_needs(config(speed_repeats=0), planned.shape, planned.inp, 8, None, heal_kept=False) == []


def test_a_resumed_run_checks_the_disk_for_what_it_has_still_to_write(tmp_path, monkeypatch):
    """The disk may have filled while a run was stopped: it is refused before the next stage, not in its midst."""
    from ship.plan import Plan, check_disk_left

    monkeypatch.setattr("prune.planner.estimate.local_gpus", lambda device: (0, 0.0))
    monkeypatch.setenv("LAYERCUT_CACHE", str(tmp_path / "cache"))
    LlamaConfig(**LLAMA3_8B).save_pretrained(tmp_path / "llama-3-8b")
    prune = PruneConfig(load={"model": str(tmp_path / "llama-3-8b"), "offload": "sequential"},
                        data={"data": "builtin", "samples": 32}, drop=8)
    config = ShipConfig(prune=prune, out=str(tmp_path / "slim"), engine="llamacpp", gguf_type="q4_k_m",
                        heal_steps=0, speed_repeats=0)
    (tmp_path / "slim.work" / "checkpoint").mkdir(parents=True)  # the build was done: its GGUF is left
    _disk(monkeypatch, 10e9)
    with pytest.raises(LayercutError, match=r"writes about 17\.2 GB at its peak .*\(the q4_k_m GGUF 3\.8 GB, its "
                                            r"float16 conversion 12\.6 GB\) and it has 10\.0 GB free"):
        check_disk_left(config, Plan(num_blocks=32, params=None, drop=8))
    _disk(monkeypatch, 20e9)
    check_disk_left(config, Plan(num_blocks=32, params=None, drop=8))
    check_disk_left(config, Plan(num_blocks=None, params=None, drop=None))  # no budget resolved: nothing planned


def test_a_time_budget_the_tasks_overrun_names_tasks_and_limit_among_the_ways_out(tmp_path, monkeypatch):
    """SmolLM2-135M on this CPU: --tasks lambada runs lambada_openai's 5,153 rows from a data folder, and is planned so
    (it was planned as a task of unknown rows, counting nothing); a minute is refused either way."""
    import json

    import ship.plan as plan_module
    from tests.helpers import write_piqa

    monkeypatch.setattr("prune.planner.estimate.local_gpus", lambda device: (0, 0.0))
    monkeypatch.setenv("LAYERCUT_CACHE", str(tmp_path / "cache"))
    LlamaConfig(**SMOLLM2_135M).save_pretrained(tmp_path / "smollm2-135m")
    data = write_piqa(tmp_path / "data")
    (data / "lambada").mkdir()
    (data / "lambada" / "lambada_test.jsonl").write_text(json.dumps({"text": "The cat sat on the mat"}) + "\n")
    costed, real = [], plan_module.stage_seconds
    monkeypatch.setattr(plan_module, "stage_seconds", lambda *args: costed.append(args[2]) or real(*args))

    def refusal(**tasks) -> str:
        prune = PruneConfig(load={"model": str(tmp_path / "smollm2-135m")}, data={"data": "builtin"}, drop=8)
        with pytest.raises(LayercutError) as raised:
            plan_module.make_plan(ShipConfig(prune=prune, out=str(tmp_path / "slim"), engine="transformers",
                                             time_budget=60.0, **tasks))
        return str(raised.value)

    words = refusal(tasks=["lambada"], data_dir=str(data))
    assert [(task.name, task.rows) for task in costed[0].tasks] == [("lambada_openai", 5153)]
    assert re.search(r": give more time, a smaller --samples, fewer --tasks or a smaller --limit \(the tasks take "
                     r"\S+ of the verify stage's \S+\), or a smaller budget$", words), words
    # without tasks, or with a few rows of them that are no real share of the verify stage: not named
    for tasks in ({}, {"tasks": ["lambada"], "data_dir": str(data), "limit": 2}):
        assert refusal(**tasks).endswith(": give more time, a smaller --samples, or a smaller budget")
