"""Where each architecture keeps its blocks, final norm and MLP output projection.

Architectures are data: one table keyed by ``config.model_type``. Everything else in layercut is
architecture-free and reaches into a model only through these paths.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from prune.errors import LayercutError


@dataclass(frozen=True)
class ArchSpec:
    """Attribute paths inside a ``*ForCausalLM`` model (dotted, from the top-level model).

    Attributes:
        blocks: the ``nn.ModuleList`` of decoder blocks.
        final_norm: the norm applied after the last block, before the LM head.
        layer_count: the config attribute holding the number of blocks, under the model's own name.
        attention: the attention sub-module, relative to a block.
        mlp: the feed-forward sub-module, relative to a block.
        mlp_out: the MLP's output projection, relative to a block (``fold`` writes into it).
        norms: the layer norms inside a block, relative to it.
    """

    blocks: str
    final_norm: str
    layer_count: str
    attention: str
    mlp: str
    mlp_out: str
    norms: tuple[str, ...]


_LLAMA_LIKE = ArchSpec(
    blocks="model.layers",
    final_norm="model.norm",
    layer_count="num_hidden_layers",
    attention="self_attn",
    mlp="mlp",
    mlp_out="mlp.down_proj",
    norms=("input_layernorm", "post_attention_layernorm"),
)

ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "phi3": _LLAMA_LIKE,
    "gemma": _LLAMA_LIKE,
    "gemma2": ArchSpec(
        blocks="model.layers",
        final_norm="model.norm",
        layer_count="num_hidden_layers",
        attention="self_attn",
        mlp="mlp",
        mlp_out="mlp.down_proj",
        norms=(
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ),
    ),
    "opt": ArchSpec(
        blocks="model.decoder.layers",
        final_norm="model.decoder.final_layer_norm",
        layer_count="num_hidden_layers",
        attention="self_attn",
        mlp="fc1",
        mlp_out="fc2",
        norms=("self_attn_layer_norm", "final_layer_norm"),
    ),
    "gpt2": ArchSpec(
        blocks="transformer.h",
        final_norm="transformer.ln_f",
        layer_count="n_layer",
        attention="attn",
        mlp="mlp",
        mlp_out="mlp.c_proj",
        norms=("ln_1", "ln_2"),
    ),
    "gpt_neox": ArchSpec(
        blocks="gpt_neox.layers",
        final_norm="gpt_neox.final_layer_norm",
        layer_count="num_hidden_layers",
        attention="attention",
        mlp="mlp",
        mlp_out="mlp.dense_4h_to_h",
        norms=("input_layernorm", "post_attention_layernorm"),
    ),
}

# Config lists with one entry per block; surgery keeps the entries of the kept blocks.
PER_LAYER_CONFIG_LISTS = ("layer_types", "no_rope_layers")


def supported_architectures() -> list[str]:
    """The ``model_type`` values layercut knows, sorted."""
    return sorted(ARCHITECTURES)


def arch_spec(model_or_type: nn.Module | str) -> ArchSpec:
    """The adapter for a model (or a ``model_type`` string); a clear error if unsupported."""
    model_type = model_or_type if isinstance(model_or_type, str) else getattr(model_or_type.config, "model_type", "?")
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise LayercutError(
            f"unsupported architecture '{model_type}': layercut supports {', '.join(supported_architectures())}; "
            "add an entry to prune.adapters.ARCHITECTURES for a new one"
        ) from None


def get_submodule(root: nn.Module, path: str) -> nn.Module:
    """``root.get_submodule`` that also accepts an empty path and gives a readable error."""
    return root.get_submodule(path) if path else root


def get_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The dotted path and the ``ModuleList`` of decoder blocks."""
    spec = arch_spec(model)
    return spec.blocks, get_submodule(model, spec.blocks)


def num_blocks(model: nn.Module) -> int:
    """Number of decoder blocks actually in the model."""
    return len(get_blocks(model)[1])


def final_norm(model: nn.Module) -> nn.Module:
    """The norm between the last block and the LM head (identity for OPT variants without one)."""
    spec = arch_spec(model)
    try:
        norm = get_submodule(model, spec.final_norm)
    except AttributeError:
        return nn.Identity()
    return nn.Identity() if norm is None else norm


def lm_head(model: nn.Module) -> nn.Module:
    """The projection from hidden states to vocabulary logits (named differently across versions)."""
    return model.get_output_embeddings()


def block_part(block: nn.Module, model: nn.Module, part: str) -> nn.Module:
    """A named part (``attention``, ``mlp``, ``mlp_out``) of one block of ``model``."""
    return get_submodule(block, getattr(arch_spec(model), part))


def hidden_size(model: nn.Module) -> int:
    """Width of the residual stream."""
    config = model.config
    for name in ("hidden_size", "n_embd", "d_model"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    return int(model.get_input_embeddings().weight.shape[1])


def input_device(model: nn.Module):
    """Device the token ids must be on (the embedding's device, also under a device_map)."""
    return model.get_input_embeddings().weight.device


def max_positions(model_or_config) -> int | None:
    """The longest sequence the model's (text) config allows, or None when the config does not say."""
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def config_layer_count(config) -> int | None:
    """The number of blocks a (text) config declares, under its architecture's own name; None if unknown."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    spec = ARCHITECTURES.get(getattr(config, "model_type", None))
    value = getattr(config, spec.layer_count, None) if spec is not None else None
    return value if isinstance(value, int) else None
