"""Sub-layer removals as the DeciLM layout, which vLLM and llama.cpp serve.

    python -m prune.decilm slim/ --out slim-decilm/ [--llama-cpp] [--overwrite]
    vllm serve slim-decilm/ --trust-remote-code

A checkpoint with attention or MLP sub-layers removed alone (``prune.run --unit attention,mlp``) is a
layercut checkpoint: no transformers architecture leaves a sub-layer out. NVIDIA's Nemotron-NAS models
(Llama-3.1-Nemotron-51B, Llama-3.3-Nemotron-Super-49B) do, in a layout that serving engines run:
``architectures: ["DeciLMForCausalLM"]``, ``model_type: "nemotron-nas"`` and one ``block_configs`` entry
per layer, ``{"attention": {"no_op", "replace_with_linear", "n_heads_in_group"}, "ffn": {"no_op",
"replace_with_linear", "ffn_mult"}}``. vLLM (``nemotron_nas.py``) and llama.cpp (``conversion/deci.py``
and its ``deci`` graph) read it as follows, and this module writes it to match:

* a no-op attention or FFN has no tensors at all, its RMSNorm included (vLLM builds no
  ``input_layernorm`` / ``post_attention_layernorm`` for it, llama.cpp no ``attn_norm`` / ``ffn_norm``);
* an FFN's width is ``int(2 * ffn_mult * hidden_size / 3)`` rounded up to a multiple of 256, so only an
  ``intermediate_size`` that is a multiple of 256 has an exact ``ffn_mult`` (:func:`ffn_mult_for`);
* an attention's KV heads are ``num_attention_heads // n_heads_in_group``.

transformers has no DeciLM architecture: NVIDIA's checkpoints carry their modeling code for
``trust_remote_code``, and engines read their config through transformers' ``AutoConfig`` with remote code.
The folder written here carries layercut's own ``configuration_decilm.py`` (a ``LlamaConfig`` whose
``block_configs`` read as attributes, as vLLM reads them) and no modeling code: vLLM needs
``--trust-remote-code``, llama.cpp's converter reads ``config.json`` itself, and transformers cannot build
the model (``prune.load`` the layercut checkpoint it came from instead).

llama.cpp's limits, found in its code: a layer whose FFN is a no-op is skipped whole there, attention
included, so an MLP removed alone is written as a zero MLP of width 256 for it (``--llama-cpp``; exact,
and vLLM runs it too); its converter takes the head size as ``hidden_size / num_attention_heads`` and
writes only llama3 RoPE scaling; and for a vocabulary other than Llama 3's it reads a Llama-2 style
(byte-fallback) ``tokenizer.json`` only. :func:`decilm_serving` says which engines run a given config.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from prune.atomic import atomic_directory, write_json
from prune.checkpoint.write import REPORT_FILE, read_report
from prune.errors import LayercutError
from prune.loading.loader import check_safetensors, damaged
from prune.model import remote_code as hf_remote_code

logger = logging.getLogger(__name__)

ARCHITECTURE = "DeciLMForCausalLM"
MODEL_TYPE = "nemotron-nas"
CONFIG_CODE_FILE = "configuration_decilm.py"
AUTO_MAP = {"AutoConfig": "configuration_decilm.DeciLMConfig"}
FAMILY = ("llama", "mistral")  # the engines' DeciLM blocks are Llama blocks; Mistral without a window is one
FFN_MULTIPLE = 256  # both engines round an FFN's width up to a multiple of this
LLAMA_CPP_ROPE = (None, "default", "llama3")  # the RoPE types llama.cpp's DeciLM converter writes
# files copied as they are: the tokenizer's, and the generation defaults that vLLM reads
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                "spiece.model", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                "chat_template.json", "generation_config.json")
_ATTENTION = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight")
_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_ATTENTION_NORM, _MLP_NORM = "input_layernorm.weight", "post_attention_layernorm.weight"
_OUTSIDE_BLOCKS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
_FIX = "load it with prune.load, or remove whole blocks (--unit block) for a plain checkpoint"


# ----------------------------------------------------------------------------------------------------------------
# Config


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
    """``layercut.json``'s ``serving`` entry for a DeciLM folder with this config: the engines that run it exactly."""
    limits = llama_cpp_limits(config)
    entry = {"layout": "decilm", "engines": ["vllm"] + ([] if limits else ["llama.cpp"]), "vllm": True,
             "llama_cpp": not limits,
             "why": "removed sub-layers are no-op entries of block_configs (DeciLMForCausalLM, Nemotron-NAS)",
             "serve": "vllm serve FOLDER --trust-remote-code; llama.cpp: convert_hf_to_gguf.py FOLDER"}
    if limits:
        entry["llama_cpp_why_not"] = "; ".join(limits)
    return entry


# The configuration file the folder carries: layercut's own, written for this layout (transformers only).
CONFIG_CODE = '''"""DeciLM (Nemotron-NAS) configuration by layercut: a Llama config with per-layer ``block_configs``.

Each ``block_configs`` entry reads as attributes (``config.block_configs[i].attention.no_op``,
``.ffn.ffn_mult``), as vLLM's ``nemotron_nas`` model reads it, and is written back as a plain dict.
There is no modeling code here: serve the folder with vLLM (``--trust-remote-code``) or llama.cpp.
"""

from transformers import LlamaConfig


class SubLayerConfig:
    """One sub-layer's entry (``attention`` or ``ffn``): exactly the keys of its dict, as attributes."""

    def __init__(self, values):
        self.__dict__.update(dict(values))

    def to_dict(self):
        """The entry as ``config.json`` holds it."""
        return dict(self.__dict__)

    def __eq__(self, other):
        return isinstance(other, SubLayerConfig) and self.__dict__ == other.__dict__

    def __repr__(self):
        return f"SubLayerConfig({self.__dict__})"


class BlockConfig:
    """One layer's entry: its ``attention`` and ``ffn``."""

    def __init__(self, attention, ffn, **extra):
        self.attention = attention if isinstance(attention, SubLayerConfig) else SubLayerConfig(attention)
        self.ffn = ffn if isinstance(ffn, SubLayerConfig) else SubLayerConfig(ffn)
        self.__dict__.update(extra)

    def to_dict(self):
        """The entry as ``config.json`` holds it."""
        return {key: value.to_dict() if isinstance(value, SubLayerConfig) else value
                for key, value in self.__dict__.items()}

    def __eq__(self, other):
        return isinstance(other, BlockConfig) and self.to_dict() == other.to_dict()

    def __repr__(self):
        return f"BlockConfig({self.to_dict()})"


class DeciLMConfig(LlamaConfig):
    """A Llama config whose layers may lack their attention or FFN (``block_configs[i].*.no_op``)."""

    model_type = "nemotron-nas"

    def __init__(self, block_configs=None, **kwargs):
        self.block_configs = [b if isinstance(b, BlockConfig) else BlockConfig(**b) for b in block_configs or []]
        super().__init__(**kwargs)

    def to_dict(self):
        """The ``config.json`` dict, ``block_configs`` as plain dicts."""
        output = super().to_dict()
        output["block_configs"] = [b.to_dict() if isinstance(b, BlockConfig) else b for b in self.block_configs]
        return output
'''


# ----------------------------------------------------------------------------------------------------------------
# Folder


def _source_config(src: Path) -> tuple[dict, list[dict]]:
    """The plain model's config dict and its removal records, from a layercut sub-layer checkpoint folder."""
    config_file = src / "config.json"
    if not config_file.is_file():
        raise LayercutError(f"{src} is not a checkpoint folder (no config.json): pass the folder prune.run wrote")
    if (src / hf_remote_code.MAPS_FILE).is_file():
        raise LayercutError(f"{src} carries replacement maps ({hf_remote_code.MAPS_FILE}), which no DeciLM engine "
                            "runs: export --replace fold, --replace none or the magcomp recipe for a plain checkpoint")
    try:
        wrapped = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise damaged(config_file, f"not valid JSON: {getattr(err, 'msg', 'not UTF-8 text')}") from None
    if not isinstance(wrapped, dict) or not hf_remote_code.is_wrapped(wrapped):
        model_type = wrapped.get("model_type") if isinstance(wrapped, dict) else None
        raise LayercutError(f"{src} is not a layercut sub-layer checkpoint (model_type {model_type!r}): a plain "
                            "checkpoint needs no DeciLM layout, vLLM and llama.cpp serve it as it is")
    base = hf_remote_code.unwrap_config_dict(wrapped)
    maps = [r for r in base.get(hf_remote_code.RECORDS_KEY) or []
            if isinstance(r, dict) and (r.get("maps") or r.get("method", r.get("kind")) in hf_remote_code.MAP_TYPES)]
    if maps:
        raise LayercutError(f"{src} records replacement maps, which no DeciLM engine runs: export --replace fold, "
                            "--replace none or the magcomp recipe for a plain checkpoint")
    records = hf_remote_code.sublayer_records(base)
    if not records:
        raise LayercutError(f"{src} records no removed sub-layers ({hf_remote_code.SUBLAYERS_KEY}): a plain "
                            "checkpoint needs no DeciLM layout, vLLM and llama.cpp serve it as it is")
    return base, records


def _weight_files(src: Path) -> tuple[dict[str, str], bool]:
    """Tensor name -> file name, and whether the folder is sharded (has an index)."""
    from safetensors import safe_open

    index = src / "model.safetensors.index.json"
    if index.is_file():
        try:
            return dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"]), True
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise damaged(index, "no readable weight_map") from None
    single = src / "model.safetensors"
    if not single.is_file():
        raise LayercutError(f"{src} has no model.safetensors: the DeciLM export copies safetensors weights; "
                            "re-export the checkpoint with prune.run")
    check_safetensors(single)
    with safe_open(str(single), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single.name), False


def _plan(config: dict, names: set[str], zero_blocks: set[int], src: Path) -> tuple[set[str], dict[str, int]]:
    """The source tensors to copy, and the zero MLP tensors to make (name -> block); refuses any mismatch."""
    copied, dropped, made = set(), set(), {}
    for block in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{block}."
        entry = config["block_configs"][block]
        attention, ffn = not entry["attention"]["no_op"], not entry["ffn"]["no_op"]
        copied |= {prefix + s for s in ((_ATTENTION_NORM, *_ATTENTION) if attention else ())}
        copied |= {prefix + s for s in ((_MLP_NORM,) + (() if block in zero_blocks else _MLP) if ffn else ())}
        dropped |= {prefix + _ATTENTION_NORM} if not attention else set()
        dropped |= {prefix + _MLP_NORM} if not ffn else set()
        made.update({prefix + s: block for s in _MLP} if block in zero_blocks else {})
    copied |= {name for name in _OUTSIDE_BLOCKS if name in names}
    missing = sorted((copied | {"model.embed_tokens.weight", "model.norm.weight"}) - names)
    if missing:
        raise LayercutError(f"{src} lacks the tensor {missing[0]} that its config needs: the folder's files do not "
                            "belong together; re-export the checkpoint with prune.run")
    extra = sorted(names - copied - dropped)
    if extra:
        raise LayercutError(f"{src} holds the tensor {extra[0]}, which the DeciLM layout has no place for (a removed "
                            "sub-layer's weights, or not a Llama checkpoint): re-export the checkpoint with prune.run")
    return copied, made


def _write_weights(src: Path, staging: Path, config: dict, zero_blocks: set[int]) -> dict[str, str]:
    """Copy the kept tensors file by file (one source file in memory at a time); returns name -> file written."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    files, sharded = _weight_files(src)
    copied, made = _plan(config, set(files), zero_blocks, src)
    hidden = config["hidden_size"]
    written: dict[str, str] = {}
    for file in sorted(set(files.values())):
        path = src / file
        check_safetensors(path)
        with safe_open(str(path), framework="pt") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys() if name in copied}
        for name, block in made.items():  # beside the norm of their block, in its dtype
            norm = tensors.get(f"model.layers.{block}.{_MLP_NORM}")
            if norm is not None:
                shape = (hidden, FFN_MULTIPLE) if name.endswith("down_proj.weight") else (FFN_MULTIPLE, hidden)
                tensors[name] = torch.zeros(shape, dtype=norm.dtype)  # [out, in]: adds exactly nothing
        if tensors:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(staging / file), metadata={"format": "pt"})
            written.update(dict.fromkeys(tensors, file))
    if sharded:
        index = {"metadata": {}, "weight_map": dict(sorted(written.items()))}
        write_json(staging / "model.safetensors.index.json", index)
    return written


_CARD_NOTE = """
## This folder: the DeciLM layout

This is the DeciLM (Nemotron-NAS, `DeciLMForCausalLM`) layout of the layercut checkpoint described above:
its removed sub-layers are no-op entries of `block_configs` in `config.json`, with no weights. The loading
instructions above are the source checkpoint's; this folder serves as it is:

```bash
vllm serve {name} --trust-remote-code   # reads configuration_decilm.py (layercut's own, no modeling code)
```

llama.cpp: {llama_cpp}
transformers has no DeciLM model: `prune.load` the source checkpoint instead.
"""


def _write_card(src: Path, staging: Path, name: str, serving: dict) -> None:
    card = src / "README.md"
    text = card.read_text(encoding="utf-8") if card.is_file() else f"# {name}\n"
    llama_cpp = ("`python convert_hf_to_gguf.py " + name + "` converts it (its `deci` architecture)."
                 if serving["llama_cpp"] else f"not exact: {serving['llama_cpp_why_not']}.")
    (staging / "README.md").write_text(text + _CARD_NOTE.format(name=name, llama_cpp=llama_cpp), encoding="utf-8")


def write_decilm(src: str | Path, out: str | Path, overwrite: bool = False, llama_cpp: bool = False) -> Path:
    """Write a layercut sub-layer checkpoint as a DeciLM-layout folder that vLLM and llama.cpp serve, atomically.

    The folder holds the DeciLM ``config.json`` (:func:`decilm_config`) and ``configuration_decilm.py``,
    the source's tensors under their Llama names less those of the removed sub-layers and their norms
    (sharded as the source was), its tokenizer and generation files, its model card with a note, and its
    ``layercut.json`` with ``serving`` set by :func:`decilm_serving`.

    Args:
        src: a folder written by ``prune.run --unit attention,mlp`` (or ``prune.checkpoint.save_load.save``).
        out: the destination folder.
        overwrite: replace a non-empty ``out``.
        llama_cpp: write removed MLPs as zero MLPs of width 256 (see :func:`decilm_config`), so that
            llama.cpp runs the folder exactly too.

    Raises:
        LayercutError: one line: not a sub-layer checkpoint, replacement maps, a model the layout cannot
            hold, tensors that disagree with the config, or ``out`` is ``src``.
    """
    src, out = Path(src).expanduser(), Path(out).expanduser()
    if out.resolve() == src.resolve():
        raise LayercutError(f"--out {out} is the source folder: choose another folder for the DeciLM layout")
    base, records = _source_config(src)
    config = decilm_config(base, records, zero_mlps=llama_cpp)
    zero_blocks = {r["block"] for r in records if r["kind"] == "mlp"} if llama_cpp else set()
    serving = decilm_serving(config)
    report = read_report(src)
    with atomic_directory(out, overwrite) as staging:
        _write_weights(src, staging, config, zero_blocks)
        write_json(staging / "config.json", config)
        (staging / CONFIG_CODE_FILE).write_text(CONFIG_CODE, encoding="utf-8")
        for name in COPIED_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, staging / name)
        write_json(staging / REPORT_FILE, {**report, "serving": serving, "decilm_source": str(src)})
        _write_card(src, staging, out.name, serving)
    logger.info("wrote the DeciLM layout of %s to %s", src, out)
    return out
