"""What the planner is given: one run's options as plain numbers (:class:`PlanInput`) and the machine it runs on."""

from __future__ import annotations

from dataclasses import dataclass, field

from prune.errors import LayercutError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# --lora-targets' default: adapters on every Linear of the blocks (peft's own word for it)
LORA_ALL = "all-linear"


def lora_targets_spec(spec) -> str:
    """``--lora-targets`` written one way: "all-linear", or its layer names comma-joined, each once, in order.

    A name is a layer's own (``q_proj``), not a path: adapters go inside the blocks only, so a dot or an empty
    name is refused in one line. A recipe's YAML list (``lora_targets: [q_proj, v_proj]``) reads as the comma list.
    """
    listed = spec if isinstance(spec, (list, tuple)) else str(spec).split(",")
    names = [str(name).strip() for name in listed]
    if names == [LORA_ALL]:
        return LORA_ALL
    if not names or not all(names) or any("." in name or name == LORA_ALL for name in names):
        raise LayercutError(f"--lora-targets takes {LORA_ALL} or a comma list of the blocks' Linear layer names "
                            f"(q_proj,v_proj), got {spec!r}")
    return ",".join(dict.fromkeys(names))


@dataclass(frozen=True)
class DistillSpec:
    """What the plan needs of distillation (defaults mirror ``distill.config.DistillConfig``'s).

    Attributes:
        steps: optimizer steps (0: no distillation).
        batch_size: sequences per micro-batch (per GPU under FSDP).
        seq_len: tokens per sequence.
        grad_accum: micro-batches per step.
        train: replacements | all | lora.
        lora_r: LoRA rank.
        lora_targets: the Linear layers LoRA adapts (``--lora-targets``: ``all-linear`` or their names, comma list).
        kl: a loss on the logits (float32 [batch, seq, vocab] for teacher and student).
        teacher_cache: top-k of a teacher-logit cache (the teacher is then not in memory while training);
            0: the teacher runs beside the student.
        cache_sequences: sequences the cache is written over, the training and held-out ones (``data``'s
            ``samples`` + ``heldout_samples``); 0: as many as the steps read.
    """

    steps: int = 0
    batch_size: int = 4
    seq_len: int = 128
    grad_accum: int = 1
    train: str = "replacements"
    lora_r: int = 8
    lora_targets: str = LORA_ALL
    kl: bool = True
    teacher_cache: int = 0
    cache_sequences: int = 0


@dataclass(frozen=True)
class Hardware:
    """The devices a plan is made for.

    Attributes:
        gpus: GPUs (0: the CPU alone).
        gpu_memory: bytes of one GPU.
        host_memory: bytes of RAM.
        fsdp: distillation shards the student (weights, gradients, AdamW states) over the GPUs (FSDP);
            without it a multi-GPU run spreads the blocks with accelerate's device map.
    """

    gpus: int = 0
    gpu_memory: float = 0.0
    host_memory: float = 0.0
    fsdp: bool = False


@dataclass(frozen=True)
class PlanInput:
    """The options of one run that decide its memory and time (``prune.run``'s, as plain numbers)."""

    model: str
    drop: int = 0
    replace: str = "none"
    dtype: str = "auto"
    quant_bits: int = 16
    offload: str = "none"
    samples: int = 64
    seq_len: int = 512
    heldout_samples: int = 8
    batch_size: int = 4
    fit_short: int = 0
    select: str = "topk"
    protected: int = 2  # blocks no selection removes (--protect; "0,-1" by default)
    checkpoint_dtype: str = "float32"
    distill: DistillSpec = field(default_factory=DistillSpec)
    hardware: Hardware = field(default_factory=Hardware)
    # whether --offload sequential could run these options, as PruneConfig.offload_refusals says (the data aside);
    # False where no config says so, and a plan then never proposes it
    offloadable: bool = False
    # the FLOP rate of this model's widths over the reference widths' on this CPU (prune.planner.machine.shape_speed)
    shape_speed: float = 1.0

    @property
    def on_gpu(self) -> bool:
        """Whether the run computes on GPUs."""
        return self.hardware.gpus > 0

    @property
    def dtype_bytes(self) -> int:
        """Bytes of a weight that is not quantized: ``--dtype auto`` is float32 on a CPU, the checkpoint's on a GPU."""
        if self.dtype != "auto":
            return DTYPE_BYTES[self.dtype]
        if self.quant_bits < 16:
            return 2  # bitsandbytes computes in bf16
        return DTYPE_BYTES.get(self.checkpoint_dtype, 4) if self.on_gpu else 4

    @property
    def act_bytes(self) -> int:
        """Bytes of an activation (the compute dtype)."""
        return self.dtype_bytes

    @property
    def spans(self) -> int:
        """Spans replaced: at most one per dropped block (one for ``--select span``)."""
        return min(self.drop, 1) if self.select == "span" else self.drop

    @property
    def calibration_tokens(self) -> int:
        """Tokens scored."""
        return self.samples * self.seq_len
