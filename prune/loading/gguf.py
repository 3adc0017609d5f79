"""GGUF files as plain checkpoints: dequantized once by transformers, cached as float32 safetensors.

A ``.gguf`` file is converted on first use into a folder under :func:`cache_dir` that any tool loads with
``AutoModelForCausalLM.from_pretrained(folder)``; later loads read that folder. The folder is written beside
its final place and renamed into it, so a crash or a concurrent conversion never leaves a half-written copy.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import mmap
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from prune.errors import LayercutError
from prune.loading.names import EMBEDDED_MODEL, embedded_gguf_path, find_embedded_gguf
from prune.loading.tokenizer import TOKENIZER_FILES, set_pad_token
from prune.model.adapters import max_positions

if TYPE_CHECKING:  # transformers is imported where it is used: it costs seconds at start-up
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

# The GGUF weights are dequantized exactly into float32 (Q4_1/Q8_0 values are scale * int + offset with float16
# scales, which bfloat16 would round), so the cached copy is float32; `dtype=` casts at load time.
CONVERTED_DTYPE = torch.float32
_MARKER = "layercut-source.json"  # written last inside a converted folder; its presence means "complete"


def cache_dir() -> Path:
    """Folder for converted checkpoints: ``$LAYERCUT_CACHE`` or ``~/.cache/layercut`` (not created here)."""
    env = os.environ.get("LAYERCUT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "layercut"


def is_converted(folder: Path) -> bool:
    """Whether ``folder`` holds a finished conversion (its marker is written last)."""
    return (folder / _MARKER).is_file() and (folder / "config.json").is_file()


def gguf_target(gguf: Path) -> Path:
    """Cache folder for a GGUF file: a fixed one for the embedded model, else keyed by name, size and mtime."""
    if gguf == find_embedded_gguf():
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
    target = gguf_target(gguf)
    if not is_converted(target):
        check_gguf_file(gguf)
        _convert_gguf(gguf, target)
    return target


# fixed-size GGUF metadata value types (u8, i8, u16, i16, u32, i32, f32, bool, u64, i64, f64) and their widths;
# 8 is a string, 9 an array
_VALUE_WIDTH = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class _CutShort(Exception):
    """The header of a GGUF file runs past its end."""


def _gguf_bytes_needed(blob: mmap.mmap) -> int:
    """Bytes a whole GGUF file has, by its header: the aligned tensor table's end plus the last tensor's end."""
    import gguf

    def take(fmt: str) -> tuple:
        nonlocal pos
        values = struct.unpack_from(fmt, blob, pos)
        pos += struct.calcsize(fmt)
        return values

    def skip_string() -> None:
        nonlocal pos
        (length,) = take("<Q")
        pos += length

    pos = 4
    _, tensors, fields = take("<IQQ")
    alignment = 32  # llama.cpp's default, unless general.alignment says otherwise
    for _ in range(fields):
        (length,) = take("<Q")
        key = bytes(blob[pos:pos + length])
        pos += length
        (kind,) = take("<I")
        if kind == 9:
            kind, count = take("<IQ")
            if kind in _VALUE_WIDTH:
                pos += count * _VALUE_WIDTH[kind]
            else:
                for _ in range(count):
                    skip_string()
                    if pos > len(blob):
                        raise _CutShort
        elif kind == 8:
            skip_string()
        elif key == b"general.alignment" and kind == 4:
            (alignment,) = take("<I")
        else:
            pos += _VALUE_WIDTH[kind]
        if pos > len(blob):
            raise _CutShort
    ends = []
    for _ in range(tensors):
        skip_string()
        (dims,) = take("<I")
        shape = take(f"<{min(dims, 8)}Q")
        kind, offset = take("<IQ")
        block, size = gguf.GGML_QUANT_SIZES.get(kind, (1, 0))  # a type this gguf does not know: its offset only
        ends.append(offset + math.prod(shape) // block * size)
    return (pos + alignment - 1) // alignment * alignment + max(ends, default=0)


def check_gguf_file(path: Path) -> None:
    """Fail in one line when a ``.gguf`` file is cut short (an interrupted download or copy).

    The header gives every tensor's offset and size, so the bytes a whole file has are known before
    transformers reads it (and fails on a truncated file with a numpy reshape error); flipped bytes inside
    a tensor carry no checksum and pass.

    Raises:
        LayercutError: the file is not a GGUF file, its header is unreadable or it is shorter than its header says.
    """
    size = path.stat().st_size
    fix = "download it again (or copy it whole)"
    with path.open("rb") as handle:
        if handle.read(4) != b"GGUF":
            raise LayercutError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes): "
                                f"{fix}" if size else f"{path} is empty: {fix}")
        try:
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as blob:
                needed = _gguf_bytes_needed(blob)
        except (_CutShort, struct.error, KeyError, ValueError, OverflowError, MemoryError):
            raise LayercutError(f"{path} is damaged or truncated (its header is cut short or unreadable at "
                                f"{size:,} bytes): {fix}") from None
    if needed > size:
        raise LayercutError(f"{path} is damaged or truncated (cut short: {size:,} of its {needed:,} bytes): {fix}")


def embedded_model_dir() -> Path:
    """Return the converted safetensors copy of the embedded SmolLM2-135M-Instruct (made on first call)."""
    target = cache_dir() / EMBEDDED_MODEL
    if is_converted(target):
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to a float32 safetensors checkpoint in %s (once)", gguf, target)
    start = time.perf_counter()
    with _alone(gguf) as folder:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=gguf.name, dtype=CONVERTED_DTYPE, **_gguf_model_kwargs()
        )
    _make_saveable(model)
    set_pad_token(tokenizer)
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


@contextlib.contextmanager
def _alone(gguf: Path) -> Iterator[Path]:
    """A folder holding ``gguf`` and no other file: its parent when that holds no checkpoint files, else a link.

    transformers reads ``gguf_file=`` against its folder: a ``tokenizer.json`` there replaces the GGUF's own
    tokenizer, and its chat template and special tokens are then read from neither (a GGUF written inside the
    checkpoint folder it came from, or one from a repository that ships both).
    """
    if not any((gguf.parent / name).is_file() for name in (*TOKENIZER_FILES, "config.json")):
        yield gguf.parent
        return
    with tempfile.TemporaryDirectory(prefix="layercut-gguf-") as scratch:
        try:
            (Path(scratch) / gguf.name).symlink_to(gguf)
        except OSError:  # no symbolic links here (some Windows setups): read it where it is
            logger.warning("%s sits beside tokenizer files that transformers reads instead of its own", gguf)
            yield gguf.parent
            return
        yield Path(scratch)


def _publish(tmp: Path, target: Path) -> None:
    """Rename a finished folder into place; if another process got there first, keep theirs."""
    if target.exists() and not is_converted(target):
        # a stale folder that is not ours (e.g. hand-made); it is never a half-written one of ours
        shutil.rmtree(target, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:
        if not is_converted(target):
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

