"""How fast this CPU runs now, against the machine the planner's rates were measured on.

The planner's CPU rates (``prune.planner.stages.CPU_FLOPS``, ``ship.costs``' shares and byte rates) were measured
on one 2-core machine. The same machine ran the same ship twice as fast on the evening of the day it was costed
(its scoring pass 7.8 s a batch, then 4.0 s: another tenant of the host), and another machine is another speed.
So before a plan, :func:`machine_speed` times a fixed float32 product on the threads the run will use and divides
the reference time by it; the CPU rates are multiplied by that factor. It is measured once per process (about half
a second), and ``$LAYERCUT_MACHINE_SPEED`` fixes it (tests set 1: their plans must not depend on the machine's load).

    from prune.planner.machine import machine_speed
    machine_speed()   # 1.9: this CPU runs the planner's work 1.9x as fast as the reference machine did
"""

from __future__ import annotations

import functools
import logging
import math
import os
import statistics
import time

import torch

from prune.errors import LayercutError

logger = logging.getLogger(__name__)

SPEED_ENV = "LAYERCUT_MACHINE_SPEED"
# the product timed: a scoring batch's tokens through one MLP projection of SmolLM2-135M (float32)
PROBE_SHAPE = (2048, 576, 1536)
PROBE_PRODUCTS = 4  # products per round
PROBE_ROUNDS = 5  # rounds timed after a warm-up; their median is the probe's time
# the probe's median on the machine the rates were measured on: 2 threads of this project's 2-core machine, idle,
# 2026-12-02, between the runs that measured CPU_FLOPS (prune.planner.stages) and ship.costs' reference
# (0.0925 s in the first of six medians, 0.0828-0.0845 s in the others: the warm ones)
REFERENCE_SECONDS = 0.0835


def probe_seconds(rounds: int = PROBE_ROUNDS) -> float:
    """The median seconds of ``PROBE_PRODUCTS`` float32 products of :data:`PROBE_SHAPE` on torch's threads."""
    tokens, hidden, width = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    left = torch.randn(tokens, hidden, generator=generator)  # [tokens, hidden]
    right = torch.randn(hidden, width, generator=generator)  # [hidden, width]
    for _ in range(PROBE_PRODUCTS):  # warm-up: the first calls allocate and spin the threads up
        torch.mm(left, right)
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        for _ in range(PROBE_PRODUCTS):
            torch.mm(left, right)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


@functools.cache
def machine_speed() -> float:
    """The speed of this CPU as a multiple of the reference machine's: ``$LAYERCUT_MACHINE_SPEED``, else measured.

    Raises:
        LayercutError: ``$LAYERCUT_MACHINE_SPEED`` is not a positive number.
    """
    fixed = os.environ.get(SPEED_ENV)
    if fixed:
        try:
            speed = float(fixed)
        except ValueError:
            speed = math.nan
        if not (math.isfinite(speed) and speed > 0):
            raise LayercutError(f"${SPEED_ENV}={fixed!r}: give a positive number (1: the reference machine), "
                                "or unset it to measure this CPU")
        return speed
    speed = REFERENCE_SECONDS / probe_seconds()
    logger.info("this CPU runs the planner's work at %.2fx the reference machine (%d threads)", speed,
                torch.get_num_threads())
    return speed
