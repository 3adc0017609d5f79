"""Peak resident memory of this process, one way for every report (distillation, speed, scoring cost)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
import time
from collections.abc import Callable
from typing import Any


@functools.cache
def _libc() -> ctypes.CDLL | None:
    # found once: find_library runs ldconfig in a subprocess, too slow for a call per batch
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def return_freed_memory() -> None:
    """Hand the C heap's free blocks back to the system (glibc's ``malloc_trim``; nothing elsewhere).

    A pass frees a block's activations and a batch of a state, and glibc keeps such freed blocks in its heap,
    where the next tensors, of other sizes, do not fit them all: on SmolLM2-135M (32k tokens) the block-by-block
    pass grew 5 MB a batch, 125 MB a block, without this, and stays within one batch's activations with it
    (``reports/smollm2-135m-offload``). The peak of a run is the sum of such leftovers at its highest point,
    so stages that free much between steps call this too.
    """
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def vm_hwm_bytes() -> int | None:
    """Peak resident set of this process from ``/proc/self/status`` (Linux), None elsewhere.

    ``VmHWM`` starts afresh at ``exec``, unlike ``ru_maxrss``, which Linux carries over from the parent
    process (a child of a big parent would report the parent's peak).
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        return None
    return None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (the high-water mark, not the current size).

    ``VmHWM`` where Linux has it; else ``ru_maxrss``; on Windows, which keeps no high-water mark, the
    current size.
    """
    peak = vm_hwm_bytes()
    if peak is not None:
        return peak
    try:
        import resource
    except ImportError:
        import psutil

        return int(psutil.Process().memory_info().rss)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)  # KiB elsewhere, bytes on macOS


def reset_peak_rss() -> bool:
    """Start the high-water mark afresh from the current resident set (Linux ``clear_refs``); False elsewhere.

    A measurement of one stage then excludes what loading touched and freed before it.
    """
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
    except OSError:
        return False
    return True


def measured_stage(fn: Callable[[], Any]) -> tuple[Any, dict]:
    """``fn()``'s result and ``{"seconds", "peak_rss_bytes", "peak_cuda_bytes"}`` of the stage it ran.

    The resident high-water mark starts afresh first (:func:`reset_peak_rss`), so what ran before (imports,
    loading, another stage) is not this stage's peak; on a GPU torch's allocated peak is read too (None else).
    """
    import torch

    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    reset_peak_rss()
    started = time.perf_counter()
    value = fn()
    return value, {"seconds": time.perf_counter() - started, "peak_rss_bytes": peak_rss_bytes(),
                   "peak_cuda_bytes": torch.cuda.max_memory_allocated() if cuda else None}
