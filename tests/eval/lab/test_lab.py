"""``eval.lab``: the diagnostics the reports quote, on made-up results with known answers and on the shared data."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

import eval.lab
from eval.lab.cli import build_parser, main
from eval.lab.splits import write_selection_split, write_task_prompts
from eval.lab.tables import SHARES, best_share, hellaswag_by_source, paired_fidelity, paired_gaps, share_optimum
from prune.errors import EXIT_BAD_INPUT, LayercutError

REPORTS = Path(__file__).resolve().parents[3] / "reports"

pytestmark = pytest.mark.usefixtures("lm_eval_once")  # lm-eval's templates compiled and environment described once


def _results(path: Path, dense_rows: dict, cells: dict) -> Path:
    dense = {"tasks": {t: sum(r) / len(r) for t, r in dense_rows.items()}, "task_rows": dense_rows}
    body = {"dense": dense, "cells": {}}
    for key, rows in cells.items():
        body["cells"][key] = {"tasks": {t: sum(r) / len(r) for t, r in rows.items()}, "task_rows": rows,
                              "task_stderr": {t: 0.01 for t in rows}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body))
    return path


def test_paired_gaps_read_rows_of_several_comparisons(tmp_path):
    dense = {"arc_easy": [1] * 60 + [0] * 40, "piqa": [1] * 80 + [0] * 20}  # 0.6 and 0.8: 0.35 + 0.3 above chance
    base = _results(tmp_path / "a" / "results.json", dense, {"remove@4": {"arc_easy": [1] * 40 + [0] * 60,
                                                                         "piqa": [1] * 70 + [0] * 30}})
    other = _results(tmp_path / "b" / "results.json", dense, {"linear@4": {"arc_easy": [1] * 50 + [0] * 50,
                                                                          "piqa": [1] * 70 + [0] * 30}})
    lines = paired_gaps([f"{base}::remove@4", f"{other}::linear@4"], [["arc_easy", "piqa"]])
    assert lines[0] == "2 tasks"
    # retention (0.15 + 0.2) / 0.65 = 53.8 %, and (0.25 + 0.2) / 0.65 = 69.2 %: +15.4 points
    assert lines[1].startswith("  remove@4 (a): 53.8 ± ") and lines[1].endswith("minus remove@4 (a): +0.0 ± 0.0")
    assert lines[2].startswith("  linear@4 (b): 69.2 ± ") and "minus remove@4 (a): +15.4 ± " in lines[2]
    _results(other, {**dense, "piqa": [0] + dense["piqa"][1:]}, {"linear@4": {"arc_easy": [1], "piqa": [1]}})
    with pytest.raises(LayercutError, match="answered the task rows otherwise"):
        paired_gaps([f"{base}::remove@4", f"{other}::linear@4"])


def _fidelity_results(path: Path, own: list, cells: dict, prompts: int = 4) -> Path:
    settings = {"prompts": prompts, "prompt_tokens": 8, "new_tokens": 4}

    def row(nll, kept):
        return {"nll": sum(nll) / len(nll), "nll_rows": nll, "kept": kept, **settings}
    body = {"dense": {"fidelity": row(own, 1.0)},
            "cells": {key: {"fidelity": row(*value)} for key, value in cells.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body))
    return path


def test_paired_fidelity_gaps_over_the_same_prompts(tmp_path, capsys):
    own = [1.0, 1.2, 0.8, 1.0]
    base = _fidelity_results(tmp_path / "a" / "results.json", own, {"local@8": ([2.0, 2.4, 1.6, 2.0], 0.25)})
    # prompt by prompt 0.1 lower, give or take 0.02: a small gap, far inside each row's own spread, yet not a tie
    other = _fidelity_results(tmp_path / "b" / "results.json", own, {
        "heal@8": ([1.92, 2.28, 1.5, 1.9], 0.5), "noisy@8": ([2.5, 1.9, 2.1, 1.5], 0.0)})
    lines = paired_fidelity([f"{base}::local@8", f"{other}::heal@8", f"{other}::noisy@8", f"{base}::dense"])
    assert lines[0].startswith("4 prompts of 8 tokens, 4 greedy tokens each")
    assert lines[1] == "  local@8 (a): NLL 2.000 ± 0.163, kept 0.250; minus local@8 (a): +0.000 ± 0.000"
    assert lines[2] == "  heal@8 (b): NLL 1.900 ± 0.159, kept 0.500; minus local@8 (a): -0.100 ± 0.008 (lower)"
    assert lines[3].startswith("  noisy@8 (b): NLL 2.000 ± 0.208") and lines[3].endswith("(tie)")
    assert lines[4].startswith("  dense (a): NLL 1.000 ± 0.082, kept 1.000; minus local@8 (a): -1.000 ± 0.082")
    assert main(["paired-fidelity", f"{base}::local@8", f"{other}::heal@8"]) == 0
    assert capsys.readouterr().out.splitlines()[2] == lines[2]
    moved = _fidelity_results(tmp_path / "c" / "results.json", [1.0, 1.2, 0.8, 1.1], {"heal@8": ([2.0] * 4, 0.0)})
    with pytest.raises(LayercutError, match="its prompts differ"):
        paired_fidelity([f"{base}::local@8", f"{moved}::heal@8"])
    with pytest.raises(LayercutError, match="no cell 'gone@8'"):
        paired_fidelity([f"{base}::gone@8"])
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "results.json").write_text(json.dumps({"dense": {}, "cells": {"x@8": {"fidelity": {"nll": 2}}}}))
    with pytest.raises(LayercutError, match="no per-prompt fidelity rows"):
        paired_fidelity([f"{tmp_path / 'd' / 'results.json'}::x@8"])


def test_best_share_is_the_vertex_of_the_parabola(tmp_path):
    values = {name: (share - 0.62) ** 2 + 1 for name, share in SHARES.items()}
    assert best_share(values) == pytest.approx(0.62)
    folder = tmp_path / "scale"
    folder.mkdir()
    errors = {"novel": {name: {"relative": (s - 0.9) ** 2} for name, s in SHARES.items()}}
    logits = {"novel": {name: {"kl_relative": (s - 0.7) ** 2 + 0.1 * s ** 3} for name, s in SHARES.items()}}
    (folder / "results.json").write_text(json.dumps({"span": [12, 15], "errors": errors, "logits": logits}))
    lines = share_optimum([folder])
    assert lines[:2] == ["| span | measure | novel |", "|---|---|---:|"]
    assert lines[2] == "| 12-15 | hidden-state error | 0.90 |"
    assert lines[3].startswith("| 12-15 | KL, five shares |") and lines[4].startswith("| 12-15 | KL, 0.5-1 |")
    near = [float(line.split("|")[3]) for line in lines[3:]]
    assert all(math.isfinite(v) and 0.5 < v < 0.8 for v in near)


def test_hellaswag_by_source_on_the_reported_draw(shared_data, capsys):
    results = REPORTS / "smollm2-135m-tasks-draw" / "results.json"
    lines = hellaswag_by_source(results, shared_data / "hellaswag" / "hellaswag_val_full.txt")
    assert lines[0] == "--limit 1000~:-500: 1000 rows, 678 WikiHow"
    dense = next(line for line in lines if line.startswith("| dense |"))
    activity, wikihow, everything = (cell.strip() for cell in dense.strip("|").split("|")[1:])
    assert activity.endswith("(322)") and wikihow.endswith("(678)")
    share = (322 * float(activity.split()[0]) + 678 * float(wikihow.split()[0])) / 1000
    assert share == pytest.approx(float(everything), abs=0.06)  # the parts add up to the whole
    assert main(["hellaswag-by-source", str(results), str(shared_data / "hellaswag" / "hellaswag_val_full.txt")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == lines[0]


def test_splits_keep_the_selection_rows_apart_from_the_reported_ones(shared_data, tmp_path, capsys):
    written = write_task_prompts(shared_data, tmp_path / "prompts", tasks=("piqa",), rows=3)
    assert [path.name for path in written] == ["piqa.jsonl"]
    assert len(written[0].read_text().splitlines()) == 3 and json.loads(written[0].read_text().splitlines()[0])["text"]
    with pytest.raises(LayercutError, match="would meet the reported first"):
        write_selection_split(shared_data, tmp_path / "selection", tasks=("piqa",), rows=10, reported=10 ** 6)
    written = write_selection_split(shared_data, tmp_path / "selection", tasks=("piqa",), rows=5, reported=1000)
    assert [path.name for path in written] == ["plays_last_fifth.txt", "piqa.jsonl"]
    assert len(written[1].read_text().splitlines()) == 5


def test_a_diagnostic_on_a_damaged_file_is_one_line(tmp_path, capsys):
    bad = _results(tmp_path / "a" / "results.json", {"piqa": [1, 0]}, {"x@1": {"piqa": [1, 1]}})
    other = _results(tmp_path / "b" / "results.json", {"piqa": [0, 0]}, {"y@1": {"piqa": [1, 1]}})
    assert main(["paired", f"{bad}::x@1", f"{other}::y@1"]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err.strip().startswith("error: ")


def test_share_tasks_variants_are_removal_the_whole_update_or_a_share():
    import torch

    from eval.lab.share_tasks import variant_fit
    from prune.measure.least_squares import LinearFit

    fit = LinearFit(weight=torch.eye(3, dtype=torch.float64) * 3, bias=torch.ones(3, dtype=torch.float64))
    assert variant_fit(fit, "removal") is None
    whole, half = variant_fit(fit, "ls"), variant_fit(fit, "0.5")
    assert torch.equal(whole.weight, fit.weight) and torch.equal(whole.bias, fit.bias)
    # h + 0.5 (f(h) - h): the identity moved half way to the fitted map
    assert torch.allclose(half.weight, torch.eye(3, dtype=torch.float64) * 2)
    assert torch.allclose(half.bias, fit.bias / 2)


def test_every_eval_lab_call_in_a_reports_run_script_is_a_subcommand(capsys):
    """The package's promise: the reports' run.sh files call eval.lab, so a figure in a report is code a test runs."""
    assert "run.sh" in eval.lab.__doc__
    used = {name for script in REPORTS.rglob("run.sh")
            for name in re.findall(r"python -m eval\.lab ([\w-]+)", script.read_text())}
    assert {"selection-split", "task-prompts", "share-tasks", "share-optimum"} <= used
    for name in sorted(used):
        with pytest.raises(SystemExit) as done:
            build_parser().parse_args([name, "--help"])
        assert done.value.code == 0, name
    capsys.readouterr()


def test_import_eval_lab_imports_none_of_its_modules():
    code = ("import json, sys\nimport eval.lab\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('eval'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=REPORTS.parent)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["eval", "eval.lab"]


@pytest.mark.parametrize("command", ["selection-split", "task-prompts"])
def test_a_file_where_the_folder_goes_is_one_line(tmp_path, capsys, command):
    taken = tmp_path / "out"
    taken.write_text("mine")
    assert main([command, str(tmp_path), str(taken)]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err.strip() == f"error: {taken} is a file: pass a folder to write the {command} into"
    assert taken.read_text() == "mine"
