"""The lm-eval bridge: offline tasks reproduce lm-eval's standard tasks row for row, and bad input fails in one line.

The "standard" side of each comparison is lm-eval's own installed YAML for the task, with only its
dataset swapped for the same rows in the hub's layout (read with the ``json`` builder), since the hub
is unreachable here. Our side is the shipped YAML reading ``shared/data`` through ``run_lm_eval``'s
task registry. Both are scored by the same tiny random llama, so any difference in a prompt, a
target or a choice shows up as a different request and, almost surely, a different log-likelihood.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import random
import re
from pathlib import Path

import lm_eval
import pytest
import torch
from lm_eval import evaluator
from lm_eval.api.task import ConfigurableTask
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from eval.quality import lmeval
from eval.quality.lmeval import (
    answered_prompts,
    clean_metrics,
    hub_offline,
    local_data_files,
    local_tasks,
    offline_tasks,
    primary_metric,
    resolve_data_dir,
    run_lm_eval,
)
from eval.quality.needs.ifeval import check_ifeval_ready
from eval.tasks import local_docs
from prune.errors import LayercutError

DATA = Path(__file__).resolve().parents[4] / "shared" / "data"
LM_EVAL_TASKS = Path(lm_eval.__file__).resolve().parent / "tasks"
ROWS = 12  # rows per task in the row-for-row comparisons

pytestmark = pytest.mark.usefixtures("lm_eval_once")  # templates compiled and the environment described once

_SENTENCES = [
    "Question: Which statement best explains why photosynthesis is the foundation of most food webs?",
    "Answer: Sunlight is the source of energy for nearly all ecosystems.",
    "A man is sitting on a roof. He starts pulling up roofing on a roof.",
    "How do I ready a guinea pig cage for its new occupants? Provide bedding, water and food.",
    "Sarah was a much better surgeon than Maria so Maria always got the harder cases.",
    "does ethanol take more energy make than produces? no. yes.",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE trained in code on a few sentences: every string is encodable, nothing downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_SENTENCES * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def _tiny_llama(vocab: int, seed: int = 0):
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=4096,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def model(tokenizer):
    return _tiny_llama(len(tokenizer))


@pytest.fixture(scope="module")
def lm(model, tokenizer):
    return HFLM(pretrained=model, tokenizer=tokenizer, batch_size=8)


@pytest.fixture
def data() -> Path:
    if not DATA.is_dir():
        pytest.skip(f"shared data folder {DATA} not present")
    return DATA


@pytest.fixture(scope="module")
def every_task() -> dict:
    """Every offline task built once from the real files (HellaSwag's 10,042 rows take seconds to prepare)."""
    if not DATA.is_dir():
        pytest.skip(f"shared data folder {DATA} not present")
    return local_tasks([name for name in offline_tasks() if name not in _needs_missing_extra()], DATA)


def _needs_missing_extra() -> tuple[str, ...]:
    """The offline tasks whose scoring needs what this environment lacks (ifeval without its extra or punkt_tab)."""
    try:
        check_ifeval_ready()
    except LayercutError:
        return tuple(name for name, spec in lmeval.task_table().items() if "ifeval" in spec.needs)
    return ()


@pytest.fixture(autouse=True)
def _no_data_env(monkeypatch):
    monkeypatch.delenv(lmeval.DATA_DIR_ENV, raising=False)
    monkeypatch.delenv(lmeval.TASK_DIRS_ENV, raising=False)


# ----------------------------------------------------------------------------- helpers
def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _load_lm_eval_yaml(relative: str) -> dict:
    """lm-eval's installed task config with its !function references and includes resolved."""
    from lm_eval.tasks._yaml_loader import load_yaml  # lm-eval 0.4.13's loader (the tested version)

    return load_yaml(LM_EVAL_TASKS / relative)


def standard_task(relative_yaml: str, split: str, rows_file: Path, cache: Path) -> ConfigurableTask:
    """lm-eval's standard task from its own YAML, reading ``rows_file`` (hub layout) instead of the hub."""
    config = _load_lm_eval_yaml(relative_yaml)
    config.pop("tag", None)
    config.update(
        dataset_path="json", dataset_name=None,
        dataset_kwargs={"data_files": {split: str(rows_file)}, "cache_dir": str(cache)},
        training_split=None, validation_split=None, test_split=None, fewshot_split=None,
    )
    config[f"{split}_split"] = split
    with hub_offline():
        return ConfigurableTask(config=config)


@functools.lru_cache(maxsize=1)
def _small_task_manager() -> TaskManager:
    # simple_evaluate indexes lm-eval's whole registry (seconds) unless given a manager; Task objects need none
    return TaskManager(include_path=str(lmeval.TASKS_DIR), include_defaults=False)


def scored_rows(lm, task, limit: int) -> tuple[dict[str, float], list[tuple]]:
    """Metrics and, per row, (doc_id, requests, log-likelihoods) of ``task`` scored by ``lm``."""
    out = evaluator.simple_evaluate(
        model=lm, tasks=[task], limit=limit, log_samples=True, bootstrap_iters=0, task_manager=_small_task_manager()
    )
    name = task.config.task
    rows = [
        (s["doc_id"], [tuple(a) for a in s["arguments"]], [r[0] for r in s["filtered_resps"]])
        for s in sorted(out["samples"][name], key=lambda s: s["doc_id"])
    ]
    return clean_metrics(out["results"][name]), rows


def assert_same_rows(ours: tuple, standard: tuple) -> None:
    our_metrics, our_rows = ours
    std_metrics, std_rows = standard
    assert len(our_rows) == len(std_rows) > 0
    for (doc_a, req_a, ll_a), (doc_b, req_b, ll_b) in zip(our_rows, std_rows, strict=True):
        assert doc_a == doc_b
        assert req_a == req_b, f"row {doc_a}: requests differ"
        assert ll_a == pytest.approx(ll_b, abs=1e-5)
    for metric in ("acc", "acc_norm", "perplexity"):
        if metric in std_metrics:
            assert our_metrics[metric] == pytest.approx(std_metrics[metric], rel=1e-9), metric


# ------------------------------------------------------------------ same rows, same scores
def _hub_rows_arc_easy(data: Path, tmp: Path) -> Path:
    return data / "arc" / "hf_format" / "ARC-Easy-test.jsonl"  # already the hub layout


def _hub_rows_piqa(data: Path, tmp: Path) -> Path:
    goals = [json.loads(line) for line in (data / "piqa" / "valid.jsonl").read_text().splitlines()]
    labels = (data / "piqa" / "valid-labels.lst").read_text().split()
    return _write_jsonl(tmp / "piqa.jsonl", [{**g, "label": int(y)} for g, y in zip(goals, labels, strict=True)])


def _hub_rows_lambada(data: Path, tmp: Path) -> Path:
    return data / "lambada" / "lambada_test.jsonl"  # {"text": ...}, the hub layout


def _hub_rows_boolq(data: Path, tmp: Path) -> Path:
    rows = [json.loads(line) for line in (data / "boolq" / "val.jsonl").read_text().splitlines()[:50]]
    return _write_jsonl(tmp / "boolq.jsonl", [{**r, "label": int(r["label"] == "true")} for r in rows])


@pytest.mark.parametrize(
    ("task", "yaml", "split", "hub_rows"),
    [
        ("arc_easy", "arc/arc_easy.yaml", "test", _hub_rows_arc_easy),
        ("piqa", "piqa/piqa.yaml", "validation", _hub_rows_piqa),
        ("lambada_openai", "lambada/lambada_openai.yaml", "test", _hub_rows_lambada),
        ("boolq", "super_glue/boolq/default.yaml", "validation", _hub_rows_boolq),
    ],
)
def test_local_task_reproduces_standard_task(task, yaml, split, hub_rows, data, lm, tmp_path):
    standard = standard_task(yaml, split, hub_rows(data, tmp_path), tmp_path / "cache")
    ours = local_tasks([task], data)[task]
    assert_same_rows(scored_rows(lm, ours, ROWS), scored_rows(lm, standard, ROWS))


def test_run_lm_eval_gives_the_standard_score(data, model, tokenizer, lm, tmp_path):
    standard = standard_task("arc/arc_easy.yaml", "test", _hub_rows_arc_easy(data, tmp_path), tmp_path / "cache")
    std_metrics, _ = scored_rows(lm, standard, ROWS)
    rows = {}
    ours = run_lm_eval(model, tokenizer, ["arc_easy"], data_dir=data, limit=ROWS, batch_size=8, rows=rows)
    assert set(ours) == {"arc_easy"}
    # the per-row scores (acc_norm, the quoted metric) are the ones averaged
    assert len(rows["arc_easy"]) == ROWS and set(rows["arc_easy"]) <= {0.0, 1.0}
    assert sum(rows["arc_easy"]) / ROWS == pytest.approx(ours["arc_easy"]["acc_norm"])
    assert {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"} <= set(ours["arc_easy"])
    assert ours["arc_easy"]["acc"] == std_metrics["acc"]
    assert ours["arc_easy"]["acc_norm"] == std_metrics["acc_norm"]
    # the closed-form stderr of a mean of 0/1 scores over ROWS rows
    p = ours["arc_easy"]["acc"]
    assert ours["arc_easy"]["acc_stderr"] == pytest.approx((p * (1 - p) / (ROWS - 1)) ** 0.5)


# A few rows in the hub's Rowan/hellaswag layout: the first real validation item (whose ctx_a / ctx_b
# split is the one the HellaSwag README shows), and made-up ones that exercise the ctx_b capitalisation
# (which also lower-cases the rest of ctx_b), multi-sentence contexts, quotes, and WikiHow tags inside
# a context (ctx_b empty).
_HELLASWAG_HUB_ROWS = [
    {"activity_label": "Roof shingle removal", "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
     "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                 "is holding a rubik's cube.", "starts pulling up roofing on a roof."], "label": "3"},
    {"activity_label": "Clean and jerk", "ctx_a": "A lady walks to a barbell. She bends down and grabs the pole.",
     "ctx_b": "the lady in a Nike shirt",
     "endings": ["swings and lands.", "pulls the barbell.", "pulls a rope.", "stands and lifts it."], "label": "3"},
    {"activity_label": "Sharpening knives", "ctx_a": 'A "trend routing" logo appears on screen!', "ctx_b": "a man",
     "endings": ["sharpens a knife.", "eats.", "sleeps on the bench.", "walks away."], "label": "0"},
    {"activity_label": "Playing saxophone", "ctx_a": "", "ctx_b": "a guy",
     "endings": ["plays.", "talks.", "is playing the saxophone.", "sings."], "label": "2"},
    {"activity_label": "Home and Garden",
     "ctx_a": "[header] How to water a plant [title] Fill a can. [step] Use cold water. [title] Pour slowly.",
     "ctx_b": "",
     "endings": ["Stop when the soil is wet. [substeps] Do not flood it.", "Paint the can.",
                 "Water the plant [title] again.", "Wait a week."], "label": "0"},
]


def _as_text_file(rows: list[dict]) -> str:
    """The rows as the 6-lines-per-item text file writes them (data/hellaswag/SOURCE.md's preprocessing)."""

    def clean(text: str) -> str:
        for tag in ("[header]", "[step]", "[substeps]"):
            text = text.replace(tag, "")
        text = text.replace(" [title]", ". ").replace("[title] ", "").replace("[title].", "")
        return re.sub(" {2,}", " ", text).strip()

    lines = []
    for r in rows:
        ctx = f"{r['ctx_a']} {r['ctx_b']}".strip()
        lines += [clean(f"{r['activity_label']}: {ctx}"), r["label"], *[clean(e) for e in r["endings"]]]
    return "\n".join(lines) + "\n"


def test_hellaswag_from_text_file_reproduces_standard_task(lm, tmp_path):
    (tmp_path / "hellaswag").mkdir()
    (tmp_path / "hellaswag" / "hellaswag_val_full.txt").write_text(_as_text_file(_HELLASWAG_HUB_ROWS))
    hub_file = _write_jsonl(tmp_path / "hub.jsonl", _HELLASWAG_HUB_ROWS)
    standard = standard_task("hellaswag/hellaswag.yaml", "validation", hub_file, tmp_path / "cache")
    ours = local_tasks(["hellaswag"], tmp_path)["hellaswag"]
    our_scores, std_scores = scored_rows(lm, ours, 10), scored_rows(lm, standard, 10)
    assert_same_rows(our_scores, std_scores)
    first_context = our_scores[1][0][1][0][0]
    assert first_context == "Roof shingle removal: A man is sitting on a roof. He"
    assert our_scores[1][1][1][0][0].endswith("grabs the pole. The lady in a nike shirt")


def test_a_range_loads_each_task_once_and_scores_its_rows(model, tokenizer, tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    (tmp_path / "hellaswag").mkdir()
    (tmp_path / "hellaswag" / "hellaswag_val_full.txt").write_text(_as_text_file(_HELLASWAG_HUB_ROWS))
    built = []  # the tasks built from their names (a built task handed back to load() is not built again)
    load = TaskManager.load

    def counted(self, specs):
        built.extend(spec for spec in specs if isinstance(spec, str))
        return load(self, specs)

    monkeypatch.setattr(TaskManager, "load", counted)
    every, middle = {}, {}
    run_lm_eval(model, tokenizer, ["hellaswag"], data_dir=tmp_path, rows=every)
    assert built == ["hellaswag"] and len(every["hellaswag"]) == 5
    built.clear()
    run_lm_eval(model, tokenizer, ["hellaswag"], data_dir=tmp_path, limit="1:4", rows=middle)
    # the rows are counted on the tasks lm-eval then runs: built once (it was twice, about 3 s a task on real files)
    assert built == ["hellaswag"] and middle["hellaswag"] == every["hellaswag"][1:4]


def test_answered_prompts_join_each_prompt_to_its_right_answer_as_lm_eval_scores_it(tmp_path):
    (tmp_path / "hellaswag").mkdir()
    (tmp_path / "hellaswag" / "hellaswag_val_full.txt").write_text(_as_text_file(_HELLASWAG_HUB_ROWS))
    texts = answered_prompts(local_tasks(["hellaswag"], tmp_path)["hellaswag"])
    assert len(texts) == len(_HELLASWAG_HUB_ROWS)
    # the gold ending (label 3) after lm-eval's " " delimiter
    assert texts[0] == "Roof shingle removal: A man is sitting on a roof. He starts pulling up roofing on a roof."


def test_answered_prompts_of_the_real_arc_and_lambada_files(data):
    tasks = local_tasks(["arc_easy", "lambada_openai"], data)
    arc = answered_prompts(tasks["arc_easy"])
    assert arc[0] == ("Question: Which statement best explains why photosynthesis is the foundation of most food webs?"
                      "\nAnswer: Sunlight is the source of energy for nearly all ecosystems.")
    lambada = answered_prompts(tasks["lambada_openai"])  # not multiple choice: the target follows as it is
    assert len(lambada) == 5153 and not lambada[0].endswith(" ") and " " in lambada[0]


def test_hellaswag_real_file_first_item_is_lm_evals_prompt(every_task):
    task = every_task["hellaswag"]
    docs = task.validation_docs()
    assert len(docs) == 10042
    assert docs[0]["query"] == "Roof shingle removal: A man is sitting on a roof. He"
    assert docs[0]["choices"][3] == "starts pulling up roofing on a roof."
    assert docs[0]["gold"] == 3
    assert docs[1]["query"].endswith("She bends down and grabs the pole. The lady")


def test_split_hellaswag_context():
    assert local_docs.split_hellaswag_context("A man sits. he") == ("A man sits.", "he")
    assert local_docs.split_hellaswag_context("Stir. Serve it.") == ("Stir. Serve it.", "")
    assert local_docs.split_hellaswag_context("the man") == ("", "the man")
    assert local_docs.split_hellaswag_context('He says "hi." two men') == ('He says "hi."', "two men")


def test_winogrande_requests_are_the_files_partial_scoring(data, lm):
    task = local_tasks(["winogrande"], data)["winogrande"]
    _, rows = scored_rows(lm, task, ROWS)
    lines = (data / "winogrande" / "winogrande_dev_llmfoundry.jsonl").read_text().splitlines()
    labels = (data / "winogrande" / "dev-labels.lst").read_text().split()
    for doc_id, requests, _ in rows:
        item = json.loads(lines[doc_id])
        assert requests == [(ctx, " " + item["continuation"]) for ctx in item["context_options"]]
        assert task.doc_to_text(task.validation_docs()[doc_id]) == int(labels[doc_id]) - 1 == item["gold"]


def test_winogrande_row_keeps_shared_letters_in_the_options():
    row = local_docs.winogrande_row(["ruin the bed and the blanket, but the blanket",
                                     "ruin the bed and the blanket, but the bed"], "was ruined.", "2")
    assert row == {"sentence": "ruin the bed and the blanket, but the _ was ruined.",
                   "option1": "blanket", "option2": "bed", "answer": "2"}


def test_every_offline_task_loads_all_rows(every_task):
    expected = {"arc_easy": 2376, "arc_challenge": 1172, "hellaswag": 10042, "piqa": 1838,
                "lambada_openai": 5153, "winogrande": 1267, "boolq": 3270, "ifeval": 541}
    assert set(expected) == set(offline_tasks())
    tasks = every_task
    built = {name: n for name, n in expected.items() if name not in _needs_missing_extra()}
    assert {name: len(list(task.eval_docs)) for name, task in tasks.items()} == built
    boolq = tasks["boolq"].validation_docs()
    assert sum(boolq["label"]) == 2033  # SOURCE.md: 2,033 true


# ---------------------------------------------------------------------- run_lm_eval API
def test_folder_model_scores_like_in_memory_model(data, model, tokenizer, tmp_path):
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    in_memory = run_lm_eval(model, tokenizer, ["piqa"], data_dir=data, limit=6)
    folder = run_lm_eval(tmp_path / "ckpt", None, ["piqa"], data_dir=data, limit=6)
    assert folder["piqa"]["acc"] == in_memory["piqa"]["acc"]
    assert folder["piqa"]["acc_norm"] == in_memory["piqa"]["acc_norm"]


def test_lambada_runs_lambada_openai_offline(data, model, tokenizer, caplog, monkeypatch):
    monkeypatch.setenv(lmeval.DATA_DIR_ENV, str(data))  # the env var stands in for --data-dir
    with caplog.at_level(logging.INFO, logger="eval.quality.lmeval"):
        results = run_lm_eval(model, tokenizer, ["lambada"], limit=3)
    assert set(results) == {"lambada_openai"}
    assert {"acc", "perplexity"} <= set(results["lambada_openai"])
    assert results["lambada_openai"]["perplexity"] > 1.0
    assert any("runs lambada_openai only" in r.getMessage() for r in caplog.records)


def test_data_dir_argument_beats_env(monkeypatch, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert resolve_data_dir(None) is None
    monkeypatch.setenv(lmeval.DATA_DIR_ENV, str(tmp_path / "b"))
    assert resolve_data_dir(None) == tmp_path / "b"
    assert resolve_data_dir(tmp_path / "a") == tmp_path / "a"
    assert resolve_data_dir(str(tmp_path / "a")) == tmp_path / "a"


def test_hub_offline_sets_and_restores_flags(monkeypatch):
    import datasets.config

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    before = datasets.config.HF_DATASETS_OFFLINE
    with hub_offline():
        assert os.environ["HF_DATASETS_OFFLINE"] == os.environ["HF_HUB_OFFLINE"] == "1"
        assert datasets.config.HF_DATASETS_OFFLINE is True
    assert "HF_DATASETS_OFFLINE" not in os.environ
    assert os.environ["HF_HUB_OFFLINE"] == "0"
    assert datasets.config.HF_DATASETS_OFFLINE == before


def test_primary_metric():
    assert primary_metric("hellaswag") == primary_metric("arc_easy") == primary_metric("arc_challenge") == "acc_norm"
    assert primary_metric("piqa") == primary_metric("lambada") == primary_metric("winogrande") == "acc"


def test_clean_metrics_strips_the_none_filter():
    raw = {"alias": "piqa", "name": "piqa", "sample_len": 3, "acc,none": 0.5, "acc_stderr,none": "N/A",
           "exact_match,strict-match": 0.25}
    cleaned = clean_metrics(raw)
    assert cleaned["acc"] == 0.5 and cleaned["sample_len"] == 3.0
    assert cleaned["acc_stderr"] != cleaned["acc_stderr"]  # N/A -> nan
    assert cleaned["exact_match,strict-match"] == 0.25
    assert "alias" not in cleaned and "name" not in cleaned


# ------------------------------------------------------------------------------ bad input
def _one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message
    return message


def test_unknown_task_lists_the_offline_tasks(data, monkeypatch):
    # lm-eval's registry as lm-eval builds it, over its ARC folder only: indexing all its ~14,000 YAMLs takes half a
    # minute on 2 cores, and a name is looked up in a registry of 3 tasks as in one of thousands
    arc_only = TaskManager(include_path=str(LM_EVAL_TASKS / "arc"), include_defaults=False)
    monkeypatch.setattr(lmeval, "_registry", lambda: arc_only)
    assert lmeval.plan_tasks(["arc_easy", "arc_challenge_chat"], data) == (["arc_easy"], ["arc_challenge_chat"])
    with pytest.raises(LayercutError) as err:
        run_lm_eval(None, None, ["arc_easy", "no_such_task"], data_dir=data)
    message = _one_line(err)
    assert "'no_such_task'" in message
    assert all(name in message for name in offline_tasks())
    assert "lm-eval ls tasks" in message and "lm-eval --tasks list" in message


def test_missing_local_file_names_the_file_and_folder(tmp_path):
    (tmp_path / "piqa").mkdir()
    (tmp_path / "piqa" / "valid.jsonl").write_text('{"goal": "g", "sol1": "a", "sol2": "b"}\n')
    with pytest.raises(LayercutError) as err:
        run_lm_eval(None, None, ["piqa"], data_dir=tmp_path)
    message = _one_line(err)
    assert "piqa/valid-labels.lst" in message and str(tmp_path.resolve()) in message
    with pytest.raises(LayercutError, match="hellaswag/hellaswag_val_full.txt"):
        local_data_files("hellaswag", tmp_path)


def test_missing_data_folder_is_one_line(tmp_path):
    with pytest.raises(LayercutError) as err:
        run_lm_eval(None, None, ["piqa"], data_dir=tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in _one_line(err)


@pytest.mark.parametrize(
    "kwargs", [{"limit": 0}, {"limit": 1.5}, {"limit": "10"}, {"batch_size": 0}, {"num_fewshot": -1}, {"tasks": []}]
)
def test_bad_options_are_one_line(kwargs, data):
    args = {"tasks": ["piqa"], **kwargs}
    with pytest.raises(LayercutError) as err:
        run_lm_eval(None, None, args.pop("tasks"), data_dir=data, **args)
    _one_line(err)


def test_limit_is_read_like_lm_eval():
    assert lmeval._check_options(200.0, 8, None) == 200 and isinstance(lmeval._check_options(200.0, 8, None), int)
    assert lmeval._check_options(0.25, 8, 0) == 0.25
    assert lmeval._check_options(None, 1, None) is None


def test_a_range_of_rows_scores_those_rows(data, model, tokenizer):
    first, middle = {}, {}
    run_lm_eval(model, tokenizer, ["piqa"], data_dir=data, limit=6, rows=first)
    run_lm_eval(model, tokenizer, ["piqa"], data_dir=data, limit="2:6", rows=middle)
    assert len(middle["piqa"]) == 4 and middle["piqa"] == first["piqa"][2:6]


def rows_of(names, manager, rows, seed):
    """The rows ``run_lm_eval`` reads of each task, as it picks them (the split it evaluates, then the rule)."""
    return lmeval._rows_in(lmeval._load_tasks(manager, names), rows, seed)


def test_a_range_counts_from_the_end_of_the_rows_the_task_evaluates(data):
    manager = lmeval._local_task_manager(data)
    # ARC-Easy's test split has 2,376 rows, PIQA's validation split 1,838
    picked = rows_of(["arc_easy", "piqa"], manager, "-3:", seed=1)
    assert picked == {"arc_easy": [2373, 2374, 2375], "piqa": [1835, 1836, 1837]}
    assert rows_of(["piqa"], manager, "1830:1900", seed=1) == {"piqa": list(range(1830, 1838))}
    with pytest.raises(LayercutError) as err:
        rows_of(["piqa"], manager, "5000:", seed=1)
    assert _one_line(err) == "rows 5000: of piqa are none of its 1838 rows: pick a range inside 0:1838"


@pytest.mark.parametrize("limit, form", [
    *[(limit, "START:END") for limit in ("1:2:3", "a:", ":x", "1.5:")],
    *[(limit, "N~START:END") for limit in ("0~1:", "x~1:", "~1:", "1.5~:", "1~2~3:")],
])
def test_a_malformed_range_or_draw_is_one_line(limit, form):
    with pytest.raises(LayercutError, match=form) as err:
        lmeval._check_options(limit, 8, None)
    _one_line(err)


def test_ranges_are_kept_as_typed():
    assert lmeval._check_options("-500:", 8, None) == "-500:"
    assert lmeval.row_range("-500:") == slice(-500, None) and lmeval.row_range(":10") == slice(None, 10)
    assert lmeval.row_range(200) is None and lmeval.row_range("200") is None


def test_a_draw_scores_the_rows_it_names(data, model, tokenizer):
    first, drawn = {}, {}
    run_lm_eval(model, tokenizer, ["piqa"], data_dir=data, limit=8, rows=first)
    run_lm_eval(model, tokenizer, ["piqa"], data_dir=data, limit="3~2:8", rows=drawn)
    picked = sorted(random.Random(lmeval.TASK_SEED).sample(range(2, 8), 3))
    assert len(drawn["piqa"]) == 3 and drawn["piqa"] == [first["piqa"][i] for i in picked]
    assert picked == [2, 5, 6] and drawn["piqa"] != first["piqa"][2:5]  # not the range's first three


def test_a_draw_is_the_same_rows_every_time_and_stays_in_its_range(data):
    manager = lmeval._local_task_manager(data)
    picked = rows_of(["arc_easy", "piqa"], manager, "5~1000:", seed=1234)
    # the one-liner a reader can rerun: random.Random(1234).sample(range(1000, 1838), 5), sorted
    assert picked["piqa"] == sorted(random.Random(1234).sample(range(1000, 1838), 5))
    assert picked["arc_easy"] == sorted(random.Random(1234).sample(range(1000, 2376), 5))
    assert all(1000 <= i for rows in picked.values() for i in rows) and picked["piqa"] != list(range(1000, 1005))
    assert rows_of(["piqa"], manager, "5~1000:", seed=1234) == {"piqa": picked["piqa"]}
    assert rows_of(["piqa"], manager, "5~1000:", seed=7) != {"piqa": picked["piqa"]}
    assert rows_of(["piqa"], manager, "8~1830:", seed=1) == {"piqa": list(range(1830, 1838))}
    with pytest.raises(LayercutError) as err:
        rows_of(["piqa"], manager, "9~1830:", seed=1)
    assert _one_line(err) == "9~1830: draws 9 rows from 8 of piqa: draw fewer or widen the range"
    with pytest.raises(LayercutError) as err:
        rows_of(["piqa"], manager, "9~5000:", seed=1)
    assert _one_line(err) == "rows 5000: of piqa are none of its 1838 rows: pick a range inside 0:1838"


def test_draws_are_kept_as_typed():
    assert lmeval._check_options("1000~1000:", 8, None) == "1000~1000:"
    assert lmeval.row_range("1000~1000:") == slice(1000, None) and lmeval.row_draw("1000~1000:") == 1000
    assert lmeval.row_draw("-500:") is None and lmeval.row_draw(200) is None
    with pytest.raises(LayercutError, match="START:END"):
        lmeval._check_options("5~", 8, None)


def test_in_memory_model_needs_tokenizer(data, model):
    with pytest.raises(LayercutError, match="tokenizer"):
        run_lm_eval(model, None, ["piqa"], data_dir=data, limit=1)


def test_malformed_hellaswag_file_is_one_line():
    with pytest.raises(LayercutError) as err:
        local_docs.hellaswag_items("Label: ctx\n3\na\nb\nc\n")
    assert "6 lines" in _one_line(err)


# ------------------------------------------------------------------------------ real model
@pytest.mark.slow
def test_smollm2_arc_easy_beats_chance(data):
    try:
        from prune.loading.loader import load_model
    except ImportError:
        pytest.skip("prune.loading.loader is not there yet")
    loaded = load_model("smollm2-135m")
    results = run_lm_eval(loaded.model, loaded.tokenizer, ["arc_easy"], data_dir=data, limit=50)
    assert results["arc_easy"]["acc_norm"] > 0.35  # chance is 0.25 (4 choices)


def test_registry_task_data_unreadable_is_one_line_before_any_model(monkeypatch):
    """Offline, a hub task (mmlu) used to fail deep inside lm-eval after the model loaded; now it is checked first."""
    import eval.quality.lmeval as lmeval
    from prune.errors import LayercutError

    class OfflineRegistry:
        def load_task_or_group(self, names):
            raise ConnectionError("Couldn't reach 'cais/mmlu' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(lmeval, "_registry", lambda: OfflineRegistry())
    with pytest.raises(LayercutError) as info:
        lmeval.check_registry_data(["mmlu"])
    message = str(info.value)
    assert "\n" not in message and message.startswith("lm-eval task(s) mmlu: their data could not be read")
    assert "ConnectionError: Couldn't reach 'cais/mmlu'" in message and "arc_easy" in message
    lmeval.check_registry_data([])  # nothing to check, nothing built


def test_task_rows_names_the_rows_each_limit_reads():
    assert lmeval.task_rows(None, 5) == [0, 1, 2, 3, 4]
    assert lmeval.task_rows(3, 10) == [0, 1, 2] and lmeval.task_rows(30, 10) == list(range(10))
    assert lmeval.task_rows(0.25, 10) == [0, 1, 2]  # 2.5 rows round up, as lm-eval counts a fraction
    assert lmeval.task_rows("2:5", 10) == [2, 3, 4] and lmeval.task_rows("-2:", 10) == [8, 9]
    assert lmeval.task_rows("3~2:8", 10) == [2, 5, 6]  # the rows test_a_draw_scores_the_rows_it_names scores
    assert lmeval.task_rows("3~2:8", 10, seed=7) != [2, 5, 6]
    with pytest.raises(LayercutError) as err:
        lmeval.task_rows("4~-3:", 10, "piqa")
    assert _one_line(err) == "4~-3: draws 4 rows from 3 of piqa: draw fewer or widen the range"
    with pytest.raises(LayercutError, match="limit must be"):
        lmeval.task_rows(-1, 10)


def test_a_fraction_scores_the_rows_task_rows_names(data, model, tokenizer):
    first, share = {}, {}
    run_lm_eval(model, tokenizer, ["piqa"], data_dir=data, limit=8, rows=first)
    run_lm_eval(model, tokenizer, ["piqa"], data_dir=data, limit=0.0035, rows=share)  # 6.4 of 1,838 rows
    assert lmeval.task_rows(0.0035, 1838) == list(range(7))
    assert share["piqa"] == first["piqa"][:7]
