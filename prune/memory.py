"""Peak resident memory of this process, one way for every report (distillation, speed, scoring cost)."""

from __future__ import annotations

import sys


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
