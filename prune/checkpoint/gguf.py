"""A servable checkpoint folder as one GGUF file for llama.cpp, written by llama.cpp's own converter.

    python -m prune.export_gguf slim/ [--out slim.gguf] [--outtype f32|f16|bf16|q8_0|q4_k_m] [--converter PATH]
    python -m prune.run --model smollm2-135m --drop 4 --replace fold --out slim/ --export gguf

The conversion is llama.cpp's ``convert_hf_to_gguf.py`` (it knows each architecture's tensor names,
permutations and tokenizer metadata; layercut does not re-implement it). It is not on PyPI as a
module: point ``--converter`` (or ``LLAMA_CPP_CONVERTER``) at the script in a llama.cpp checkout or
in the ``vendor/llama.cpp`` folder of the ``llama-cpp-python`` source distribution. It needs
``sentencepiece`` (``pip install 'layercut[gguf]'``).

What layercut adds around it:

* a checkpoint no engine runs (replacement maps: ``serving.layout`` "layercut" in ``layercut.json``)
  is refused in one line naming the vanilla recipe that ships instead; a sub-layer checkpoint goes
  through the DeciLM layout first (``prune.checkpoint.decilm``), which llama.cpp runs as its ``deci`` architecture;
* the file is written under a temporary name and renamed once read back: its block count must be the
  checkpoint's, every block index present, no per-layer array left at the original depth (the
  failure of llama.cpp's ``--prune-layers``, llama.cpp#27976), and every tensor the converter only
  copies (norms, MLP and output projections, embeddings; not the permuted q/k) equal to the
  checkpoint's within the output type's rounding.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from prune.checkpoint.exports import ExportTarget, check_removes, export_option, register_export
from prune.errors import LayercutError, ended_by, signal_name

logger = logging.getLogger(__name__)

CONVERTER_ENV = "LLAMA_CPP_CONVERTER"
CONVERTER_NAME = "convert_hf_to_gguf.py"
# the types llama.cpp's own quantizer writes from the converter's f16 file: what llama.cpp users serve. The
# quantizer is a C function of llama.cpp, reached through llama-cpp-python (``pip install 'layercut[llamacpp]'``)
QUANTIZER_TYPES = {"q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
OUTTYPES = ("f32", "f16", "bf16", "q8_0", *QUANTIZER_TYPES)
# bits a parameter takes in a file of each type (what a run's disk is planned on): llama.cpp's own figures for
# Llama-3-8B (q4_k_m 4.89, its small tensors kept wider; q8_0 blocks of 32 int8 weights and an f16 scale)
OUTTYPE_BITS = {"f32": 32.0, "f16": 16.0, "bf16": 16.0, "q8_0": 8.5, "q4_k_m": 4.9}
# largest relative difference a tensor may show after the output type's rounding (q8_0: 8-bit blocks; a
# quantizer type keeps its small tensors, the norms, in f32 and compares only those)
TOLERANCE = {"f32": 0.0, "f16": 1e-3, "bf16": 8e-3, "q8_0": 2e-2, **{name: 1e-3 for name in QUANTIZER_TYPES}}
# the converter rewrites these (Llama's rotary permutation of q/k): they are not compared one to one
_PERMUTED = re.compile(r"\.attn_(q|k)\.weight$")


# the llama-cpp-python source distribution whose vendored converter --fetch-converter unpacks (as CI does); the
# installed llama-cpp-python's own version when there is one, so the converter matches the engine
CONVERTER_PACKAGE, CONVERTER_VERSION = "llama-cpp-python", "0.3.36"
# what of that source distribution the converter needs: the script, its conversion modules and its gguf-py
_CONVERTER_PARTS = ("vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/conversion", "vendor/llama.cpp/gguf-py")


def converter_version() -> str:
    """The llama-cpp-python version whose converter is fetched: the installed one's, else the tested pin."""
    from importlib import metadata

    try:
        return metadata.version(CONVERTER_PACKAGE)
    except metadata.PackageNotFoundError:
        return CONVERTER_VERSION


def cached_converter(version: str | None = None) -> Path:
    """Where :func:`fetch_converter` puts the converter: under ``$LAYERCUT_CACHE`` (``~/.cache/layercut``)."""
    from prune.loading.gguf import cache_dir

    version = version or converter_version()
    root = cache_dir() / "llama.cpp-converter" / version
    return root / f"llama_cpp_python-{version}" / _CONVERTER_PARTS[0]


def fetch_converter(version: str | None = None) -> Path:
    """Download llama-cpp-python's source distribution (nothing is built) and unpack its converter into the cache.

    ``pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==VERSION``, then only the converter's
    files are unpacked, under a temporary name renamed when whole. Returns the script's path. The source only of
    llama-cpp-python itself: pip still prepares its metadata, and ``:all:`` would build that step's own
    requirements from source too (over 5 minutes with no pip cache, 2026-12-03, against 14 s).
    """
    import shutil
    import tarfile

    version = version or converter_version()
    script = cached_converter(version)
    if script.is_file():
        return script
    root = script.parents[3]
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=root.parent) as scratch:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", CONVERTER_PACKAGE, "-q",
                   f"{CONVERTER_PACKAGE}=={version}", "-d", scratch]
        logger.info("fetching llama.cpp's converter: %s", " ".join(command[1:]))
        done = subprocess.run(command, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
        archives = sorted(Path(scratch).glob("*.tar.gz"))
        if done.returncode != 0 or not archives:
            last = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()][-1:]
            raise LayercutError(f"could not download {CONVERTER_PACKAGE}=={version}'s source for llama.cpp's "
                                f"converter ({last[0] if last else 'pip failed'}): pass --converter PATH to a "
                                f"llama.cpp checkout's {CONVERTER_NAME}")
        unpacked = Path(scratch) / "unpacked"
        prefix = f"llama_cpp_python-{version}/"
        with tarfile.open(archives[0]) as archive:
            members = [m for m in archive.getmembers()
                       if any(m.name == prefix + part or m.name.startswith(prefix + part + "/")
                              for part in _CONVERTER_PARTS)]
            archive.extractall(unpacked, members=members, filter="data")
        if root.exists():
            shutil.rmtree(root)
        (unpacked).rename(root)
    if not script.is_file():
        raise LayercutError(f"{CONVERTER_PACKAGE}=={version}'s source has no {_CONVERTER_PARTS[0]}: pass --converter")
    return script


def find_converter(converter: str | Path | None = None) -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py``: the given path, ``$LLAMA_CPP_CONVERTER``, else the one fetched.

    The path may be the script or a folder holding it; "the one fetched" is what :func:`fetch_converter` put in the
    cache.

    Raises:
        LayercutError: none given, set or fetched, or none there; the message says how to get it.
    """
    given = converter or os.environ.get(CONVERTER_ENV)
    if not given and cached_converter().is_file():
        return cached_converter()
    if not given:
        raise LayercutError(
            f"GGUF export runs llama.cpp's {CONVERTER_NAME}: fetch it once with python -m prune.export_gguf "
            f"--fetch-converter (downloads {CONVERTER_PACKAGE}'s source, builds nothing), or pass --converter PATH / "
            f"set {CONVERTER_ENV} to a llama.cpp checkout's script")
    path = Path(given).expanduser()
    if path.is_dir():
        path = path / CONVERTER_NAME
    if not path.is_file():
        raise LayercutError(f"no {CONVERTER_NAME} at {given}: point --converter / {CONVERTER_ENV} at the script or "
                            "the llama.cpp folder holding it")
    return path


def serving_of(folder: Path) -> dict:
    """The ``serving`` entry of a checkpoint's ``layercut.json`` ({} for a folder layercut did not write)."""
    from prune.checkpoint.report import read_report

    return read_report(folder).get("serving", {})


def check_servable(folder: Path) -> str:
    """The checkpoint's layout ("vanilla" or "decilm"); refuses one that no engine runs, naming what to ship instead.

    Raises:
        LayercutError: the folder is missing, not a checkpoint, or carries replacement maps.
    """
    from prune.checkpoint.serving import layout_of_folder
    from prune.model.layouts import LAYERCUT

    if not (folder / "config.json").is_file():
        raise LayercutError(f"{folder} is not a checkpoint folder (no config.json): pass the folder prune.run wrote")
    layout = layout_of_folder(folder)
    if layout == LAYERCUT:
        serving = serving_of(folder)
        instead = serving.get("servable_instead") or "a vanilla recipe (--replace fold, none or magcomp)"
        why = serving.get("why") or "its replacement maps run in no engine"
        raise LayercutError(f"{folder} is not servable ({why}); export {instead} instead")
    return layout


GGUF_FOLDER = "gguf"  # the checkpoint's sub-folder a GGUF export goes to when not told


def default_output(folder: Path, outtype: str, name: str | None = None) -> Path:
    """Where the GGUF goes when not told: ``FOLDER/gguf/<name>-<type>.gguf``, apart from the checkpoint's tokenizer.

    ``name`` defaults to the folder's; a folder that is renamed once written (``prune.ship``'s work folder
    becomes ``--out``) passes the name it will have.

    transformers reads ``from_pretrained(folder, gguf_file=...)`` against the folder: beside the checkpoint's
    ``tokenizer.json`` the GGUF's own tokenizer is replaced by it and its chat template and special tokens are
    read from neither file (``chat_template`` and ``eos_token`` come back None). In a folder of its own the GGUF
    loads whole in transformers, as in llama.cpp, and the checkpoint stays one folder to copy or upload.
    """
    return folder / GGUF_FOLDER / f"{name or folder.resolve().name}-{outtype}.gguf"


def export_gguf(folder: str | Path, out: str | Path | None = None, outtype: str = "f32",
                converter: str | Path | None = None) -> Path:
    """Convert a servable checkpoint folder to one GGUF file with llama.cpp's converter, then check it.

    Args:
        folder: a checkpoint folder (``prune.run --out``, or any transformers checkpoint).
        out: the ``.gguf`` path (default: ``FOLDER/gguf/<name>-<outtype>.gguf``, see :func:`default_output`).
        outtype: ``f32``, ``f16``, ``bf16`` or ``q8_0`` (the converter's output types), or ``q4_k_m``
            (the converter's f16, then llama.cpp's quantizer through llama-cpp-python).
        converter: llama.cpp's ``convert_hf_to_gguf.py`` or its folder (default: ``$LLAMA_CPP_CONVERTER``).

    Returns:
        The GGUF path, written whole (a temporary name until it was read back).

    Raises:
        LayercutError: not servable, no converter, the converter failed (its last error line), or the
            file read back disagrees with the checkpoint.
    """
    return convert(folder, out, outtype, converter)[0]


def convert(folder: str | Path, out: str | Path | None = None, outtype: str = "f32",
            converter: str | Path | None = None) -> tuple[Path, dict]:
    """:func:`export_gguf`, also returning what :func:`check_gguf` found."""
    folder = Path(folder).expanduser()
    if outtype not in OUTTYPES:
        raise LayercutError(f"unknown GGUF output type '{outtype}': choose one of {', '.join(OUTTYPES)}")
    layout = check_servable(folder)
    script = find_converter(converter)
    if outtype in QUANTIZER_TYPES:
        check_quantizer(outtype)
    out = Path(out).expanduser() if out else default_output(folder, outtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial")
    with tempfile.TemporaryDirectory(prefix="layercut-gguf-") as scratch:
        source = folder
        if layout == "decilm":  # sub-layer removals: llama.cpp runs them as its "deci" architecture
            source = _decilm_source(folder, Path(scratch))
        try:
            if outtype in QUANTIZER_TYPES:  # the f16 file beside the output: a large model's is large
                wide = partial.with_name(f".{out.name}.f16.partial")
                try:
                    _run_converter(script, source, wide, "f16")
                    check_gguf(wide, source, "f16")
                    _quantize(wide, partial, outtype)
                finally:
                    wide.unlink(missing_ok=True)
            else:
                _run_converter(script, source, partial, outtype)
            checked = check_gguf(partial, source, outtype)
        except BaseException:  # a failed check, an unreadable file or Ctrl-C: no partial file stays
            partial.unlink(missing_ok=True)
            raise
    partial.replace(out)
    logger.info("wrote %s", out)
    return out, checked


def is_decilm_folder(folder: Path) -> bool:
    """Whether ``folder`` is already in the DeciLM layout (written by ``prune.checkpoint.decilm``)."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return config.get("architectures") == ["DeciLMForCausalLM"]


def _decilm_source(folder: Path, scratch: Path) -> Path:
    """The DeciLM folder llama.cpp converts: ``folder`` itself or its copy; refused where llama.cpp runs it wrong."""
    from prune.checkpoint.decilm import write_decilm
    from prune.checkpoint.decilm_config import llama_cpp_limits

    source = folder if is_decilm_folder(folder) else write_decilm(folder, scratch / "decilm", llama_cpp=True)
    limits = llama_cpp_limits(json.loads((source / "config.json").read_text(encoding="utf-8")))
    if limits:
        raise LayercutError(f"llama.cpp would run {folder} wrong: {limits[0]}")
    return source


def _run_converter(script: Path, source: Path, out: Path, outtype: str) -> None:
    command = [sys.executable, str(script), str(source), "--outfile", str(out), "--outtype", outtype]
    logger.info("running %s", " ".join(command))
    # stdin closed: the converter's tokenizer loading may ask whether to run remote code
    done = subprocess.run(command, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
    if done.returncode == 0 and out.is_file():
        return
    out.unlink(missing_ok=True)
    lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    missing = next((m for line in lines if (m := re.search(r"No module named '([\w.]+)'", line))), None)
    if missing:
        raise LayercutError(f"llama.cpp's converter needs the Python package '{missing.group(1)}': "
                            f"pip install {missing.group(1).split('.')[0]} (or pip install 'layercut[gguf]')")
    if any("No space left on device" in line or "[Errno 28]" in line for line in lines):
        raise LayercutError(f"the disk is full: llama.cpp's converter could not write {out.name} in {out.parent} "
                            "(free space there or pass --out elsewhere; nothing was replaced)")
    raise LayercutError(f"llama.cpp's converter failed on {source} (exit {done.returncode}): {_last_error(lines)}")


def _last_error(lines: list[str]) -> str:
    """The last line of a failed child's output that names an error, else its last line."""
    return next((line for line in reversed(lines) if "Error" in line or "error" in line),
                lines[-1] if lines else "").strip()


def check_quantizer(outtype: str) -> None:
    """Refuse ``outtype`` in one line where llama.cpp's quantizer (llama-cpp-python) is not installed."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        raise LayercutError(f"--gguf-type {outtype} is written by llama.cpp's quantizer, reached through "
                            "llama-cpp-python: pip install 'layercut[llamacpp]', or choose f32, f16, bf16 or q8_0")


# llama.cpp's quantizer runs in a child process: llama.cpp brings its own OpenMP runtime beside torch's, and a crash
# inside it (a build for another CPU, the two runtimes' threads) would end the whole run without a word; in a child it
# is one line and the run's earlier work stays
_QUANTIZE_CHILD = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = getattr(llama_cpp, sys.argv[3])
params.nthread = int(sys.argv[4])
sys.exit(0 if llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)) == 0
         else 3)
"""


def _quantize(source: Path, out: Path, outtype: str) -> None:
    """llama.cpp's ``llama_model_quantize`` of the f16 GGUF ``source`` into ``out``, in a child process."""
    logger.info("quantizing %s to %s with llama.cpp", source.name, outtype)
    command = [sys.executable, "-c", _QUANTIZE_CHILD, str(source), str(out), QUANTIZER_TYPES[outtype],
               str(os.cpu_count() or 1)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
    if done.returncode == 0 and out.is_file():
        return
    out.unlink(missing_ok=True)
    if done.returncode < 0:  # killed by a signal: llama.cpp itself crashed (a Python error exits 1), or was killed
        fix = ("free memory" if signal_name(done.returncode) == "SIGKILL"
               else "reinstall llama-cpp-python built for this machine (pip install --force-reinstall --no-cache-dir "
                    "llama-cpp-python)")
        raise LayercutError(f"llama.cpp's quantizer ended by {ended_by(done.returncode)} writing {outtype}: {fix}, "
                            "or choose f32, f16, bf16 or q8_0 (llama.cpp's converter writes those)")
    lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    raise LayercutError(f"llama.cpp's quantizer failed to write {outtype} (exit {done.returncode}): "
                        f"{_last_error(lines)}")


def _arch_enum(gguf, arch: str):
    for enum, name in gguf.MODEL_ARCH_NAMES.items():
        if name == arch:
            return enum
    raise LayercutError(f"the GGUF names architecture '{arch}', which this gguf package does not know: "
                        "pip install -U gguf")


def check_gguf(path: str | Path, folder: str | Path, outtype: str = "f32") -> dict:
    """Read a GGUF back and compare it with the checkpoint folder it was converted from.

    Returns:
        ``{"architecture", "blocks", "tensors", "compared", "max_rel_diff"}``.

    Raises:
        LayercutError: a block count, block index, per-layer array or copied tensor that disagrees.
    """
    import gguf
    import numpy as np
    from safetensors import safe_open

    path, folder = Path(path), Path(folder)
    try:
        reader = gguf.GGUFReader(str(path))
        arch = gguf_field(reader, "general.architecture")
        count = gguf_field(reader, f"{arch}.block_count") if arch else None
    except (KeyError, ValueError, TypeError, OSError) as err:
        raise LayercutError(f"{path.name} does not read back as a GGUF model ({type(err).__name__}: {err})") from None
    if count is None:
        raise LayercutError(f"{path.name} has no {arch or 'general.architecture'}.block_count: it does not read "
                            "back as a llama.cpp GGUF model")
    blocks = int(count)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config = config.get("text_config", config)
    expected = config.get("num_hidden_layers")
    if expected is not None and blocks != expected:
        raise LayercutError(f"{path.name}: {arch}.block_count is {blocks}, the checkpoint has {expected} blocks")
    indices = {int(m.group(1)) for t in reader.tensors if (m := re.match(r"blk\.(\d+)\.", t.name))}
    if indices and indices != set(range(blocks)):
        raise LayercutError(f"{path.name}: tensors of blocks {sorted(set(range(blocks)) ^ indices)} are missing or "
                            f"extra for {blocks} blocks")
    original = _original_blocks(folder)
    for key, field in reader.fields.items():
        if not key.startswith(f"{arch}.") or field.types[:1] != [gguf.GGUFValueType.ARRAY]:
            continue
        length = len(field.data)
        if original and length == original != blocks:
            raise LayercutError(f"{path.name}: per-layer {key} has {length} entries, the original depth, for "
                                f"{blocks} blocks: the config was not sliced")
    names = gguf.get_tensor_name_map(_arch_enum(gguf, arch), blocks)
    wanted = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():
                mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
                if mapped:
                    wanted[mapped] = (file, name)
    compared, worst = 0, 0.0
    for tensor in reader.tensors:
        if tensor.name not in wanted or _PERMUTED.search(tensor.name):
            continue
        if tensor.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            continue  # bf16 / q8_0 blocks need dequantising: their block counts and indices were checked above
        file, name = wanted[tensor.name]
        with safe_open(str(file), "pt") as handle:
            source = handle.get_tensor(name).float().numpy()
        got = np.asarray(tensor.data, dtype=np.float32)
        if got.size != source.size:
            raise LayercutError(f"{path.name}: {tensor.name} has {got.size} values, the checkpoint's {name} "
                                f"{source.size}")
        got = got.reshape(source.shape)
        if arch.startswith("gemma") and tensor.name.endswith("norm.weight"):
            source = source + 1  # llama.cpp's Gemma converters store the norms' (1 + weight)
        scale = float(np.abs(source).max()) or 1.0
        diff = float(np.abs(got - source).max()) / scale
        worst = max(worst, diff)
        compared += 1
        if diff > TOLERANCE[outtype] + 1e-7:
            raise LayercutError(f"{path.name}: {tensor.name} differs from the checkpoint's {name} by {diff:.2e} "
                                f"(relative), beyond {outtype}'s rounding")
    return {"architecture": arch, "blocks": blocks, "tensors": len(reader.tensors), "compared": compared,
            "max_rel_diff": worst}


def gguf_field(reader, key: str):
    """One metadata value of a ``gguf.GGUFReader`` (a str, a number or a list), None when absent."""
    entry = reader.fields.get(key)
    if entry is None:
        return None
    if hasattr(entry, "contents"):
        return entry.contents()
    value = entry.parts[entry.data[0]]
    return bytes(value).decode("utf-8") if value.dtype.kind == "u" and value.itemsize == 1 else value.tolist()[0]


def _original_blocks(folder: Path) -> int | None:
    """The unpruned depth, from ``layercut.json`` (None for a folder layercut did not write)."""
    from prune.checkpoint.report import read_report

    report = read_report(folder)
    # every original index is either covered by a kept block's layout entry or listed as dropped
    seen = [i for entry in report.get("layout") or [] for i in entry] + list(report.get("dropped") or [])
    return max(seen) + 1 if seen else None


@dataclass(frozen=True)
class GGUFOptions:
    """``--export gguf``'s options: ``prune.run --gguf-type/--converter``, ``prune.save(gguf_type=, converter=)``."""

    gguf_type: str = export_option("f32", "the GGUF's tensor type", flag="--gguf-type", choices=OUTTYPES)
    converter: str | None = export_option(None, f"llama.cpp's {CONVERTER_NAME} or its folder (None: "
                                          f"${CONVERTER_ENV})", flag="--converter")


def _check_export(config, options: GGUFOptions) -> None:
    """Refuse ``--export gguf`` before any work when it cannot succeed: no output, maps no engine runs, no converter."""
    from prune.model.layouts import LAYERCUT, VANILLA_RECIPE
    from prune.replace import METHODS

    check_removes(config, "gguf")
    method = METHODS[config.replace.method]
    if method.serving == LAYERCUT:
        raise LayercutError(f"--export gguf: --replace {method.name} writes maps that no serving engine runs; "
                            f"use {VANILLA_RECIPE} instead (same blocks, the map folded into standard weights)")
    find_converter(options.converter)
    if options.gguf_type in QUANTIZER_TYPES:
        check_quantizer(options.gguf_type)


def _write_export(folder: Path, options: GGUFOptions) -> str:
    path, checked = convert(folder, outtype=options.gguf_type, converter=options.converter)
    return (f"wrote {path} ({checked['architecture']}, {checked['blocks']} blocks, read back: {checked['compared']} "
            f"tensors equal to the checkpoint's within {options.gguf_type} rounding)")


register_export(ExportTarget(
    "gguf", "a GGUF for llama.cpp in the output folder's gguf/, converted by llama.cpp's own converter and read back",
    GGUFOptions, _check_export, _write_export))
