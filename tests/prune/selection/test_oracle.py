"""The perplexity oracle: single-block removal perplexity and each score's Spearman agreement with it."""

import math

import pytest
import torch
from scipy.stats import spearmanr

import prune.selection.oracle as oracle_module
from prune.measure.heldout import packed_perplexity
from prune.measure.moments import stream_moments
from prune.measure.scores import SCORES, block_scores
from prune.model.adapters import get_blocks
from prune.model.surgery import drop_blocks_
from prune.selection.oracle import (
    oracle_table,
    removal_perplexities,
    removal_perplexity,
    run_oracle,
    score_agreement,
    spearman,
)
from tests.helpers import make_tiny_model


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

    from prune.checkpoint.load_config import LoadConfig
    from prune.data.calibration import DataConfig
    from prune.pipeline.config import PruneConfig
    from prune.pipeline.runner import run_prune

    config = PruneConfig(load=LoadConfig(model=str(tiny_folder)), data=DataConfig(samples=8, seq_len=32,
                         heldout_samples=0), drop=1, oracle=True, out=str(tmp_path / "slim"))
    result = run_prune(config)
    oracle = json.loads((tmp_path / "slim" / "layercut.json").read_text())["oracle"]
    assert len(oracle["removed"]) == 4 and oracle["tokens"] == 8 * 32
    assert all(ppl > 0 for ppl in oracle["removed"]) and set(oracle["spearman"]) == set(result.scores)
    table = (tmp_path / "slim" / "scores.md").read_text()
    assert "Spearman" in table and f"{oracle['removed'][2]:.3f}" in table


@pytest.mark.parametrize("model_type", ["llama", "gemma", "gemma2", "opt", "gpt2", "gpt_neox"])
def test_removal_passes_started_behind_the_candidate_equal_whole_passes(model_type, one_thread, caplog):
    model = make_tiny_model(model_type, seed=3)
    ids = torch.randint(3, 250, (6, 24), generator=torch.Generator().manual_seed(1))
    reference = {b: removal_perplexity(model, ids, [1, b], batch_size=4) for b in (0, 2, 3)}
    cache = {}
    found = removal_perplexities(model, ids, [1], [0, 2, 3], batch_size=4, cache=cache)
    assert found == pytest.approx(reference, rel=1e-5)
    assert "whole passes" not in caplog.text  # the shortcut held: no fallback
    assert cache.keys() == {(0, 1), (1, 2), (1, 3)} and model.config.num_hidden_layers == 4  # restored
    single = removal_perplexities(model, ids, [], range(4), batch_size=4)
    assert single == pytest.approx({b: removal_perplexity(model, ids, [b], batch_size=4) for b in range(4)}, rel=1e-5)


def _carry_between_blocks(model):
    """Block 0 leaves a value that block 3 adds to its input: state passed on beside the hidden state."""
    _, blocks = get_blocks(model)
    carried = {}
    blocks[0].register_forward_hook(lambda _m, _a, _o: carried.__setitem__("x", 0.5))

    def add(_m, args, kwargs):
        bonus = carried.pop("x", 0.0)
        if args:
            return (args[0] + bonus, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] + bonus}

    blocks[3].register_forward_pre_hook(add, with_kwargs=True)


def test_removal_passes_fall_back_to_whole_passes_when_the_shortcut_disagrees(caplog, one_thread):
    model = make_tiny_model("llama", seed=3)
    _carry_between_blocks(model)
    ids = torch.randint(3, 250, (4, 24), generator=torch.Generator().manual_seed(1))
    reference = {b: removal_perplexity(model, ids, [b]) for b in range(4)}
    assert removal_perplexities(model, ids, [], range(4)) == pytest.approx(reference, rel=1e-6)
    assert "measuring every set with whole passes" in caplog.text


def test_a_shortcut_that_fails_falls_back_too(monkeypatch, caplog, one_thread):
    model = make_tiny_model("llama", seed=3)
    ids = torch.randint(3, 250, (4, 24), generator=torch.Generator().manual_seed(1))
    reference = {b: removal_perplexity(model, ids, [b]) for b in range(4)}

    def broken(*args):
        raise RuntimeError("needs the previous layer's top-k indices")

    monkeypatch.setattr(oracle_module, "_loss_from", broken)
    assert removal_perplexities(model, ids, [], range(4)) == pytest.approx(reference, rel=1e-6)
    assert "top-k indices" in caplog.text


def test_cached_sets_are_not_measured_again_and_bad_candidates_are_refused(monkeypatch, one_thread):
    model = make_tiny_model("llama", seed=3)
    ids = torch.randint(3, 250, (8, 24), generator=torch.Generator().manual_seed(1))
    cache = {(0, 2): 5.0}
    measured = []
    real = oracle_module._measure
    monkeypatch.setattr(oracle_module, "_measure", lambda m, i, positions, *r: measured.append(positions)
                        or real(m, i, positions, *r))
    monkeypatch.setattr(oracle_module, "CHUNK", 1)
    found = removal_perplexities(model, ids, [2], [0, 1, 1, 3], cache=cache)
    assert found[0] == 5.0 and set(found) == {0, 1, 3}
    # deepest first, one chunk each (each in the cache as soon as it is measured); the duplicate measured once
    assert measured == [[2], [1]] and set(cache) == {(0, 2), (1, 2), (2, 3)}
    for bad in ([2], [4], [-1]):
        with pytest.raises(ValueError, match="outside the base"):
            removal_perplexities(model, ids, [2], bad)
