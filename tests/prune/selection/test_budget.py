"""Budgets in place of --drop: a parameter target or an ideal speed-up picks how many blocks go."""

import json

import pytest

from prune.checkpoint.load_config import LoadConfig
from prune.data.calibration import DataConfig
from prune.errors import LayercutError
from prune.pipeline.config import PruneConfig
from prune.pipeline.runner import run_prune
from prune.replace import parameter_count
from prune.selection.budget import blocks_for_params, blocks_for_speedup, parse_param_target


@pytest.mark.parametrize("value,expected", [("110M", 110_000_000), ("0.9B", 900_000_000), ("85%", 850_000_000),
                                            (900_000_000, 900_000_000), ("2,500K", 2_500_000)])
def test_parse_param_target(value, expected):
    assert parse_param_target(value, 1_000_000_000) == expected


@pytest.mark.parametrize("value,message", [("2B", "not below the model's 1,000,000,000 parameters"),
                                           ("lots", "must be a count like 110M"), ("0%", "leaves no parameters")])
def test_bad_param_targets_are_one_line_errors(value, message):
    with pytest.raises(LayercutError, match=message):
        parse_param_target(value, 1_000_000_000)


def test_speedup_is_the_ideal_block_ratio():
    assert blocks_for_speedup(1.25, 30) == 6  # 30 / 24 = 1.25 exactly
    assert blocks_for_speedup(1.2, 30) == 5  # 30 / 25 = 1.2
    assert blocks_for_speedup(1.21, 30) == 6
    with pytest.raises(LayercutError, match="above 1"):
        blocks_for_speedup(0.9, 30)
    with pytest.raises(LayercutError, match="all 4 blocks"):
        blocks_for_speedup(100, 4)


def test_params_checks_the_selected_blocks_of_unequal_size():
    sizes = [50, 10, 10, 10, 50]  # dense first and last layers are larger
    # The selection prefers the small blocks: 1, 2, 3, then the big ones.
    order = [1, 2, 3, 0, 4]
    assert blocks_for_params(200, 230, sizes, lambda k: order[:k], 5) == 3
    assert blocks_for_params(190, 230, sizes, lambda k: order[:k], 5) == 4
    with pytest.raises(LayercutError, match="out of reach"):
        blocks_for_params(50, 230, sizes, lambda k: order[:k], 3)
    # nothing removable (every sub-layer protected): the same one-line error, named for the unit
    with pytest.raises(LayercutError, match="removing every removable sub-layer leaves about 230 parameters"):
        blocks_for_params(200, 230, [], lambda k: [], 0, what="removable sub-layer")


def run(tiny_folder, tmp_path, **kw):
    config = PruneConfig(load=LoadConfig(model=str(tiny_folder)), data=DataConfig(samples=8, seq_len=32,
                         heldout_samples=0), out=str(tmp_path / "slim"), **kw)
    return run_prune(config)


def test_target_params_removes_the_fewest_blocks_that_meet_it(tiny_folder, tmp_path, one_thread):
    from prune.loading.loader import load_model

    model = load_model(str(tiny_folder)).model
    total = parameter_count(model)
    block = parameter_count(model.model.layers[1])
    result = run(tiny_folder, tmp_path, target_params=total - block - 1)  # one block is not enough
    budget = json.loads((tmp_path / "slim" / "layercut.json").read_text())["budget"]
    assert len(result.dropped) == 2 and budget["drop"] == 2
    assert budget["params_after"] == total - 2 * block <= budget["target_params"]


def test_target_speedup_and_replacements_that_break_the_budget(tiny_folder, tmp_path, one_thread):
    result = run(tiny_folder, tmp_path, target_speedup=1.3)  # 4 blocks: 4 / 3 = 1.33
    assert len(result.dropped) == 1
    from prune.loading.loader import load_model

    total = parameter_count(load_model(str(tiny_folder)).model)
    block = parameter_count(load_model(str(tiny_folder)).model.model.layers[1])
    with pytest.raises(LayercutError, match="replacements bring the model back"):  # a d x d map per span
        run(tiny_folder, tmp_path, target_params=total - block, replace="linear", overwrite=True)


def test_one_amount_only():
    with pytest.raises(LayercutError, match="--drop and --target-params both say how much"):
        PruneConfig(drop=2, target_params="100M")
    assert PruneConfig(target_speedup=1.25).out.endswith("-speedup1.25x")


def test_cli_budget_errors_and_a_method_recipe_with_a_budget(tiny_folder, tmp_path, capsys, one_thread):
    from tests.helpers import run_prune_cli

    code, _, err = run_prune_cli(capsys, "--model", tiny_folder, "--target-params", "10B", "--samples", "8",
                                 "--seq-len", "32", "--out", tmp_path / "big")
    lines = err.strip().splitlines()
    assert code == 2 and lines[-1].startswith("error: --target-params 10B is not below the model's")
    assert sum(line.startswith("error") for line in lines) == 1 and "perplexity" not in err  # before any pass
    assert not (tmp_path / "big").exists()
    code, out, err = run_prune_cli(capsys, "--recipe", "recipes/methods/shortgpt.yaml", "--model", tiny_folder,
                                   "--target-speedup", "1.3", "--samples", "8", "--seq-len", "32",
                                   "--heldout-samples", "0", "--out", tmp_path / "fast")
    assert code == 0, err
    assert "--target-speedup 1.3 (ideal 1.333x): 1 blocks" in out
    assert json.loads((tmp_path / "fast" / "layercut.json").read_text())["budget"]["drop"] == 1
