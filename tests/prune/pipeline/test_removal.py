"""Whole-block removal behind the one signature the runner calls: the chosen blocks go, a met budget is recorded."""

import torch

from prune.data.calibration import CalibrationData, DataConfig
from prune.model.surgery import block_layout
from prune.pipeline.config import PruneConfig
from prune.pipeline.removal import Removal, block_budget, chosen_blocks, remove_blocks
from prune.pipeline.runner import score_model
from prune.replace import ReplaceConfig
from tests.helpers import make_tiny_model

DATA = DataConfig("builtin", samples=8, seq_len=32)  # the sizes only: nothing is read


def test_remove_blocks_removes_what_the_selection_chooses(one_thread):
    model = make_tiny_model("llama")
    calibration = CalibrationData(torch.randint(3, 320, (8, 32), generator=torch.Generator().manual_seed(0)), "test")
    config = PruneConfig(data=DATA, drop=1, replace=ReplaceConfig(method="none", progress=False))
    amounts = config.resolve(model)
    moments, scores = score_model(model, calibration, config)
    chosen = chosen_blocks(model, calibration, moments, scores, config, amounts).blocks
    assert len(chosen) == 1 and chosen[0] in (1, 2)  # blocks 0 and 3 are protected by default
    removal = remove_blocks(model, calibration, moments, scores, config, amounts, {})
    assert (removal.dropped, removal.changed, removal.budget, removal.sections) == (chosen, True, None, {})
    assert block_layout(model) == [[block] for block in range(4) if block not in chosen]
    assert removal.recorded(config)["drop"] == 1


def test_a_speed_up_target_becomes_a_block_count_recorded_as_the_drop():
    config = PruneConfig(data=DATA, target_speedup=1.5)
    amounts = config.resolve(make_tiny_model("llama"))
    budget = block_budget(None, None, None, {}, config, amounts)  # a speed-up target needs no measurement
    assert budget == {"target_speedup": 1.5, "drop": 2, "ideal_speedup": 2.0}  # 4 / (4 - 2) >= 1.5
    assert block_budget(None, None, None, {}, PruneConfig(data=DATA, drop=1), amounts.with_drop(1)) is None
    removal = Removal([1, 2], {}, budget, amounts.with_drop(2), changed=True)
    written = removal.recorded(config)
    assert (written["drop"], written["target_speedup"], written["target_params"]) == (2, None, None)
    assert config.target_speedup == 1.5 and config.drop is None  # the caller's config is never changed
