"""Which student parameters a run trains (``--train replacements | all | lora``), and LoRA in and out.

- ``replacements``: only the modules ``prune.replace.replacement_modules(student)`` returns (linear /
  low-rank maps, trained replacement blocks, folded projections). The cheapest: the rest of the
  student is the teacher's own weights.
- ``all``: every student parameter except the token/position embeddings and the LM head (tied to
  the embeddings in many models, and the largest matrices of a small model; the layerwise loss does
  not reach the input embedding differently from the teacher's anyway).
- ``lora``: peft LoRA adapters on every ``Linear`` (GPT-2: ``Conv1D``) of the student's blocks (the
  attention and MLP projections; ``--lora-targets`` names some of them), and the replacement modules
  trained in full: they are what the surgery changed, start from a fitted initialisation and are small.
  Adapters are merged into the weights (``merge_and_unload``) before the student is returned, so the
  export is a plain checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

from distill.config import LORA_ALL, DistillConfig
from prune.errors import LayercutError
from prune.model.adapters import get_blocks
from prune.replace import replacement_modules

logger = logging.getLogger(__name__)


def _linear_types() -> tuple[type, ...]:
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, Conv1D)


def lora_target_names(student: nn.Module, exclude: list[nn.Module] | None = None, targets: str = LORA_ALL) -> list[str]:
    """Full names of the ``Linear`` / ``Conv1D`` layers inside the student's blocks, minus ``exclude``'s.

    ``targets``: ``DistillConfig.lora_targets``; a comma list keeps the layers whose own name (the last part of
    the path) is in it, and a name no layer of the blocks has is refused in one line that lists theirs (a
    misspelt ``q_porj`` would otherwise adapt fewer layers than asked, without a word).
    """
    path, _ = get_blocks(student)
    skipped = {id(m) for module in exclude or [] for m in module.modules()}
    linear = [
        name
        for name, module in student.named_modules()
        if name.startswith(path + ".") and isinstance(module, _linear_types()) and id(module) not in skipped
    ]
    if targets == LORA_ALL:
        return linear
    wanted = targets.split(",")
    present = dict.fromkeys(name.rsplit(".", 1)[-1] for name in linear)
    missing = [name for name in wanted if name not in present]
    if missing:
        raise LayercutError(f"--lora-targets: the blocks have no Linear layer named {', '.join(missing)}; theirs are "
                            f"{', '.join(present) or 'none'} (or use {LORA_ALL})")
    return [name for name in linear if name.rsplit(".", 1)[-1] in wanted]


def apply_lora(student: nn.Module, config: DistillConfig, exclude: list[nn.Module] | None = None) -> nn.Module:
    """Inject LoRA adapters into the student in place; returns the ``PeftModel`` (for merging later)."""
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    targets = lora_target_names(student, exclude, config.lora_targets)
    if not targets:
        raise LayercutError("--train lora: the student's blocks have no Linear layers to adapt; use --train all")
    conv1d = any(isinstance(student.get_submodule(name), Conv1D) for name in targets)
    lora = LoraConfig(
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=targets,
        bias="none",
        fan_in_fan_out=conv1d,  # GPT-2's Conv1D stores weights as [in, out]
    )
    return get_peft_model(student, lora)


def merge_lora(peft_model: nn.Module) -> nn.Module:
    """Fold the adapters into the weights and remove the LoRA layers; returns the plain student."""
    return peft_model.merge_and_unload()


@dataclass
class Trainable:
    """The parameters a run optimises.

    Attributes:
        names: parameter names (as in ``student.named_parameters()``), in optimizer order.
        parameters: the tensors themselves.
        peft_model: the ``PeftModel`` wrapper under ``--train lora`` (merge it at the end), else None.
    """

    names: list[str] = field(default_factory=list)
    parameters: list[nn.Parameter] = field(default_factory=list)
    peft_model: nn.Module | None = None

    @property
    def count(self) -> int:
        """Number of trained scalars."""
        return sum(p.numel() for p in self.parameters)


def _freeze_embeddings(student: nn.Module) -> None:
    for module in student.modules():
        if isinstance(module, nn.Embedding):
            module.requires_grad_(False)
    head = student.get_output_embeddings()
    if head is not None:
        head.requires_grad_(False)


def select_trainable(student: nn.Module, config: DistillConfig) -> Trainable:
    """Freeze the student, then unfreeze (or add, for LoRA) what ``config.train`` names."""
    student.requires_grad_(False)
    replacements = replacement_modules(student)
    peft_model = None
    if config.train == "replacements":
        if not replacements:
            raise LayercutError(
                "--train replacements: the student has no replacement modules (its blocks were removed without a "
                "replacement); use --train all or --train lora"
            )
    elif config.train == "all":
        student.requires_grad_(True)
        _freeze_embeddings(student)
    else:
        peft_model = apply_lora(student, config, exclude=replacements)
    for module in replacements:
        module.requires_grad_(True)
    named = [(name, p) for name, p in student.named_parameters() if p.requires_grad]
    trainable = Trainable([n for n, _ in named], [p for _, p in named], peft_model)
    logger.info("training %s: %d tensors, %.2fM parameters", config.train, len(named), trainable.count / 1e6)
    return trainable
