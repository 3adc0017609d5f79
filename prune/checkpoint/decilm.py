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
  ``intermediate_size`` that is a multiple of 256 has an exact ``ffn_mult`` (``ffn_mult_for``);
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
(byte-fallback) ``tokenizer.json`` only. The config itself (``ffn_mult_for``, ``decilm_config``) and the limits of
llama.cpp it meets (``why_not`` of its serving entry) are :mod:`prune.checkpoint.decilm_config`; this module
writes the folder.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch

from prune.atomic import atomic_directory, write_json
from prune.checkpoint.decilm_config import (
    CONFIG_CODE_FILE,
    FFN_MULTIPLE,
    LLAMACPP,
    decilm_config,
    decilm_serving,
)
from prune.checkpoint.report import REPORT_FILE, read_report, stamped, upgrade_records
from prune.errors import LayercutError
from prune.loading.loader import check_safetensors, damaged
from prune.model import remote_code as hf_remote_code

logger = logging.getLogger(__name__)

# files copied as they are: the tokenizer's, and the generation defaults that vLLM reads
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                "spiece.model", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                "chat_template.json", "generation_config.json")
_ATTENTION = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight")
_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_ATTENTION_NORM, _MLP_NORM = "input_layernorm.weight", "post_attention_layernorm.weight"
_OUTSIDE_BLOCKS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


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
    records = upgrade_records(base.get(hf_remote_code.RECORDS_KEY) or [])  # config.json has no format number
    maps = [r for r in records if isinstance(r, dict) and r.get("maps")]
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
    why_not = serving.get("why_not", {}).get(LLAMACPP)
    llama_cpp = (f"not exact: {why_not}." if why_not
                 else "`python convert_hf_to_gguf.py " + name + "` converts it (its `deci` architecture).")
    (staging / "README.md").write_text(text + _CARD_NOTE.format(name=name, llama_cpp=llama_cpp), encoding="utf-8")


def write_decilm(src: str | Path, out: str | Path, overwrite: bool = False, llama_cpp: bool = False) -> Path:
    """Write a layercut sub-layer checkpoint as a DeciLM-layout folder that vLLM and llama.cpp serve, atomically.

    The folder holds the DeciLM ``config.json`` (``decilm_config``) and ``configuration_decilm.py``,
    the source's tensors under their Llama names less those of the removed sub-layers and their norms
    (sharded as the source was), its tokenizer and generation files, its model card with a note, and its
    ``layercut.json`` with ``serving`` set by ``decilm_serving`` (both of :mod:`prune.checkpoint.decilm_config`).

    Args:
        src: a folder written by ``prune.run --unit attention,mlp`` (or ``prune.checkpoint.save_load.save``).
        out: the destination folder.
        overwrite: replace a non-empty ``out``.
        llama_cpp: write removed MLPs as zero MLPs of width 256 (see ``decilm_config``), so that
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
        write_json(staging / REPORT_FILE, stamped({**report, "serving": serving, "decilm_source": str(src)}))
        _write_card(src, staging, out.name, serving)
    logger.info("wrote the DeciLM layout of %s to %s", src, out)
    return out
