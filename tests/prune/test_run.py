"""``python -m prune.run`` end to end on a tiny saved model, and every bad-input error it promises."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from prune.errors import EXIT_BAD_INPUT
from tests.helpers import make_tiny_tokenizer
from tests.helpers import run_prune_cli as run


def small(folder):
    return ["--model", folder, "--samples", "8", "--seq-len", "32", "--batch-size", "4"]


def test_prune_exports_a_plain_checkpoint(tiny_folder, tmp_path, capsys):
    out = tmp_path / "slim"
    code, stdout, _ = run(capsys, *small(tiny_folder), "--drop", "2", "--protect", "none", "--out", out)
    assert code == 0
    assert "| block | linearity | linearity-nores |" in stdout and "4 blocks -> 2" in stdout
    for name in ("config.json", "model.safetensors", "tokenizer.json", "layercut.json", "README.md",
                 "linearity_profile.png", "scores.md"):
        assert (out / name).is_file(), name
    report = json.loads((out / "layercut.json").read_text())
    assert report["num_blocks_before"] == 4 and report["num_blocks_after"] == 2
    assert len(report["dropped"]) == 2 and report["dropped"] == sorted(report["dropped"])
    assert set(report["scores"]) >= {"linearity", "linearity-nores", "cosine", "angular", "bi"}
    assert all(len(v) == 4 for v in report["scores"].values())
    assert report["data"]["tokens"] == 256 and "transformers" in report["versions"] and report["seconds"] > 0
    # The dropped blocks are the most linear ones.
    lin = report["scores"]["linearity"]
    assert sorted(report["dropped"]) == sorted(sorted(range(4), key=lambda b: -lin[b])[:2])
    assert not list(tmp_path.glob(".slim*")), "no temporary folder may be left behind"

    # Plain transformers loads it; logits equal the in-memory pruned model (drop the same blocks by hand).
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert AutoConfig.from_pretrained(out).num_hidden_layers == 2
    reference = AutoModelForCausalLM.from_pretrained(tiny_folder).eval()
    from prune.model.surgery import drop_blocks_

    drop_blocks_(reference, report["dropped"])
    ids = torch.randint(3, 320, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
        generated = loaded.generate(ids[:, :5], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert generated.shape == (2, 11)


def test_scores_only_writes_profile(tiny_folder, tmp_path, capsys):
    out = tmp_path / "profile"
    code, stdout, _ = run(capsys, *small(tiny_folder), "--score", "angular", "--out", out)
    assert code == 0 and "dropped []" in stdout
    assert (out / "linearity_profile.png").stat().st_size > 1000
    assert not (out / "model.safetensors").exists()


def test_overwrite(tiny_folder, tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    code, _, err = run(capsys, *small(tiny_folder), "--drop", "1", "--out", out)
    assert code == EXIT_BAD_INPUT and "exists and is not empty: pass --overwrite" in err
    assert (out / "keep.txt").exists()
    code, _, _ = run(capsys, *small(tiny_folder), "--drop", "1", "--out", out, "--overwrite")
    assert code == 0 and (out / "layercut.json").exists() and not (out / "keep.txt").exists()


def unsupported_folder(tmp_path):
    config = AutoConfig.for_model("bert", hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                  intermediate_size=64, vocab_size=320, is_decoder=True)
    folder = tmp_path / "bert"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "case,extra,message",
    [
        ("unknown model", ["--model", "no-such-model-xyz"], "unknown model 'no-such-model-xyz'"),
        ("drop too many", ["--drop", "4"], "drop at most 2 (blocks [0, 3] are protected; --protect none allows 3)"),
        ("drop zero", ["--drop", "0"], "removes no block"),
        ("drop negative", ["--drop", "-1"], "removes no block"),
        ("too few tokens", ["--samples", "2", "--seq-len", "16", "--drop", "1"], "need at least 128"),
        ("missing data", ["--data", "missing.txt", "--drop", "1"], "data file 'missing.txt' not found"),
        pytest.param("4-bit on cpu", ["--load-in-4bit", "--drop", "1"], "needs a CUDA GPU",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")),
    ],
)
def test_bad_input_is_one_line_with_exit_code_2(tiny_folder, tmp_path, capsys, monkeypatch, case, extra, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["--model", tiny_folder, "--samples", "8", "--seq-len", "32", "--out", tmp_path / "o", *extra]
    code, _, err = run(capsys, *args)
    assert code == EXIT_BAD_INPUT, err
    assert message in err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: ") and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_unsupported_architecture(tmp_path, capsys):
    code, _, err = run(capsys, "--model", unsupported_folder(tmp_path), "--drop", "1")
    assert code == EXIT_BAD_INPUT
    assert "unsupported architecture 'bert': an encoder" in err and "--list-architectures" in err


def test_subprocess_exit_code(tiny_folder):
    """The real entry point (python -m prune.run) exits with 2 and prints one line."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "prune.run", "--model", str(tiny_folder), "--drop", "0"]
    proc = subprocess.run(argv, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --drop 0 removes no block")


def test_the_default_repairs_with_the_best_servable_method_and_says_what_it_gained(tiny_folder, tmp_path, capsys):
    """``--drop K`` alone: the tiny llama (untied head, RMSNorm) gets fold-rotate, a plain checkpoint, and the summary
    puts its held-out perplexity beside removal of the same blocks; ``--replace none`` still removes only."""
    out = tmp_path / "slim"
    code, stdout, err = run(capsys, *small(tiny_folder), "--drop", "1", "--heldout-samples", "2", "--out", out,
                            default_repair=True)
    assert code == 0, err
    report = json.loads((out / "layercut.json").read_text())
    assert report["replace"] == "fold-rotate" and report["config"]["auto_replace"] is True
    assert [r["method"] for r in report["replacements"]] == ["fold-rotate"]
    held = report["heldout"]
    assert held["removal"] > 0 and held["removal_ratio"] == pytest.approx(held["removal"] / held["original"])
    assert "--replace auto: fold-rotate" in stdout and "removal of the same blocks alone:" in stdout
    assert AutoModelForCausalLM.from_pretrained(out).config.num_hidden_layers == 3  # plain transformers loads it
    code, stdout, _ = run(capsys, *small(tiny_folder), "--drop", "1", "--replace", "none", "--out", tmp_path / "rm",
                          default_repair=True)
    report = json.loads((tmp_path / "rm" / "layercut.json").read_text())
    assert code == 0 and report["replace"] == "none" and not report["config"]["auto_replace"]
    assert "removal of the same blocks" not in stdout
    # a method's option with the method not named yet: one line that says to name it
    code, _, err = run(capsys, *small(tiny_folder), "--drop", "1", "--update-scale", "0.5", default_repair=True)
    assert code == EXIT_BAD_INPUT and err.count("\n") == 1
    assert "--update-scale: an option of a method, and --replace auto chooses the method" in err
