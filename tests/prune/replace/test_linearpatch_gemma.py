"""LinearPatch where it does harm (sandwich-norm models) and the blocks its recipe chooses (ShortGPT's)."""

import pytest
import torch

from prune.errors import LayercutError
from prune.measure.moments import stream_moments
from prune.measure.scores import get_score
from prune.model.adapters import get_blocks
from prune.model.tiny import build_tiny
from prune.pipeline.recipes import METHODS_DIR, config_from_recipe
from prune.replace import ReplaceConfig, check_replacement_supported, replace_blocks_
from prune.replace.linearpatch import orthonormal_hadamard
from prune.selection.strategies import SelectionInput, select_blocks
from tests.helpers import make_tiny_model


def tokens(samples=8, seq=24, seed=0):
    return torch.randint(3, 320, (samples, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", ["gemma3_text", "gemma2"])
def test_linearpatch_refuses_sandwich_norm_models_in_one_line(model_type):
    model = build_tiny(model_type) if model_type == "gemma3_text" else make_tiny_model(model_type)
    with pytest.raises(LayercutError) as raised:
        check_replacement_supported(model, "linearpatch")
    message = str(raised.value)
    assert "\n" not in message and f"linearpatch: '{model_type}' normalises each sub-layer's output" in message
    assert "use --replace linear or none" in message


def test_linearpatch_on_llama_is_the_paper_patch_from_hidden_states(one_thread):
    """Llama is untouched by the refusal: the installed map is H diag(mean|yH| / mean|xH|) H^T, read plainly."""
    ids = tokens()
    model = make_tiny_model("llama")
    check_replacement_supported(model, "linearpatch")
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    x, y = hidden[1].reshape(-1, 32).double(), hidden[3].reshape(-1, 32).double()  # [tokens, d] around blocks 1-2
    rotation = orthonormal_hadamard(32)
    scale = (y @ rotation).abs().mean(0) / (x @ rotation).abs().mean(0)
    expected = rotation @ torch.diag(scale) @ rotation.T
    replace_blocks_(model, [1, 2], ids, ReplaceConfig(method="linearpatch", progress=False))
    weight = get_blocks(model)[1][0].after.proj.weight.detach().double()
    torch.testing.assert_close(weight.T, expected, rtol=1e-5, atol=1e-6)


def recipe_selection(name: str, model, moments) -> list[int]:
    """The blocks recipe ``name`` removes at drop 2, from one scoring pass."""
    overrides = {"drop": 2, "load": {"model": "tiny"}, "data": {"seq_len": 32}}
    config = config_from_recipe(METHODS_DIR / f"{name}.yaml", overrides)
    plan = config.resolve(model)
    score = get_score(config.score)
    values = [score.compute(moments, b) for b in range(plan.num_blocks)]
    return select_blocks(config.select, SelectionInput(score, moments, values, plan.drop, list(plan.protected)))


def test_linearpatch_recipe_removes_shortgpts_blocks(one_thread):
    """LinearPatch's tables patch ShortGPT's pruned models: both recipes choose the same blocks."""
    model = make_tiny_model("llama")
    moments = stream_moments(model, tokens(16, 32), batch_size=8, progress=False)
    shortgpt = recipe_selection("shortgpt", model, moments)
    assert recipe_selection("linearpatch", model, moments) == shortgpt
    # ShortGPT protects nothing: its blocks are Block Influence's plain top 2
    influence = [get_score("bi").compute(moments, b) for b in range(4)]
    assert shortgpt == sorted(sorted(range(4), key=lambda b: influence[b])[:2])
