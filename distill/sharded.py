"""Distillation with the student sharded by FSDP2 (``accelerate launch --config_file recipes/accelerate/fsdp.yaml``).

The teacher is never handed to accelerate: it stays outside FSDP (a teacher inside a sharded wrapper breaks
runs, transformers#45941), whole on every process, or replaced by its logits cache. Each process holds a
shard of the student's parameters, gradients and AdamW states; checkpoints and the export need them whole,
so they are gathered here with torch's distributed state-dict functions (full tensors, on the CPU, keyed by
parameter name): a checkpoint written by N processes resumes on any other count, FSDP or not.

accelerate offers FSDP on GPUs only. ``LAYERCUT_CPU_FSDP=1`` runs the same FSDP2 over gloo on the CPU
(tests, CPU-only clusters) by setting accelerate's engine after it chose plain data parallelism.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from prune.errors import LayercutError


def is_sharded(accelerator) -> bool:
    """Whether the student is sharded by FSDP in this run."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def use_fsdp_on_cpu(accelerator) -> None:
    """With ``LAYERCUT_CPU_FSDP=1`` on several CPU processes, switch accelerate's engine to FSDP2 over gloo."""
    from accelerate import FullyShardedDataParallelPlugin, PartialState
    from accelerate.utils import DistributedType

    if os.environ.get("LAYERCUT_CPU_FSDP") != "1" or accelerator.distributed_type != DistributedType.MULTI_CPU:
        return
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            state_dict_type="FULL_STATE_DICT")
    # both shared states: accelerate copies the process state's engine into each new AcceleratorState
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin


def check_sharded_options(accelerator, train: str) -> None:
    """Refuse, in one line, what a sharded student does not do."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # checkpoints and the export would read ZeRO-partitioned weights: never write a half-empty checkpoint
        raise LayercutError("distill.run does not run under DeepSpeed: shard the student with FSDP2 "
                            "(accelerate launch --config_file recipes/accelerate/fsdp.yaml -m distill.run ...)")
    if is_sharded(accelerator) and train == "lora":
        raise LayercutError("--train lora with FSDP: LoRA's weights are small enough to replicate; launch with "
                            "data parallelism (recipes/accelerate/ddp.yaml), or train --train all under FSDP")


def _options(**extra):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True, **extra)


def full_model_state(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """The trained parameters ``names`` and every buffer, whole, on the main process (a collective)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_options())  # fresh CPU copies already: no clone
    # every name a parameter goes by, a tied head's included, so that only true buffers join the trained ones
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    wanted = set(names)
    return {n: t.detach() for n, t in state.items() if n in wanted or n not in params}


def full_optimizer_state(model: nn.Module, optimizer) -> dict:
    """The optimizer's state keyed by parameter name, whole, on the main process (a collective)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer), options=_options())


def load_full_state(model: nn.Module, optimizer, model_state: dict, optimizer_state: dict,
                    from_main: bool = False) -> None:
    """Put whole tensors from a checkpoint into the (sharded or plain) student and its optimizer.

    ``from_main``: only the main process holds the tensors (the others pass empty dicts) and sends each
    process its shards, so N processes on one machine do not hold N copies of the checkpoint.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, strict=False, broadcast_from_rank0=from_main)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, getattr(optimizer, "optimizer", optimizer), optimizer_state, options=options)
