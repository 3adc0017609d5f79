import pytest
import torch

from prune.errors import LayercutError
from prune.measure.moments import StateMoments, stream_moments
from prune.measure.scores import get_score
from prune.selection.strategies import SelectionInput, parse_drop, parse_protect, select_blocks
from tests.helpers import make_tiny_model


def inputs(values, count, protected=(), score="linearity", moments=None):
    return SelectionInput(get_score(score), moments or StateMoments(len(values) + 1, []), list(values), count,
                          list(protected))


def test_topk_takes_the_most_removable_unprotected_blocks():
    values = [0.9, 0.99, 0.95, 0.999, 0.97, 0.98]
    assert select_blocks("topk", inputs(values, 2, protected=[3])) == [1, 5]
    # For distance scores low means removable.
    assert select_blocks("topk", inputs([0.3, 0.1, 0.2, 0.05], 2, score="angular")) == [1, 3]


def test_span_takes_the_best_contiguous_run():
    values = [0.99, 0.5, 0.9, 0.95, 0.94, 0.6, 0.999]
    assert select_blocks("span", inputs(values, 3, protected=[0, 6])) == [2, 3, 4]
    with pytest.raises(LayercutError, match="no contiguous span"):
        select_blocks("span", inputs(values, 3, protected=[0, 3, 6]))


def test_span_with_angular_uses_endpoint_distance():
    model = make_tiny_model("llama")
    moments = stream_moments(model, torch.randint(3, 320, (4, 16)), cosine_pairs="all", progress=False)
    values = [moments.mean_angular_distance(b, b + 1) for b in range(4)]
    chosen = select_blocks("span", inputs(values, 2, moments=moments, score="angular"))
    best = min(range(3), key=lambda s: moments.mean_angular_distance(s, s + 2))
    assert chosen == [best, best + 1]


def test_greedy_rescoring_matches_topk_for_one_block_and_runs_for_more():
    model = make_tiny_model("llama")
    ids = torch.randint(3, 320, (8, 32))
    moments = stream_moments(model, ids, progress=False)
    score = get_score("linearity")
    values = [score.compute(moments, b) for b in range(4)]
    one = SelectionInput(score, moments, values, 1, [], model, ids)
    assert select_blocks("greedy", one) == select_blocks("topk", one)
    two = SelectionInput(score, moments, values, 2, [0], model, ids)
    chosen = select_blocks("greedy", two)
    assert len(chosen) == 2 and 0 not in chosen
    assert model.config.num_hidden_layers == 4  # greedy restores the model between rounds


@pytest.mark.parametrize("value,expected", [("4", 4), (3, 3), ("25%", 8), ("10%", 3)])
def test_parse_drop(value, expected):
    assert parse_drop(value, 30) == expected


@pytest.mark.parametrize("value,message", [("30", "at most 29"), ("0", "no block"), ("-2", "no block"),
                                           ("abc", "count like 4")])
def test_parse_drop_errors(value, message):
    with pytest.raises(LayercutError, match=message):
        parse_drop(value, 30)


def test_parse_protect():
    assert parse_protect("0,-1", 30) == [0, 29]
    assert parse_protect("none", 30) == []
    with pytest.raises(LayercutError, match="blocks 0..29"):
        parse_protect("40", 30)


def test_not_enough_unprotected_blocks():
    with pytest.raises(LayercutError, match="only 2 of 4 are not protected"):
        select_blocks("topk", inputs([0.9, 0.8, 0.7, 0.6], 3, protected=[0, 3]))


def test_greedy_ppl_removes_the_block_whose_removal_hurts_calibration_perplexity_least():
    from prune.measure.heldout import packed_perplexity
    from prune.model.surgery import blocks_removed

    model = make_tiny_model("llama", seed=3)
    ids = torch.randint(3, 320, (4, 16), generator=torch.Generator().manual_seed(1))
    score = get_score("linearity")
    alone = {}
    for block in (1, 2, 3):
        with blocks_removed(model, [block]):
            alone[block] = packed_perplexity(model, ids, progress=False)
    one = SelectionInput(score, StateMoments(5, []), [0.0] * 4, 1, [0], model, ids)
    assert select_blocks("greedy-ppl", one) == [min(alone, key=alone.get)]
    first = min(alone, key=alone.get)
    pairs = {}
    for block in {1, 2, 3} - {first}:
        with blocks_removed(model, [first, block]):
            pairs[block] = packed_perplexity(model, ids, progress=False)
    two = SelectionInput(score, StateMoments(5, []), [0.0] * 4, 2, [0], model, ids)
    assert select_blocks("greedy-ppl", two) == sorted([first, min(pairs, key=pairs.get)])
    assert model.config.num_hidden_layers == 4  # the model is restored after every trial


def test_last_takes_the_deepest_unprotected_blocks():
    assert select_blocks("last", inputs([0.0] * 8, 3, protected=[0, 7])) == [4, 5, 6]
    assert select_blocks("last", inputs([0.0] * 8, 2, protected=[0])) == [6, 7]


def _count_passes(monkeypatch) -> list:
    import prune.selection.oracle
    import prune.selection.strategies

    calls = []  # one per block set measured (a cached set is not), one per re-scoring
    real = prune.selection.oracle.packed_perplexity
    monkeypatch.setattr(prune.selection.oracle, "packed_perplexity", lambda *a, **k: calls.append(1) or real(*a, **k))
    real_measure = prune.selection.oracle._measure

    def measure(model, ids, positions, *rest):
        calls.extend(1 for _ in positions)
        return real_measure(model, ids, positions, *rest)

    monkeypatch.setattr(prune.selection.oracle, "_measure", measure)
    real_stream = prune.selection.strategies.stream_any
    monkeypatch.setattr(prune.selection.strategies, "stream_any",
                        lambda *a, **k: calls.append(1) or real_stream(*a, **k))
    return calls


@pytest.mark.parametrize("method", ["greedy-ppl", "greedy"])
def test_a_memo_continues_a_smaller_drop_and_changes_no_choice(method, monkeypatch):
    model = make_tiny_model("llama", seed=4)
    ids = torch.randint(3, 320, (4, 16), generator=torch.Generator().manual_seed(2))
    moments = stream_moments(model, ids, progress=False)
    score = get_score("linearity")
    values = [score.compute(moments, b) for b in range(4)]
    fresh = {k: select_blocks(method, SelectionInput(score, moments, values, k, [], model, ids)) for k in (2, 3)}
    calls = _count_passes(monkeypatch)
    memo = {}
    shared = {k: select_blocks(method, SelectionInput(score, moments, values, k, [], model, ids, memo=memo))
              for k in (2, 3)}
    assert shared == fresh
    # greedy-ppl: 4 + 3 passes for the drop of 2, then only the third step's 2 (not 4 + 3 + 2 again);
    # greedy: one re-scoring for the drop of 2, then one more
    assert len(calls) == (4 + 3 + 2 if method == "greedy-ppl" else 2)


def test_the_oracle_fills_the_cache_greedy_ppl_starts_from(monkeypatch):
    from prune.selection.oracle import removal_cache, run_oracle

    model = make_tiny_model("llama", seed=4)
    ids = torch.randint(3, 320, (4, 16), generator=torch.Generator().manual_seed(2))
    score = get_score("linearity")
    memo = {}
    oracle = run_oracle(model, ids, {}, progress=False, cache=removal_cache(memo))
    calls = _count_passes(monkeypatch)
    chosen = select_blocks("greedy-ppl", SelectionInput(score, StateMoments(5, []), [0.0] * 4, 1, [], model, ids,
                                                        memo=memo))
    assert calls == [] and chosen == [min(range(4), key=lambda b: oracle.removed[b])]


def test_measured_takes_the_blocks_whose_removal_alone_costs_least_and_reuses_the_oracle(monkeypatch):
    from prune.selection.oracle import removal_cache, run_oracle

    model = make_tiny_model("llama", seed=4)
    ids = torch.randint(3, 320, (4, 16), generator=torch.Generator().manual_seed(2))
    memo = {}
    oracle = run_oracle(model, ids, {}, progress=False, cache=removal_cache(memo))
    calls = _count_passes(monkeypatch)
    inputs = SelectionInput(get_score("linearity"), StateMoments(5, []), [0.0] * 4, 2, [0], model, ids, memo=memo)
    chosen = select_blocks("measured", inputs)
    assert calls == []  # the oracle measured every single removal already
    assert chosen == sorted(sorted((1, 2, 3), key=lambda b: oracle.removed[b])[:2])
    assert len(set(oracle.removed[1:])) == 3  # distinct costs: the order is not a tie broken by position


def test_capabilities_are_declared_where_each_selection_registers():
    from prune.selection.strategies import (
        SELECTIONS,
        Selection,
        measured_selections,
        register_selection,
        selection_help,
        unit_selections,
    )

    # the tuples offload and sub-layer checks used to keep by hand, now read from the registrations
    assert measured_selections() == ("greedy-ppl", "measured", "repaired-greedy", "repaired-greedy-kl",
                                     "repaired-greedy-crossfit", "repaired-greedy-kl-crossfit", "repaired-once",
                                     "repaired-fast")
    assert [name for name, entry in SELECTIONS.items() if entry.rows == "crossfit"] == [
        "repaired-greedy-crossfit", "repaired-greedy-kl-crossfit"]
    assert unit_selections() == ("topk", "measured")
    assert all(isinstance(entry, Selection) and entry.help and "\n" not in entry.help for entry in SELECTIONS.values())
    assert selection_help().startswith("topk: the K most removable blocks; span: ")
    assert all(f"{name}: " in selection_help() for name in SELECTIONS)

    register_selection("toy-first", "the first K blocks (test only)", measures=True)(
        lambda inputs: list(range(inputs.count)))
    try:
        assert "toy-first" in measured_selections() and "toy-first" not in unit_selections()
        assert "toy-first: the first K blocks (test only)" in selection_help()
        assert select_blocks("toy-first", inputs([0.5] * 4, 2)) == [0, 1]
    finally:
        SELECTIONS.unregister("toy-first")
    assert "toy-first" not in measured_selections()
