import pytest
import torch
from conftest import TINY_CONFIGS, assert_cache_and_generate, make_tiny_model

from prune.adapters import arch_spec, get_blocks
from prune.errors import LayercutError
from prune.surgery import blocks_removed, drop_blocks_


def attention_indices(model):
    blocks = get_blocks(model)[1]
    return [m.layer_idx for b in blocks for m in b.modules() if hasattr(m, "layer_idx")]


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_drop_blocks_renumbers_and_generates_with_cache(model_type):
    model = make_tiny_model(model_type)
    ids = torch.randint(3, 320, (2, 12))
    kept_blocks = [get_blocks(model)[1][i] for i in (0, 3)]
    layer_types = getattr(model.config, "layer_types", None)
    kept = drop_blocks_(model, [1, 2])
    assert kept == [0, 3]
    spec = arch_spec(model)
    assert getattr(model.config, spec.layer_count) == 2
    assert list(get_blocks(model)[1]) == kept_blocks
    assert sorted(set(attention_indices(model))) == [0, 1]
    if layer_types is not None:
        assert model.config.layer_types == [layer_types[0], layer_types[3]]
    assert_cache_and_generate(model, ids)


def test_blocks_removed_restores_everything():
    model = make_tiny_model("gemma2")
    ids = torch.randint(3, 320, (1, 10))
    with torch.no_grad():
        before = model(ids).logits
        types = list(model.config.layer_types)
        with blocks_removed(model, [0, 2]):
            assert model.config.num_hidden_layers == 2
            during = model(ids).logits
        after = model(ids).logits
    assert not torch.allclose(before, during)
    torch.testing.assert_close(before, after)
    assert model.config.num_hidden_layers == 4 and model.config.layer_types == types
    assert attention_indices(model) == [0, 1, 2, 3]


def test_removed_block_is_really_skipped():
    """Dropping block 1 equals running the blocks 0, 2, 3 by hand."""
    model = make_tiny_model("gpt2")
    ids = torch.randint(3, 320, (1, 6))
    with torch.no_grad():
        h = model.transformer.wte(ids) + model.transformer.wpe(torch.arange(6))[None]
        blocks = list(model.transformer.h)
        for i in (0, 2, 3):
            out = blocks[i](h)
            h = out[0] if isinstance(out, tuple) else out
        expected = model.lm_head(model.transformer.ln_f(h))
        drop_blocks_(model, [1])
        torch.testing.assert_close(model(ids, use_cache=False).logits, expected, rtol=1e-5, atol=1e-5)
    assert model.config.n_layer == 3


def test_bad_block_indices():
    model = make_tiny_model("llama")
    with pytest.raises(LayercutError, match="out of range"):
        drop_blocks_(model, [7])
    with pytest.raises(LayercutError, match="at least one must stay"):
        drop_blocks_(model, [0, 1, 2, 3])
