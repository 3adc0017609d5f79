import pytest
import torch
from conftest import BLOCKS, HIDDEN, TINY_CONFIGS, make_tiny_model

from prune.adapters import (
    ARCHITECTURES,
    arch_spec,
    block_part,
    final_norm,
    get_blocks,
    hidden_size,
    lm_head,
    num_blocks,
    supported_architectures,
)
from prune.errors import LayercutError


def test_every_supported_architecture_has_a_tiny_model():
    assert set(TINY_CONFIGS) == set(ARCHITECTURES)
    assert {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "opt", "gpt2", "gpt_neox"} <= set(
        supported_architectures()
    )


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS))
def test_adapter_paths_resolve(model_type):
    model = make_tiny_model(model_type)
    spec = arch_spec(model)
    path, blocks = get_blocks(model)
    assert path == spec.blocks
    assert isinstance(blocks, torch.nn.ModuleList)
    assert len(blocks) == num_blocks(model) == BLOCKS == getattr(model.config, spec.layer_count)
    assert hidden_size(model) == HIDDEN
    head = lm_head(model)
    assert head.weight.shape[-1] == HIDDEN or head.weight.shape[0] == HIDDEN
    norm = final_norm(model)
    state = torch.randn(2, 3, HIDDEN)
    assert norm(state).shape == state.shape
    for block in blocks:
        assert block_part(block, model, "attention") is not None
        mlp_out = block_part(block, model, "mlp_out")
        # nn.Linear stores [out, in]; GPT-2's Conv1D stores [in, out]: either way one side is the hidden size.
        assert HIDDEN in mlp_out.weight.shape
        for norm_name in spec.norms:
            assert block.get_submodule(norm_name) is not None


def test_unsupported_architecture_lists_the_supported_ones():
    with pytest.raises(LayercutError, match="unsupported architecture 'bert'.*gpt2.*llama"):
        arch_spec("bert")
