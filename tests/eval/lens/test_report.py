"""The lens run's markdown: tables per layer and shortcut, early exit, and the papers' claims counted on the run."""

from eval.lens.report import claims, claims_list, early_exit_table, layer_table, lens_readme, shortcut_table


def results() -> dict:
    """A lens ``results.json`` of 4 blocks, two shortcuts: mat beats id at layers 1 and 2, not at 3."""
    per_layer = {
        "id": {"r2": [0.0, 0.1, 0.2, 0.9, 1.0], "precision@1": [0.0, 0.2, 0.3, 0.8, 1.0]},
        "mat": {"r2": [0.0, 0.5, 0.6, 0.8, 1.0], "precision@1": [0.0, 0.4, 0.5, 0.8, 1.0]},
    }
    for metrics in per_layer.values():  # the columns only the README shows
        metrics.update({"precision@5": [1.0] * 5, "precision@10": [1.0] * 5, "surprisal": [2.0, 1.5, 1.0, 0.5, 0.0]})
    shortcuts = {"id": {"description": "h", "params_per_layer": 0, "params_total": 0, "share_of_mat": 0.0},
                 "mat": {"description": "h A + b", "params_per_layer": 1056, "params_total": 4224, "share_of_mat": 1.0}}
    exits = {"id": {"layers_used_at_goal": 3.5, "layers_saved_at_goal": 0.5, "saved_share": 0.125},
             "mat": {"layers_used_at_goal": None, "layers_saved_at_goal": None, "saved_share": None}}
    return {"model": "tiny", "num_blocks": 4, "hidden_size": 32, "layers": [0, 1, 2, 3, 4], "per_layer": per_layer,
            "shortcuts": shortcuts,
            "early_exit": {"goal": 0.95, "exit_layers": [1, 3], "mat_minus_id_saved_share": 0.125, "shortcuts": exits},
            "data": {"fit": {"tokens": 256, "source": "fit.txt"}, "eval": {"tokens": 64, "source": "eval.txt"},
                     "split": "disjoint windows"}}


def test_the_claims_are_counted_on_the_intermediate_layers():
    run = results()
    found = claims(run)
    assert found == {"layers_compared": 3, "first_half_layers": 2, "mat_beats_id_r2_layers": 2,
                     "mat_beats_id_precision@1_layers": 2, "mat_minus_id_layers_saved_share": 0.125}
    lines = claims_list({**run, "claims": found})
    assert lines[0] == "- mat beats id in R^2 at 2/3 intermediate layers and in Precision@1 at 2/3."
    assert lines[1].startswith("- early exit at 95% precision: mat saves +12.5% of the layers more than id")


def test_the_tables_have_a_row_per_layer_and_per_shortcut():
    run = results()
    rows = layer_table(run, [("r2", "R^2", 3)]).splitlines()
    assert rows[0] == "| layer | id R^2 | mat R^2 |" and rows[3] == "| 1 | 0.100 | 0.500 |" and len(rows) == 2 + 5
    assert "| mat | h A + b | 1,056 | 4,224 | 100.00% |" in shortcut_table(run).splitlines()
    exits = early_exit_table(run).splitlines()
    assert "| id | 3.50 | 0.50 | 12.5% |" in exits and "| mat | - | - | - |" in exits
    assert exits[-1] == "mat saves +12.5% of the layers more than id."
    readme = lens_readme({**run, "claims": claims(run)}, ["heatmap.png"])
    assert readme.startswith("# Lens: what each layer of tiny already predicts")
    assert "![heatmap.png](heatmap.png)" in readme
    assert "## Early exit" in readme and "## Sub-module stand-ins" not in readme
