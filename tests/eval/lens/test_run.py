"""The lens CLI and pipeline end to end on tiny models: files, reload, data split, one-line errors."""

import json
import random
import runpy
import sys

import pytest

from eval.lens.metrics import evaluate_shortcuts
from eval.lens.pipeline import FIT_SHARE, LensConfig, _token_windows, lens_splits, run_lens
from eval.lens.run import main
from eval.lens.shortcuts import LowRankConfig, load_shortcuts
from prune.checkpoint.load_config import LoadConfig
from prune.loading.loader import LoadedModel
from tests.helpers import _TEXT, make_tiny_model, make_tiny_tokenizer

WORDS = _TEXT.split()
FAST = ["--tokens", "512", "--eval-tokens", "128", "--seq-len", "32", "--steps", "8", "--token-batch", "64",
        "--no-progress"]  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_thread")


def random_text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lens")
    model_dir = root / "tiny-llama"
    make_tiny_model("llama").save_pretrained(model_dir)
    make_tiny_tokenizer().save_pretrained(model_dir)
    (root / "fit.txt").write_text(random_text(3000, 0))
    (root / "held.txt").write_text(random_text(600, 1))
    return root, model_dir


def test_cli_writes_results_figures_and_reloadable_shortcuts(tiny, capsys):
    root, model_dir = tiny
    out = root / "out"
    argv = ["--model", str(model_dir), "--data", str(root / "fit.txt"), *FAST, "--submodules",
            "--submodule-blocks", "0,-1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| layer | id P@1 |" in printed and "wrote" in printed
    assert "| block | attention P@1 |" in printed  # the stand-ins table is printed, not only written
    names = {p.name for p in out.iterdir()}
    assert names == {"results.json", "README.md", "shortcuts.safetensors", "r2.png", "precision.png",
                     "surprisal.png", "heatmap.png", "early_exit.png", "submodules.png"}  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    assert results["num_blocks"] == 4 and results["layers"] == [0, 1, 2, 3, 4]
    assert list(results["per_layer"]) == ["id", "mat", "njtc", "n-njtc"]
    for metrics in results["per_layer"].values():
        assert all(len(v) == 5 for v in metrics.values())
        assert metrics["precision@1"][-1] == 1.0
    assert results["shortcuts"]["mat"]["params_per_layer"] == 32 * 32 + 32
    assert results["shortcuts"]["n-njtc"]["params_per_layer"] == 2 * 1 * 32 + 2 * 32  # rank max(1, 32 // 100)
    assert len(results["heatmap"]["id"]) == 5 and results["heatmap"]["states"] == [0, 1, 2, 3, 4]
    assert [row["block"] for row in results["submodules"]["rows"]] == [0, 3]
    exits = results["early_exit"]["shortcuts"]["mat"]
    assert exits["sweep"][-1]["layers"] == 4 and exits["sweep"][-1]["precision@1"] == 1.0
    assert exits["layers_saved_at_goal"] == pytest.approx(4 - exits["layers_used_at_goal"])
    readme = (out / "README.md").read_text()
    assert "## Early exit" in readme and "![early_exit.png](early_exit.png)" in readme
    assert "## Sub-module stand-ins" in readme

    # The saved shortcuts, reloaded, give the same held-out numbers.
    config = LensConfig(load=LoadConfig(str(model_dir)), data=str(root / "fit.txt"), tokens=512, eval_tokens=128,
                        seq_len=32)  # fmt: skip
    tokenizer = make_tiny_tokenizer()
    _, held, _ = lens_splits(tokenizer, config)
    model = make_tiny_model("llama")
    again = evaluate_shortcuts(model, load_shortcuts(out), held.token_ids, progress=False)
    for name in again.names:
        assert again.precision[name][1] == pytest.approx(results["per_layer"][name]["precision@1"], abs=1e-12)
        assert again.surprisal[name] == pytest.approx(results["per_layer"][name]["surprisal"], rel=1e-6)


def test_default_split_is_disjoint(tiny):
    root, _ = tiny
    tokenizer = make_tiny_tokenizer()
    config = LensConfig(data=str(root / "fit.txt"), tokens=256, eval_tokens=128, seq_len=32)
    fit, held, split = lens_splits(tokenizer, config)
    windows, _ = _token_windows(config.data, tokenizer, config, limit=10**9)
    cut = int(FIT_SHARE * len(windows))
    assert fit.token_ids.shape == (8, 32) and held.token_ids.shape == (4, 32)
    rows = {tuple(w.tolist()): i for i, w in enumerate(windows)}
    assert all(rows[tuple(w.tolist())] < cut for w in fit.token_ids)
    assert all(rows[tuple(w.tolist())] >= cut for w in held.token_ids)
    assert "first" in split
    config = LensConfig(data=str(root / "fit.txt"), eval_data=str(root / "held.txt"), tokens=256, eval_tokens=128,
                        seq_len=32)  # fmt: skip
    _, held, split = lens_splits(tokenizer, config)
    assert held.source.endswith("held.txt") and split == "fit on --data, held out on --eval-data"


@pytest.mark.parametrize("model_type", ["gpt2", "opt"])
def test_pipeline_on_other_architectures(tiny, model_type):
    root, _ = tiny
    model = make_tiny_model(model_type)
    loaded = LoadedModel(model, make_tiny_tokenizer(), f"tiny-{model_type}", "memory")
    config = LensConfig(data=str(root / "fit.txt"), eval_data=str(root / "held.txt"), tokens=256, eval_tokens=128,
                        seq_len=32, shortcuts="id,mat,njtc,n-njtc", low_rank=LowRankConfig(steps=4, token_batch=32),
                        heatmap=False, early_exit=True, progress=False)  # fmt: skip
    results = run_lens(config, loaded).results
    assert list(results["per_layer"]) == ["id", "mat", "njtc", "n-njtc"] and results["heatmap"] is None
    assert results["r2_source"] == {"id": "moments", "mat": "moments", "njtc": "tokens", "n-njtc": "tokens"}
    assert set(results["early_exit"]["shortcuts"]) >= {"id", "mat"}
    assert results["claims"]["layers_compared"] == 3


def test_cli_without_heatmap_or_early_exit(tiny):
    root, model_dir = tiny
    out = root / "small"
    argv = ["--model", str(model_dir), "--data", str(root / "fit.txt"), "--eval-data", str(root / "held.txt"), *FAST,
            "--shortcuts", "mat,id", "--no-heatmap", "--no-early-exit", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["heatmap"] is None and results["early_exit"] is None
    assert {p.name for p in out.glob("*.png")} == {"r2.png", "precision.png", "surprisal.png"}
    assert load_shortcuts(out).names == ["id", "mat"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tokens", "64"], "--tokens 64 is too few for hidden size 32: the mat fit needs at least 128"),
        (["--shortcuts", "id,tuned"], "unknown shortcut 'tuned': choose from id, mat, njtc, n-njtc"),
        (["--submodules", "--submodule-blocks", "7"], "names block 7: the model has blocks 0..3"),
        (["--eval-tokens", "100000"], "held-out text"),
        (["--seq-len", "1"], "--seq-len must be at least 2, got 1"),
        (["--threads", "0"], "--threads must be a positive integer, got 0"),
    ],
)
def test_bad_input_is_one_line_exit_2(tiny, capsys, extra, message):
    root, model_dir = tiny
    argv = ["--model", str(model_dir), "--data", str(root / "fit.txt"), *FAST, *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([line for line in err if line.startswith("error:")]) == 1
    assert message in err[-1]


def test_module_help_lists_the_lens_flags(capsys, monkeypatch):
    """``python -m eval.lens --help``, run in this process: ``__main__`` reaches the CLI, which exits 0."""
    monkeypatch.setattr(sys, "argv", ["eval.lens", "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_module("eval.lens", run_name="__main__")
    assert done.value.code == 0
    printed = capsys.readouterr().out
    assert "--shortcuts" in printed and "--threads" in printed


def test_existing_output_folder_needs_overwrite(tiny, capsys):
    root, model_dir = tiny
    out = root / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(["--model", str(model_dir), *FAST, "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_mat_beats_id():
    from prune.loading.loader import load_model

    loaded = load_model("smollm2-135m")
    config = LensConfig(tokens=4096, eval_tokens=1024, shortcuts="id,mat", heatmap=False, early_exit=False,
                        progress=False)  # fmt: skip
    results = run_lens(config, loaded).results
    claims = results["claims"]
    assert claims["mat_beats_id_r2_layers"] >= 0.8 * claims["layers_compared"]
    assert claims["mat_beats_id_precision@1_layers"] >= 0.8 * claims["layers_compared"]
