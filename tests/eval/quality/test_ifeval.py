"""IFEval offline: lm-eval's own ifeval task (prompt, chat template, checks, metrics) on the local 541 prompts.

The "standard" side is lm-eval's installed ``ifeval.yaml`` with only its dataset swapped for the same JSON-lines
file (the hub is unreachable here). The scoring is lm-eval's ``process_results``, fed hand-made responses that pass
and fail known instructions, so a copy of the checks (or the wrong rows) would show. The tests that import lm-eval's
IFEval checks skip when the ``ifeval`` extra or NLTK's punkt_tab data is missing; the preflight tests run anywhere.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import lm_eval
import pytest
import torch
from lm_eval.api.task import ConfigurableTask
from lm_eval.models.huggingface import HFLM
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from eval.quality import lmeval
from eval.quality.lmeval import hub_offline, local_tasks, plan_tasks, run_lm_eval, task_table
from eval.quality.needs import ifeval
from eval.tasks import local_docs
from prune.errors import LayercutError

DATA = Path(__file__).resolve().parents[4] / "shared" / "data"
ROWS_FILE = DATA / "ifeval" / "input_data.jsonl"
LM_EVAL_IFEVAL = Path(lm_eval.__file__).resolve().parent / "tasks" / "ifeval" / "ifeval.yaml"
METRICS = ("prompt_level_strict_acc", "inst_level_strict_acc", "prompt_level_loose_acc", "inst_level_loose_acc")
# a chat template of the usual shape: role tags, an end-of-turn token, the assistant's turn opened for generation
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
USER_TAG = "<|user|>\n"

pytestmark = pytest.mark.usefixtures("lm_eval_once")  # lm-eval's templates compiled and environment described once


def _ifeval_missing() -> str | None:
    try:
        ifeval.check_ifeval_ready()
    except LayercutError as err:
        return str(err)
    return None


@pytest.fixture(scope="module")
def ready() -> None:
    """Skip unless lm-eval's IFEval checks can be imported offline (the ``ifeval`` extra and punkt_tab)."""
    missing = _ifeval_missing()
    if missing:
        pytest.skip(f"ifeval extra or punkt_tab missing: {missing}")


@pytest.fixture
def data() -> Path:
    if not ROWS_FILE.is_file():
        pytest.skip(f"{ROWS_FILE} not present")
    return DATA


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv(lmeval.DATA_DIR_ENV, raising=False)
    monkeypatch.delenv(lmeval.TASK_DIRS_ENV, raising=False)


def _tokenizer(chat_template: str | None) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained in code (every string encodable, nothing downloaded), with or without a template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["Write a short poem in all lowercase letters.", "<|user|> <|assistant|>"] * 4, trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    out.chat_template = chat_template
    return out


@pytest.fixture(scope="module")
def chat_tokenizer() -> PreTrainedTokenizerFast:
    return _tokenizer(CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def model(chat_tokenizer):
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(chat_tokenizer), max_position_embeddings=4096,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    return AutoModelForCausalLM.from_config(config).eval()


def _jsonl_rows() -> list[dict]:
    return [json.loads(line) for line in ROWS_FILE.read_text(encoding="utf-8").splitlines()]


def _standard_task(cache: Path) -> ConfigurableTask:
    """lm-eval's own ifeval from its installed YAML, reading the same JSON-lines file instead of the hub."""
    from lm_eval.tasks._yaml_loader import load_yaml  # lm-eval 0.4.13's loader (the tested version)

    config = load_yaml(LM_EVAL_IFEVAL)
    config.update(dataset_path="json", dataset_name=None,
                  dataset_kwargs={"data_files": {"train": str(ROWS_FILE)}, "cache_dir": str(cache)})
    with hub_offline():
        return ConfigurableTask(config=config)


def _requests(task, lm: HFLM, samples: list[int]) -> list[tuple[int, str, dict]]:
    task.build_all_requests(samples=samples, apply_chat_template=True, chat_template=lm.apply_chat_template)
    return sorted((inst.doc_id, inst.args[0], dict(inst.args[1])) for inst in task.instances)


# ------------------------------------------------------------------------ (a) the rows and requests
def test_the_offline_rows_are_the_files_rows_in_the_hubs_layout(data):
    split = local_docs.load_jsonl(data, {"files": ["ifeval/input_data.jsonl"]}, split="train")["train"]
    rows = _jsonl_rows()
    assert len(split) == len(rows) == 541
    for ours, row in zip(split, rows, strict=True):
        assert (ours["key"], ours["prompt"], ours["instruction_id_list"]) == (row["key"], row["prompt"],
                                                                             row["instruction_id_list"])
        # the hub's struct column: every argument name in every row, None where the instruction takes no such one
        assert [{k: v for k, v in kw.items() if v is not None} for kw in ours["kwargs"]] == row["kwargs"]
    assert set(split[0]["kwargs"][0]) >= {"num_highlights", "relation", "num_words", "forbidden_words"}


def test_the_requests_are_lm_evals_own_through_the_chat_template(ready, data, model, chat_tokenizer, tmp_path):
    ours = local_tasks(["ifeval"], data)["ifeval"]
    rows = _jsonl_rows()
    trailing = [i for i, r in enumerate(rows) if r["prompt"] != r["prompt"].rstrip()]  # SOURCE.md: keep as written
    assert len(trailing) == 4
    samples = [0, 1, 2, 3, *trailing, 540]
    lm = HFLM(pretrained=model, tokenizer=chat_tokenizer, batch_size=4)
    mine, theirs = _requests(ours, lm, samples), _requests(_standard_task(tmp_path / "cache"), lm, samples)
    assert [r[0] for r in mine] == [r[0] for r in theirs] == list(range(len(samples)))  # lm-eval numbers the draw
    for (_, context, gen), (_, std_context, std_gen), row in zip(mine, theirs, sorted(samples), strict=True):
        assert context == std_context, f"row {row}: prompts differ"
        assert context == f"{USER_TAG}{rows[row]['prompt']}</s>\n<|assistant|>\n"  # templated, not stripped
        # greedy as lm-eval's; only the budget differs (256 against lm-eval's 1280)
        assert gen.pop("max_gen_toks") == 256 and std_gen.pop("max_gen_toks") == 1280
        assert gen == std_gen and gen["do_sample"] is False and gen["until"] == []


# ---------------------------------------------------------------------------- (b) lm-eval's scores
def _row(instruction: str, kwargs: dict | None = None) -> int:
    """The first prompt with ``instruction`` as its only instruction (and these arguments, when given)."""
    for i, row in enumerate(_jsonl_rows()):
        if row["instruction_id_list"] == [instruction] and (kwargs is None or row["kwargs"] == [kwargs]):
            return i
    raise AssertionError(f"no prompt with only {instruction} {kwargs or ''}")


FIVE_SENTENCES = ("Mr. Smith went to Washington. He met Dr. Jones at 5 p.m. on the hill. They talked. "
                  "It rained. Then they left.")  # abbreviations punkt must not split at
# long plain English: the lowercase check also asks langdetect (unseeded, so short texts may come out as another
# language) that the response is English
LOWER = "the river runs past the old mill and the children walk home along the water after school every day."
SCORED = [  # (instruction, its arguments, response, followed strictly, followed loosely)
    ("change_case:english_lowercase", None, LOWER, True, True),
    ("change_case:english_lowercase", None, LOWER.capitalize(), False, False),
    ("length_constraints:number_sentences", {"relation": "less than", "num_sentences": 6}, FIVE_SENTENCES,
     True, True),
    ("length_constraints:number_sentences", {"relation": "less than", "num_sentences": 6},
     FIVE_SENTENCES + " One more. And another.", False, False),
    ("keywords:forbidden_words", {"forbidden_words": ["can", "ride"]}, "We could go by bus.", True, True),
    ("keywords:forbidden_words", {"forbidden_words": ["can", "ride"]}, "We can take the bus.", False, False),
    # loose forgives a first line of chatter, strict does not
    ("change_case:english_lowercase", None, "Sure! Here it is:\n" + LOWER, False, True),
]


@pytest.mark.parametrize(("instruction", "kwargs", "response", "strict", "loose"), SCORED)
def test_the_scores_are_lm_evals_own(ready, data, instruction, kwargs, response, strict, loose):
    from lm_eval.tasks.ifeval import utils as lm_eval_ifeval

    task = local_tasks(["ifeval"], data)["ifeval"]
    index = _row(instruction, kwargs)
    ours = task.process_results(task.test_docs()[index], [response])
    theirs = lm_eval_ifeval.process_results(_jsonl_rows()[index], [response])
    assert ours == theirs == {"prompt_level_strict_acc": strict, "inst_level_strict_acc": [strict],
                              "prompt_level_loose_acc": loose, "inst_level_loose_acc": [loose]}


def _lm_evals(function) -> bool:
    """Whether ``function`` is lm-eval's own IFEval code (lm-eval may have loaded that file twice: compare files)."""
    return (function.__module__ == "lm_eval.tasks.ifeval.utils"
            and Path(inspect.getsourcefile(function)) == LM_EVAL_IFEVAL.with_name("utils.py"))


def test_the_task_calls_lm_evals_functions_not_copies(ready, data):
    task = local_tasks(["ifeval"], data)["ifeval"]
    assert _lm_evals(task.config.process_results) and task.config.process_results.__name__ == "process_results"
    aggregation = task.aggregation()
    assert list(aggregation) == list(METRICS)
    assert aggregation["inst_level_strict_acc"] is aggregation["inst_level_loose_acc"]
    assert _lm_evals(aggregation["inst_level_strict_acc"])
    assert aggregation["inst_level_strict_acc"].__name__ == "agg_inst_level_acc"
    # the sentence counter is NLTK's punkt: five sentences, the abbreviations not split at
    assert len(__import__("nltk").sent_tokenize(FIVE_SENTENCES)) == 5


# --------------------------------------------------------------------------------- (c) end to end
class _Spy:
    """Record what each of the model's request methods is asked: the contexts and generation arguments."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, list[tuple]]] = []
        wrap = lmeval.wrap_model

        def wrapped(*args, **kwargs):
            lm = wrap(*args, **kwargs)
            for method in ("generate_until", "loglikelihood"):
                original = getattr(lm, method)

                def recording(requests, *a, _original=original, _method=method, **kw):
                    self.calls.append((_method, [tuple(r.args) for r in requests]))
                    return _original(requests, *a, **kw)

                setattr(lm, method, recording)
            return lm

        monkeypatch.setattr(lmeval, "wrap_model", wrapped)

    def args(self, method: str) -> list[tuple]:
        return [args for name, calls in self.calls if name == method for args in calls]


def test_run_lm_eval_scores_ifeval_with_the_template_and_a_fixed_budget(ready, data, model, chat_tokenizer,
                                                                        monkeypatch):
    spy = _Spy(monkeypatch)
    rows: dict[str, list[float]] = {}
    results = run_lm_eval(model, chat_tokenizer, ["piqa", "ifeval"], data_dir=data, limit=3, rows=rows)
    scores = results["ifeval"]
    assert set(METRICS) <= set(scores) and all(0.0 <= scores[m] <= 1.0 for m in METRICS)
    assert scores["max_gen_toks"] == 256 and "max_gen_toks" not in results["piqa"]  # the budget, said with the figure
    assert len(rows["ifeval"]) == 3 and set(rows["ifeval"]) <= {0.0, 1.0}
    assert sum(rows["ifeval"]) / 3 == pytest.approx(scores["prompt_level_strict_acc"])
    prompts = [row["prompt"] for row in _jsonl_rows()[:3]]
    generated = spy.args("generate_until")
    assert [context for context, _ in generated] == [f"{USER_TAG}{p}</s>\n<|assistant|>\n" for p in prompts]
    assert all(gen["max_gen_toks"] == 256 and gen["do_sample"] is False for _, gen in generated)
    # piqa ran in its own call, without the template (lm-eval applies one to every task of a call)
    assert spy.args("loglikelihood") and not any(USER_TAG in context for context, _ in spy.args("loglikelihood"))


def test_the_token_budget_is_overridable_and_recorded(ready, data, model, chat_tokenizer, monkeypatch):
    spy = _Spy(monkeypatch)
    results = run_lm_eval(model, chat_tokenizer, ["ifeval"], data_dir=data, limit=2, max_gen_toks=5)
    assert results["ifeval"]["max_gen_toks"] == 5
    assert [gen["max_gen_toks"] for _, gen in spy.args("generate_until")] == [5, 5]
    with pytest.raises(LayercutError, match="max_gen_toks must be a positive whole number of tokens, got 0"):
        run_lm_eval(model, chat_tokenizer, ["ifeval"], data_dir=data, limit=2, max_gen_toks=0)


def test_a_tokenizer_without_a_chat_template_is_one_line(ready, data, model):
    with pytest.raises(LayercutError) as err:
        run_lm_eval(model, _tokenizer(None), ["piqa", "ifeval"], data_dir=data, limit=2)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("ifeval runs its prompts through the model's chat template, and this tokenizer has none")
    assert "tokenizer.chat_template" in message


def test_the_spec_says_chat_budget_and_the_quoted_metric():
    spec = task_table()["ifeval"]
    assert (spec.chat, spec.max_gen_toks, spec.primary_metric, spec.chance) == (True, 256, "prompt_level_strict_acc",
                                                                               0.0)
    assert spec.files == ("ifeval/input_data.jsonl",)
    assert not task_table()["piqa"].chat and task_table()["piqa"].max_gen_toks is None
    groups = lmeval._run_settings(["piqa", "ifeval", "arc_easy", "gsm8k"], None)
    assert groups == {(False, None): ["piqa", "arc_easy", "gsm8k"], (True, 256): ["ifeval"]}
    assert lmeval._run_settings(["piqa", "ifeval"], 64) == {(False, 64): ["piqa"], (True, 64): ["ifeval"]}


# ------------------------------------------------------------------------------ (d) the preflight
@pytest.mark.parametrize("package", ifeval.IFEVAL_PACKAGES)
def test_a_missing_package_is_one_line_naming_the_extra(monkeypatch, package):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else find_spec(name, *a))
    with pytest.raises(LayercutError) as err:
        ifeval.check_ifeval_ready()
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"ifeval needs {package} ")
    assert 'pip install "layercut[ifeval]"' in message


def test_an_old_nltk_is_one_line(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(ifeval.metadata, "version", lambda name: "3.8.1")
    with pytest.raises(LayercutError, match=r'^ifeval needs nltk>=3\.9\.1, found 3\.8\.1 .*layercut\[ifeval\]"$'):
        ifeval.check_ifeval_ready()


def test_missing_punkt_tab_is_one_line_naming_the_fixes(monkeypatch):
    pytest.importorskip("nltk")
    import importlib.util

    import nltk.data

    looked = []

    def not_found(resource, *a, **kw):
        looked.append(resource)
        raise LookupError(resource)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(ifeval.metadata, "version", lambda name: "3.9.1")
    monkeypatch.setattr(nltk.data, "find", not_found)
    with pytest.raises(LayercutError) as err:
        ifeval.check_ifeval_ready()
    message = str(err.value)
    assert looked == ["tokenizers/punkt_tab"] and "\n" not in message
    assert "python -m nltk.downloader punkt_tab" in message and "NLTK_DATA" in message


def test_planning_ifeval_runs_the_preflight_before_lm_eval_imports_anything(data, monkeypatch):
    checked = []

    def refuse():
        checked.append(True)
        raise LayercutError("ifeval needs langdetect (lm-eval's IFEval checks import them); pip install ...")

    needs, real = ifeval.TASK_NEEDS, ifeval.TASK_NEEDS.get
    assert real("ifeval") is ifeval.check_ifeval_ready  # what ifeval.yaml's `needs: [ifeval]` runs
    assert task_table()["ifeval"].needs == ("ifeval",) and task_table()["piqa"].needs == ()
    monkeypatch.setattr(needs, "get", lambda name: refuse if name == "ifeval" else real(name))
    assert plan_tasks(["piqa"], data) == (["piqa"], []) and not checked  # other tasks need none of it
    with pytest.raises(LayercutError, match="^ifeval needs langdetect"):
        plan_tasks(["piqa", "ifeval"], data)
    with pytest.raises(LayercutError, match="^ifeval needs langdetect"):
        local_tasks(["ifeval"], data)
    assert checked == [True, True]


def test_the_report_says_the_token_budget_as_a_setting_not_a_score():
    from eval.quality.report import markdown_table, table_metrics

    results = {"baseline": None, "models": [
        {"name": "m", "role": "candidate", "metrics": {"ifeval/prompt_level_strict_acc": 0.25,
                                                      "ifeval/prompt_level_strict_acc_stderr": 0.05,
                                                      "ifeval/max_gen_toks": 256}}]}
    assert table_metrics(results) == ["ifeval/prompt_level_strict_acc"]
    assert "max_gen_toks" not in markdown_table(results)
