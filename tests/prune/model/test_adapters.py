import pytest
import torch

from prune.errors import LayercutError
from prune.model.adapters import (
    ARCHITECTURES,
    arch_spec,
    block_part,
    config_layer_count,
    discover_spec,
    final_norm,
    get_blocks,
    hidden_size,
    lm_head,
    num_blocks,
)
from prune.model.architectures import build_tiny
from tests.helpers import BLOCKS, HIDDEN, TINY_TYPES, make_tiny_model


def test_overrides_are_few_and_lookups_read_structure():
    # only OPT (bare fc1/fc2 on the block) cannot be read; every other type is read from its default config
    assert set(dict(ARCHITECTURES)) == {"opt"}
    llama = ARCHITECTURES["llama"]
    assert (llama.blocks, llama.final_norm, llama.mlp_out) == ("model.layers", "model.norm", "mlp.down_proj")
    assert "llama" not in dict(ARCHITECTURES), "a looked-up spec is not stored as an override"


@pytest.mark.parametrize("model_type", sorted(TINY_TYPES))
def test_adapter_paths_resolve(model_type):
    model = make_tiny_model(model_type)
    spec = arch_spec(model)
    path, blocks = get_blocks(model)
    assert path == spec.blocks
    assert isinstance(blocks, torch.nn.ModuleList)
    assert len(blocks) == num_blocks(model) == BLOCKS == getattr(model.config, spec.layer_count)
    assert config_layer_count(model.config) == BLOCKS
    assert hidden_size(model) == HIDDEN
    head = lm_head(model)
    assert head.weight.shape[-1] == HIDDEN or head.weight.shape[0] == HIDDEN
    norm = final_norm(model)
    assert spec.final_norm and not isinstance(norm, torch.nn.Identity)
    state = torch.randn(2, 3, HIDDEN)
    assert norm(state).shape == state.shape
    for block in blocks:
        assert block_part(block, model, "attention") is not None
        mlp_out = block_part(block, model, "mlp_out")
        # nn.Linear stores [out, in]; GPT-2's Conv1D stores [in, out]: either way one side is the hidden size.
        assert HIDDEN in mlp_out.weight.shape
        for norm_name in spec.norms:
            assert block.get_submodule(norm_name) is not None


@pytest.mark.parametrize("model_type,expected", [
    ("gpt2", ("transformer.h", "transformer.ln_f", "n_layer", "attn", "mlp", "mlp.c_proj")),
    ("gpt_neox", ("gpt_neox.layers", "gpt_neox.final_layer_norm", "num_hidden_layers", "attention", "mlp",
                  "mlp.dense_4h_to_h")),
    ("bloom", ("transformer.h", "transformer.ln_f", "n_layer", "self_attention", "mlp", "mlp.dense_4h_to_h")),
    ("mixtral", ("model.layers", "model.norm", "num_hidden_layers", "self_attn", "mlp", "")),
    ("falcon", ("transformer.h", "transformer.ln_f", "num_hidden_layers", "self_attention", "mlp",
                "mlp.dense_4h_to_h")),
])
def test_discovery_finds_the_known_paths(model_type, expected):
    spec = discover_spec(build_tiny(model_type, device="meta"))
    assert (spec.blocks, spec.final_norm, spec.layer_count, spec.attention, spec.mlp, spec.mlp_out) == expected


def test_gemma2_style_blocks_know_their_normed_mlp_output():
    spec = arch_spec(make_tiny_model("gemma2"))
    assert spec.mlp_out == "mlp.down_proj" and spec.mlp_out_norm == "post_feedforward_layernorm"
    assert len(spec.norms) == 4


def test_hybrid_attention_is_the_softmax_one():
    """Qwen3-Next: most blocks hold linear_attn, the full-attention ones self_attn; the spec names self_attn."""
    spec = discover_spec(build_tiny("qwen3_next", device="meta"))
    assert spec.attention == "self_attn" and spec.mlp == "mlp" and spec.mlp_out == ""


def test_multimodal_wrapper_prunes_the_language_model():
    model = build_tiny("gemma3", device="meta")
    spec = arch_spec(model)
    assert spec.blocks == "model.language_model.layers" and spec.final_norm == "model.language_model.norm"
    assert config_layer_count(model.config) == num_blocks(model) == model.config.text_config.num_hidden_layers


def test_unsupported_architecture_names_the_reason():
    with pytest.raises(LayercutError, match="unsupported architecture 'bert': an encoder.*--list-architectures"):
        arch_spec("bert")
    with pytest.raises(LayercutError, match="unsupported architecture 'no-such-type': not a transformers model"):
        arch_spec("no-such-type")
