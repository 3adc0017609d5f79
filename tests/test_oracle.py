"""The perplexity oracle: single-block removal perplexity and each score's Spearman agreement with it."""

import math

import pytest
import torch
from conftest import make_tiny_model
from scipy.stats import spearmanr

from prune.heldout import packed_perplexity
from prune.oracle import oracle_table, run_oracle, score_agreement, spearman
from prune.scores import SCORES, block_scores
from prune.stats import stream_moments
from prune.surgery import drop_blocks_


@pytest.mark.parametrize("a,b", [([1, 2, 3, 4], [10, 20, 30, 40]), ([1, 2, 3, 4], [4, 3, 2, 1]),
                                 ([0.3, 0.1, 0.1, 0.9, 0.5], [2.0, 1.0, 3.0, 5.0, 5.0])])
def test_spearman_matches_scipy_with_ties(a, b):
    assert spearman(a, b) == pytest.approx(spearmanr(a, b).statistic, abs=1e-12)


def test_spearman_of_a_constant_is_nan():
    assert math.isnan(spearman([1, 1, 1], [1, 2, 3]))


def test_oracle_measures_each_removal_and_rates_the_scores(one_thread):
    model = make_tiny_model("llama", seed=2)
    ids = torch.randint(3, 320, (4, 32), generator=torch.Generator().manual_seed(0))
    scores = block_scores(stream_moments(model, ids, progress=False))
    oracle = run_oracle(model, ids, scores, progress=False)
    assert model.config.num_hidden_layers == 4  # restored
    assert oracle.dense == pytest.approx(packed_perplexity(model, ids, progress=False))
    for block in (0, 3):
        copy = make_tiny_model("llama", seed=2)
        drop_blocks_(copy, [block])
        assert oracle.removed[block] == pytest.approx(packed_perplexity(copy, ids, progress=False), rel=1e-6)
    assert set(oracle.spearman) == set(SCORES) and oracle.tokens == 128
    # a score that is the oracle itself agrees perfectly; its negation perfectly disagrees
    assert score_agreement({"bi": oracle.removed}, oracle.removed)["bi"] == pytest.approx(1.0)
    assert score_agreement({"cosine": oracle.removed}, oracle.removed)["cosine"] == pytest.approx(-1.0)
    table = oracle_table(oracle, scores)
    assert "| score | Spearman |" in table and f"| 3 | {oracle.removed[3]:.3f} |" in table
    assert f"dense {oracle.dense:.3f}" in table


def test_prune_run_with_oracle_reports_it_beside_the_scores(tiny_folder, tmp_path, one_thread):
    import json

    from prune.data import DataConfig
    from prune.options import LoadConfig
    from prune.pipeline import PruneConfig, run_prune

    config = PruneConfig(load=LoadConfig(model=str(tiny_folder)), data=DataConfig(samples=8, seq_len=32,
                         heldout_samples=0), drop=1, oracle=True, out=str(tmp_path / "slim"))
    result = run_prune(config)
    oracle = json.loads((tmp_path / "slim" / "layercut.json").read_text())["oracle"]
    assert len(oracle["removed"]) == 4 and oracle["tokens"] == 8 * 32
    assert all(ppl > 0 for ppl in oracle["removed"]) and set(oracle["spearman"]) == set(result.scores)
    table = (tmp_path / "slim" / "scores.md").read_text()
    assert "Spearman" in table and f"{oracle['removed'][2]:.3f}" in table
