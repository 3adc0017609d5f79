"""The traps a user met (issue 46): a report overwritten unasked, checks that came late, warnings, plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from matplotlib.container import BarContainer
from matplotlib.figure import Figure
from transformers import AutoConfig

from prune.checkpoint.load_config import LoadConfig
from prune.errors import EXIT_BAD_INPUT, LayercutError
from prune.pipeline.config import PruneConfig
from prune.pipeline.resolve import resolve_amounts
from tests.helpers import make_tiny_model, make_tiny_tokenizer
from tests.helpers import run_prune_cli as run_prune


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading a model fails the test: the check under test must come before it."""

    def refuse(self, model=None):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(LoadConfig, "load", refuse)


@pytest.fixture
def text_file(tmp_path, sample_text):
    path = tmp_path / "text.txt"
    path.write_text(sample_text)
    return path


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


# ---- eval.run: --out is never overwritten unasked, and --overwrite exists ----


def test_eval_run_refuses_a_non_empty_out_and_takes_overwrite(tiny_folder, text_file, tmp_path, capsys, one_thread):
    from eval.run import main

    out = tmp_path / "report"
    base = ["--model", str(tiny_folder), "--seq-len", "32", "--out", str(out), "--no-progress", "--threads", "1"]
    assert main([*base, "--tasks", f"ppl:{text_file}"]) == 0
    first = (out / "results.json").read_text()
    capsys.readouterr()
    other = tmp_path / "other.txt"
    other.write_text(text_file.read_text()[::-1])
    assert main([*base, "--tasks", f"ppl:{other}"]) == EXIT_BAD_INPUT
    line = one_error_line(capsys.readouterr().err)
    assert line == f"error: --out {out} exists and is not empty: pass --overwrite or choose another folder"
    assert (out / "results.json").read_text() == first  # the first results are still there
    assert main([*base, "--tasks", f"ppl:{other}", "--overwrite"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert "ppl:other/perplexity" in results["models"][0]["metrics"] and "overwrite" not in results["settings"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left


def test_eval_run_logs_the_report_folder_not_its_staging_folder(tiny_folder, text_file, tmp_path, caplog,
                                                                one_thread):
    import logging

    from eval.run import main

    out = tmp_path / "report"
    with caplog.at_level(logging.INFO):
        assert main(["--model", str(tiny_folder), "--tasks", f"ppl:{text_file}", "--seq-len", "32", "--out", str(out),
                     "--no-progress", "--threads", "1"]) == 0
    messages = [record.getMessage() for record in caplog.records]
    assert [m for m in messages if "report written" in m] == [f"report written to {out}"]
    assert not [m for m in messages if f"{tmp_path}/." in m], messages  # no staging folder named anywhere


def test_eval_run_checks_out_before_loading_a_model(tiny_folder, text_file, tmp_path, capsys, no_model_load):
    from eval.run import main

    out = tmp_path / "taken"
    out.mkdir()
    (out / "results.json").write_text("{}")
    assert main(["--model", str(tiny_folder), "--tasks", f"ppl:{text_file}", "--out", str(out)]) == EXIT_BAD_INPUT
    assert "pass --overwrite" in one_error_line(capsys.readouterr().err)


# ---- prune.run: what is known from the flags and the config fails before the model loads ----


def test_too_few_calibration_tokens_fail_before_the_model_loads(tiny_folder, tmp_path, capsys, no_model_load):
    code, _, err = run_prune(capsys, "--model", tiny_folder, "--samples", "2", "--seq-len", "16", "--drop", "1",
                             "--out", tmp_path / "o")
    assert code == EXIT_BAD_INPUT
    assert one_error_line(err) == ("error: 32 calibration tokens are too few for hidden size 32: need at least 128 "
                                   "(4 x hidden); raise --samples or --seq-len")


def test_a_missing_data_file_fails_before_the_model_loads(tiny_folder, tmp_path, capsys, no_model_load):
    code, _, err = run_prune(capsys, "--model", tiny_folder, "--data", "builtin@0.5,missing.txt@0.5",
                             "--samples", "8", "--seq-len", "32", "--drop", "1", "--out", tmp_path / "o")
    assert code == EXIT_BAD_INPUT
    assert "data file 'missing.txt' not found" in one_error_line(err)


@pytest.mark.parametrize(("name", "content", "why"), [
    ("empty.txt", "", "it is empty or only whitespace"), ("blank.txt", " \n\n", "it is empty or only whitespace"),
    ("empty.jsonl", "", "it is empty or only whitespace"),  # datasets' own StopIteration traceback before
    ("blank.jsonl", '{"text": ""}\n{"text": " "}\n', "no row has text in its 'text' field"),
])
def test_an_empty_data_file_fails_before_the_model_loads(tiny_folder, tmp_path, capsys, no_model_load, name,
                                                         content, why):
    data = tmp_path / name
    data.write_text(content)
    code, _, err = run_prune(capsys, "--model", tiny_folder, "--data", data, "--samples", "8", "--seq-len", "32",
                             "--drop", "1", "--out", tmp_path / "o")
    assert code == EXIT_BAD_INPUT and "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]  # a .jsonl: datasets' progress bar too
    assert errors == [f"error: --data file {data} holds no text ({why}): pass a file with the text to read"]


def test_too_large_a_drop_names_the_maximum_that_runs(tiny_folder, tmp_path, capsys, no_model_load):
    code, _, err = run_prune(capsys, "--model", tiny_folder, "--samples", "8", "--seq-len", "32", "--drop", "4",
                             "--out", tmp_path / "o")
    assert code == EXIT_BAD_INPUT
    assert one_error_line(err) == ("error: --drop 4 asks for 4 of the model's 4 blocks: drop at most 2 (blocks "
                                   "[0, 3] are protected; --protect none allows 3)")


def test_a_seq_len_past_the_positions_is_named_before_any_memory_advice(tiny_folder, tmp_path, capsys,
                                                                      no_model_load):
    # 10 MB of host memory: the planner would refuse the run for memory, with --offload advice that cannot help
    code, _, err = run_prune(capsys, "--model", tiny_folder, "--seq-len", "100000", "--drop", "1",
                             "--plan-host-memory", "10MB", "--out", tmp_path / "o")
    assert code == EXIT_BAD_INPUT
    assert one_error_line(err) == ("error: --seq-len 100000 exceeds the model's 256 positions: lower --seq-len (and "
                                   "raise --samples to keep the tokens)")


def test_the_maximum_drop_named_is_accepted_on_a_30_block_model():
    config = AutoConfig.for_model("llama", hidden_size=64, num_hidden_layers=30, num_attention_heads=4,
                                  max_position_embeddings=512)

    def check(drop, protect="0,-1"):
        resolve_amounts(PruneConfig(drop=drop, protect=protect, out="o", data={"seq_len": 32}), config, 10**6)

    with pytest.raises(LayercutError, match=r"drop at most 28 \(blocks \[0, 29\] are protected"):
        check(30)
    check(28)  # the maximum the message names runs
    with pytest.raises(LayercutError, match="only 28 of 30 are not protected"):
        check(29)
    with pytest.raises(LayercutError, match=r"drop at most 29$"):
        check(30, protect="none")
    check(29, protect="none")


# ---- no FutureWarning from the KV cache keyword ----


def test_decoding_with_the_cache_emits_no_future_warning(one_thread):
    from eval.speed.timing import SpeedOptions, greedy_decode, make_prompt
    from prune.data.self_text import sample_sequences

    model = make_tiny_model("llama")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens, _ = greedy_decode(model, make_prompt(320, SpeedOptions(prompt_len=8)), 4)
        sample_sequences(model, make_tiny_tokenizer(), 2, 6, seed=0)
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]
    reference = model.generate(make_prompt(320, SpeedOptions(prompt_len=8)), max_new_tokens=4, do_sample=False,
                               pad_token_id=0)
    assert torch.equal(tokens, reference[:, 8:])


def test_the_cache_keyword_follows_the_forward_signature():
    from prune.model.adapters import cache_keyword

    class Old(torch.nn.Module):  # transformers < 5: only past_key_values
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return input_ids

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None):
            return input_ids

    assert cache_keyword(Old()) == "past_key_values" and cache_keyword(New()) == "cache"


# ---- plots: error bars where lm-eval gives standard errors, each lens panel labelled with its k ----


@pytest.fixture
def drawn(monkeypatch):
    """The figures saved while the test runs, kept open for their artists to be read."""
    figures = []
    real = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (figures.append(self), real(self, *a, **k))[1])
    return figures


def test_metrics_plot_draws_lm_eval_standard_errors(tmp_path, drawn):
    from eval.quality.report import plot_metrics

    models = [{"name": "base", "role": "baseline", "metrics": {"arc_easy/acc": 0.6, "arc_easy/acc_stderr": 0.02,
                                                               "wikitext/perplexity": 20.0}},
              {"name": "slim", "role": "candidate", "metrics": {"arc_easy/acc": 0.5, "arc_easy/acc_stderr": 0.03,
                                                                "wikitext/perplexity": 30.0}}]
    results = {"baseline": "base", "models": models,
               "primary_metrics": ["wikitext/perplexity", "arc_easy/acc"]}  # fmt: skip
    plot_metrics(results, tmp_path / "metrics.png")
    ppl, acc = drawn[0].axes
    bars = {ax: next(c for c in ax.containers if isinstance(c, BarContainer)) for ax in (ppl, acc)}
    assert bars[ppl].errorbar is None  # perplexity has no standard error
    segments = bars[acc].errorbar.lines[2][0].get_segments()  # (data line, caps, [bar lines])
    half_widths = [(seg[1][1] - seg[0][1]) / 2 for seg in segments]
    assert half_widths == pytest.approx([0.02, 0.03])


def test_lens_precision_panels_are_labelled_with_their_k(tmp_path, drawn):
    from eval.lens.plots import plot_precision

    ks = [1, 5, 10]
    results = {"model": "m", "num_blocks": 2, "layers": [0, 1, 2], "precision_ks": ks,
               "per_layer": {"id": {f"precision@{k}": [0.2, 0.5, 1.0] for k in ks}},
               "shortcuts": {"id": {"params_per_layer": 0}}}  # fmt: skip
    plot_precision(results, tmp_path / "precision.png")
    axes = drawn[0].axes
    assert [ax.get_ylabel() for ax in axes] == [f"Precision@{k}" for k in ks]
    assert [ax.get_title() for ax in axes] == [f"Precision@{k}" for k in ks]


# ---- recipes: numbers written as text are read as numbers; other text in a number field is one line ----


def test_recipe_numbers_in_exponent_form_are_numbers(tmp_path):
    from prune.pipeline.recipes import config_from_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text("load: {model: tiny}\ndata: {samples: '16', seq_len: 32}\ndrop: 1\n"
                      "distill: {steps: 2, lr: 3e-4}\nout: o\n")  # YAML 1.1 reads 3e-4 as text
    config = config_from_recipe(recipe)
    assert config.distill["lr"] == 3e-4 and config.data.samples == 16
    (step,) = config.build_steps()
    assert step.config.lr == 3e-4


@pytest.mark.parametrize(("section", "message"), [
    ("data: {samples: eight, seq_len: 32}", "error: data: samples must be an integer, got 'eight'"),
    ("data: {samples: 8, seq_len: 32}\ndistill: {steps: 2, lr: fast}",
     "error: distill: lr must be a number, got 'fast'"),
])
def test_recipe_values_of_the_wrong_type_are_one_line(tiny_folder, tmp_path, capsys, no_model_load, section, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"load: {{model: {tiny_folder}}}\n{section}\ndrop: 1\nout: {tmp_path / 'o'}\n")
    code, _, err = run_prune(capsys, "--recipe", recipe)
    assert code == EXIT_BAD_INPUT and one_error_line(err) == message


# ---- distill.run: a student without layercut.json under --plan, an absurd --lr ----


def test_distill_plan_of_a_student_without_a_report_is_one_line(tiny_folder, tmp_path, capsys):
    from distill.run import main

    assert main(["--student", str(tiny_folder), "--teacher", str(tiny_folder), "--out", str(tmp_path / "o"),
                 "--plan"]) == EXIT_BAD_INPUT
    line = one_error_line(capsys.readouterr().err)
    assert "has 4 blocks, the teacher 4 (by its config; it has no layercut.json): it is not a pruned model" in line


def test_distill_refuses_an_absurd_learning_rate_before_loading(tmp_path, capsys):
    from distill.run import main

    # the student does not exist: the refusal comes first, before anything is read
    assert main(["--student", str(tmp_path / "none"), "--out", str(tmp_path / "o"), "--lr", "1e38"]) == EXIT_BAD_INPUT
    assert one_error_line(capsys.readouterr().err).startswith("error: --lr must be a positive number at most 1 ")


# ---- distill.run --resume: a pickle in the work folder is refused unread ----


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_crafted_pickle_in_the_work_folder_is_refused_without_running_it(tiny_folder, tmp_path, capsys, text_file):
    import pickle

    from distill.run import main
    from prune.checkpoint.write import export_checkpoint
    from prune.model.surgery import drop_blocks_

    student = make_tiny_model("llama")
    drop_blocks_(student, [1, 2])
    report = {"source_model": str(tiny_folder), "model_name": str(tiny_folder), "num_blocks_before": 4,
              "num_blocks_after": 2, "dropped": [1, 2]}
    export_checkpoint(student, make_tiny_tokenizer(), tmp_path / "student", report)
    work, marker = tmp_path / "work", tmp_path / "code-ran"
    (work / "checkpoints").mkdir(parents=True)
    crafted = work / "checkpoints" / "step-00000002.pt"
    crafted.write_bytes(pickle.dumps({"step": 2, "optimizer": _RunsCode(marker)}))
    code = main(["--student", str(tmp_path / "student"), "--out", str(tmp_path / "o"), "--work-dir", str(work),
                 "--resume", "--data", str(text_file), "--samples", "8", "--seq-len", "16", "--steps", "4",
                 "--train", "all", "--threads", "1"])
    assert code == EXIT_BAD_INPUT and not marker.exists()
    err = capsys.readouterr().err  # the models loaded first: their progress bars are on stderr too
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"error: {crafted} holds Python objects") and "never unpickled" in errors[0]


# ---- the card and layercut.json name no path of this machine ----


def test_card_and_report_hold_no_local_path(tiny_folder, tmp_path, capsys, one_thread, sample_text):
    data = tmp_path / "calibration.txt"
    data.write_text(sample_text)
    out = tmp_path / "out"
    code, _, err = run_prune(capsys, "--model", tiny_folder, "--data", data, "--samples", "8", "--seq-len", "32",
                             "--drop", "1", "--out", out, "--threads", "1")
    assert code == 0, err
    for name in ("README.md", "layercut.json", "scores.md", "config.json"):
        text = (out / name).read_text()
        assert str(tmp_path) not in text and str(tiny_folder) not in text, name
    report = json.loads((out / "layercut.json").read_text())
    assert report["source_model"] == tiny_folder.name and report["config"]["out"] == "out"
    assert report["data"]["source"].startswith("calibration.txt")
    assert f"Made with layercut from `{tiny_folder.name}`" in (out / "README.md").read_text()
    # what re-opens the model is relative to the checkpoint: distill.run still finds its teacher
    from prune.checkpoint.report import read_report

    assert (out / report["model_path"]).resolve() == tiny_folder.resolve()
    assert read_report(out)["model_name"] == str(tiny_folder.resolve())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no lock or staging folder left


# ---- one writer per --out ----


def _hold_lock(out) -> subprocess.Popen:
    """Another process holding ``out``'s lock (as a running prune.run does) until it is killed."""
    script = ("import sys, time; from prune.atomic import output_lock\n"
              "with output_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(120)\n")
    child = subprocess.Popen([sys.executable, "-c", script, str(out)], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_second_writer_of_the_same_out_is_refused_while_the_first_runs(tiny_folder, tmp_path, capsys,
                                                                       no_model_load):
    from prune.atomic import lock_path, output_lock

    out = tmp_path / "o"
    child = _hold_lock(out)
    try:
        code, _, err = run_prune(capsys, "--model", tiny_folder, "--samples", "8", "--seq-len", "32", "--drop", "1",
                                 "--out", out)
        assert code == EXIT_BAD_INPUT
        assert one_error_line(err).startswith(f"error: --out {out} is being written by another run (process "
                                              f"{child.pid}; lock {lock_path(out)})")
    finally:
        child.kill()
        child.wait()
    assert lock_path(out).read_text().strip() == str(child.pid)  # killed: its lock stays, stale
    with output_lock(out):  # a lock whose process is gone is taken over
        assert lock_path(out).read_text().strip() == str(os.getpid())
        with output_lock(out):  # the same run's export takes it again
            pass
        assert lock_path(out).exists()
    assert not lock_path(out).exists() and not out.exists()
