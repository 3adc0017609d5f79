"""``python -m eval.compare`` on a tiny saved model: cells, leaderboard, plots, resume, oracle, bad input."""

import json

import pytest
from conftest import make_tiny_tokenizer
from transformers import AutoModelForCausalLM

import eval.compare as compare_module
from eval.compare import main
from prune.data import DataConfig, calibration_data
from prune.errors import EXIT_BAD_INPUT
from prune.heldout import packed_perplexity
from prune.recipes import method_recipes
from prune.surgery import drop_blocks_


def run(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def small(folder, out):
    return ["--model", folder, "--samples", "8", "--seq-len", "32", "--batch-size", "4", "--speed-tokens", "2",
            "--threads", "1", "--out", out]


@pytest.fixture
def counted(monkeypatch):
    """Count the cells that really run."""
    calls = []
    real = compare_module.run_cell

    def wrapped(name, path, drop, *rest):
        calls.append((name, drop))
        return real(name, path, drop, *rest)

    monkeypatch.setattr(compare_module, "run_cell", wrapped)
    return calls


def test_compare_cells_leaderboard_plots_and_resume(tiny_folder, tmp_path, capsys, counted):
    out = tmp_path / "cmp"
    code, stdout, err = run(capsys, *small(tiny_folder, out), "--drop", "1,2", "--methods", "shortgpt,layercut-linear",
                            "--oracle")
    assert code == 0, err
    assert sorted(counted) == [("layercut-linear", 1), ("layercut-linear", 2), ("shortgpt", 1), ("shortgpt", 2)]
    results = json.loads((out / "results.json").read_text())
    cells = results["cells"]
    assert set(cells) == {"shortgpt@1", "shortgpt@2", "layercut-linear@1", "layercut-linear@2"}
    dense = results["dense"]
    assert dense["blocks"] == 4 and dense["params"] == sum(p.numel() for p in
                                                         AutoModelForCausalLM.from_pretrained(tiny_folder).parameters())
    for row in cells.values():
        assert len(row["dropped"]) == row["drop"] and row["blocks"] == 4 - row["drop"]
        assert row["vanilla"] == (row["method"] == "shortgpt")  # linear maps ride beside the checkpoint
        assert row["heldout_ratio"] == pytest.approx(row["heldout_ppl"] / dense["heldout_ppl"])
        assert row["seconds"] > 0 and row["decode_speedup"] > 0
    assert cells["shortgpt@1"]["params"] < cells["layercut-linear@1"]["params"] < dense["params"]
    # the held-out perplexity of a cell is the perplexity of that model on the held-out sequences
    data = DataConfig(samples=8, seq_len=32)
    heldout = calibration_data(make_tiny_tokenizer(), data).heldout_ids
    model = AutoModelForCausalLM.from_pretrained(tiny_folder).eval()
    assert dense["heldout_ppl"] == pytest.approx(packed_perplexity(model, heldout, progress=False), rel=1e-5)
    drop_blocks_(model, cells["shortgpt@2"]["dropped"])
    assert cells["shortgpt@2"]["heldout_ppl"] == pytest.approx(packed_perplexity(model, heldout, progress=False),
                                                               rel=1e-5)
    readme = (out / "README.md").read_text()
    for drop in (1, 2):
        section = readme.split(f"## Drop {drop}")[1].split("##")[0]
        rows = [line for line in section.splitlines() if line.startswith("| ") and "rank" not in line]
        assert rows[0].startswith("| - | dense |")
        ppls = [float(line.split(" | ")[4]) for line in rows[1:]]
        assert ppls == sorted(ppls) and len(ppls) == 2
    assert "## Oracle" in readme and "| score | Spearman |" in (out / "oracle.md").read_text()
    assert len(results["oracle"]["removed"]) == 4
    for png in ("perplexity_vs_blocks.png", "chosen_blocks.png"):
        assert (out / png).stat().st_size > 2000
    assert not list((out / "cells" / "shortgpt-drop1").glob("*.safetensors"))  # reports only by default
    assert (out / "cells" / "shortgpt-drop1" / "layercut.json").is_file()
    assert "drop 2: best " in stdout

    # rerun with one method more: only its cells run, the finished ones are kept
    counted.clear()
    code, _, err = run(capsys, *small(tiny_folder, out), "--drop", "1,2", "--methods",
                       "shortgpt,layercut-linear,prune-comp", "--oracle")
    assert code == 0, err
    assert sorted(counted) == [("prune-comp", 1), ("prune-comp", 2)]
    again = json.loads((out / "results.json").read_text())
    assert again["cells"]["shortgpt@1"] == cells["shortgpt@1"] and len(again["cells"]) == 6
    # another setup in the same folder is refused
    code, _, err = run(capsys, *small(tiny_folder, out), "--drop", "1", "--methods", "shortgpt", "--seed", "3")
    assert code == EXIT_BAD_INPUT and "holds a comparison with another data" in err


def test_heldout_file_and_sleb_agrees_with_the_oracle(tiny_folder, tmp_path, capsys, sample_text):
    text = tmp_path / "other.txt"
    text.write_text(sample_text)
    out = tmp_path / "cmp"
    code, _, err = run(capsys, *small(tiny_folder, out), "--drop", "1", "--methods", "shortgpt,sleb", "--heldout",
                       text, "--speed-tokens", "0", "--oracle")
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert results["heldout"]["source"] == str(text.resolve()) and results["heldout"]["tokens"] > 100
    assert "decode_speedup" not in results["cells"]["shortgpt@1"]
    # SLEB's first removal is the oracle's best single removal (both on the shared calibration tokens)
    removed = results["oracle"]["removed"]
    assert results["cells"]["sleb@1"]["dropped"] == [removed.index(min(removed))]


def test_unknown_method_lists_the_known_ones(tiny_folder, tmp_path, capsys):
    code, _, err = run(capsys, *small(tiny_folder, tmp_path / "x"), "--drop", "1", "--methods", "shortgpt,squash")
    assert code == EXIT_BAD_INPUT and err.count("\n") == 1
    assert f"unknown method 'squash': choose one of {', '.join(method_recipes())}" in err
    assert not (tmp_path / "x").exists()  # nothing loaded, nothing written


def test_methods_list_prints_one_line_per_method(capsys):
    code, stdout, _ = run(capsys, "--methods", "list")
    lines = stdout.strip().splitlines()
    assert code == 0 and len(lines) == len(method_recipes())
    assert any(line.startswith("sleb ") and "2402.09025" in line for line in lines)


@pytest.mark.parametrize("args,message", [(["--methods", "shortgpt"], "--drop is required"),
                                          (["--drop", "0"], "positive block counts"),
                                          (["--drop", "9"], "drop at most 3")])
def test_bad_drop_is_one_line_exit_2(tiny_folder, tmp_path, capsys, args, message):
    code, _, err = run(capsys, *small(tiny_folder, tmp_path / "x"), *args)
    assert code == EXIT_BAD_INPUT and message in err and err.count("\n") == 1


def test_lm_eval_tasks_per_cell_and_for_dense(tiny_folder, tmp_path, capsys, shared_data):
    out = tmp_path / "cmp"
    code, _, err = run(capsys, *small(tiny_folder, out), "--drop", "1", "--methods", "shortgpt", "--tasks", "piqa",
                       "--limit", "4", "--data-dir", shared_data, "--speed-tokens", "0")
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    for row in (results["dense"], results["cells"]["shortgpt@1"]):
        assert 0 <= row["tasks"]["piqa"] <= 1 and row["tasks"]["piqa"] * 4 == round(row["tasks"]["piqa"] * 4)
    assert "| piqa |" in (out / "README.md").read_text()
