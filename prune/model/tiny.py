"""Tiny random models of any transformers architecture, from that architecture's own default config.

Sizes are shrunk under each config's own names, and per-layer entries are cut to a few representative
layers (at least one of each kind), so a hybrid keeps both its attention and its recurrent blocks.
``prune.model.adapters`` reads structure off these models and ``prune.model.architectures`` surveys them.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from functools import cache

import torch

TINY_BLOCKS = 4
TINY_VOCAB = 320

# Size entries shrunk wherever a config has them (an int already set), under each config's own name.
_TINY_SIZES = {
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "embed_dim": 64, "n_embed": 64, "dim": 64,
    "intermediate_size": 96, "ffn_dim": 96, "n_inner": 96, "ffn_hidden_size": 96, "d_ff": 96,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2, "n_head_kv": 2, "num_key_value_groups": 2,
    "head_dim": 16, "kv_channels": 16, "rotary_dim": 8, "partial_rotary_factor": None,
    "num_hidden_layers": TINY_BLOCKS, "n_layer": TINY_BLOCKS, "num_layers": TINY_BLOCKS, "n_layers": TINY_BLOCKS,
    "vocab_size": TINY_VOCAB, "unpadded_vocab_size": TINY_VOCAB,
    "max_position_embeddings": 256, "n_positions": 256, "n_ctx": 256,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "top_k_experts": 2,
    "n_shared_experts": 1, "num_shared_experts": 1, "n_group": 1, "topk_group": 1,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_n_groups": 1, "state_size": 8,
    "ssm_state_size": 8, "d_state": 8, "n_groups": 1, "mamba_headdim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "conv_L_cache": 3, "block_dim": 64, "block_ff_dim": 96, "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": TINY_VOCAB, "global_head_dim": 16, "num_global_key_value_heads": 2,
    "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
}  # fmt: skip
# Vision/audio towers of multimodal models: shrunk so the tiny model builds quickly.
_TINY_TOWER = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
    "depth": 1, "embed_dim": 32, "num_heads": 2, "out_hidden_size": 64, "projection_dim": 32,
}  # fmt: skip


_LAYER_NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def _layer_count(values: dict) -> int | None:
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        if isinstance(values.get(key), int) and not isinstance(values.get(key), bool):
            return values[key]
    return None


def _representative_layers(values: dict, count: int, keep: int) -> list[int]:
    """``keep`` layer indices that cover every distinct per-layer value (one layer of each type)."""
    chosen = list(range(min(keep, count)))
    labels = [list(v) for v in values.values() if isinstance(v, (list, str)) and len(v) == count]
    labels += [[i in v for i in range(count)] for v in values.values() if _is_index_list(v, count)]
    for label in labels:
        try:
            kinds = list(dict.fromkeys(label))
        except TypeError:  # unhashable entries (per-layer dicts): no kinds to cover
            continue
        for kind in kinds:
            if kind in [label[i] for i in chosen]:
                continue
            # replace the last chosen layer whose kind another chosen layer also has
            spare = [i for i in chosen if [label[j] for j in chosen].count(label[i]) > 1]
            if spare:
                chosen[chosen.index(spare[-1])] = label.index(kind)
                chosen.sort()
    return chosen


def _is_index_list(value, count: int) -> bool:
    return (isinstance(value, list) and 0 < len(value) < count and all(isinstance(v, int) for v in value)
            and value == sorted(set(value)) and value[-1] < count)


def _cut_layers(values: dict, keep: int) -> dict:
    """Per-layer entries of a config dict reduced to ``keep`` representative layers."""
    count = _layer_count(values)
    if count is None or count <= keep:
        return {}
    chosen = _representative_layers(values, count, keep)
    position = {layer: i for i, layer in enumerate(chosen)}
    out = {}
    for key, value in values.items():
        if isinstance(value, list) and len(value) == count:
            out[key] = [value[i] for i in chosen]
        elif isinstance(value, str) and len(value) == count and "pattern" in key:
            out[key] = "".join(value[i] for i in chosen)
        elif _is_index_list(value, count) and key != "layer_types":
            out[key] = [position[i] for i in value if i in position]
        elif isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            out[key] = {str(position[int(k)]) if isinstance(k, str) else position[int(k)]: v
                        for k, v in value.items() if int(k) in position}
    return out


def _shrink(values: dict, sizes: dict, keep: int) -> dict:
    out = {}
    for key, value in values.items():
        if key in sizes and isinstance(value, int) and not isinstance(value, bool) and sizes[key] is not None:
            out[key] = sizes[key]
        elif isinstance(value, dict) and key.endswith("_config") and value:
            inner = sizes if key == "text_config" else _TINY_TOWER
            out[key] = {**value, **_shrink(value, inner, keep if key == "text_config" else 1)}
        elif key.endswith("token_id") and isinstance(value, int) and value >= TINY_VOCAB:
            out[key] = 2
    if "qk_rope_head_dim" in out and "head_dim" in out:
        out["head_dim"] = out["qk_rope_head_dim"]  # multi-head latent attention ropes head_dim channels
    out.update(_cut_layers(values, keep))
    for key in [k for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if k in values]:
        if isinstance(values[key], int) and values[key] > keep:
            out[key] = keep
    return out


@cache
def _default_dict(model_type: str) -> dict:
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type).to_dict()


# Hybrids whose default tiny cut has no attention layer (or nothing else): a layout with both kinds.
_TINY_LAYOUTS = {
    "bamba": {"attn_layer_indices": [1, 3]},
    "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba", "attention"]},
    "lfm2": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
}


def tiny_config(model_type: str, sizes: dict | None = None, **overrides):
    """A small config of ``model_type`` (few blocks, width 64, vocab 320), from its defaults.

    Per-layer entries (``layer_types``, index lists, per-layer dicts) are cut to a few representative
    layers, at least one of each kind, so that hybrids keep both their attention and recurrent blocks.
    ``sizes`` changes the size table, whose entries apply under each config's own names wherever the config
    has them (``{"hidden_size": 32, "n_embd": 32, ...}``: width 32 whatever the architecture calls it);
    ``overrides`` are passed to the config as they are.
    """
    from transformers import AutoConfig

    keep = next((v for k, v in overrides.items() if k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers")),
                TINY_BLOCKS)
    table = {**_TINY_SIZES, **(sizes or {}), **dict.fromkeys(_LAYER_NAMES, keep)}
    kwargs = _shrink(_default_dict(model_type), table, keep)
    return AutoConfig.for_model(model_type, **{**kwargs, **_TINY_LAYOUTS.get(model_type, {}), **overrides})


@contextlib.contextmanager
def quiet():
    """Silence transformers' warnings and prints while tiny models are built (the survey builds hundreds)."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logger.setLevel(level)


def build_tiny(model_type: str, device: str = "cpu", seed: int = 0, sizes: dict | None = None, **overrides):
    """A tiny random causal LM of ``model_type`` in eval mode (``device='meta'``: structure only).

    ``sizes`` and ``overrides``: as :func:`tiny_config` takes them.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, sizes, **overrides)
    torch.manual_seed(seed)
    with quiet(), torch.device(device):
        model = AutoModelForCausalLM.from_config(config)
    return model.eval()


