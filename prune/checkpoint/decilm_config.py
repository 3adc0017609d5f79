"""The DeciLM (Nemotron-NAS) config of a checkpoint with removed sub-layers, and whether that layout holds them.

What the engines' DeciLM accepts is set out in :mod:`prune.checkpoint.decilm`, which writes the folder. This
module is the config alone (no file is read or written), so that reading a checkpoint's report
(:mod:`prune.checkpoint.report`) can ask whether a sub-layer checkpoint fits the layout without importing the writer.
"""

from __future__ import annotations

from prune.errors import LayercutError
from prune.model import remote_code as hf_remote_code
from prune.model.layouts import DECILM, LAYERCUT

ARCHITECTURE = "DeciLMForCausalLM"
MODEL_TYPE = "nemotron-nas"
CONFIG_CODE_FILE = "configuration_decilm.py"
AUTO_MAP = {"AutoConfig": "configuration_decilm.DeciLMConfig"}
FAMILY = ("llama", "mistral")  # the engines' DeciLM blocks are Llama blocks; Mistral without a window is one
FFN_MULTIPLE = 256  # both engines round an FFN's width up to a multiple of this
LLAMA_CPP_ROPE = (None, "default", "llama3")  # the RoPE types llama.cpp's DeciLM converter writes
# the engine whose converter llama_cpp_limits reads, by its name in eval.speed.engines: a serving entry's why_not key
LLAMACPP = "llamacpp"
_FIX = "load it with prune.load, or remove whole blocks (--unit block) for a plain checkpoint"



def ffn_width(ffn_mult: float, hidden_size: int) -> int:
    """The FFN width both engines give a DeciLM layer: ``int(2 * ffn_mult * hidden / 3)``, up to 256's multiple."""
    width = int(2 * ffn_mult * hidden_size / 3)
    return -(-width // FFN_MULTIPLE) * FFN_MULTIPLE


def ffn_mult_for(intermediate_size: int, hidden_size: int) -> float | None:
    """The shortest ``ffn_mult`` whose :func:`ffn_width` is exactly ``intermediate_size``; None when none is."""
    exact = 3 * intermediate_size / (2 * hidden_size)
    for candidate in [*(round(exact, digits) for digits in range(1, 8)), exact]:
        if ffn_width(candidate, hidden_size) == intermediate_size:
            return candidate
    return None


def _size(base: dict, key: str) -> int:
    value = base.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise LayercutError(f"the config has no positive integer {key} (got {value!r}), which the DeciLM layout "
                            f"needs: {_FIX}")
    return value


def _check_family(base: dict) -> None:
    """Refuse, in one line, a config whose blocks are not the Llama blocks that the engines' DeciLM runs."""
    model_type = base.get("model_type")
    if model_type not in FAMILY:
        raise LayercutError(f"the DeciLM layout that vLLM and llama.cpp serve holds Llama blocks, not "
                            f"{model_type!r} ones: {_FIX}")
    if base.get("sliding_window"):
        raise LayercutError(f"{model_type} with sliding-window attention ({base['sliding_window']} tokens) does not "
                            f"fit the DeciLM layout (full attention only): {_FIX}")
    if base.get("attention_bias") or base.get("mlp_bias"):
        raise LayercutError(f"attention/MLP biases (attention_bias, mlp_bias) are not part of layercut's DeciLM "
                            f"export: {_FIX}")
    if base.get("hidden_act", "silu") != "silu":
        raise LayercutError(f"hidden_act {base['hidden_act']!r}: the DeciLM engines run SiLU MLPs only: {_FIX}")


def _removed(records: list[dict], blocks: int) -> dict[int, set[str]]:
    """Block -> kinds removed alone, with every record checked against the config."""
    removed: dict[int, set[str]] = {}
    modules = {"attention": "self_attn", "mlp": "mlp"}
    for record in records:
        block, kind = record.get("block"), record.get("kind")
        if kind not in modules or record.get("module", modules[kind]) != modules[kind] or not isinstance(block, int):
            raise LayercutError(f"{hf_remote_code.SUBLAYERS_KEY} entry {record} is not a Llama attention (self_attn) "
                                "or MLP (mlp) removal: mismatched config; re-export the checkpoint")
        if not 0 <= block < blocks:
            raise LayercutError(f"{hf_remote_code.SUBLAYERS_KEY} names block {block} but the config has {blocks} "
                                "blocks: mismatched config; re-export the checkpoint")
        if kind in removed.setdefault(block, set()):
            raise LayercutError(f"{hf_remote_code.SUBLAYERS_KEY} names {block}.{kind} twice: mismatched config; "
                                "re-export the checkpoint")
        removed[block].add(kind)
    both = sorted(b for b, kinds in removed.items() if len(kinds) == 2)
    if both:
        raise LayercutError(f"block {both[0]} has both its attention and its MLP removed, which layercut removes as a "
                            "whole block (prune.selection.sublayers.remove_units_): re-run the pruning")
    if "attention" in removed.get(0, ()):
        raise LayercutError("block 0's attention is removed, but vLLM's DeciLM needs the first block's attention "
                            "(layercut keeps it for the KV cache): re-run the pruning")
    return removed


def decilm_config(base: dict, records: list[dict], zero_mlps: bool = False) -> dict:
    """The DeciLM (Nemotron-NAS) ``config.json`` of a Llama-family model with these sub-layers removed.

    Every key of ``base`` is kept except the removal records (``block_configs`` holds them now); the
    architecture, ``model_type``, ``auto_map`` (to :data:`CONFIG_CODE_FILE`) and ``block_configs`` are set.
    Engines read this config with remote code (vLLM: ``--trust-remote-code``); see the module docstring.

    Args:
        base: the plain model's ``config.json`` dict (``model_type`` "llama", or "mistral" without a
            sliding window), e.g. ``prune.model.remote_code.unwrap_config_dict`` of a layercut checkpoint's.
        records: the removed sub-layers, ``[{"block", "kind", "module", "returns"}, ...]`` as
            ``prune.selection.sublayers.remove_units_`` records them (current block numbering).
        zero_mlps: write each removed MLP as a zero MLP of width 256 (``ffn_mult`` giving 256, not a
            no-op): llama.cpp skips a whole layer whose FFN is a no-op, attention included.

    Raises:
        LayercutError: one line naming the fix, when the engines' DeciLM cannot hold the model exactly
            (another family, a sliding window, biases, a non-SiLU MLP, an ``intermediate_size`` that no
            ``ffn_mult`` gives, a block with both sub-layers removed, block 0's attention removed).
    """
    _check_family(base)
    hidden, heads = _size(base, "hidden_size"), _size(base, "num_attention_heads")
    blocks, intermediate = _size(base, "num_hidden_layers"), _size(base, "intermediate_size")
    kv_heads = base.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise LayercutError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}: "
                            f"{_FIX}")
    ffn_mult = ffn_mult_for(intermediate, hidden)
    if ffn_mult is None:
        raise LayercutError(f"intermediate_size {intermediate} is no DeciLM ffn_mult's width (vLLM and llama.cpp "
                            f"round int(2 * ffn_mult * {hidden} / 3) up to a multiple of {FFN_MULTIPLE}): {_FIX}")
    removed = _removed(records, blocks)
    zero_mult = ffn_mult_for(FFN_MULTIPLE, hidden)
    block_configs = []
    for block in range(blocks):
        no_attention = "attention" in removed.get(block, ())
        no_mlp = "mlp" in removed.get(block, ())
        attention = {"no_op": no_attention, "replace_with_linear": False,
                     "n_heads_in_group": None if no_attention else heads // kv_heads}
        ffn = {"no_op": no_mlp and not zero_mlps, "replace_with_linear": False,
               "ffn_mult": (zero_mult if zero_mlps else None) if no_mlp else ffn_mult}
        block_configs.append({"attention": attention, "ffn": ffn})
    config = {key: value for key, value in base.items() if key != hf_remote_code.SUBLAYERS_KEY}
    config.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE, auto_map=dict(AUTO_MAP),
                  block_configs=block_configs)
    return config


def _rope_type(config: dict) -> str | None:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None


def llama_cpp_limits(config: dict) -> list[str]:
    """Why llama.cpp would run a DeciLM config wrong, from its converter and graph; [] when it runs it exactly."""
    limits = []
    if any(b["ffn"]["no_op"] and not b["attention"]["no_op"] for b in config["block_configs"]):
        limits.append("llama.cpp skips a whole layer whose FFN is a no-op, attention included: write the folder "
                      "with --llama-cpp (removed MLPs as zero MLPs of width 256)")
    head_dim = config.get("head_dim")
    if head_dim and head_dim * config["num_attention_heads"] != config["hidden_size"]:
        limits.append(f"llama.cpp's DeciLM converter takes the head size as hidden_size / num_attention_heads, not "
                      f"head_dim {head_dim}")
    if _rope_type(config) not in LLAMA_CPP_ROPE:
        limits.append(f"llama.cpp's DeciLM converter writes no {_rope_type(config)} RoPE scaling")
    return limits


def decilm_serving(config: dict) -> dict:
    """``layercut.json``'s ``serving`` entry for a DeciLM folder with this config; ``why_not`` where llama.cpp errs.

    The engines that run the layout are theirs to say (``eval.speed.engines``); llama.cpp's converter limits
    are a fact of this config, under ``why_not`` by that engine's name.
    """
    entry = {"layout": DECILM,
             "why": "removed sub-layers are no-op entries of block_configs (DeciLMForCausalLM, Nemotron-NAS)",
             "serve": "vllm serve FOLDER --trust-remote-code; llama.cpp: convert_hf_to_gguf.py FOLDER"}
    limits = llama_cpp_limits(config)
    if limits:
        entry["why_not"] = {LLAMACPP: "; ".join(limits)}
    return entry


def sublayer_refusal(config: dict) -> str | None:
    """Why the DeciLM layout cannot hold this config's sub-layer removals (None: it can)."""
    try:
        decilm_config(config, hf_remote_code.sublayer_records(config))
    except LayercutError as err:
        return str(err)
    return None


def sublayer_layout(config: dict) -> str:
    """``decilm`` when the engines' DeciLM layout can hold these sub-layer removals, else ``layercut``."""
    return DECILM if sublayer_refusal(config) is None else LAYERCUT
