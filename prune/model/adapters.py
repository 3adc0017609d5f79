"""Where a decoder keeps its blocks, final norm, LM head and MLP output projection: found by structure.

Any ``*ForCausalLM`` (and the language model inside a multimodal ``*ForConditionalGeneration``) is
read the same way: the decoder blocks are the ``nn.ModuleList`` whose length equals the text
config's layer count; the final norm is the norm module registered beside them; inside a block, the
attention, MLP and norms are the children named and typed as such, and the MLP output projection is
the one dense layer of the MLP that writes the residual width. ``ARCHITECTURES`` holds overrides only
for the few architectures whose structure cannot be read that way, each with its reason.
Everything else in layercut is architecture-free and reaches into a model only through this module.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

from torch import nn

from prune.errors import LayercutError


@dataclass(frozen=True)
class ArchSpec:
    """Attribute paths inside a causal-LM model (dotted, from the top-level model).

    Attributes:
        blocks: the ``nn.ModuleList`` of decoder blocks.
        final_norm: the norm applied after the last block, before the LM head ("" when there is none).
        layer_count: the text-config attribute holding the number of blocks, under the model's own name.
        attention: the attention sub-module, relative to a block ("" when no block has one).
        mlp: the feed-forward sub-module, relative to a block.
        mlp_out: the MLP's output projection, relative to a block (``fold`` writes into it); "" when
            the MLP has no single dense output projection (mixture-of-experts, fused kernels).
        norms: the layer norms inside a block, relative to it.
        mlp_out_norm: the norm applied to the MLP output before the residual add ("" if none): no
            linear map folds into ``mlp_out`` through it.
    """

    blocks: str
    final_norm: str
    layer_count: str
    attention: str
    mlp: str
    mlp_out: str
    norms: tuple[str, ...]
    mlp_out_norm: str = ""


class _ArchTable(dict):
    """Overrides by ``model_type``; looking up any other type reads it from the type's default config."""

    def __missing__(self, model_type: str) -> ArchSpec:
        from prune.model.tiny import build_tiny  # transformers' model classes load only when asked

        # not stored: only real overrides live in the table, and arch_spec consults them first
        return discover_spec(build_tiny(model_type, device="meta"))


# Only architectures whose structure cannot be read; each says why.
ARCHITECTURES: dict[str, ArchSpec] = _ArchTable({
    # OPT's feed-forward is two bare Linear layers on the block (fc1, fc2), not a sub-module to find.
    "opt": ArchSpec(
        blocks="model.decoder.layers",
        final_norm="model.decoder.final_layer_norm",
        layer_count="num_hidden_layers",
        attention="self_attn",
        mlp="fc1",
        mlp_out="fc2",
        norms=("self_attn_layer_norm", "final_layer_norm"),
    ),
})

# Names of per-layer config entries known by heart; prune.model.surgery also finds unknown ones by shape.
PER_LAYER_CONFIG_LISTS = ("layer_types", "no_rope_layers")

_ATTENTION_NAMES = ("self_attn", "self_attention", "attention", "attn", "mixer_attn")
_MLP_NAMES = ("mlp", "feed_forward", "block_sparse_moe", "moe", "ffn", "ff", "mlp_block", "feedforward")
# Paths of the towers of multimodal models: their layer lists may have the text model's length.
_NON_TEXT_PARTS = ("vision", "visual", "image", "audio", "speech", "vqmodel", "vq_model", "projector", "tower",
                   "encoder", "mtp")
_LAYER_COUNT_NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers")
_SPEC_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# config fields of what some models apply to the logits after the head's matmul (Gemma 2's soft-capping, Cohere's and
# Granite's logit scales, Falcon-H1's multiplier): a model that sets one has logits that are not its head's product
# alone
AFTER_HEAD_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier")


def changes_logits_after_head(model_or_config) -> bool:
    """Whether the (text) config sets one of :data:`AFTER_HEAD_FIELDS` to anything but none or 1."""
    config = text_config(model_or_config)
    return any(getattr(config, name, None) not in (None, 1, 1.0) for name in AFTER_HEAD_FIELDS)


def text_config(model_or_config):
    """The config that describes the decoder blocks (the text config of a multimodal model)."""
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def is_dense(module: nn.Module) -> bool:
    """Whether ``module`` is one dense layer (``nn.Linear`` or GPT-2's ``Conv1D``)."""
    weight = getattr(module, "weight", None)
    return type(module).__name__ in ("Linear", "Conv1D") or (
        isinstance(module, nn.Linear) and weight is not None and weight.ndim == 2
    )


def _out_features(module: nn.Module) -> int:
    # nn.Linear stores [out, in]; GPT-2's Conv1D stores [in, out] and says nf
    return int(getattr(module, "out_features", None) or getattr(module, "nf", None) or module.weight.shape[0])


def layer_count_attribute(config, count: int | None = None) -> str | None:
    """The text-config attribute that holds the layer count under the model's own name (None if none)."""
    config = text_config(config)
    names = [config.attribute_map.get("num_hidden_layers", "num_hidden_layers"), *_LAYER_COUNT_NAMES]
    for name in dict.fromkeys(names):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and (count is None or value == count):
            return name
    return None


def _find_blocks(model: nn.Module, count: int) -> str | None:
    best, best_params = None, -1
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) != count or count == 0:
            continue
        if any(part in path.lower() for part in _NON_TEXT_PARTS):
            continue
        params = sum(p.numel() for p in module.parameters())
        # nested lists (experts of a block) hold fewer parameters than the list of blocks around them
        if params > best_params or (params == best_params and best is not None and len(path) < len(best)):
            best, best_params = path, params
    return best


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _final_norm(model: nn.Module, blocks_path: str) -> str:
    parent_path = _parent(blocks_path)
    parent = model.get_submodule(parent_path) if parent_path else model
    names = [name for name, _ in parent.named_children()]
    after = names[names.index(blocks_path.rsplit(".", 1)[-1]) + 1:] if blocks_path else names
    candidates = [n for n in after if _is_norm(getattr(parent, n))] or [
        n for n in names if _is_norm(getattr(parent, n)) and any(k in n for k in ("final", "norm_f", "ln_f", "norm"))
    ]
    if not candidates:
        return ""
    return f"{parent_path}.{candidates[-1]}" if parent_path else candidates[-1]


def _named_child(block: nn.Module, names: tuple[str, ...], fragments: tuple[str, ...]) -> str:
    children = dict(block.named_children())
    for name in names:
        if name in children and not _is_norm(children[name]) and list(children[name].parameters()):
            return name
    for name, child in children.items():
        if any(f in name.lower() for f in fragments) and not _is_norm(child) and list(child.parameters()):
            return name
    return ""


def _mlp_out(block: nn.Module, mlp: str, hidden: int) -> str:
    """The single dense layer of the MLP that writes the residual width ("" for experts or none)."""
    if not mlp:
        return ""
    module = block.get_submodule(mlp)
    if any(p.ndim >= 3 for p in module.parameters()) or any("expert" in n for n, _ in module.named_modules()):
        return ""  # experts: the output is a routed sum, no single projection
    if is_dense(module):
        return ""
    outs = [n for n, m in module.named_modules() if n and is_dense(m) and _out_features(m) == hidden]
    return f"{mlp}.{outs[0]}" if len(outs) == 1 else ""


def _first_with(blocks: nn.ModuleList, find) -> str:
    found = [find(block) for block in blocks]
    return next((f for f in found if f), "")


def _consistent(blocks: nn.ModuleList, path: str) -> bool:
    try:
        return all(block.get_submodule(path) is not None for block in blocks) if path else False
    except AttributeError:
        return False


def discover_spec(model: nn.Module) -> ArchSpec:
    """Read an ``ArchSpec`` off a model's structure.

    Raises:
        LayercutError: a structure layercut cannot prune (named in the message).
    """
    config = text_config(model)
    model_type = getattr(model.config, "model_type", "?")
    if getattr(model.config, "is_encoder_decoder", False):
        raise LayercutError(f"unsupported architecture '{model_type}': an encoder-decoder model, not a decoder")
    count_name = layer_count_attribute(config)
    if count_name is None:
        raise LayercutError(f"unsupported architecture '{model_type}': its config names no layer count")
    count = getattr(config, count_name)
    blocks_path = _find_blocks(model, count)
    if blocks_path is None:
        encoder = any("encoder" in p for p, m in model.named_modules() if isinstance(m, nn.ModuleList))
        reason = ("an encoder (bidirectional) model" if encoder else
                  f"no list of {count} blocks ({count_name}) outside the vision/audio towers")
        raise LayercutError(f"unsupported architecture '{model_type}': {reason}")
    blocks = model.get_submodule(blocks_path)
    parent = model.get_submodule(_parent(blocks_path)) if "." in blocks_path else model
    siblings = [n for n, m in parent.named_children() if isinstance(m, nn.ModuleList) and len(m) == count]
    if len(siblings) > 1:
        raise LayercutError(
            f"unsupported architecture '{model_type}': its blocks are split across parallel lists "
            f"({', '.join(siblings)}), not one module per block"
        )
    hidden = hidden_size(model)
    # hybrids: the softmax attention by its usual name wins over a linear-attention child of other blocks
    attention = _first_with(blocks, lambda b: _named_child(b, _ATTENTION_NAMES, ())) or _first_with(
        blocks, lambda b: _named_child(b, (), ("attn", "attention")))
    mlp = _first_with(blocks, lambda b: _named_child(b, _MLP_NAMES, ())) or _first_with(
        blocks, lambda b: _named_child(b, (), ("mlp", "feed_forward", "ffn", "moe")))
    outs = {_mlp_out(block, mlp, hidden) for block in blocks if mlp and hasattr(block, mlp)}
    mlp_out = outs.pop() if len(outs) == 1 else ""
    norms = tuple(name for name, child in blocks[0].named_children() if _is_norm(child))
    normed = [n for n in norms if any(k in n for k in ("post_feedforward", "post_mlp", "post_ffn", "ffn_post"))]
    return ArchSpec(
        blocks=blocks_path,
        final_norm=_final_norm(model, blocks_path),
        layer_count=count_name,
        attention=attention,
        mlp=mlp,
        mlp_out=mlp_out if _consistent(blocks, mlp_out) else "",
        norms=norms,
        mlp_out_norm=normed[0] if normed else "",
    )


def arch_spec(model_or_type: nn.Module | str) -> ArchSpec:
    """The adapter for a model (or a ``model_type`` string); a clear error if it cannot be pruned."""
    if isinstance(model_or_type, str):
        try:
            return ARCHITECTURES[model_or_type]
        except (LayercutError, ValueError, KeyError) as exc:
            reason = str(exc).split(": ", 1)[-1] if isinstance(exc, LayercutError) else "not a transformers model"
            raise LayercutError(
                f"unsupported architecture '{model_or_type}': {reason}; "
                "python -m prune.run --list-architectures lists what layercut supports"
            ) from None
    model_type = getattr(model_or_type.config, "model_type", "?")
    if dict.__contains__(ARCHITECTURES, model_type):
        return dict.__getitem__(ARCHITECTURES, model_type)
    spec = _SPEC_CACHE.get(model_or_type)
    if spec is None:
        try:
            spec = discover_spec(model_or_type)
        except LayercutError as exc:
            raise LayercutError(
                f"{exc}; python -m prune.run --list-architectures lists what layercut supports"
            ) from None
        _SPEC_CACHE[model_or_type] = spec
    return spec


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
    """The norm between the last block and the LM head (identity for models without one)."""
    spec = arch_spec(model)
    if not spec.final_norm:
        return nn.Identity()
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
    config = text_config(model)
    for name in ("hidden_size", "n_embd", "d_model"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    return int(model.get_input_embeddings().weight.shape[1])


# the attribute of a skeleton model (``prune.loading.offload``) holding where its blocks' weights are read from
OFFLOAD_ATTR = "_layercut_offload"


def is_offloaded(model: nn.Module) -> bool:
    """Whether ``model`` is a skeleton whose blocks are read from its checkpoint one at a time."""
    return getattr(model, OFFLOAD_ATTR, None) is not None


def input_device(model: nn.Module):
    """Device the token ids must be on (the embedding's device, also under a device_map)."""
    return model.get_input_embeddings().weight.device


def max_positions(model_or_config) -> int | None:
    """The longest sequence the model's (text) config allows, or None when the config does not say."""
    config = text_config(model_or_config)
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def config_layer_count(config) -> int | None:
    """The number of blocks a (text) config declares, under its architecture's own name; None if unknown."""
    config = text_config(config)
    override = dict.get(ARCHITECTURES, getattr(config, "model_type", None))
    name = override.layer_count if override is not None else layer_count_attribute(config)
    value = getattr(config, name, None) if name else None
    return value if isinstance(value, int) else None


def cache_keyword(model) -> str:
    """The name ``model.forward`` takes its KV cache under, which its output also uses.

    transformers 5.x renamed ``past_key_values`` to ``cache`` and warns (a ``FutureWarning`` each call)
    on the old name; older releases know only ``past_key_values``. The signature says which one this
    model's forward reads.
    """
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
