"""``eval.bench.checks``: a typed engine check runs in a process of its own and hands back its figures, or one line."""

from __future__ import annotations

import dataclasses
import json

import pytest

import eval.bench.checks as checks
from eval.bench.checks import CheckCrashed, FidelityCheck, ServingCheck, run_in_child
from prune.errors import LayercutError


def test_a_serving_check_scores_every_model_on_every_text_with_one_load_each(tiny_folder, tmp_path, sample_text):
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text(sample_text)
    second.write_text(sample_text[::-1])
    check = ServingCheck(models=(("original", str(tiny_folder), "transformers"),
                                 ("again", str(tiny_folder), "transformers")),
                         texts=(("first", str(first)), ("second", str(second))), tokenizer=str(tiny_folder),
                         seq_len=16, tokens=64, greedy_tokens=4, threads=1)
    figures = run_in_child(check, tmp_path / "check" / "serving.log")
    assert sorted(figures) == ["first", "second"]
    for text, result in figures.items():
        assert result["setup"]["windows"] == 4 and result["setup"]["predicted"] == 4 * 15
        rows = result["rows"]
        original, again = rows["original"]["transformers"], rows["again"]["transformers"]
        assert original["runs"] and original["ppl"] == again["ppl"] > 1, text  # the same model, the same ids
        assert len(original["greedy"]) == 4 and original["greedy"] == again["greedy"]
    assert figures["first"]["rows"]["original"]["transformers"]["ppl"] != \
        figures["second"]["rows"]["original"]["transformers"]["ppl"]
    assert sorted(p.name for p in (tmp_path / "check").iterdir()) == ["serving.log"]  # request and result read


def test_a_failed_check_is_one_line_naming_its_log(tiny_folder, tmp_path):
    check = ServingCheck(models=(("original", str(tiny_folder), "transformers"),),
                         texts=(("gone", str(tmp_path / "missing.txt")),), tokenizer=str(tiny_folder), seq_len=16,
                         tokens=64, threads=1)
    with pytest.raises(LayercutError) as raised:
        run_in_child(check, tmp_path / "serving.log")
    message = str(raised.value)
    assert "\n" not in message and "missing.txt" in message and "serving.log" in message
    assert "exit 2" in message  # the check's own one-line refusal, not a crash


def test_a_check_whose_process_crashes_names_the_signal(tiny_folder, tmp_path, monkeypatch):
    crashing = tmp_path / "python"  # a "Python" that dies by SIGSEGV, as a native crash in an engine does
    crashing.write_text("#!/bin/sh\necho loading the model\nkill -SEGV $$\n")
    crashing.chmod(0o755)
    monkeypatch.setattr(checks.sys, "executable", str(crashing))
    check = ServingCheck(models=(("original", str(tiny_folder), "transformers"),), texts=(), tokenizer="t")
    with pytest.raises(CheckCrashed) as raised:
        run_in_child(check, tmp_path / "serving.log")
    assert raised.value.signal == "SIGSEGV"
    assert str(raised.value) == (f"the engine check failed (ServingCheck, ended by SIGSEGV): loading the model "
                                 f"(its log: {tmp_path / 'serving.log'})")


def test_a_crash_names_its_signal_and_what_sigkill_means(tmp_path):
    killed = CheckCrashed("SpeedCheck", -9, "timing", tmp_path / "speed.log")
    assert killed.signal == "SIGKILL" and "(SpeedCheck, ended by SIGKILL (out of memory, or stopped)): timing" in str(
        killed)
    assert CheckCrashed("SpeedCheck", -40, "x", tmp_path / "speed.log").signal == "signal 40"  # real-time: no name


def test_a_native_crash_inside_a_check_leaves_its_python_stack_in_the_log(tmp_path, monkeypatch):
    import os
    import sys

    # the child's check reads address 0, as an engine's native code crashing does, while descriptor 2 points at
    # /dev/null, as llama-cpp-python's quiet model load has it
    (tmp_path / "sitecustomize.py").write_text(
        "import ctypes, os\nimport eval.bench.checks as checks\n"
        "def crash_in_the_engine(self):\n"
        "    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)\n"
        "    return ctypes.string_at(0)\n"
        "checks.ServingCheck.run = crash_in_the_engine\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    monkeypatch.delenv("PYTHONFAULTHANDLER", raising=False)
    check = ServingCheck(models=(), texts=(), tokenizer="t")
    with pytest.raises(CheckCrashed, match="ended by SIGSEGV") as raised:
        run_in_child(check, tmp_path / "serving.log")
    # the line: the check's own last one and where it crashed, not the end of faulthandler's stack
    assert "): layercut check: this process started in " in str(raised.value)
    assert "s; crashed in File " in str(raised.value) and " in string_at (its log: " in str(raised.value)
    log = (tmp_path / "serving.log").read_text()
    assert "Fatal Python error: Segmentation fault" in log and "in crash_in_the_engine" in log


def test_the_original_s_rows_are_measured_once_then_read_from_the_cache(tiny_folder, tmp_path, sample_text,
                                                                       monkeypatch):
    import eval.bench.serving as serving

    monkeypatch.setenv("LAYERCUT_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "a.txt"
    text.write_text(sample_text)
    scored: list[list[str]] = []
    real = serving.score_texts
    monkeypatch.setattr(serving, "score_texts", lambda engine, models, *a: scored.append(sorted(models)) or
                        real(engine, models, *a))
    check = ServingCheck(models=(("original", str(tiny_folder), "transformers"),
                                 ("slim", str(tiny_folder), "transformers")),
                         texts=(("a", str(text)),), tokenizer=str(tiny_folder), seq_len=16, tokens=64,
                         greedy_tokens=4, threads=1, kept=("original",))
    first, second = check.run(), check.run()
    assert scored == [["original", "slim"], ["slim"]]  # the second run scored the slim model alone
    measured, kept = first["a"]["rows"]["original"]["transformers"], second["a"]["rows"]["original"]["transformers"]
    assert kept.pop("kept") is True and "kept" not in measured
    assert kept == measured and kept["ppl"] > 1
    # other token ids (another text, or more of it) are another key: measured again
    longer = ServingCheck(**{**check.__dict__, "tokens": 48})
    longer.run()
    assert scored[-1] == ["original", "slim"]
    # a changed file of the model is another key as well
    config = tiny_folder / "config.json"
    config.write_text(config.read_text())
    import os

    os.utime(config, ns=(1, 1))
    check.run()
    assert scored[-1] == ["original", "slim"]


def test_a_fidelity_check_has_the_original_judge_what_the_model_writes(tiny_folder, tmp_path, sample_text):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eval.bench.checks import FidelityCheck

    text = tmp_path / "text.txt"
    text.write_text(sample_text)
    other = tmp_path / "other"
    model = AutoModelForCausalLM.from_pretrained(tiny_folder)
    with torch.no_grad():  # a different model of the same shape: it writes other text than the original
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    model.save_pretrained(other)
    AutoTokenizer.from_pretrained(tiny_folder).save_pretrained(other)
    figures = {}
    for label, folder in (("itself", tiny_folder), ("other", other)):
        check = FidelityCheck(original=str(tiny_folder), model=str(folder), texts=(("text", str(text)),),
                              tokenizer=str(tiny_folder), prompts=4, prompt_tokens=8, new_tokens=6, threads=1)
        figures[label] = run_in_child(check, tmp_path / label / "fidelity.log")
    itself, changed = figures["itself"], figures["other"]
    assert itself["kept"] == 1.0 and itself["nll"] == pytest.approx(itself["own_nll"], rel=1e-6)
    assert itself["texts"] == ["text"] and len(itself["nll_rows"]) == 4 and itself["new_tokens"] == 6
    assert changed["kept"] < 1.0 and changed["nll"] > changed["own_nll"] == pytest.approx(itself["own_nll"])


def test_a_fidelity_check_keeps_the_original_s_side_and_reads_it_back(tiny_folder, tmp_path, sample_text,
                                                                       monkeypatch):
    monkeypatch.setenv("LAYERCUT_CACHE", str(tmp_path / "cache"))  # the child processes inherit it
    text = tmp_path / "text.txt"
    text.write_text(sample_text)
    check = FidelityCheck(original=str(tiny_folder), model=str(tiny_folder), texts=(("text", str(text)),),
                          tokenizer=str(tiny_folder), prompts=4, prompt_tokens=8, new_tokens=6, threads=1,
                          keep_original=True)
    assert not check.original_kept()  # the planner's question, asked before any run kept it
    first = run_in_child(check, tmp_path / "first.log")
    kept = list((tmp_path / "cache" / "fidelity-original").glob("*.json"))
    assert not first["original_kept"] and len(kept) == 1 and check.original_kept()
    again = run_in_child(check, tmp_path / "again.log")
    assert again["original_kept"] and {k: v for k, v in again.items() if k != "original_kept"} == {
        k: v for k, v in first.items() if k != "original_kept"}
    # what is read is the cache's: a floor written there is the one reported
    row = json.loads(kept[0].read_text())
    row["own_nll"] = [12.5] * 4
    kept[0].write_text(json.dumps(row))
    assert run_in_child(check, tmp_path / "third.log")["own_nll"] == pytest.approx(12.5)
    # another thread count is another entry: the greedy ids may follow the order of a sum
    assert not dataclasses.replace(check, threads=2).original_kept()
    other = run_in_child(dataclasses.replace(check, threads=2), tmp_path / "fourth.log")
    assert not other["original_kept"] and other["own_nll"] == pytest.approx(first["own_nll"], rel=1e-5)


def test_a_tasks_check_scores_both_models_on_the_same_rows_and_keeps_the_original_s(tiny_folder, tmp_path,
                                                                                   monkeypatch, lm_eval_once):
    import shutil

    from eval.bench.checks import TasksCheck
    from prune.checkpoint.load_config import LoadConfig
    from tests.helpers import write_piqa

    monkeypatch.setenv("LAYERCUT_CACHE", str(tmp_path / "cache"))  # the child process inherits it
    checkpoint = shutil.copytree(tiny_folder, tmp_path / "checkpoint")  # the same weights in another folder
    check = TasksCheck(original=str(tiny_folder), model=str(checkpoint), tasks=("piqa",), limit=3,
                       data_dir=str(write_piqa(tmp_path / "data")), batch_size=2, threads=1, keep_original=True)
    assert not check.original_kept()  # the planner's question, asked before any run kept it
    first = run_in_child(check, tmp_path / "tasks.log")
    piqa = first["tasks"]["piqa"]
    assert (piqa["metric"], piqa["rows"], piqa["chat"]) == ("acc", 3, False)
    assert first["rows"] == "the first 3 rows of each task" and first["limit"] == 3
    value = piqa["original"]
    assert piqa["original_stderr"] == pytest.approx((value * (1 - value) / 2) ** 0.5)  # lm-eval's, over 3 rows
    # the same weights answer each row as the original does: the paired gap is exactly none, where the two standard
    # errors alone would allow some
    assert piqa["model"] == value and piqa["kept"] == 1.0 and piqa["gap"] == 0 and piqa["gap_stderr"] == 0
    assert piqa["paired"] and "max_gen_toks" not in piqa and not first["original_kept"]
    # three rows leave the original within two standard errors of chance: no retention, and the figures say why
    assert "retention" not in first and first["retention_tasks"] == []
    assert first["excluded_tasks"] == {"piqa": f"the original's {value:.3f} is within 2 standard errors of chance 0.5"}
    kept = list((tmp_path / "cache" / "tasks-original").glob("*.json"))
    assert len(kept) == 1 and check.original_kept()
    # a second check (in this process) reads the original's side from the cache and loads the checkpoint alone
    row = json.loads(kept[0].read_text())
    rows = row["scores"]["task_rows"]["piqa"]
    assert len(rows) == 3 and sum(rows) / 3 == pytest.approx(value)
    flipped = [1.0 - rows[0], *rows[1:]]  # the cache's original answers its first row the other way
    row["scores"]["task_rows"]["piqa"], row["scores"]["tasks"]["piqa"] = flipped, sum(flipped) / 3
    kept[0].write_text(json.dumps(row))
    loaded, load = [], LoadConfig.load
    monkeypatch.setattr(LoadConfig, "load", lambda self, model=None: loaded.append(model) or load(self, model))
    again = check.run()
    assert loaded == [str(checkpoint)] and again["original_kept"]
    piqa = again["tasks"]["piqa"]
    assert piqa["original"] == pytest.approx(sum(flipped) / 3) and piqa["model"] == value  # the cache's original
    # one row of three differs: the paired standard error is the spread of (0, 0, +-1) over sqrt(3)
    assert piqa["gap"] == pytest.approx(value - sum(flipped) / 3) and piqa["gap_stderr"] == pytest.approx(1 / 3)
    # other rows are another entry
    assert not dataclasses.replace(check, limit=2).original_kept()


def _fake_lm_eval(monkeypatch, results: dict, stop: str | None = None) -> list:
    """Each model's lm-eval results (``results[model]``) without a load or a forward pass; the models loaded.

    ``stop``: the model whose scoring is stopped (a run killed there).
    """
    import types

    import torch

    from eval.quality import lmeval
    from prune.checkpoint.load_config import LoadConfig

    loaded = []
    monkeypatch.setattr(LoadConfig, "load", lambda self, model=None: loaded.append(model) or types.SimpleNamespace(
        model=torch.nn.Linear(1, 1), tokenizer=model))  # the tokenizer says which model lm-eval scores

    def scored(model, tokenizer, tasks, rows, **_):
        if tokenizer == stop:
            raise KeyboardInterrupt
        rows.update({task: [1.0, 0.0, 1.0] for task in tasks})
        return results[tokenizer]

    monkeypatch.setattr(lmeval, "run_lm_eval", scored)
    return loaded


def _piqa_check(tiny_folder, tmp_path, monkeypatch, **changes):
    from eval.bench.checks import TasksCheck
    from tests.helpers import write_piqa

    monkeypatch.setenv("LAYERCUT_CACHE", str(tmp_path / "cache"))
    fields = dict(original=str(tiny_folder), model=str(tmp_path / "checkpoint"), tasks=("piqa",), limit=3,
                  data_dir=str(write_piqa(tmp_path / "data")), keep_original=True)
    return TasksCheck(**{**fields, **changes})


def test_a_task_scored_without_its_primary_metric_is_refused_before_the_checkpoint_is_scored(tiny_folder, tmp_path,
                                                                                            monkeypatch):
    check = _piqa_check(tiny_folder, tmp_path, monkeypatch)
    loaded = _fake_lm_eval(monkeypatch, {name: {"piqa": {"acc_norm": 0.6, "acc_norm_stderr": 0.3}}
                                         for name in (check.original, check.model)})
    with pytest.raises(LayercutError) as raised:
        check.run()
    assert str(raised.value) == ("lm-eval scored piqa without acc, the metric layercut quotes for it (it gave "
                                 "acc_norm): set primary_metric in the layercut: block of its task YAML to one of "
                                 "them (eval/tasks/README.md)")
    assert loaded == [str(tiny_folder)] and not check.original_kept()  # no checkpoint scored, nothing kept


def test_a_task_lm_eval_gives_no_figure_for_is_refused_before_the_checkpoint_is_scored(tiny_folder, tmp_path,
                                                                                          monkeypatch):
    check = _piqa_check(tiny_folder, tmp_path, monkeypatch)  # as lm-eval's hub tag lambada runs: its tasks only
    loaded = _fake_lm_eval(monkeypatch, {name: {"piqa_a": {"acc": 0.6}, "piqa_b": {"acc": 0.5}}
                                         for name in (check.original, check.model)})
    with pytest.raises(LayercutError) as raised:
        check.run()
    assert str(raised.value) == ("lm-eval gave no figure named piqa (it scored piqa_a, piqa_b): name those tasks in "
                                 "--tasks")
    assert loaded == [str(tiny_folder)] and not check.original_kept()


def test_the_original_s_scores_are_kept_before_the_checkpoint_is_scored(tiny_folder, tmp_path, monkeypatch):
    check = _piqa_check(tiny_folder, tmp_path, monkeypatch)
    results = {name: {"piqa": {"acc": 2 / 3, "acc_stderr": 0.3}} for name in (check.original, check.model)}
    loaded = _fake_lm_eval(monkeypatch, results, stop=check.model)
    with pytest.raises(KeyboardInterrupt):  # stopped while the checkpoint is scored
        check.run()
    assert loaded == [check.original, check.model] and check.original_kept()
    loaded = _fake_lm_eval(monkeypatch, results)
    figures = check.run()  # the run again: the checkpoint alone
    assert loaded == [check.model] and figures["original_kept"] and figures["tasks"]["piqa"]["gap"] == 0


def test_the_original_s_kept_scores_follow_its_tokenizer_its_task_yamls_and_the_readers(tiny_folder, tmp_path,
                                                                                         monkeypatch):
    import shutil

    from eval.quality import lmeval

    # --tokenizer a folder: its files, not its name alone
    tokenizer = shutil.copytree(tiny_folder, tmp_path / "tokenizer")
    monkeypatch.delenv("LAYERCUT_DATA", raising=False)
    hub = _piqa_check(tiny_folder, tmp_path, monkeypatch, data_dir=None, tokenizer=str(tokenizer))
    before = hub._kept_path()
    (tokenizer / "tokenizer_config.json").write_text("{}")
    assert hub._kept_path() != before
    # a task's YAML and the YAML it includes (its prompts, chat setting, token budget), with or without a data folder
    tasks, readers = tmp_path / "tasks", tmp_path / "readers"
    tasks.mkdir()
    readers.mkdir()
    (tasks / "piqa.yaml").write_text("include: base.yaml\ntask: piqa\n")
    (tasks / "base.yaml").write_text("output_type: multiple_choice\n")
    (tasks / "reader.py").write_text("def load():\n    return []\n")
    (readers / "local_docs.py").write_text("def load_piqa():\n    return []\n")
    piqa = dataclasses.replace(lmeval.task_table()["piqa"], source=tasks / "piqa.yaml")
    monkeypatch.setattr(lmeval, "task_table", lambda: {"piqa": piqa})
    monkeypatch.setattr(lmeval, "TASKS_DIR", readers)
    local = _piqa_check(tiny_folder, tmp_path, monkeypatch)
    for check in (hub, local):
        before = check._kept_path()
        (tasks / "base.yaml").write_text(f"output_type: multiple_choice\n# {before}\n")
        assert check._kept_path() != before
    # with a data folder, the readers' code: layercut's and a reader beside the YAML, by content
    for reader in (readers / "local_docs.py", tasks / "reader.py"):
        before, unread = local._kept_path(), hub._kept_path()
        reader.write_text(reader.read_text() + "# changed\n")
        assert local._kept_path() != before and hub._kept_path() == unread  # the hub's rows are lm-eval's


def test_kept_scores_of_a_generating_task_at_another_token_budget_are_scored_again(tiny_folder, tmp_path,
                                                                                   monkeypatch):
    from eval.bench.checks import _keep_row

    monkeypatch.delenv("LAYERCUT_DATA", raising=False)
    check = _piqa_check(tiny_folder, tmp_path, monkeypatch, tasks=("ifeval",), data_dir=None)
    for budget, kept in ((128, False), (None, False), (256, True)):  # ifeval.yaml's budget: 256
        _keep_row(check._kept_path(), {"runs": 1, "scores": {"tasks": {"ifeval": 0.3},
                                                             "max_gen_toks": {"ifeval": budget} if budget else {}}})
        assert check.original_kept() == kept, budget
