"""``python -m eval.compare`` on a tiny saved model: cells, leaderboard, plots, resume, oracle, bad input."""

import json
import logging
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from eval.compare import cells as cells_module
from eval.compare import digest as digest_module
from eval.compare import grid
from eval.compare.cli import main
from eval.compare.digest import recipe_digest, resolved_method
from eval.compare.grid import summary_lines
from eval.compare.heldout import mean_perplexity
from eval.compare.leaderboard import head_caveat, task_rows_note
from eval.compare.leaderboard import leaderboard as render_leaderboard
from eval.compare.measurements import calibration_digest
from eval.compare.results import FORMAT, Results, check_calibration, migrate
from eval.compare.stats import analyse as analyse_results
from eval.compare.stats import gap_stderr
from prune.data.calibration import DataConfig, calibration_data
from prune.errors import EXIT_BAD_INPUT, LayercutError
from prune.measure.heldout import packed_perplexity
from prune.model.surgery import drop_blocks_
from prune.pipeline import runner
from prune.pipeline.recipes import METHODS_DIR, method_recipes
from tests.helpers import make_tiny_model, make_tiny_tokenizer

pytestmark = pytest.mark.usefixtures("lm_eval_once")  # lm-eval's templates compiled and environment described once


def analyse(results: dict) -> dict:
    return analyse_results(Results.from_dict(results))


def leaderboard(results: dict) -> str:
    return render_leaderboard(Results.from_dict(results))


def print_summary(results: dict) -> None:
    print("\n".join(summary_lines(Results.from_dict(results))))


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
    real = grid.run_cell

    def wrapped(name, path, drop, *rest):
        calls.append((name, drop))
        return real(name, path, drop, *rest)

    monkeypatch.setattr(grid, "run_cell", wrapped)
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
    model = AutoModelForCausalLM.from_pretrained(tiny_folder).eval()
    # the default calibration samples half its sequences from the model: same model and seed, same text
    heldout = calibration_data(make_tiny_tokenizer(), data, model=model).heldout_ids
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
    assert "## Oracle" in readme
    assert "| score | Spearman with removal | Spearman with repaired |" in (out / "oracle.md").read_text()
    assert len(results["oracle"]["removed"]) == 4
    repaired = results["oracle"]["repaired"]  # each block alone removed and replaced by its map, then measured
    assert repaired["method"] == "linear" and len(repaired["ppl"]) == len(repaired["map_error"]) == 4
    assert all(0 < e < 1 for e in repaired["map_error"]) and min(repaired["ppl"]) > 1
    assert set(repaired["spearman"]) >= {"linearity", "removal", "map-error (repaired-fast)"}
    for png in ("perplexity_vs_blocks.png", "chosen_blocks.png"):
        assert (out / png).stat().st_size > 2000
    assert not list((out / "cells" / "shortgpt-drop1").glob("*.safetensors"))  # reports only by default
    assert (out / "cells" / "shortgpt-drop1" / "layercut.json").is_file()
    assert "drop 2: best " in stdout
    # the oracle: the dense model and each of the 4 blocks alone, removed (5) and repaired by its map (4), once
    (first,) = results["timing"]["runs"]
    assert first["cells"] == 4 and first["seconds"] > 0 and first["removal_sets_measured"] == 5 + 4
    assert first["removal_sets_read_back"] == 0 and "Wall time so far" in readme

    # rerun with one method more: only its cells run, the finished ones are kept
    counted.clear()
    code, _, err = run(capsys, *small(tiny_folder, out), "--drop", "1,2", "--methods",
                       "shortgpt,layercut-linear,prune-comp", "--oracle")
    assert code == 0, err
    assert sorted(counted) == [("prune-comp", 1), ("prune-comp", 2)]
    again = json.loads((out / "results.json").read_text())
    assert again["cells"]["shortgpt@1"] == cells["shortgpt@1"] and len(again["cells"]) == 6
    assert [(r["cells"], r["removal_sets_read_back"], r["removal_sets_measured"]) for r in again["timing"]["runs"]] \
        == [(4, 0, 9), (2, 9, 0)]
    assert "over 2 invocation(s) and 6 cell(s)" in (out / "README.md").read_text()
    # another setup in the same folder is refused
    code, _, err = run(capsys, *small(tiny_folder, out), "--drop", "1", "--methods", "shortgpt", "--seed", "3")
    assert code == EXIT_BAD_INPUT and "holds a comparison with another data.seed (0 there, 3 now)" in err


def test_heldout_file_and_sleb_agrees_with_the_oracle(tiny_folder, tmp_path, capsys, sample_text):
    text = tmp_path / "other.txt"
    text.write_text(sample_text)
    out = tmp_path / "cmp"
    code, _, err = run(capsys, *small(tiny_folder, out), "--drop", "1", "--methods", "shortgpt,sleb", "--heldout",
                       text, "--speed-tokens", "0", "--oracle")
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    domain = results["heldout"]["domains"]["other"]
    assert domain["source"] == str(text.resolve()) and domain["tokens"] > 100 and results["format"] == FORMAT
    assert "decode_speedup" not in results["cells"]["shortgpt@1"]
    # SLEB's first removal is the oracle's best single removal (both on the shared calibration tokens)
    removed = results["oracle"]["removed"]
    assert results["cells"]["sleb@1"]["dropped"] == [removed.index(min(removed))]


def test_a_method_that_cannot_take_a_drop_fails_before_the_model_loads(tiny_folder, tmp_path, capsys):
    code, _, err = run(capsys, *small(tiny_folder, tmp_path / "x"), "--drop", "1,2", "--methods",
                       "shortgpt,llm-streamline")
    assert code == EXIT_BAD_INPUT and err.count("\n") == 1
    assert err.strip() == ("error: --replace block puts one block in place of a span of 2 or more blocks, and --drop 1 "
                           "makes a span of 1: llm-streamline cannot run at this drop; take 1 out of --drop, or leave "
                           "llm-streamline out of --methods")
    assert not (tmp_path / "x").exists()


def test_unknown_method_lists_the_known_ones(tiny_folder, tmp_path, capsys):
    code, _, err = run(capsys, *small(tiny_folder, tmp_path / "x"), "--drop", "1", "--methods", "shortgpt,squash")
    assert code == EXIT_BAD_INPUT and err.count("\n") == 1
    assert f"unknown method 'squash': choose one of {', '.join(method_recipes())}" in err
    assert not (tmp_path / "x").exists()  # nothing loaded, nothing written


def test_methods_list_prints_one_line_per_method(capsys):
    code, stdout, _ = run(capsys, "--methods", "list")
    lines = stdout.strip().splitlines()[2:]  # after the header and its rule
    assert code == 0 and len(lines) == len(method_recipes())
    assert any(line.startswith("sleb ") and "2402.09025" in line for line in lines)
    serves = {line.split()[0]: line.split()[1] for line in lines}  # what a user ships, at a glance
    assert serves["layercut-linear"] == "maps" and serves["layercut-rotate"] == "plain"
    assert serves["layercut-rotate-heal"] == "plain"  # LoRA merged: still the original architecture
    assert serves["llm-streamline"] == "plain" and serves["layercut-sublayer"] == "DeciLM"


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
        p = row["tasks"]["piqa"]  # lm-eval's standard error of a mean of 4 zero-one scores
        assert row["task_stderr"]["piqa"] == pytest.approx((p * (1 - p) / 3) ** 0.5)
    analysis = results["analysis"]
    assert analysis["chance"] == {"piqa": 0.5} and analysis["tasks"] == ["piqa"]
    # 4 rows of a random model cannot be clearly above chance: retention falls back to the plain task mean
    assert analysis["retention_tasks"] == [] and analysis["task_quality"] == "task_mean"
    assert analysis["rows"]["shortgpt@1"]["task_mean"] == results["cells"]["shortgpt@1"]["tasks"]["piqa"]
    readme = (out / "README.md").read_text()
    assert "| piqa | task mean | retention | tasks vs best |" in readme and "piqa: dense" in readme


def _row(method, drop, domains, tasks=None, stderr=0.02):
    row = {"method": method, "drop": drop, "domains": domains, "dropped": list(range(drop)), "params": 10,
           "heldout_ppl": mean_perplexity(domains, list(domains)), "heldout_ratio": 1.0,
           "domain_ratios": {n: 1.0 for n in domains}, "seconds": 1.0, "vanilla": True, "copy_seconds": 0.1}
    if tasks is not None:
        row["tasks"] = tasks
        row["task_stderr"] = {t: stderr for t in tasks}
    return row


def test_retention_above_chance_ties_and_better_than():
    dense = _row("dense", 0, {"novel": 10.0, "news": 20.0},
                 {"arc_easy": 0.60, "piqa": 0.70, "winogrande": 0.51, "lambada_openai": 0.30, "mystery": 0.9})
    cells = {
        "remove@4": _row("remove", 4, {"novel": 14.0, "news": 30.0},
                         {"arc_easy": 0.55, "piqa": 0.66, "winogrande": 0.52, "lambada_openai": 0.20, "mystery": 0.5}),
        "linear@4": _row("linear", 4, {"novel": 12.0, "news": 28.0},
                         {"arc_easy": 0.45, "piqa": 0.60, "winogrande": 0.53, "lambada_openai": 0.22, "mystery": 0.5}),
        "fold@4": _row("fold", 4, {"novel": 13.0, "news": 31.0},
                       {"arc_easy": 0.40, "piqa": 0.58, "winogrande": 0.50, "lambada_openai": 0.10, "mystery": 0.5}),
    }
    heldout = {"domains": {"novel": {"source": "a.txt", "tokens": 100}, "news": {"source": "b", "tokens": 9}}}
    results = {"setup": {"model": "m", "speed_tokens": 0}, "dense": dense, "cells": cells,
               "domains": ["novel", "news"], "heldout": heldout}
    analysis = analyse(results)
    # winogrande: 0.51 is within two standard errors (0.04) of chance 0.5; "mystery" has no known chance level
    assert analysis["retention_tasks"] == ["arc_easy", "lambada_openai", "piqa"]
    assert set(analysis["excluded_tasks"]) == {"winogrande", "mystery"}
    rows = analysis["rows"]
    # (0.30 + 0.16 + 0.20) / (0.35 + 0.20 + 0.30)
    assert rows["remove@4"]["retention"] == pytest.approx(0.66 / 0.85)
    assert rows["linear@4"]["retention"] == pytest.approx((0.20 + 0.22 + 0.10) / 0.85)
    assert rows["remove@4"]["retention_stderr"] == pytest.approx(0.02 * 3 ** 0.5 / 0.85)
    assert rows["dense"]["retention"] == pytest.approx(1.0)
    assert rows["remove@4"]["task_mean"] == pytest.approx((0.55 + 0.66 + 0.52 + 0.20 + 0.5) / 5)
    assert rows["remove@4"]["task_mean_stderr"] == pytest.approx(0.02 * 5 ** 0.5 / 5)
    # linear wins perplexity on both domains but loses retention to removal (0.61 vs 0.78, gap > 2 x 0.082):
    # better than fold only; removal loses perplexity on the novel to fold, so it is better than none
    assert analysis["better_than"] == {"remove@4": [], "linear@4": ["fold@4"], "fold@4": []}
    assert analysis["vs_best_tasks"] == {"remove@4": "best", "linear@4": "-16.5", "fold@4": "-38.8"}
    # within two standard errors of the best (0.69 vs 0.78): a tie, and a tie is no win
    cells["linear@4"]["tasks"]["arc_easy"] = 0.52
    analysis = analyse(results)
    assert analysis["vs_best_tasks"]["linear@4"] == "tie" and analysis["better_than"]["linear@4"] == ["fold@4"]
    cells["linear@4"]["tasks"].update(arc_easy=0.60, lambada_openai=0.30, piqa=0.70)
    assert analyse(results)["better_than"]["linear@4"] == ["fold@4", "remove@4"]
    cells["linear@4"]["tasks"].update(arc_easy=0.52, lambada_openai=0.22, piqa=0.60)
    results["analysis"] = analysis
    readme = leaderboard(results)
    header = next(line for line in readme.splitlines() if line.startswith("| rank"))
    assert "| novel ppl | news ppl |" in header and "| retention | tasks vs best | better than |" in header
    linear = next(line for line in readme.splitlines() if line.startswith("| 1 | linear"))
    assert "| 12.000 (+20.0%) | 28.000 (+40.0%) |" in linear and "| tie | fold |" in linear
    assert "left out: mystery: no chance level known; winogrande: dense 0.510 is within 2" in readme


def test_without_tasks_better_means_every_domain():
    dense = _row("dense", 0, {"a": 10.0, "b": 10.0})
    cells = {"x@1": _row("x", 1, {"a": 11.0, "b": 12.0}), "y@1": _row("y", 1, {"a": 12.0, "b": 11.5}),
             "z@1": _row("z", 1, {"a": 13.0, "b": 13.0})}
    analysis = analyse({"dense": dense, "cells": cells, "domains": ["a", "b"]})
    assert analysis["better_than"] == {"x@1": ["z@1"], "y@1": ["z@1"], "z@1": []}
    assert analysis["tasks"] == [] and analysis["vs_best_tasks"] == {}


def test_heldout_domains_resume_when_a_domain_is_added(tiny_folder, tmp_path, capsys, counted, sample_text,
                                                        monkeypatch):
    from eval.quality.perplexity import perplexity, tokenize_text

    novel, speech, news = tmp_path / "novel.txt", tmp_path / "speech.txt", tmp_path / "news.txt"
    novel.write_text(sample_text)
    speech.write_text(" ".join(sample_text.split()[::-1]))
    news.write_text(sample_text.upper())
    out = tmp_path / "cmp"
    # a working folder far from both the model and the texts, wherever the checkout lies
    far = tmp_path / "a" / "b" / "c"
    far.mkdir(parents=True)
    monkeypatch.chdir(far)
    base = [*small(tiny_folder, out), "--drop", "1", "--methods", "shortgpt", "--speed-tokens", "0"]
    code, _, err = run(capsys, *base, "--heldout", f"{novel},talk={speech}")
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    dense, cell = results["dense"], results["cells"]["shortgpt@1"]
    assert list(results["heldout"]["domains"]) == ["novel", "talk"] == results["domains"]
    tok = make_tiny_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(tiny_folder).eval()
    expected = {name: perplexity(model, tokenize_text(tok, path.read_text()), seq_len=32, batch_size=4,
                                 progress=False).perplexity for name, path in (("novel", novel), ("talk", speech))}
    assert dense["domains"] == pytest.approx(expected, rel=1e-5)
    assert dense["heldout_ppl"] == pytest.approx((expected["novel"] * expected["talk"]) ** 0.5, rel=1e-5)
    assert cell["domain_ratios"]["talk"] == pytest.approx(cell["domains"]["talk"] / expected["talk"])
    readme = (out / "README.md").read_text()
    assert "| novel ppl | talk ppl |" in readme and "| better than |" in readme
    # the page is shared: files far from the working folder show as their folder and name, never this machine's path
    assert str(tmp_path) not in readme and str(tiny_folder) not in readme
    assert f"# Method comparison: {tiny_folder.parent.name}/{tiny_folder.name}\n" in readme
    assert f"novel: {tmp_path.name}/novel.txt" in readme
    # the same request again runs nothing; one domain more reruns the cell and completes the dense row
    counted.clear()
    assert run(capsys, *base, "--heldout", f"{novel},talk={speech}")[0] == 0 and counted == []
    code, _, err = run(capsys, *base, "--heldout", f"{novel},talk={speech},{news}")
    assert code == 0, err
    assert counted == [("shortgpt", 1)]
    again = json.loads((out / "results.json").read_text())
    assert again["dense"]["domains"]["novel"] == dense["domains"]["novel"]  # kept, not measured again
    assert set(again["cells"]["shortgpt@1"]["domains"]) == {"novel", "talk", "news"}
    assert again["cells"]["shortgpt@1"]["domains"]["talk"] == pytest.approx(cell["domains"]["talk"])
    # the same files named by relative paths from elsewhere are the same texts: nothing is measured again
    counted.clear()
    monkeypatch.chdir(news.parent)
    code, _, err = run(capsys, *base, "--heldout", f"{novel.name},talk={speech.name},{news.name}")
    assert code == 0, err
    assert counted == [] and json.loads((out / "results.json").read_text())["cells"] == again["cells"]
    # a domain name that now means another text is measured again
    code, _, err = run(capsys, *base, "--heldout", f"{novel},talk={news},{news}")
    assert code == 0, err
    third = json.loads((out / "results.json").read_text())
    assert counted == [("shortgpt", 1)]
    assert third["dense"]["domains"]["talk"] == pytest.approx(third["dense"]["domains"]["news"])


def test_mixture_calibration_gives_one_domain_per_source(tiny_folder, tmp_path, capsys, sample_text):
    a, b = tmp_path / "austen.txt", tmp_path / "shout.txt"
    a.write_text(sample_text)
    b.write_text(sample_text.upper())
    out = tmp_path / "cmp"
    code, _, err = run(capsys, *small(tiny_folder, out), "--drop", "1", "--methods", "shortgpt", "--speed-tokens",
                       "0", "--data", f"{a}@0.75,{b}@0.25", "--heldout-samples", "4")
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert [(p["samples"], p["heldout"]) for p in results["calibration"]["mixture"]] == [(6, 3), (2, 1)]
    domains = results["heldout"]["domains"]
    assert list(domains) == ["austen", "shout"] and [d["tokens"] for d in domains.values()] == [3 * 32, 1 * 32]
    data = calibration_data(make_tiny_tokenizer(), DataConfig(f"{a}@0.75,{b}@0.25", 8, 32, heldout_samples=4))
    model = AutoModelForCausalLM.from_pretrained(tiny_folder).eval()
    shout = list(data.heldout_by_source.values())[1]
    assert results["dense"]["domains"]["shout"] == pytest.approx(packed_perplexity(model, shout, progress=False),
                                                                 rel=1e-5)


@pytest.mark.parametrize("heldout,message", [("a=x.txt,a=y.txt", "names the domain 'a' twice"),
                                             ("x.txt,,y.txt", "is empty: give FILE or NAME=FILE"),
                                             ("a.txt,b.txt", "data file 'a.txt' not found"),
                                             ("pyproject.toml", "unsupported data file 'pyproject.toml'")])
def test_bad_heldout_lists_are_one_line_errors(tiny_folder, tmp_path, capsys, heldout, message):
    code, _, err = run(capsys, *small(tiny_folder, tmp_path / "x"), "--drop", "1", "--methods", "shortgpt",
                       "--heldout", heldout)
    assert code == EXIT_BAD_INPUT and message in err and err.count("\n") == 1


def test_a_sublayer_method_meets_the_parameters_of_the_blocks_it_stands_for(tiny_folder, tmp_path, capsys):
    out = tmp_path / "cmp-units"
    code, _, err = run(capsys, *small(tiny_folder, out), "--drop", "1", "--methods", "shortgpt,layercut-sublayer")
    assert code == 0, err
    cells = json.loads((out / "results.json").read_text())["cells"]
    units, blocks = cells["layercut-sublayer@1"], cells["shortgpt@1"]
    assert units["unit"] == "attention,mlp" and units["sublayers"] and not units["vanilla"]
    # at most the parameters of the model less one block: the budget a drop of 1 stands for
    assert units["params"] <= blocks["params"]
    readme = (out / "README.md").read_text()
    assert "sub-layers (whole:" in readme


def test_row_by_row_scores_make_a_small_shared_gap_a_win():
    """Two models answer the same rows alike but for 16 of 400: separately a tie, paired a clear gap."""
    generator = torch.Generator().manual_seed(0)
    base = {t: (torch.rand(400, generator=generator) < p).int().tolist() for t, p in (("arc_easy", 0.5), ("piqa", 0.6))}
    better = {t: list(r) for t, r in base.items()}
    for rows in better.values():
        wrong = [i for i, v in enumerate(rows) if v == 0][:16]
        for i in wrong:
            rows[i] = 1

    def scored(method, rows, domains):
        tasks = {t: sum(r) / len(r) for t, r in rows.items()}
        stderr = {t: (v * (1 - v) / (len(rows[t]) - 1)) ** 0.5 for t, v in tasks.items()}
        row = _row(method, 4 if method != "dense" else 0, domains, tasks)
        row["task_stderr"], row["task_rows"] = stderr, rows
        return row

    dense = scored("dense", {"arc_easy": [1] * 300 + [0] * 100, "piqa": [1] * 320 + [0] * 80}, {"a": 10.0})
    cells = {"a@4": scored("a", better, {"a": 11.0}), "b@4": scored("b", base, {"a": 12.0})}
    results = {"dense": dense, "cells": cells, "domains": ["a"]}
    analysis = analyse(results)
    rows = analysis["rows"]
    gap = rows["a@4"]["retention"] - rows["b@4"]["retention"]
    assert gap == pytest.approx(32 / 400 / (0.5 + 0.3))
    assert gap < 2 * math.hypot(rows["a@4"]["retention_stderr"], rows["b@4"]["retention_stderr"])  # unpaired: a tie
    paired = gap_stderr(cells["a@4"], cells["b@4"], rows["a@4"], rows["b@4"], "retention",
                                       ["arc_easy", "piqa"], dense)
    one_task = torch.tensor([1.0] * 16 + [0.0] * 384).var().item() / 400
    assert paired == pytest.approx((2 * one_task) ** 0.5 / 0.8)
    assert analysis["vs_best_tasks"] == {"a@4": "best", "b@4": f"-{100 * gap:.1f}"}
    assert analysis["better_than"]["a@4"] == ["b@4"]
    # without the rows, the same figures are a tie
    for row in cells.values():
        del row["task_rows"]
    assert analyse(results)["vs_best_tasks"]["b@4"] == "tie"


def test_a_changed_default_reruns_the_cells_of_the_methods_it_changes(monkeypatch):
    from prune.replace.linear import LinearOptions

    linear, shortgpt = METHODS_DIR / "layercut-linear.yaml", METHODS_DIR / "shortgpt.yaml"
    before = recipe_digest(linear), recipe_digest(shortgpt)
    monkeypatch.setattr(LinearOptions, "default_short", 0)  # the recipe leaves replace.short unset
    after = recipe_digest(linear), recipe_digest(shortgpt)
    assert after[0] != before[0] and after[1] == before[1]


def test_an_added_option_at_its_old_value_keeps_every_finished_cell(monkeypatch):
    """A new option that does what was done before it must not make every cell look changed and run again."""
    repairs = METHODS_DIR.parent / "repairs"
    least_squares, remove = repairs / "linear-ls.yaml", repairs / "remove.yaml"
    # the whole update (every method before the option) and a method that does not read it: as before it existed
    assert "update_scale" not in json.dumps(resolved_method(least_squares))
    assert "update_scale" not in json.dumps(resolved_method(remove))
    # linear's default of 0.7 is not what was done before: part of the method, so its old cells run again
    default = resolved_method(METHODS_DIR / "layercut-linear.yaml")
    assert default["replace"]["update_scale"] == 0.7
    assert default == resolved_method(repairs / "linear-scaled.yaml")
    before = recipe_digest(least_squares), recipe_digest(remove)
    monkeypatch.setattr(digest_module, "neutral_options", dict)  # hashed at its old value too: every digest moves
    after = recipe_digest(least_squares), recipe_digest(remove)
    assert after[0] != before[0] and after[1] != before[1]


def test_a_changed_distillation_default_reruns_the_distilling_cells(monkeypatch):
    import distill.config

    distilled, linear = METHODS_DIR / "layercut-linear-distill.yaml", METHODS_DIR / "layercut-linear.yaml"
    before = recipe_digest(distilled), recipe_digest(linear)
    # the recipe names no distillation text: the default is part of what its cell ran
    monkeypatch.setattr(distill.config, "DEFAULT_SAMPLES", 2 * distill.config.DEFAULT_SAMPLES)
    after = recipe_digest(distilled), recipe_digest(linear)
    assert after[0] != before[0] and after[1] == before[1]


def test_a_distilled_row_names_the_text_and_loss_it_was_distilled_with(tiny_folder, tmp_path, capsys, sample_text):
    text = tmp_path / "text.txt"
    text.write_text(sample_text)
    recipe = tmp_path / "kl.yaml"
    recipe.write_text("score: linearity\nselect: topk\nreplace: linear\n"
                      "distill: {steps: 2, mse_weight: 0.0, kl_weight: 1.0, batch_size: 2,\n"
                      f"          data: {{data: '{text}', samples: 4, seq_len: 16}}}}\n")
    out = tmp_path / "cmp"
    code, _, err = run(capsys, *small(tiny_folder, out), "--drop", "1", "--methods", f"layercut-linear,{recipe}",
                       "--speed-tokens", "0")
    assert code == 0, err
    cells = json.loads((out / "results.json").read_text())["cells"]
    fit = cells["kl@1"]["distill"].pop("generalisation")
    assert cells["kl@1"]["distill"] == {"data": str(text), "samples": 4, "seq_len": 16, "train": "replacements",
                                        "losses": {"teacher_student_kl": 1.0}}
    # the held-out check of the cell's distillation: the text's 8 held-out sequences, beside 4 that 2 steps of 2 drew
    assert fit["sequences"] == {"training": 4, "held_out": 8} and fit["before_step"] == 0
    assert set(fit["held_out"]) == {"before", "after"} and fit["held_out"]["after"]["teacher_student_kl"] > 0
    assert cells["kl@1"]["distill_steps"] == 2 and "distill" not in cells["layercut-linear@1"]


def test_a_recipe_edited_while_its_cell_runs_keeps_the_digest_it_ran_with(tiny_folder, tmp_path, capsys, counted,
                                                                         monkeypatch):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text((METHODS_DIR / "shortgpt.yaml").read_text())
    before = recipe_digest(recipe)
    real = cells_module.run_prune

    def edit_meanwhile(*args, **kwargs):
        recipe.write_text(recipe.read_text().replace("select: topk", "select: span"))
        return real(*args, **kwargs)

    monkeypatch.setattr(cells_module, "run_prune", edit_meanwhile)
    out = tmp_path / "cmp"
    code, _, err = run(capsys, *small(tiny_folder, out), "--drop", "1", "--methods", recipe, "--speed-tokens", "0")
    assert code == 0, err
    assert json.loads((out / "results.json").read_text())["cells"]["mine@1"]["recipe_digest"] == before
    monkeypatch.setattr(cells_module, "run_prune", real)
    counted.clear()  # the recipe as it is now was never run: resuming runs it
    code, _, err = run(capsys, *small(tiny_folder, out), "--drop", "1", "--methods", recipe, "--speed-tokens", "0")
    assert code == 0 and counted == [("mine", 1)]


def test_tasks_are_added_from_kept_weights_checked_against_the_row(tiny_folder, tmp_path, capsys, counted,
                                                                   shared_data):
    out = tmp_path / "cmp"
    def base(methods="shortgpt,layercut-linear"):
        return [*small(tiny_folder, out), "--drop", "1", "--methods", methods, "--speed-tokens", "0",
                "--keep-checkpoints"]

    assert run(capsys, *base())[0] == 0
    first = json.loads((out / "results.json").read_text())
    assert "tasks" not in first["cells"]["shortgpt@1"] and "limit" not in first["setup"]
    # tasks for one method: only its cell is completed, from its weights (layercut-linear's carry maps)
    counted.clear()
    tasks = ["--tasks", "piqa", "--limit", "4", "--data-dir", shared_data]
    code, _, err = run(capsys, *base("layercut-linear"), *tasks)
    assert code == 0, err
    assert counted == []  # nothing ran again
    second = json.loads((out / "results.json").read_text())
    linear, shortgpt = second["cells"]["layercut-linear@1"], second["cells"]["shortgpt@1"]
    assert linear["completed_from_checkpoint"] and len(linear["task_rows"]["piqa"]) == 4
    assert linear["domains"] == first["cells"]["layercut-linear@1"]["domains"] and "tasks" not in shortgpt
    assert len(second["dense"]["task_rows"]["piqa"]) == 4 and second["task_limit"] == 4
    # the same tasks on all rows read from another model than the row's: that cell runs again instead
    row = second["cells"]["shortgpt@1"]
    row["domains"] = {name: value * 1.01 for name, value in row["domains"].items()}
    (out / "results.json").write_text(json.dumps(second))
    code, _, err = run(capsys, *base(), *tasks)
    assert code == 0, err
    assert counted == [("shortgpt", 1)]
    third = json.loads((out / "results.json").read_text())
    assert third["cells"]["shortgpt@1"]["domains"] == first["cells"]["shortgpt@1"]["domains"]
    assert "completed_from_checkpoint" not in third["cells"]["shortgpt@1"]
    # task figures of one comparison share one --limit
    code, _, err = run(capsys, *base(), "--tasks", "piqa", "--limit", "8", "--data-dir", shared_data)
    assert code == EXIT_BAD_INPUT and "holds task figures taken at --limit 4: pass --limit 4" in err
    assert len(err.strip().splitlines()) == 1


def test_tasks_on_a_range_of_rows_say_which_rows_and_keep_them(tiny_folder, tmp_path, capsys, shared_data):
    # the last rows: a default chosen there never reads the first rows a report reads
    out = tmp_path / "cmp"
    base = [*small(tiny_folder, out), "--drop", "1", "--methods", "shortgpt", "--speed-tokens", "0",
            "--tasks", "piqa", "--data-dir", shared_data]
    code, _, err = run(capsys, *base, "--limit=-3:")
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert results["task_limit"] == "-3:"
    assert len(results["dense"]["task_rows"]["piqa"]) == 3 == len(results["cells"]["shortgpt@1"]["task_rows"]["piqa"])
    assert "Tasks (rows -3: of each task, as Python slices them):" in (out / "README.md").read_text()
    code, _, err = run(capsys, *base, "--limit", "3")
    assert code == EXIT_BAD_INPUT and "taken at --limit -3:: pass --limit=-3: to add tasks" in err


def test_the_leaderboard_says_which_rows_its_tasks_read():
    limits = (None, 1000, 0.5, "-500:", "100~1000:")
    said = {limit: task_rows_note(Results.from_dict({"task_limit": limit})) for limit in limits}
    assert said == {None: " (every row of each task)", 1000: " (the first 1,000 rows of each task)",
                    0.5: " (the first 50% of each task)", "-500:": " (rows -500: of each task, as Python slices them)",
                    "100~1000:": " (100 rows of each task drawn at random, seed 1234, from its rows 1000: as Python "
                                 "slices them)"}
    assert task_rows_note(Results.from_dict({})) == ""
    warned = {limit: "--limit 1000~:" in head_caveat(Results.from_dict({"task_limit": limit})) for limit in limits}
    assert warned == {None: False, 1000: True, 0.5: True, "-500:": False, "100~1000:": False}


def test_without_kept_weights_adding_tasks_runs_the_cell_again(tiny_folder, tmp_path, capsys, counted, shared_data):
    out = tmp_path / "cmp"
    base = [*small(tiny_folder, out), "--drop", "1", "--methods", "shortgpt", "--speed-tokens", "0"]
    assert run(capsys, *base)[0] == 0
    counted.clear()
    code, _, err = run(capsys, *base, "--tasks", "piqa", "--limit", "4", "--data-dir", shared_data)
    assert code == 0, err
    assert counted == [("shortgpt", 1)]
    assert len(json.loads((out / "results.json").read_text())["cells"]["shortgpt@1"]["task_rows"]["piqa"]) == 4


def test_a_comparison_written_with_tasks_in_its_setup_resumes():
    results = {"setup": {"model": "m", "tasks": "piqa", "limit": 200, "batch_size": 4}, "dense": None, "cells": {}}
    results = migrate(results)
    assert results["setup"] == {"model": "m", "batch_size": 4, "engine": "transformers"}
    assert results["task_limit"] == 200
    untouched = migrate({"setup": {"model": "m", "tasks": None, "limit": None}, "dense": None, "cells": {}})
    assert "task_limit" not in untouched and untouched["setup"] == {"model": "m", "engine": "transformers"}
    assert Results.from_dict(untouched).to_dict()["format"] == FORMAT


def test_a_comparison_of_format_2_reads_its_rows_serving_entries_in_the_current_format():
    from eval.compare.leaderboard import serves

    decilm = {"layout": "decilm", "engines": ["vllm"], "vllm": True, "llama_cpp": False,
              "llama_cpp_why_not": "a no-op FFN", "why": "no-op entries"}
    results = migrate({"format": 2, "setup": {}, "dense": None,
                       "cells": {"a@1": {"serving": decilm, "vanilla": False}, "b@1": {"vanilla": True},
                                 "c@1": {"vanilla": False}}})
    cells = results["cells"]
    assert cells["a@1"]["serving"] == {"layout": "decilm", "why": "no-op entries",
                                       "why_not": {"llamacpp": "a no-op FFN"}}
    assert [serves(cells[key]) for key in ("a@1", "b@1", "c@1")] == [
        "vLLM (DeciLM layout)", "transformers, llama.cpp, vLLM", "no (maps)"]


def test_a_comparison_recorded_before_an_option_existed_resumes_at_that_option_s_old_value():
    from eval.compare.results import differing

    stored = migrate({"format": 2, "setup": {"model": "m", "load": {"dtype": "float32"}}, "dense": None, "cells": {}})
    now = {"model": "m", "load": {"dtype": "float32", "offload": "none"}, "engine": "transformers"}
    assert differing(stored["setup"], now) == []
    assert differing(stored["setup"], {**now, "engine": "vllm"}) == ["engine ('transformers' there, 'vllm' now)"]


def test_rows_without_tasks_are_compared_on_perplexity_alone():
    dense = _row("dense", 0, {"a": 10.0}, tasks={"arc_easy": 0.6}, stderr=0.01)
    results = {"dense": dense, "domains": ["a"], "cells": {
        "x@2": _row("x", 2, {"a": 11.0}), "y@2": _row("y", 2, {"a": 12.0}),
        "z@2": _row("z", 2, {"a": 13.0}, tasks={"arc_easy": 0.59}, stderr=0.01)}}
    analysis = analyse(results)
    assert analysis["task_quality"] == "retention"
    # x beats y on perplexity, neither ran the tasks; z has task figures, x and y cannot be weighed against it
    assert analysis["better_than"] == {"x@2": ["y@2"], "y@2": [], "z@2": []}


def test_a_row_whose_recipe_changed_since_is_marked_not_passed_off_as_the_recipe(tiny_folder, tmp_path, capsys):
    """A leaderboard re-rendered after a recipe (or a default it leaves unset) changed names the row's method as it
    ran, not as the recipe runs now."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text((METHODS_DIR / "shortgpt.yaml").read_text())
    out = tmp_path / "cmp"
    code, stdout, err = run(capsys, *small(tiny_folder, out), "--drop", "1", "--methods", recipe, "--speed-tokens", "0")
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert "| mine |" in leaderboard(results) and "†" not in leaderboard(results)
    assert "rerun" not in stdout

    recipe.write_text(recipe.read_text().replace("select: topk", "select: span"))
    table = leaderboard(results)
    assert "| mine† |" in table and "has changed since this row ran" in table and "‡" not in table
    print_summary(results)
    assert "ran before its recipe or a default it uses changed: rerun to refresh" in capsys.readouterr().out

    recipe.unlink()
    table = leaderboard(results)
    assert "| mine‡ |" in table and "cannot be checked" in table and "†" not in table


def test_a_repair_is_judged_against_removal_of_its_own_blocks_only(capsys):
    tasks = lambda arc, lam: {"arc_easy": arc, "lambada_openai": lam}  # noqa: E731
    dense = _row("dense", 0, {"novel": 10.0, "news": 20.0}, tasks(0.65, 0.40))

    def row(method, blocks, replace, domains, arc, lam, steps=0):
        r = _row(method, 8, domains, tasks(arc, lam))
        r.update(dropped=blocks, replace=replace, distill_steps=steps)
        return r

    span, top = list(range(11, 19)), list(range(12, 20))
    cells = {"remove@8": row("remove", top, "none", {"novel": 30.0, "news": 80.0}, 0.45, 0.04),
             "linear@8": row("linear", top, "linear", {"novel": 20.0, "news": 60.0}, 0.50, 0.11),
             "heal@8": row("heal", top, "none", {"novel": 25.0, "news": 90.0}, 0.45, 0.06, steps=200),
             "fold@8": row("fold", span, "fold", {"novel": 22.0, "news": 70.0}, 0.38, 0.06)}
    results = {"setup": {"model": "m", "speed_tokens": 0}, "dense": dense, "cells": cells,
               "domains": ["novel", "news"]}
    versus = analyse(results)["vs_removal"]
    # fold removed other blocks than the removal row: no verdict against the wrong baseline
    assert set(versus) == {"linear@8", "heal@8", "fold@8"} and versus["fold@8"] is None
    # (0.25 + 0.11) / 0.80 against (0.20 + 0.04) / 0.80, unpaired standard error 0.02 x 2 / 0.80
    assert versus["linear@8"]["gap"] == pytest.approx(0.12 / 0.80)
    assert versus["linear@8"]["gap_stderr"] == pytest.approx(0.04 / 0.80)
    assert versus["linear@8"]["verdict"] == "win" and versus["linear@8"]["perplexity_higher_on"] == []
    # trained after removal is a repair too; 0.02 / 0.80 is well inside two standard errors
    assert versus["heal@8"]["verdict"] == "tie" and versus["heal@8"]["perplexity_higher_on"] == ["news"]
    readme = leaderboard(results)
    assert "| +15.0 ± 5.0 (win); ppl lower on all |" in readme and "| no removal row |" in readme
    results["analysis"] = analyse(results)
    print_summary(results)
    assert "; no removal of the blocks of fold ran (a recipe with their score" in capsys.readouterr().out
    del results["analysis"]  # the leaderboard reads a stored analysis first
    assert "+2.5 ± 5.0 (tie); ppl higher on news" in readme
    cells["remove-span@8"] = row("remove-span", span, "none", {"novel": 28.0, "news": 65.0}, 0.48, 0.05)
    versus = analyse(results)["vs_removal"]
    assert versus["fold@8"]["baseline"] == "remove-span@8" and versus["fold@8"]["verdict"] == "loss"
    assert versus["fold@8"]["perplexity_higher_on"] == ["news"]
    assert versus["linear@8"]["baseline"] == "remove@8"
    # a removal row without tasks: perplexity is compared, the tasks are not passed off as compared
    del cells["remove@8"]["tasks"], cells["remove@8"]["task_stderr"]
    versus = analyse(results)["vs_removal"]
    assert versus["linear@8"]["verdict"] == "tasks on one row only" and "gap" not in versus["linear@8"]
    assert "| tasks on one row only; ppl lower on all |" in leaderboard(results)


def test_cells_fitted_on_other_calibration_tokens_are_not_mixed(tmp_path, caplog):
    ids = torch.arange(12).reshape(3, 4)
    digest = calibration_digest("m", ids)
    results = {"cells": {"remove@4": {}}, "calibration": {"source": "self"}}
    with caplog.at_level(logging.WARNING):
        check_calibration(Results.from_dict(results), digest, tmp_path)
    assert "no calibration digest" in caplog.text
    results["calibration"]["digest"] = digest
    check_calibration(Results.from_dict(results), calibration_digest("m", ids.clone()), tmp_path)  # the same tokens
    resampled = ids.clone()
    resampled[2, 3] = 99  # one token drawn differently
    with pytest.raises(LayercutError, match="other calibration tokens.*another --out"):
        check_calibration(Results.from_dict(results), calibration_digest("m", resampled), tmp_path)
    with pytest.raises(LayercutError):
        check_calibration(Results.from_dict(results), calibration_digest("another build", ids), tmp_path)


def test_resuming_on_other_calibration_tokens_is_refused(tiny_folder, tmp_path, capsys):
    out = tmp_path / "cmp"
    code, _, err = run(capsys, *small(tiny_folder, out), "--drop", "1", "--methods", "shortgpt")
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    digest = results["calibration"]["digest"]
    results["calibration"]["digest"] = "0" * 32  # as if the sampled half had been drawn differently
    (out / "results.json").write_text(json.dumps(results))
    code, _, err = run(capsys, *small(tiny_folder, out), "--drop", "1,2", "--methods", "shortgpt")
    last = err.strip().splitlines()[-1]  # after the model's loading bars
    assert code == EXIT_BAD_INPUT and "Traceback" not in err
    assert last.startswith("error: ") and "holds cells fitted on other calibration tokens or weights" in last
    assert set(json.loads((out / "results.json").read_text())["cells"]) == {"shortgpt@1"}  # nothing added
    results["calibration"]["digest"] = digest
    (out / "results.json").write_text(json.dumps(results))
    code, _, err = run(capsys, *small(tiny_folder, out), "--drop", "1,2", "--methods", "shortgpt")
    assert code == 0, err  # the same model, seed and options draw the same tokens again
    assert json.loads((out / "results.json").read_text())["calibration"]["digest"] == digest


def test_a_share_of_the_blocks_reads_as_prune_run_reads_it(tiny_folder):
    """``--drop 25%,50%`` counts the model's blocks from its config (4 here), without loading its weights."""
    from eval.compare.config import parse_drops
    from prune.errors import LayercutError

    assert parse_drops("25%,50%,3", str(tiny_folder)) == [1, 2, 3]
    assert parse_drops("2,4") == [2, 4]  # counts need no model
    with pytest.raises(LayercutError, match="a share needs the model's block count"):
        parse_drops("25%", None)


def test_a_method_the_model_refuses_is_recorded_and_the_others_run(tmp_path, capsys, counted, monkeypatch):
    folder = tmp_path / "tiny-gemma2"  # sandwich norms: no fold carries a map into them
    make_tiny_model("gemma2").save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    built = []  # the meta-device skeleton: built once for the refusals and the amounts (a 70B config takes seconds)
    monkeypatch.setattr(runner, "build_on_meta", lambda config, real=runner.build_on_meta: built.append(1) or real(
        config))
    out = tmp_path / "cmp"
    args = [*small(folder, out), "--drop", "1,2", "--speed-tokens", "0"]
    code, stdout, err = run(capsys, *args, "--methods", "layercut-rotate,shortgpt")
    assert code == 0, err
    assert len(built) == 1
    assert counted == [("shortgpt", 1), ("shortgpt", 2)]  # refused from the config, before the model loaded
    results = json.loads((out / "results.json").read_text())
    assert set(results["cells"]) == {"shortgpt@1", "shortgpt@2"} and set(results["refused"]) == {
        "layercut-rotate@1", "layercut-rotate@2"}
    refused = results["refused"]["layercut-rotate@1"]
    assert refused["drop"] == 1 and "post_feedforward_layernorm" in refused["why"] and "\n" not in refused["why"]
    assert refused["recipe_digest"] == recipe_digest(method_recipes()["layercut-rotate"])
    assert f"refused: layercut-rotate at drop 2 ({refused['why']})" in stdout
    readme = (out / "README.md").read_text()
    assert f"| layercut-rotate | 1 | {refused['why']} |" in readme.split("## Refused")[1]
    # naming only methods the model refuses is a one-line error before anything is written
    code, _, err = run(capsys, *small(folder, tmp_path / "none"), "--drop", "1", "--methods", "layercut-rotate")
    assert code == EXIT_BAD_INPUT and err.count("\n") == 1 and not (tmp_path / "none").exists()
    assert err.startswith("error: every method named refuses this model "
                          "(layercut-rotate: --replace fold-rotate: 'gemma2'")


def test_a_cell_refused_while_it_runs_is_recorded_and_not_run_again(tiny_folder, tmp_path, capsys, counted,
                                                                    monkeypatch):
    real = cells_module.run_prune

    def refusing(config, **kwargs):  # a refusal only the run finds (the span its selection picks, say)
        if config.replace.method == "linear":
            raise LayercutError("linear refuses these blocks: use another recipe")
        return real(config, **kwargs)

    monkeypatch.setattr(cells_module, "run_prune", refusing)
    out = tmp_path / "cmp"
    args = [*small(tiny_folder, out), "--drop", "1", "--speed-tokens", "0"]
    code, stdout, err = run(capsys, *args, "--methods", "layercut-linear,shortgpt")
    assert code == 0, err
    assert counted == [("layercut-linear", 1), ("shortgpt", 1)]
    results = json.loads((out / "results.json").read_text())
    assert set(results["cells"]) == {"shortgpt@1"} and results["timing"]["runs"][0]["cells_refused"] == 1
    assert results["refused"]["layercut-linear@1"]["why"] == "linear refuses these blocks: use another recipe"
    assert "refused: layercut-linear at drop 1 (linear refuses these blocks: use another recipe)" in stdout
    counted.clear()  # resumed: the refusal stands, nothing runs again
    code, _, err = run(capsys, *args, "--methods", "layercut-linear,shortgpt")
    assert code == 0 and counted == [], err
    # a comparison every cell of which was refused measured no method: one line, exit 2
    code, _, err = run(capsys, *args, "--methods", "layercut-linear")
    assert code == EXIT_BAD_INPUT and err.count("\n") == 1 and counted == []
    assert err.startswith("error: every cell was refused (1; recorded in ") and "layercut-linear at drop 1 as: " in err
    # a recipe changed since its refusal is tried again
    monkeypatch.setattr(grid, "recipe_digest", lambda path: "another")
    code, _, err = run(capsys, *args, "--methods", "layercut-linear,shortgpt")
    assert code == 0, err
    assert counted == [("layercut-linear", 1), ("shortgpt", 1)]
    results = json.loads((out / "results.json").read_text())
    assert results["refused"]["layercut-linear@1"]["recipe_digest"] == "another"
