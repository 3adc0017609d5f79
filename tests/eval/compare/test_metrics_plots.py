"""eval.compare's registered metrics, its noise flag, repairs worse than removal, plots and interrupted cells."""

import json

import matplotlib
import pytest

from eval.compare import cells as cells_module
from eval.compare import plots
from eval.compare.metrics import METRICS, register_metric
from eval.compare.plots import _perplexity_bars, method_colour, plot_selection_steps
from eval.compare.results import Results, differing
from prune.errors import LayercutError
from tests.eval.compare.test_compare import _row, leaderboard, print_summary, run, small

matplotlib.use("Agg")


@pytest.fixture
def toy_metric():
    @register_metric("toy-vocab", head="vocab", field="toy_vocab", cell=lambda v: f"{v:,}")
    def _vocab(model, tokenizer):
        return {"toy_vocab": model.config.vocab_size}

    yield
    METRICS.unregister("toy-vocab")


def test_a_registered_metric_is_measured_on_every_model_and_shown(tiny_folder, tmp_path, capsys, toy_metric):
    out = tmp_path / "cmp"
    code, _, err = run(capsys, *small(tiny_folder, out), "--drop", "1", "--methods", "shortgpt", "--speed-tokens", "0",
                       "--metrics", "toy-vocab,weights-mb")
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    dense, cell = results["dense"], results["cells"]["shortgpt@1"]
    assert dense["toy_vocab"] == cell["toy_vocab"] > 0
    assert cell["weights_mb"] < dense["weights_mb"]  # one block fewer
    head = next(line for line in (out / "README.md").read_text().splitlines() if line.startswith("| rank"))
    assert "| vs removal of its blocks | weights MB | vocab | decode speed-up |" in head
    with pytest.raises(LayercutError, match="unknown metric 'nope' \\(--metrics\\): choose one of"):
        from eval.compare.config import CompareConfig

        CompareConfig(load=None, data=None, drops=[1], methods={"a": tmp_path}, out=tmp_path, metrics=["nope"])


def _results(**decode):
    dense = {**_row("dense", 0, {"a": 10.0}), "blocks": 4, "decode_s": 1.0, "decode_spread": decode.get("dense", 1.1)}
    cell = {**_row("x", 1, {"a": 12.0}), "decode_s": 0.8, "decode_speedup": 1.25,
            "decode_spread": decode.get("cell", 1.1)}
    return {"setup": {"model": "m", "speed_tokens": 8}, "dense": dense, "cells": {"x@1": cell}, "domains": ["a"]}


def test_a_decode_speed_up_from_noisy_timings_is_flagged():
    steady = leaderboard(_results())
    assert "| 1.25 |" in steady and "noise, not a measurement" not in steady
    for noisy in (_results(cell=2.0), _results(dense=1.6)):
        table = leaderboard(noisy)
        assert "| 1.25? |" in table and "noise, not a measurement" in table


def test_a_repair_worse_than_removing_its_blocks_is_flagged(capsys):
    dense = _row("dense", 0, {"a": 10.0, "b": 20.0})
    removal = {**_row("remove", 4, {"a": 30.0, "b": 60.0}), "replace": "none", "distill_steps": 0}
    patch = {**_row("patch", 4, {"a": 9e5, "b": 8e5}), "replace": "linearpatch", "distill_steps": 0}
    fine = {**_row("linear", 4, {"a": 20.0, "b": 50.0}), "replace": "linear", "distill_steps": 0}
    results = {"setup": {"model": "m", "speed_tokens": 0}, "dense": dense, "domains": ["a", "b"],
               "cells": {"remove@4": removal, "patch@4": patch, "linear@4": fine}}
    table = leaderboard(results)
    def method_line(name):
        return next(row for row in table.splitlines() if row.startswith("| ") and row.split("|")[2].strip()
                    .startswith(name))

    line = method_line("patch")
    assert "**(!)** worse than removing its blocks; ppl higher on a, b" in line
    assert "worse than removing" not in method_line("linear")
    from eval.compare.stats import analyse

    results["analysis"] = analyse(Results.from_dict(results))
    print_summary(results)
    assert "WORSE than removing their own blocks on every domain: patch" in capsys.readouterr().out


def test_colours_follow_the_method_and_one_drop_is_bars():
    assert method_colour("shortgpt") == method_colour("shortgpt") != method_colour("sleb")
    import matplotlib.pyplot as plt

    cells = {"a@4": {"method": "a", "drop": 4, "heldout_ppl": 14.0},
             "b@4": {"method": "b", "drop": 4, "heldout_ppl": 12.0}}
    results = Results.from_dict({"setup": {"model": "m"}, "dense": {"heldout_ppl": 10.0}, "cells": cells})
    fig, ax = plt.subplots()
    _perplexity_bars(ax, results, 4)
    widths = [patch.get_width() for patch in ax.patches]
    assert widths == [12.0, 14.0] and [t.get_text() for t in ax.get_yticklabels()] == ["b", "a"]
    assert ax.patches[0].get_facecolor() == method_colour("b")
    plt.close(fig)


def test_the_selection_plot_marks_whole_steps_and_the_chosen_block(tmp_path, monkeypatch):
    steps = [{"drop": 3, "costs": {"2": {"ppl": 14.0}, "3": {"ppl": 12.0}, "5": {"ppl": float("inf")}}},
             {"drop": 2, "costs": {"2": {"ppl": 20.0}, "5": {"ppl": 25.0}}},
             {"drop": 5, "costs": {"5": {"ppl": 30.0}}}]
    row = {"method": "a", "drop": 3, "heldout_ppl": 9.0, "dropped": [2, 3, 5],
           "selection": {"selection": "repaired-greedy", "repair": "fold", "steps": steps}}
    results = Results.from_dict({"setup": {"model": "m"}, "dense": {"heldout_ppl": 5.0}, "cells": {"a@3": row}})
    figures = []
    monkeypatch.setattr(plots, "write_file_atomic", lambda path, save: figures.append(save.__self__))
    assert plot_selection_steps(results, tmp_path / "steps.png")
    (ax,) = figures[0].axes
    assert list(ax.get_xticks()) == [1, 2, 3]  # no step 1.5 on a plot of whole steps
    assert [t.get_text() for t in ax.texts] == ["3", "2", "5"]  # the block removed at each step
    assert not plot_selection_steps(Results.from_dict({"setup": {}, "cells": {}}), tmp_path / "none.png")


def test_the_refusal_of_another_setup_names_the_option():
    stored = {"model": "m", "data": {"samples": 32, "seed": 0}, "batch_size": 4}
    now = {"model": "m", "data": {"samples": 64, "seed": 0}, "batch_size": 4}
    assert differing(stored, now) == ["data.samples (32 there, 64 now)"]


def test_an_interrupted_cell_leaves_no_weights_behind(tiny_folder, tmp_path, capsys, monkeypatch):
    def stop(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cells_module, "measure", stop)  # after run_prune wrote the cell's checkpoint
    out = tmp_path / "cmp"
    code, _, _ = run(capsys, *small(tiny_folder, out), "--drop", "1", "--methods", "shortgpt", "--speed-tokens", "0")
    assert code == 130
    folder = out / "cells" / "shortgpt-drop1"
    assert (folder / "config.json").is_file()  # the reports stay
    assert not [f.name for f in folder.iterdir() if f.suffix in (".safetensors", ".bin")]


def test_a_damaged_results_file_is_one_line_naming_it(tiny_folder, tmp_path, capsys):
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "results.json").write_text('{"setup": {"model": ')  # cut short
    code, _, err = run(capsys, *small(tiny_folder, out), "--drop", "1", "--methods", "shortgpt")
    assert code == 2 and err.strip().splitlines()[-1].startswith("error: ")
    assert f"{out / 'results.json'} is damaged" in err and "Traceback" not in err


def test_generation_fidelity_is_a_column_judged_by_the_dense_model(tiny_folder, tmp_path, capsys):
    out = tmp_path / "cmp"
    code, _, err = run(capsys, *small(tiny_folder, out), "--drop", "1", "--methods", "shortgpt", "--speed-tokens", "0",
                       "--metrics", "fidelity")
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    dense, cell = results["dense"]["fidelity"], results["cells"]["shortgpt@1"]["fidelity"]
    assert dense["kept"] == 1.0 and dense["nll"] == dense["own_nll"]  # the original against itself
    assert cell["own_nll"] == dense["own_nll"]  # one reference, decoded once, for every row
    assert 0.0 <= cell["kept"] < 1.0 and cell["nll"] > 0
    assert (cell["prompts"], cell["prompt_tokens"], cell["new_tokens"]) == (32, 64, 32)
    table = (out / "README.md").read_text()
    assert "| greedy kept / NLL by original |" in table
    assert f"| {cell['kept']:.2f} / {cell['nll']:.2f} ± {cell['nll_stderr']:.2f} |" in table
    assert "each model writes 32 greedy tokens after each of 32 held-out prompts of 64 tokens" in table
