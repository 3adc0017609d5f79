"""What layercut knows of a task lives in its YAML: the table read from them, and a new task added as one file.

The first test writes out the three tables the YAMLs replaced (``OFFLINE_TASKS`` and ``_PRIMARY_METRIC`` of
``eval/quality/lmeval.py``, ``CHANCE`` of ``eval/compare/stats.py``) and checks the table gives every entry back,
number for number.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lm_eval import evaluator
from lm_eval.api.task import ConfigurableTask
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from lm_eval.tasks._yaml_loader import load_yaml

from eval.compare import stats
from eval.quality import lmeval
from eval.quality.lmeval import (
    TASKS_DIR,
    TaskSpec,
    clean_metrics,
    hub_offline,
    offline_tasks,
    primary_metric,
    read_task_spec,
    run_lm_eval,
    task_table,
)
from prune.errors import LayercutError
from tests.helpers import make_tiny_model

pytestmark = pytest.mark.usefixtures("lm_eval_once")  # lm-eval's templates compiled and environment described once

OLD_OFFLINE_TASKS = {
    "arc_easy": ("arc/hf_format/ARC-Easy-test.jsonl",),
    "arc_challenge": ("arc/hf_format/ARC-Challenge-test.jsonl",),
    "hellaswag": ("hellaswag/hellaswag_val_full.txt",),
    "piqa": ("piqa/valid.jsonl", "piqa/valid-labels.lst"),
    "lambada_openai": ("lambada/lambada_test.jsonl",),
    "winogrande": ("winogrande/winogrande_dev_llmfoundry.jsonl", "winogrande/dev-labels.lst"),
    "boolq": ("boolq/val.jsonl",),
}
OLD_PRIMARY_METRIC = {
    "arc_easy": "acc_norm", "arc_challenge": "acc_norm", "hellaswag": "acc_norm", "piqa": "acc", "lambada": "acc",
    "lambada_openai": "acc", "lambada_standard": "acc", "winogrande": "acc", "boolq": "acc",
}
OLD_CHANCE = {
    "arc_easy": 0.25, "arc_challenge": 0.25, "hellaswag": 0.25, "piqa": 0.5, "winogrande": 0.5, "boolq": 0.5,
    "openbookqa": 0.25, "sciq": 0.25, "copa": 0.5, "mmlu": 0.25, "lambada": 0.0, "lambada_openai": 0.0,
    "lambada_standard": 0.0,
}

# the tasks added since, one YAML each
NEW_OFFLINE_TASKS = {"ifeval": ("ifeval/input_data.jsonl",)}
NEW_PRIMARY_METRIC = {"ifeval": "prompt_level_strict_acc"}
NEW_CHANCE = {"ifeval": 0.0}
NEW_VERSION = {"boolq": 2.0, "ifeval": 4.0}  # lm-eval's version of the task, where it is not 1.0

# A toy offline task: 5 answers a row, rows already in the hub's layout, so the shipped reader reads them.
TOY_YAML = """\
task: toy_qa
custom_dataset: !function eval.tasks.local_docs.load_jsonl
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: "{{answer}}"
doc_to_choice: "{{choices}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
  layercut:
    files: [toy/rows.jsonl]
    primary_metric: acc_norm
    chance: 0.2
"""
TOY_ROWS = [
    {"question": f"Which of these is number {i}?", "choices": [f"it is {i + k}" for k in range(5)], "answer": i % 5}
    for i in range(7)
]


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(lmeval.TASK_DIRS_ENV, raising=False)
    monkeypatch.delenv(lmeval.DATA_DIR_ENV, raising=False)


def _toy(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A folder holding the toy task's one YAML, and a data folder with its rows: (tasks, yaml, data)."""
    tasks, data = tmp_path / "tasks", tmp_path / "data"
    (data / "toy").mkdir(parents=True)
    tasks.mkdir()
    (data / "toy" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TOY_ROWS))
    (tasks / "toy_qa.yaml").write_text(TOY_YAML)
    return tasks, tasks / "toy_qa.yaml", data


# ------------------------------------------------------------------------- the shipped table
def test_the_table_gives_back_the_three_old_tables_exactly():
    table = task_table()
    offline, chance, primary = OLD_OFFLINE_TASKS | NEW_OFFLINE_TASKS, OLD_CHANCE | NEW_CHANCE, \
        OLD_PRIMARY_METRIC | NEW_PRIMARY_METRIC
    assert {name: spec.files for name, spec in table.items() if spec.offline} == offline
    assert sorted(offline_tasks()) == sorted(offline)
    assert {name: spec.chance for name, spec in table.items()} == chance
    for task in [*chance, *primary, "no_such_task"]:
        assert primary_metric(task) == primary.get(task, "acc"), task
        assert stats.chance(task) == chance.get(task), task
    assert stats.chance("no_such_task") is None


def test_every_shipped_yaml_is_its_task_and_the_table_reads_them_once():
    for path in sorted(TASKS_DIR.glob("*.yaml")):
        spec = read_task_spec(path)
        assert spec.name == path.stem and spec.source == path.resolve()
        assert task_table()[spec.name] == spec
    assert task_table() is task_table()


def test_lm_eval_reads_the_layercut_block_as_free_metadata(tmp_path):
    """lm-eval keeps the block in the task's metadata, hands it to the reader, and reads only ``version``."""
    for path in sorted(TASKS_DIR.glob("*.yaml")):  # lm-eval merges includes as our reader does
        metadata = load_yaml(path, resolve_func=False)["metadata"]
        assert tuple(metadata["layercut"]["files"]) == (OLD_OFFLINE_TASKS | NEW_OFFLINE_TASKS)[path.stem]
        assert metadata["version"] == NEW_VERSION.get(path.stem, 1.0)
    tasks, _, data = _toy(tmp_path)
    manager = TaskManager(include_path=str(tasks), include_defaults=False, metadata={"data_dir": str(data)})
    with hub_offline():
        task = manager.load(["toy_qa"])["tasks"]["toy_qa"]
    assert task.VERSION == 1.0 and task.config.metadata["layercut"]["chance"] == 0.2
    assert len(task.test_docs()) == len(TOY_ROWS)  # the reader found the files the block names


# ------------------------------------------------------------------ a new task is one YAML
def test_a_toy_task_in_an_extra_folder_is_one_yaml(tmp_path, monkeypatch):
    tasks, _, _ = _toy(tmp_path)
    assert "toy_qa" not in offline_tasks()
    monkeypatch.setenv(lmeval.TASK_DIRS_ENV, str(tasks))
    assert "toy_qa" in offline_tasks() and set(OLD_OFFLINE_TASKS) < set(offline_tasks())
    assert task_table()["toy_qa"] == TaskSpec("toy_qa", "acc_norm", 0.2, ("toy/rows.jsonl",),
                                              (tasks / "toy_qa.yaml").resolve())
    assert primary_metric("toy_qa") == "acc_norm" and stats.chance("toy_qa") == 0.2


def test_a_toy_task_in_a_copy_of_the_tasks_folder(tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in TASKS_DIR.glob("*.yaml"):
        (copy / path.name).write_text(path.read_text())
    (copy / "toy_qa.yaml").write_text(TOY_YAML)
    table = task_table([copy])
    assert table["toy_qa"].chance == 0.2 and table["toy_qa"].primary_metric == "acc_norm"
    assert {name: spec.chance for name, spec in table.items() if name != "toy_qa"} == OLD_CHANCE | NEW_CHANCE


def test_the_toy_task_scores_what_lm_evals_own_task_scores(tmp_path, monkeypatch, tiny_tokenizer):
    tasks, yaml_path, data = _toy(tmp_path)
    monkeypatch.setenv(lmeval.TASK_DIRS_ENV, str(tasks))
    model = make_tiny_model("llama")
    rows = {}
    ours = run_lm_eval(model, tiny_tokenizer, ["toy_qa"], data_dir=data, rows=rows)["toy_qa"]
    assert len(rows["toy_qa"]) == len(TOY_ROWS)
    assert sum(rows["toy_qa"]) / len(TOY_ROWS) == pytest.approx(ours["acc_norm"])  # the quoted metric, row by row
    # lm-eval's own task from the same YAML without the layercut block, reading the rows with its json builder
    config = load_yaml(yaml_path)
    config.update(custom_dataset=None, metadata={"version": 1.0}, dataset_path="json", dataset_name=None,
                  dataset_kwargs={"data_files": {"test": str(data / "toy" / "rows.jsonl")},
                                  "cache_dir": str(tmp_path / "cache")})
    with hub_offline():
        standard = ConfigurableTask(config=config)
        out = evaluator.simple_evaluate(model=HFLM(pretrained=model, tokenizer=tiny_tokenizer, batch_size=8),
                                        tasks=[standard], bootstrap_iters=0,
                                        task_manager=TaskManager(include_path=str(tasks), include_defaults=False))
    theirs = clean_metrics(out["results"]["toy_qa"])
    assert ours["acc"] == theirs["acc"] and ours["acc_norm"] == theirs["acc_norm"]


# ---------------------------------------------------------------------------- bad YAMLs
def _one_line(err: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize(("edit", "words"), [
    (lambda text: text.replace("    primary_metric: acc_norm\n", ""), "metadata: {layercut: {files:"),
    (lambda text: text.replace("primary_metric: acc_norm", "primary_metric: f1"), "not in the task's metric_list"),
    (lambda text: text.replace("chance: 0.2", "chance: 1.5"), "metadata.layercut.chance must be a number in [0, 1)"),
    (lambda text: text.replace("files: [toy/rows.jsonl]", "files: [/abs/rows.jsonl]"), "metadata.layercut.files"),
    (lambda text: text.replace("chance: 0.2", "chance: 0.2\n    chat: maybe"), "metadata.layercut.chat must be"),
    (lambda text: text.replace("output_type: multiple_choice", "output_type: generate_until\n"
                                                               "generation_kwargs: {max_gen_toks: -1}"),
     "generation_kwargs.max_gen_toks must be a positive whole number"),
])
def test_a_bad_layercut_block_is_one_line_naming_the_file(tmp_path, edit, words):
    _, yaml_path, _ = _toy(tmp_path)
    yaml_path.write_text(edit(TOY_YAML))
    with pytest.raises(LayercutError) as err:
        read_task_spec(yaml_path)
    message = _one_line(err)
    assert str(yaml_path) in message and words in message


def test_a_task_defined_twice_or_a_missing_folder_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "piqa.yaml").write_text((TASKS_DIR / "piqa.yaml").read_text())
    with pytest.raises(LayercutError) as err:
        task_table([TASKS_DIR, tmp_path])
    assert "'piqa' is defined twice" in _one_line(err)
    monkeypatch.setenv(lmeval.TASK_DIRS_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(LayercutError) as err:
        offline_tasks()
    assert str(tmp_path / "nowhere") in _one_line(err) and lmeval.TASK_DIRS_ENV in str(err.value)


def test_task_spec_checks_its_fields():
    with pytest.raises(ValueError, match="chance"):
        TaskSpec("t", "acc", -0.1)
    with pytest.raises(ValueError, match="primary_metric"):
        TaskSpec("t", "", 0.5)
    with pytest.raises(ValueError, match="chat must be true or false"):
        TaskSpec("t", "acc", 0.5, chat="yes")
    with pytest.raises(ValueError, match="max_gen_toks must be a positive whole number"):
        TaskSpec("t", "acc", 0.0, max_gen_toks=0)
    assert not TaskSpec("t", "acc", 0.5).offline and TaskSpec("t", "acc", 0.5, ("t/rows.jsonl",)).offline
