import math

import pytest
import torch

from prune.errors import LayercutError
from prune.measure.moments import stream_moments
from prune.measure.scores import SCORES, get_score, register_pair_score, register_score
from prune.registry import Registry
from prune.selection.strategies import SELECTIONS, SelectionInput, register_selection, select_blocks
from tests.helpers import make_tiny_model


def test_unknown_name_is_one_line_listing_the_known_ones():
    fruit = Registry("fruit", flag="--fruit")
    fruit.register("apple", 1)
    fruit.register("pear", 2)
    with pytest.raises(LayercutError) as error:
        fruit.get("plum")
    assert str(error.value) == "unknown fruit 'plum' (--fruit): choose one of apple, pear"
    assert fruit.get("pear") == 2 and fruit["apple"] == 1
    assert list(fruit) == fruit.names() == ["apple", "pear"] and len(fruit) == 2 and "apple" in fruit
    assert dict(fruit.items()) == {"apple": 1, "pear": 2} and list(fruit.values()) == [1, 2]


def test_registering_a_name_twice_is_a_value_error():
    fruit = Registry("fruit")
    fruit.register("apple", 1)
    with pytest.raises(ValueError, match="fruit 'apple' is already registered"):
        fruit.register("apple", 2)
    assert fruit["apple"] == 1
    fruit.unregister("apple")
    fruit.unregister("apple")  # absent: nothing to do
    assert "apple" not in fruit and len(fruit) == 0


def test_the_strategy_registries_refuse_duplicates_and_unknown_names():
    with pytest.raises(ValueError, match="score 'linearity' is already registered"):
        register_score("linearity", "again", higher_is_removable=True)(lambda moments, block: 0.0)
    with pytest.raises(ValueError, match="selection 'topk' is already registered"):
        register_selection("topk")(lambda inputs: [])
    with pytest.raises(LayercutError) as error:
        get_score("nope")
    assert str(error.value) == f"unknown score 'nope': choose one of {', '.join(SCORES)}"
    assert "\n" not in str(error.value) and SCORES.names()[:5] == ["linearity", "linearity-nores", "cosine",
                                                                    "angular", "bi"]
    with pytest.raises(LayercutError, match="unknown selection 'nope': choose one of topk, span, greedy"):
        select_blocks("nope", SelectionInput(get_score("linearity"), None, [0.0] * 4, 1, []))


def test_steps_and_bench_subcommands_are_registries():
    from eval.bench.cli import SUBCOMMANDS, build_parser
    from prune.pipeline.steps import STEPS, register_step, step_factory, unregister_step

    assert isinstance(SUBCOMMANDS, Registry)
    assert sorted(SUBCOMMANDS.names())[:7] == ["heal-cost", "heal-curve", "replace", "scale", "scoring", "serving",
                                               "speed"]
    # each module of eval.bench, by name
    assert "{heal-cost,heal-curve,replace,scale,scoring,serving,speed" in build_parser().format_usage()

    def factory(options, config):
        return None

    register_step("toy-step", factory)
    try:
        assert step_factory("toy-step") is factory and "toy-step" in STEPS
        with pytest.raises(ValueError, match="step 'toy-step' is already registered"):
            register_step("toy-step", factory)
    finally:
        unregister_step("toy-step")
    assert "toy-step" not in STEPS
    with pytest.raises(LayercutError, match="no 'toy-step' step is installed"):
        step_factory("toy-step")


@pytest.fixture
def chord():
    """A toy distance of states, registered for one test: the chord ``sqrt(2 - 2 cos)`` of unit vectors."""

    @register_pair_score("toy-chord", "chord between unit states", higher_is_removable=False)
    def _chord(moments, first, last):
        return math.sqrt(max(0.0, 2 - 2 * moments.mean_cosine(first, last)))

    yield get_score("toy-chord")
    SCORES.unregister("toy-chord")


def test_a_registered_pair_score_ranks_blocks_and_spans_by_name(chord):
    from prune.pipeline.config import PruneConfig, needed_cosine_pairs

    model = make_tiny_model("llama", seed=2)
    ids = torch.randint(3, 320, (4, 16), generator=torch.Generator().manual_seed(0))
    moments = stream_moments(model, ids, cosine_pairs="all", progress=False)
    values = [chord.compute(moments, b) for b in range(4)]
    assert values == [math.sqrt(max(0.0, 2 - 2 * moments.mean_cosine(b, b + 1))) for b in range(4)]
    assert chord.span(moments, 1, 3) == pytest.approx(math.sqrt(2 - 2 * moments.mean_cosine(1, 3)), abs=1e-12)

    def chosen(method, count):
        return select_blocks(method, SelectionInput(get_score("toy-chord"), moments, values, count, []))

    # the chord grows with 1 - cos: it ranks blocks as Block Influence does, smallest first
    assert chosen("topk", 2) == sorted(sorted(range(4), key=lambda b: values[b])[:2])
    best = min(range(3), key=lambda s: 2 - 2 * moments.mean_cosine(s, s + 2))  # the span's endpoints, not a sum
    assert chosen("span", 2) == [best, best + 1]
    span = PruneConfig(score="toy-chord", select="span")
    assert needed_cosine_pairs(span) == "all" and needed_cosine_pairs(PruneConfig(score="toy-chord")) == "adjacent"


def test_a_registered_block_score_sums_over_a_span():
    from prune.pipeline.config import PruneConfig, needed_cosine_pairs

    register_score("toy-index", "the block's index", higher_is_removable=False)(lambda moments, block: float(block))
    try:
        score = get_score("toy-index")
        assert score.span is None
        values = [3.0, 1.0, 0.5, 2.0, 0.1]
        inputs = SelectionInput(score, None, values, 2, [])
        assert select_blocks("topk", inputs) == [2, 4]
        assert select_blocks("span", inputs) == [1, 2]  # sums 1.5; 2-3 sums 2.5, 3-4 sums 2.1
        assert needed_cosine_pairs(PruneConfig(score="toy-index", select="span")) == "adjacent"
    finally:
        SCORES.unregister("toy-index")
    with pytest.raises(LayercutError, match="unknown score 'toy-index'"):
        get_score("toy-index")
    assert "toy-index" not in SELECTIONS
