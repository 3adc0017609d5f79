"""``ship.verify``: the engine checks load the models as the run did (its ``--dtype`` and ``--device``)."""

from __future__ import annotations

import signal as signal_module

import pytest

import ship.verify as verify_stage
from eval.bench.checks import CheckCrashed, FidelityCheck, ServingCheck, SpeedCheck, kept_row_path
from prune.errors import LayercutError
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


def test_the_speed_check_runs_the_original_as_the_shipped_file_s_gguf_type(tmp_path, monkeypatch):
    sent = []
    monkeypatch.setattr(verify_stage, "run_in_child", lambda check, log: sent.append(check) or {})
    checkpoint = tmp_path / "slim.work" / "checkpoint"
    (checkpoint / "gguf").mkdir(parents=True)
    for gguf_type, expected in (("q4_k_m", "q4_k_m"), ("f16", "f16")):
        sent.clear()
        config = ShipConfig(PruneConfig(load={"model": "org/model"}, drop=2), out=str(tmp_path / "slim"),
                            engine="llamacpp", gguf_type=gguf_type)
        verify_stage.verify(config, checkpoint, checkpoint / "gguf" / f"slim-{gguf_type}.gguf",
                            [f"rows={tmp_path / 'heldout.txt'}"], tmp_path / f"verify-{gguf_type}", say=lambda _: None)
        speed = sent[-1]
        assert isinstance(speed, SpeedCheck) and speed.model.endswith(f"slim-{gguf_type}.gguf")
        assert speed.gguf_type == expected


def test_repeats_0_times_nothing_and_says_so(tmp_path, monkeypatch):
    sent = []
    monkeypatch.setattr(verify_stage, "run_in_child", lambda check, log: sent.append(check) or {})
    checkpoint = tmp_path / "slim.work" / "checkpoint"
    checkpoint.mkdir(parents=True)
    config = ShipConfig(PruneConfig(load={"model": "org/model"}, drop=2), out=str(tmp_path / "slim"),
                        engine="llamacpp", gguf_type="q4_k_m", speed_repeats=0)
    verified = verify_stage.verify(config, checkpoint, checkpoint / "slim-q4_k_m.gguf",
                                   [f"rows={tmp_path / 'heldout.txt'}"], tmp_path / "verify", say=lambda _: None)
    assert not any(isinstance(check, SpeedCheck) for check in sent) and len(sent) == 2
    assert verified.speed == {"skipped": "--repeats 0"} and verified.check_seconds["speed"] is None
    with pytest.raises(LayercutError, match="--repeats must be 0 \\(no speed check\\) or more, got -1"):
        ShipConfig(PruneConfig(load={"model": "org/model"}, drop=2), out=str(tmp_path / "slim"), speed_repeats=-1)


def test_a_speed_check_passes_its_gguf_type_to_the_engine(monkeypatch):
    import eval.bench.speed as speed

    given = []
    monkeypatch.setattr(speed, "measure_speed",
                        lambda engine, baseline, models, load, **options: given.append(options["settings"]))
    SpeedCheck(baseline="org/model", model="slim.gguf", engine="llamacpp", gguf_type="q4_k_m").run()
    SpeedCheck(baseline="org/model", model="slim/", engine="transformers").run()
    assert given == [{"gguf_type": "q4_k_m"}, {}]


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


def test_the_planner_costs_the_original_s_fidelity_side_until_a_run_keeps_it(tiny_folder, tmp_path, sample_text,
                                                                              monkeypatch, one_thread):
    from ship.cli import build_parser, config_from_args
    from ship.plan import make_plan

    monkeypatch.setenv("LAYERCUT_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "text.txt"
    text.write_text(sample_text * 3)
    config = config_from_args(build_parser().parse_args(
        ["--model", str(tiny_folder), "--data", str(text), "--samples", "16", "--seq-len", "32", "--drop", "2",
         "--engine", "transformers", "--threads", "1", "--heal-steps", "0", "--heldout", f"text={text}",
         "--out", str(tmp_path / "slim")]))
    import ship.plan as plan_module

    costed = []  # what the plan costs (unrounded: a tiny model's decoding is a fraction of a planned second)
    real = plan_module.stage_seconds
    monkeypatch.setattr(plan_module, "stage_seconds", lambda *args: costed.append(args) or real(*args))
    make_plan(config)
    check = config.fidelity_check(str(tiny_folder), list(config.heldout))
    assert check.keep_original and not check.original_kept()
    check.run()  # the verify stage's check, as a first ship runs it: the original's side goes to the cache
    make_plan(config)
    assert check.original_kept() and [work.fidelity_kept for *_, work in costed] == [False, True]
    (shape, inp, first), (_, _, second) = costed
    assert 0 < real(shape, inp, second)["verify"] < real(shape, inp, first)["verify"]


def test_each_check_s_seconds_are_kept_and_a_check_kept_by_an_earlier_run_has_none(tmp_path, monkeypatch):
    import time

    def slow(check, log):
        time.sleep(0.05 if isinstance(check, SpeedCheck) else 0.01)
        return {}

    monkeypatch.setattr(verify_stage, "run_in_child", slow)
    config = ShipConfig(PruneConfig(load={"model": "org/model"}, drop=2), out=str(tmp_path / "slim"))
    checkpoint = tmp_path / "slim.work" / "checkpoint"
    checkpoint.mkdir(parents=True)
    args = (config, checkpoint, None, [f"rows={tmp_path / 'heldout.txt'}"], tmp_path / "verify")
    seconds = verify_stage.verify(*args, say=lambda _: None).check_seconds
    assert list(seconds) == ["serving", "fidelity", "speed"] and seconds["speed"] >= 0.05
    assert 0.01 <= seconds["serving"] < seconds["speed"]
    (tmp_path / "verify" / "speed.json").unlink()  # the other two kept: measured again, the speed alone
    again = verify_stage.verify(*args, say=lambda _: None).check_seconds
    assert again["serving"] is None and again["fidelity"] is None and again["speed"] >= 0.05


def _crashing_with_repack(sent: list, signal: str = "SIGSEGV", crashes=("ServingCheck", "SpeedCheck"), always=False):
    """A ``run_in_child`` whose engine crashes in the ``crashes`` checks while llama.cpp's extra buffer types are on
    (as on the CPUs where a build of it does), or ``always``; a FidelityCheck, in transformers, runs."""

    def run(check, log):
        sent.append(check)
        if type(check).__name__ in crashes and (always or not check.no_repack):
            log.write_text("loading\n")
            raise CheckCrashed(type(check).__name__, -getattr(signal_module, signal), "loading", log)
        return {}

    return run


def _verify(tmp_path, config, say=lambda _: None, folder="verify"):
    checkpoint = tmp_path / "slim.work" / "checkpoint"
    checkpoint.mkdir(parents=True, exist_ok=True)
    heldout = [f"rows={tmp_path / 'heldout.txt'}"]
    return verify_stage.verify(config, checkpoint, checkpoint / "slim-q4_k_m.gguf", heldout, tmp_path / folder, say=say)


def _llamacpp(tmp_path, **changes) -> ShipConfig:
    return ShipConfig(PruneConfig(load={"model": "org/model"}, drop=2), out=str(tmp_path / "slim"),
                      engine="llamacpp", gguf_type="q4_k_m", **changes)


def test_a_check_llama_cpp_crashes_runs_again_with_its_extra_buffers_off_and_the_card_says_so(tmp_path, monkeypatch):
    from ship.card import ship_command

    sent, said = [], []
    monkeypatch.setattr(verify_stage, "run_in_child", _crashing_with_repack(sent))
    config = _llamacpp(tmp_path)
    verified = _verify(tmp_path, config, said.append)
    serving, serving_again, _, speed = sent
    assert (serving.no_repack, serving_again.no_repack) == (False, True) and serving_again.models == serving.models
    assert speed.no_repack, "the speed check starts with them off: both files timed the same way"
    why = "the serving check crashed (SIGSEGV) with them on"
    assert verified.files["no_repack"] == {"serving": why, "speed": why}
    assert any("the serving check crashed (SIGSEGV) in llama.cpp; checking again with its extra buffer types off "
               f"(--no-repack; the crash's log: {tmp_path / 'verify' / 'serving.crashed.log'})" in line
               for line in said)
    assert (tmp_path / "verify" / "serving.crashed.log").read_text() == "loading\n"
    (tmp_path / "verify" / "speed.json").unlink()  # a resumed run: the speed check alone, with them off from the start
    sent.clear()
    assert _verify(tmp_path, config).files["no_repack"] == {"serving": why, "speed": why}
    assert [check.no_repack for check in sent if not isinstance(check, FidelityCheck)] == [True]
    assert "--no-repack" not in ship_command(config)
    given = _llamacpp(tmp_path, no_repack=True)
    sent.clear()
    assert _verify(tmp_path, given, folder="verify-given").files["no_repack"] == {"serving": "--no-repack",
                                                                                  "speed": "--no-repack"}
    assert [check.no_repack for check in sent if not isinstance(check, FidelityCheck)] == [True, True]
    assert "--no-repack" in ship_command(given).split()


def test_a_crash_in_the_speed_check_alone_is_said_of_it_alone(tmp_path, monkeypatch):
    sent = []
    monkeypatch.setattr(verify_stage, "run_in_child", _crashing_with_repack(sent, crashes=("SpeedCheck",)))
    verified = _verify(tmp_path, _llamacpp(tmp_path))
    assert [type(check).__name__ for check in sent] == ["ServingCheck", "FidelityCheck", "SpeedCheck", "SpeedCheck"]
    assert verified.files["no_repack"] == {"speed": "the speed check crashed (SIGSEGV) with them on"}


def test_a_check_that_crashes_again_with_them_off_fails_and_keeps_no_reason(tmp_path, monkeypatch):
    sent = []
    monkeypatch.setattr(verify_stage, "run_in_child", _crashing_with_repack(sent, always=True))
    with pytest.raises(CheckCrashed, match="ended by SIGSEGV"):
        _verify(tmp_path, _llamacpp(tmp_path))
    assert [check.no_repack for check in sent] == [False, True]  # once more, not a loop
    assert not list((tmp_path / "verify").glob(f"*{verify_stage.NO_REPACK}"))  # a resumed run tries with them on


@pytest.mark.parametrize(("engine", "signal"), [("llamacpp", "SIGKILL"), ("llamacpp", "SIGTERM"),
                                                ("transformers", "SIGSEGV")])
def test_a_crash_extra_buffers_cannot_cause_is_not_tried_again(tmp_path, monkeypatch, engine, signal):
    sent = []
    monkeypatch.setattr(verify_stage, "run_in_child", _crashing_with_repack(sent, signal))
    config = ShipConfig(PruneConfig(load={"model": "org/model"}, drop=2), out=str(tmp_path / "slim"), engine=engine)
    with pytest.raises(CheckCrashed, match=f"ended by {signal}"):
        _verify(tmp_path, config)
    assert len(sent) == 1 and not list((tmp_path / "verify").glob(f"*{verify_stage.NO_REPACK}"))


def test_no_repack_with_an_engine_that_has_no_such_setting_is_refused(tmp_path):
    with pytest.raises(LayercutError, match=r"^--no-repack is a setting of llamacpp, not of --engine transformers: "
                                            r"drop it$"):
        ShipConfig(PruneConfig(load={"model": "org/model"}, drop=2), out=str(tmp_path / "slim"),
                   engine="transformers", no_repack=True)


def test_the_tasks_check_runs_after_fidelity_and_its_figures_are_kept_for_a_resumed_run(tmp_path, monkeypatch):
    from eval.bench.checks import TasksCheck
    from tests.helpers import write_piqa

    sent, said = [], []
    monkeypatch.setattr(verify_stage, "run_in_child",
                        lambda check, log: sent.append((check, log.name)) or ({"tasks": {"piqa": {}}}
                                                                              if isinstance(check, TasksCheck) else {}))
    config = ShipConfig(PruneConfig(load={"model": "org/model", "dtype": "bfloat16"}, drop=2, batch_size=2),
                        out=str(tmp_path / "slim"), engine="transformers", tasks=["piqa"], limit=200,
                        data_dir=str(write_piqa(tmp_path / "data")))
    checkpoint = tmp_path / "slim.work" / "checkpoint"
    checkpoint.mkdir(parents=True)
    args = (config, checkpoint, None, [f"rows={tmp_path / 'heldout.txt'}"], tmp_path / "verify")
    verified = verify_stage.verify(*args, say=said.append)
    assert [log for _, log in sent] == ["serving.log", "fidelity.log", "tasks.log", "speed.log"]
    check = sent[2][0]
    assert (check.original, check.model, check.tasks, check.limit, check.batch_size, check.dtype) == (
        "org/model", str(checkpoint), ("piqa",), 200, 2, "bfloat16") and check.keep_original
    assert ("verifying: lm-eval tasks piqa (200 rows each) on the original and the checkpoint in transformers"
            in said)
    assert verified.tasks == {"tasks": {"piqa": {}}} and verified.check_seconds["tasks"] is not None
    sent.clear()
    again = verify_stage.verify(*args, say=said.append)  # a resumed run: the kept figures, no check
    assert sent == [] and again.tasks == verified.tasks
    assert again.check_seconds["tasks"] is None
    # without --tasks, no check and nothing kept
    (tmp_path / "plain").mkdir()
    sent.clear()
    plain = ShipConfig(PruneConfig(load={"model": "org/model"}, drop=2), out=str(tmp_path / "slim"),
                       engine="transformers")
    assert verify_stage.verify(plain, checkpoint, None, args[3], tmp_path / "plain", say=said.append).tasks == {}
    assert "tasks.log" not in [log for _, log in sent]


def test_the_planner_costs_the_original_s_task_scores_until_a_run_keeps_them(tiny_folder, tmp_path, sample_text,
                                                                             monkeypatch):
    import ship.plan as plan_module
    from eval.bench.checks import _keep_row
    from ship.cli import build_parser, config_from_args
    from ship.plan import make_plan
    from tests.helpers import write_piqa

    monkeypatch.setenv("LAYERCUT_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "text.txt"
    text.write_text(sample_text * 3)
    config = config_from_args(build_parser().parse_args(
        ["--model", str(tiny_folder), "--data", str(text), "--samples", "16", "--seq-len", "32", "--drop", "2",
         "--engine", "transformers", "--heal-steps", "0", "--tasks", "piqa", "--limit", "100",
         "--data-dir", str(write_piqa(tmp_path / "data")), "--out", str(tmp_path / "slim")]))
    costed = []
    real = plan_module.stage_seconds
    monkeypatch.setattr(plan_module, "stage_seconds", lambda *args: costed.append(args) or real(*args))
    make_plan(config)
    check = config.tasks_check("")
    _keep_row(check._kept_path(), {"runs": 1, "scores": {}})  # as a first ship's check keeps them
    make_plan(config)
    (shape, inp, first), (_, _, second) = costed
    assert [work.tasks_kept for work in (first, second)] == [False, True]
    assert [(task.name, task.rows, task.batch) for task in first.tasks] == [("piqa", 100, 4)]
    assert 0 < real(shape, inp, second)["verify"] < real(shape, inp, first)["verify"]
