"""The processes of a run: one, or several under ``accelerate launch`` / ``torchrun``, on GPUs or on the CPU.

accelerate's process state is created once per process, and the first caller fixes whether several
processes talk over the CPU (gloo): every part of a distillation run asks here, so they all agree.
"""

from __future__ import annotations

import os

import torch


def many_on_cpu() -> bool:
    """Several processes on a machine without a GPU: accelerate runs them over gloo only when told "CPU"."""
    return not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1


def process_state():
    """Accelerate's ``PartialState`` of this process (rank, count, barriers), CPU runs included."""
    from accelerate import PartialState

    return PartialState(cpu=many_on_cpu())
