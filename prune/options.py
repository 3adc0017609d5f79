"""Command-line options that every layercut entry point shares, each flag defined once.

Groups: model loading (``--model``, ``--dtype``, ``--device``, ``--load-in-4bit`` / ``--load-in-8bit``,
``--tokenizer``), calibration data (``--data``, ``--text-field``, ``--samples``, ``--seq-len``,
``--seed``), output (``--out``, ``--overwrite``) and ``--threads``. Each group has the function that
turns the parsed flags into the dataclass the library takes (:class:`LoadConfig`,
:class:`prune.data.calibration.DataConfig`), so a flag, its help text and its validation live in one place.
Entry points may prefix the loading group (``--teacher``, ``--teacher-dtype``, ...).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from pathlib import Path

import torch

from prune.checkpoint.load_config import DTYPES, OFFLOADS, LoadConfig
from prune.data.calibration import DataConfig
from prune.errors import LayercutError
from prune.loading.loader import EMBEDDED_MODEL

logger = logging.getLogger(__name__)


def _flag(prefix: str, name: str) -> str:
    return f"--{prefix}-{name}" if prefix else f"--{name}"


def add_load_arguments(parser: argparse.ArgumentParser, *, prefix: str = "", model_flag: bool = True,
                       model_default: str | None = EMBEDDED_MODEL, model_default_help: str | None = None,
                       device_default: str = "cpu", title: str = "model", offload: bool = False) -> None:
    """Model-loading flags; with ``prefix="teacher"`` they read ``--teacher``, ``--teacher-dtype``, ...

    Args:
        parser: the parser to add a group to.
        prefix: word put before every flag (the model flag is then ``--<prefix>``).
        model_flag: add the model flag itself (entry points with several models add their own).
        model_default: default of the model flag (None: required, unless ``model_default_help`` says
            what None means).
        model_default_help: what the default means, for ``--help`` (default: the default's name).
        device_default: default of the device flag.
        title: the group's title in ``--help``.
        offload: add ``--offload`` (entry points whose passes run block by block: ``prune.run``).
    """
    group = parser.add_argument_group(title)
    if model_flag:
        flag = f"--{prefix}" if prefix else "--model"
        required = model_default is None and model_default_help is None
        default = "required" if required else f"default: {model_default_help or model_default}"
        group.add_argument(flag, default=model_default, required=required,
                           help="alias (smollm2-135m, opt-1.3b, gpt2, ...), hub id, checkpoint folder or .gguf file "
                           f"({default}; smollm2-135m is embedded and works offline)")
    group.add_argument(_flag(prefix, "dtype"), default="auto", choices=DTYPES,
                       help="weights dtype (default: auto = float32 on CPU, the checkpoint's dtype on GPU)")
    group.add_argument(_flag(prefix, "device"), default=device_default,
                       help=f"cpu, cuda, cuda:N or auto (accelerate device_map over the GPUs; "
                       f"default: {device_default})")
    for bits in (4, 8):
        group.add_argument(_flag(prefix, f"load-in-{bits}bit"), action="store_true",
                           help=f"bitsandbytes {bits}-bit weights (CUDA only)")
    if not prefix:
        group.add_argument("--tokenizer", default=None,
                           help="tokenizer (model name or folder) for checkpoint folders saved without one")
    if offload:
        group.add_argument("--offload", default="none", choices=OFFLOADS,
                           help="sequential: keep one block in memory at a time, read from the checkpoint's "
                           "safetensors and run over every calibration token (models larger than memory; "
                           "default: none)")


def load_config_from_args(args: argparse.Namespace, prefix: str = "", model: str | None = None) -> LoadConfig:
    """The :class:`LoadConfig` of flags added by :func:`add_load_arguments` with the same ``prefix``."""
    key = f"{prefix}_" if prefix else ""
    if model is None:
        model = getattr(args, prefix or "model")
    return LoadConfig(model=model, dtype=getattr(args, f"{key}dtype"), device=getattr(args, f"{key}device"),
                      load_in_4bit=getattr(args, f"{key}load_in_4bit"),
                      load_in_8bit=getattr(args, f"{key}load_in_8bit"),
                      tokenizer=None if prefix else getattr(args, "tokenizer", None),
                      offload="none" if prefix else getattr(args, "offload", "none"))


def add_data_arguments(parser: argparse.ArgumentParser, *, samples: int | None = 64, seq_len: int = 512,
                       title: str = "calibration data", what: str = "sequence",
                       heldout_samples: int | None = None, heldout_help: str | None = None,
                       data: str | None = None,
                       data_help: str = "builtin@0.5,self@0.5, chosen on texts no reported figure uses; see the "
                       "README") -> None:
    """Calibration flags: ``--data --text-field --samples`` (unless None) ``--seq-len --seed [--heldout-samples]``.

    ``data`` / ``data_help``: the default of ``--data`` (None: :data:`prune.data.calibration.DEFAULT_DATA`) and how
    ``--help`` names it.
    """
    group = parser.add_argument_group(title)
    group.add_argument("--data", default=data,
                       help=".txt/.jsonl/.parquet file, datasets spec name[:config[:split]], self (text sampled "
                       "from the model; self:temperature=1.0:top_p=0.95), or a weighted mixture of these: "
                       "'emma.txt@0.5,wikitext:wikitext-2-raw-v1:train@0.3,self@0.2' (no weights: equal shares; "
                       f"builtin names the built-in Austen novel) (default: {data_help})")
    group.add_argument("--text-field", default="text",
                       help="text column of jsonl/parquet/datasets rows (default: text)")
    if samples is not None:
        group.add_argument("--samples", type=int, default=samples, help=f"packed sequences (default: {samples})")
    group.add_argument("--seq-len", type=int, default=seq_len, help=f"tokens per {what} (default: {seq_len})")
    group.add_argument("--seed", type=int, default=0, help="which sequences are drawn, and in what order (default: 0)")
    if heldout_samples is not None:
        heldout_help = heldout_help or ("sequences of the same text kept out of scoring and fitting; the original "
                                        "and the slimmed model's perplexity on them ends the run")
        group.add_argument("--heldout-samples", type=int, default=heldout_samples,
                           help=f"{heldout_help} (default: {heldout_samples}; 0: skip)")


def data_config_from_args(args: argparse.Namespace) -> DataConfig:
    """The :class:`prune.data.calibration.DataConfig` of flags added by :func:`add_data_arguments`."""
    samples = getattr(args, "samples", None) or DataConfig.samples  # entry points without --samples count tokens
    heldout = getattr(args, "heldout_samples", None)
    return DataConfig(args.data, samples, args.seq_len, args.seed, args.text_field,
                      DataConfig.heldout_samples if heldout is None else heldout)


def parse_counts(text: str, flag: str, minimum: int = 1) -> list[int]:
    """A comma list of whole numbers, each ``minimum`` or more (``--tokens 8192,32768``, ``--drop 4,8``).

    Raises:
        LayercutError: a word that is no whole number, or one below ``minimum``; the line names ``flag``.
    """
    try:
        counts = [int(word) for word in str(text).split(",")]
    except ValueError:
        counts = None
    if counts is None or min(counts) < minimum:
        raise LayercutError(f"{flag} takes a comma list of whole numbers >= {minimum}, such as 4,8; got {text!r}")
    return counts


def add_output_arguments(parser: argparse.ArgumentParser, *, required: bool = False,
                         what: str = "the checkpoint and reports") -> None:
    """``--out`` and ``--overwrite``."""
    group = parser.add_argument_group("output")
    group.add_argument("--out", default=None, required=required, help=f"folder for {what}")
    group.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads``: torch's CPU threads."""
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: the cores no other process is running on when the "
                        "command starts, at least 1, unless OMP_NUM_THREADS is set; on a CPU that other jobs keep "
                        "busy, more threads than free cores run several times slower)")


def default_threads() -> int | None:
    """Threads for a CPU run: the cores other processes are not running on now, at least 1.

    None (torch's own choice, one thread per core) when ``OMP_NUM_THREADS`` is set or the count of
    running processes cannot be read. Torch's threads wait on each other when another job holds a
    core: on a busy 2-core machine distillation ran 7.6x slower with two threads than with one. The
    count is the kernel's number of runnable processes now (a few samples, the median, this process
    excluded), not the load average, which still remembers jobs that ended a minute ago.
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    busy = running_processes()
    if busy is None:
        return None
    return max(1, min(cores, cores - busy))


def running_processes(samples: int = 5, interval_s: float = 0.01) -> int | None:
    """Runnable processes other than this one (median of a few reads of ``/proc/loadavg``); None off Linux."""
    counts = []
    for _ in range(samples):
        try:
            field = Path("/proc/loadavg").read_text().split()[3]  # "running/total"
        except (OSError, IndexError):
            return None
        counts.append(int(field.split("/")[0]) - 1)
        time.sleep(interval_s)
    return int(statistics.median(counts))


def apply_threads(args: argparse.Namespace | object) -> None:
    """Set torch's CPU threads from ``--threads``, else from :func:`default_threads`.

    ``args``: the parsed flags, or an options dataclass with a ``threads`` field (``eval.bench``'s subcommands).
    """
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        raise LayercutError(f"--threads must be a positive integer, got {threads}")
    if threads is None:
        threads = default_threads()
        if threads is None:
            return
        logger.info("using %d torch CPU thread(s): the cores free now; --threads N to choose", threads)
    torch.set_num_threads(threads)


def explicit_flags(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The ``dest`` of every option typed on the command line (so it can win over a recipe's value)."""
    saved = {action: action.default for action in parser._actions}
    try:
        for action in saved:
            action.default = argparse.SUPPRESS
        given, _ = parser.parse_known_args(argv)
    finally:
        for action, default in saved.items():
            action.default = default
    return set(vars(given))
