import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import eval.quality.evaluate as run_module
from eval.quality.perplexity import text_perplexity, wikitext2_test_text
from eval.quality.report import markdown_table, write_report
from eval.run import EvalOptions, main
from prune.errors import LayercutError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
DATA = Path(__file__).resolve().parents[4] / "shared" / "data"

pytestmark = pytest.mark.usefixtures("lm_eval_once")  # lm-eval's templates compiled and environment described once
VOCAB = 128
WORDS = "the quick brown fox jumps over the lazy dog and a cat sat on the mat".split()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    tok.train_from_iterator([" ".join(WORDS * 10)], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def save_model(folder: Path, blocks: int, seed: int = 0, tokenizer: bool = True, dropped=None) -> Path:
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=blocks,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    if tokenizer:
        tiny_tokenizer().save_pretrained(folder)
    if dropped is not None:
        report = {"num_blocks_before": blocks + len(dropped), "num_blocks_after": blocks, "dropped": dropped}
        (folder / "layercut.json").write_text(json.dumps(report))
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    data = root / "data" / "wikitext-2-raw-v1"
    data.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(12):
        idx = torch.randint(0, len(WORDS), (12,), generator=generator).tolist()
        lines += [" ", " " + " ".join(WORDS[i] for i in idx) + " . "]
    (data / "wiki.test.raw").write_text("\n".join(lines) + "\n")
    models = {
        "base": save_model(root / "base", 4),
        "cut1": save_model(root / "cut1", 3, seed=1, dropped=[2]),
        "cut2": save_model(root / "cut2", 2, seed=2),  # no layercut.json: blocks removed from the block counts
    }
    return root, models


def test_run_writes_report_with_exact_perplexities(setup, capsys):
    root, models = setup
    out = root / "report"
    argv = ["--baseline", str(models["base"]), "--model", str(models["cut1"]), "--model", str(models["cut2"]),
            "--tasks", "wikitext", "--data-dir", str(root / "data"), "--seq-len", "32", "--out", str(out),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    text = wikitext2_test_text(root / "data")
    for entry, key in zip(results["models"], ["base", "cut1", "cut2"], strict=True):
        model = AutoModelForCausalLM.from_pretrained(models[key]).eval()
        expected = text_perplexity(model, AutoTokenizer.from_pretrained(models[key]), text, seq_len=32, progress=False)
        assert entry["metrics"]["wikitext/perplexity"] == pytest.approx(expected.perplexity, rel=1e-9)
        assert entry["details"]["wikitext"]["tokens_scored"] == expected.tokens_scored
    assert [e["num_blocks"] for e in results["models"]] == [4, 3, 2]
    assert [e["blocks_removed"] for e in results["models"]] == [0, 1, 2]
    assert results["models"][1]["dropped"] == [2]
    readme = (out / "README.md").read_text()
    assert f"| metric | baseline: {models['base']} |" in readme and "delta " in readme
    assert (out / "metrics.png").stat().st_size > 1000 and (out / "vs_blocks_removed.png").stat().st_size > 1000
    assert "wikitext/perplexity (lower is better)" in capsys.readouterr().out


def test_lm_eval_tasks_are_flattened_into_metrics(setup, monkeypatch):
    root, models = setup
    calls = []

    def fake_lm_eval(model, tokenizer, tasks, **kw):
        calls.append((list(tasks), kw["limit"], kw["data_dir"]))
        blocks = model.config.num_hidden_layers
        return {"arc_easy": {"acc": 0.1 * blocks, "acc_norm": 0.05 * blocks, "acc_stderr": 0.01, "sample_len": 5}}

    monkeypatch.setattr(run_module, "run_lm_eval", fake_lm_eval)
    monkeypatch.setattr(run_module, "plan_tasks", lambda tasks, data_dir: ([], list(tasks)))
    monkeypatch.setattr(run_module, "check_registry_data", lambda names: calls.append(("checked", names)))
    options = EvalOptions(models=[str(models["cut1"])], baseline=str(models["base"]), tasks=["arc_easy"],
                          out=str(root / "lm"), limit=5, progress=False)  # fmt: skip
    results = run_module.run(options)
    assert calls == [("checked", ["arc_easy"])] + [(["arc_easy"], 5, None)] * 2  # data checked before any model
    expected = {"arc_easy/acc": 0.3, "arc_easy/acc_norm": 0.15, "arc_easy/acc_stderr": 0.01, "arc_easy/sample_len": 5}
    assert results["models"][1]["metrics"] == pytest.approx(expected, rel=1e-12)
    assert results["primary_metrics"] == ["arc_easy/acc_norm"]
    table = (root / "lm" / "README.md").read_text()
    assert "| arc_easy/acc_norm | 0.2000 | 0.1500 | -0.0500 (-25.0%) |" in table
    assert "| arc_easy/acc | 0.4000 ± 0.0100 | 0.3000 ± 0.0100 | -0.1000 (-25.0%) |" in table  # lm-eval's stderr
    assert "stderr" not in table and "sample_len" not in table


def test_unknown_task_is_a_one_line_error(setup, capsys, monkeypatch):
    import types

    from eval.quality import lmeval

    # a stand-in for lm-eval's task index: the real one indexes thousands of YAMLs (30 s and more) before a name
    # is refused; tests/eval/quality/test_lmeval.py refuses a name against the real one
    looked_up = []
    monkeypatch.setattr(lmeval, "_registry", lambda: looked_up.append(1) or types.SimpleNamespace(
        all_tasks=["arc_easy", "hellaswag", "piqa"]))
    root, models = setup
    capsys.readouterr()
    argv = ["--baseline", str(models["base"]), "--model", str(models["cut1"]), "--tasks", "wikitext,no_such_task",
            "--out", str(root / "x")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown task 'no_such_task'") and "wikitext" in err and "\n" not in err
    assert not (root / "x").exists() and looked_up  # refused by the registry's answer


def test_folder_without_tokenizer(setup, tmp_path, capsys):
    root, models = setup
    bare = save_model(tmp_path / "bare", 2, tokenizer=False)
    capsys.readouterr()
    argv = ["--baseline", str(models["base"]), "--model", str(bare), "--tasks", "wikitext",
            "--data-dir", str(root / "data"), "--out", str(tmp_path / "r"), "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: model folder {bare} has no tokenizer files; save one with tokenizer.save_pretrained(folder) "
        "or pass --tokenizer NAME"
    )
    assert main([*argv, "--tokenizer", str(models["base"])]) == 0
    assert json.loads((tmp_path / "r" / "results.json").read_text())["models"][1]["num_blocks"] == 2


def test_missing_wikitext_file_fails_before_loading(tmp_path, setup, capsys):
    _, models = setup
    capsys.readouterr()
    argv = ["--baseline", str(models["base"]), "--model", str(models["cut1"]), "--data-dir", str(tmp_path),
            "--out", str(tmp_path / "r")]  # fmt: skip
    assert main(argv) == 2
    assert "wiki.test.raw" in capsys.readouterr().err


def test_options_are_validated():
    with pytest.raises(LayercutError, match="stride"):
        EvalOptions(models=["a"], baseline="b", seq_len=8, stride=16)
    with pytest.raises(LayercutError, match="no --model"):
        EvalOptions(models=[], baseline="b")
    assert EvalOptions(models=["a"], baseline="b", tasks=["wikitext", " piqa", "piqa"]).lm_eval_tasks == ["piqa"]


def test_markdown_table_layout(tmp_path):
    results = {
        "baseline": "big",
        "models": [
            {"name": "big", "role": "baseline", "num_blocks": 30, "blocks_removed": 0,
             "metrics": {"wikitext/perplexity": 20.0, "piqa/acc": 0.7}},
            {"name": "small", "role": "candidate", "num_blocks": 26, "blocks_removed": 4,
             "metrics": {"wikitext/perplexity": 25.0, "piqa/acc": 0.65}},
        ],
    }  # fmt: skip
    assert markdown_table(results).splitlines() == [
        "| metric | baseline: big | small | delta |",
        "|---|---|---|---|",
        "| blocks | 30 | 26 | -4 |",
        "| wikitext/perplexity (lower is better) | 20.00 | 25.00 | +5.0000 (+25.0%) |",
        "| piqa/acc | 0.7000 | 0.6500 | -0.0500 (-7.1%) |",
    ]
    written = write_report(results, tmp_path)
    assert set(written) == {"json", "markdown", "metrics_plot"}  # one candidate: no blocks-removed plot


@pytest.mark.skipif(not (DATA / "arc").is_dir(), reason="shared data not present")
def test_real_lm_eval_task_on_a_tiny_model(setup):
    root, models = setup
    options = EvalOptions(models=[str(models["cut2"])], baseline=str(models["base"]), tasks=["arc_easy"],
                          out=str(root / "arc"), data_dir=str(DATA), limit=4, progress=False)  # fmt: skip
    results = run_module.run(options)
    for entry in results["models"]:
        assert 0.0 <= entry["metrics"]["arc_easy/acc_norm"] <= 1.0
        assert entry["metrics"]["arc_easy/acc"] * 4 == pytest.approx(round(entry["metrics"]["arc_easy/acc"] * 4))


def test_limit_caps_perplexity_windows_and_the_report_says_how_many_tokens(setup, capsys):
    root, models = setup
    out = root / "limited"
    argv = ["--model", str(models["cut1"]), "--tasks", "wikitext", "--data-dir", str(root / "data"), "--seq-len", "16",
            "--limit", "2", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    metrics = json.loads((out / "results.json").read_text())["models"][0]["metrics"]
    assert metrics["wikitext/tokens_scored"] == 2 * (16 - 1)  # two windows; each window's first token is context
    text = wikitext2_test_text(root / "data")
    model = AutoModelForCausalLM.from_pretrained(models["cut1"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(models["cut1"])
    expected = text_perplexity(model, tokenizer, text, seq_len=16, max_tokens=32, progress=False)
    assert metrics["wikitext/perplexity"] == pytest.approx(expected.perplexity, rel=1e-9)
    assert "wikitext/tokens_scored" in capsys.readouterr().out


def test_limit_takes_a_count_a_fraction_or_a_range_of_rows():
    from eval.run import build_parser

    parse = build_parser().parse_args
    base = ["--model", "m", "--out", "o"]
    assert parse([*base, "--limit", "200"]).limit == 200
    assert parse([*base, "--limit", "0.25"]).limit == 0.25
    assert parse([*base, "--limit=-500:"]).limit == "-500:"
    assert parse([*base, "--limit", "500:1000"]).limit == "500:1000"
    assert parse([*base, "--limit", "1000~1000:"]).limit == "1000~1000:"


@pytest.mark.parametrize("limit", ["2.5", "abc", "1:x", "0~1:", "5~"])
def test_a_bad_limit_is_a_usage_error(limit, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "m", "--out", "o", f"--limit={limit}"])
    assert exit_.value.code == 2
    assert "--limit" in capsys.readouterr().err
