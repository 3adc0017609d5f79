"""The offline task table: each task's files, metric and chance level, read from the YAMLs without lm-eval."""

import subprocess
import sys
from pathlib import Path

import pytest

from eval.quality.task_specs import (
    DATA_DIR_ENV,
    TASKS_DIR,
    TaskSpec,
    chance_level,
    local_data_files,
    primary_metric,
    read_task_spec,
    resolve_data_dir,
    task_table,
)
from prune.errors import LayercutError

REPO = Path(__file__).resolve().parents[3]

TOY = """task: toy_choice
custom_dataset: !function local_docs.load_toy
output_type: multiple_choice
metric_list:
  - metric: acc
  - metric: acc_norm
metadata:
  version: 1.0
  layercut: {files: [toy/rows.jsonl], primary_metric: acc_norm, chance: 0.25}
"""


def test_the_shipped_table_says_each_tasks_files_metric_and_chance():
    table = task_table()
    assert table["piqa"] == TaskSpec("piqa", "acc", 0.5, ("piqa/valid.jsonl", "piqa/valid-labels.lst"),
                                     TASKS_DIR / "piqa.yaml")
    assert table["piqa"].offline and not table["mmlu"].offline  # a hub task has no files here
    assert primary_metric("arc_easy") == "acc_norm" and primary_metric("not_a_task") == "acc"
    assert chance_level("copa") == 0.5 and chance_level("not_a_task") is None


def test_a_task_folder_of_ones_own_joins_the_table(tmp_path):
    (tmp_path / "toy.yaml").write_text(TOY)
    (tmp_path / "more.yaml").write_text("include: toy.yaml\ntask: toy_more\n")  # includes merge, its own keys win
    (tmp_path / "group.yaml").write_text("group: toys\ntask_list: [toy_choice]\n")  # a group: no spec
    assert read_task_spec(tmp_path / "group.yaml") is None
    table = task_table([tmp_path])
    assert table["toy_choice"] == TaskSpec("toy_choice", "acc_norm", 0.25, ("toy/rows.jsonl",), tmp_path / "toy.yaml")
    assert table["toy_more"].files == ("toy/rows.jsonl",) and "piqa" not in table and "mmlu" in table


@pytest.mark.parametrize("block,message", [
    ("{files: [a.jsonl], chance: 0.25}", "an offline task says what layercut needs under metadata"),
    ("{files: [a.jsonl], primary_metric: f1, chance: 0.25}", "primary_metric 'f1' is not in the task's metric_list"),
    ("{files: [a.jsonl], primary_metric: acc, chance: 1.5}", "metadata.layercut.chance must be a number in [0, 1)"),
    ("{files: [/abs.jsonl], primary_metric: acc, chance: 0.5}", "metadata.layercut.files must be paths relative"),
])
def test_a_malformed_layercut_block_is_one_line(tmp_path, block, message):
    path = tmp_path / "bad.yaml"
    path.write_text(f"task: bad\nmetric_list: [{{metric: acc}}]\nmetadata: {{layercut: {block}}}\n")
    with pytest.raises(LayercutError) as err:
        read_task_spec(path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_local_files_are_found_in_the_data_folder_or_named_when_missing(tmp_path, monkeypatch):
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    assert resolve_data_dir(None) is None
    (tmp_path / "piqa").mkdir()
    (tmp_path / "piqa" / "valid.jsonl").write_text("{}\n")
    with pytest.raises(LayercutError, match="piqa: local data file piqa/valid-labels.lst not found in"):
        local_data_files("piqa", tmp_path)
    (tmp_path / "piqa" / "valid-labels.lst").write_text("0\n")
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    assert local_data_files("piqa", None) == [tmp_path / "piqa" / "valid.jsonl", tmp_path / "piqa" / "valid-labels.lst"]
    with pytest.raises(LayercutError, match=r"data folder .*missing \(--data-dir\) does not exist"):
        resolve_data_dir(tmp_path / "missing")
    with pytest.raises(LayercutError, match="unknown task 'mmlu': not an offline task"):
        local_data_files("mmlu", tmp_path)


def test_reading_the_table_imports_no_lm_eval():
    code = ("import sys\nfrom eval.quality.task_specs import task_table\ntask_table()\n"
            "print('lm_eval' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]
