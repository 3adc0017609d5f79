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
