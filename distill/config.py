"""Options of a distillation run, with CPU-sensible defaults.

The defaults are sized for a small model on a laptop-class CPU: 4 sequences of 128 tokens per step
(512 tokens), so ``prune.run --model smollm2-135m --drop 4 --replace linear --distill-steps 100``
trains in about 5 minutes on two cores (3 s a step: the default KL runs both LM heads). Half of the
default text is sampled from the model first, ~9 minutes more on those cores and seconds on a GPU
(``distill: {data: {data: builtin}}`` reads the shipped novel alone instead). On a GPU raise
``batch_size`` / ``seq_len``.

The learning rate 3e-4 was measured on SmolLM2-135M with 4 blocks replaced by a closed-form linear map
(held-out perplexity after 100 steps: 34.6 at 1e-4, 34.3 at 3e-4; dense 31.4, closed form 36.3).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from prune.data import DEFAULT_DATA, DataConfig
from prune.errors import LayercutError

TRAIN_MODES = ("replacements", "all", "lora")
# Peak learning rate per --train mode. Fresh maps tolerate 3e-4; updating every pretrained weight at
# that rate diverged on SmolLM2-135M (layerwise loss 229 -> 6117 within 5 steps), 2e-5 did not.
DEFAULT_LR = {"replacements": 3e-4, "lora": 3e-4, "all": 2e-5}
DEFAULT_SEQ_LEN = 128
DEFAULT_SAMPLES = 512  # 512 x 128 = 65k tokens; 200 steps of 4 sequences pass over them 1.6 times
DEFAULT_WARMUP_SHARE = 0.1


def _default_data() -> DataConfig:
    # The calibration's default mixture, half the novel and half text sampled from the model: on a
    # selection split no reported figure reads (reports/smollm2-135m-distill-data/), 200 steps on it left
    # SmolLM2-135M at drop 8 at 1.965x dense perplexity (geometric mean over seven texts), against 2.104x
    # for 1,024 sequences of the novel alone. Sampling its 256 sequences costs ~9 minutes on 2 CPU cores.
    return DataConfig(data=DEFAULT_DATA, samples=DEFAULT_SAMPLES, seq_len=DEFAULT_SEQ_LEN)


@dataclass
class DistillConfig:
    """One distillation run.

    Attributes:
        steps: optimizer steps.
        lr: peak AdamW learning rate (reached after the warm-up, then cosine decay to 0); None takes
            ``DEFAULT_LR[train]``.
        batch_size: sequences per micro-batch.
        grad_accum: micro-batches per optimizer step (tokens per step = grad_accum x batch_size x seq_len).
        warmup_steps: linear warm-up steps; None means 10% of ``steps``.
        mse_weight: weight of the layerwise MSE between student and teacher block outputs (0 by default).
        kl_weight: weight of KL(teacher || student) on the logits (0 skips the LM head; the default objective).
        cosine_reg: weight of the consecutive-state cosine regulariser (Secretly Linear).
        train: what is trained: "replacements" (replacement modules only), "all" (every student
            parameter except the token/position embeddings and the LM head) or "lora" (LoRA adapters
            on every Linear of the kept blocks, plus the replacement modules; merged at the end).
        lora_r: LoRA rank.
        lora_alpha: LoRA scaling numerator (the update is scaled by ``lora_alpha / lora_r``).
        lora_dropout: dropout on the LoRA input.
        weight_decay: AdamW decoupled weight decay (0: a closed-form map should not be pulled to 0).
        max_grad_norm: gradient clipping threshold (global L2 norm); 0 disables clipping.
        log_every: write a ``train_log.jsonl`` line every this many steps (and at the last one).
        save_every: checkpoint every this many steps (and at the last one); 0 checkpoints only at the end.
        seed: seeds the batch order, LoRA initialisation and dropout.
        mixed_precision: "auto" (bf16 autocast on a GPU that supports it, float32 on the CPU),
            "no" or "bf16".
        data: the text sequences are drawn from; its ``seq_len`` is the training sequence length.
    """

    steps: int = 100
    lr: float | None = None
    batch_size: int = 4
    grad_accum: int = 1
    warmup_steps: int | None = None
    # KL on the logits, not the layerwise MSE of Secretly Linear: on the selection split (SmolLM2-135M, drop 8,
    # 200 steps) the MSE fell only from 587 to 424, and KL left the model at 1.832x dense perplexity (geometric
    # mean, seven texts) against 1.965x with the MSE, lower on every text (reports/smollm2-135m-distill-data/).
    # --mse-weight 1 --kl-weight 0 is the paper's objective.
    mse_weight: float = 0.0
    kl_weight: float = 1.0
    cosine_reg: float = 0.0
    train: str = "replacements"
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    log_every: int = 10
    save_every: int = 50
    seed: int = 0
    mixed_precision: str = "auto"
    data: DataConfig = field(default_factory=_default_data)

    def __post_init__(self):
        if isinstance(self.data, dict):  # a partial section keeps distillation's own defaults for the rest
            self.data = dataclasses.replace(_default_data(), **self.data)
        if self.train not in TRAIN_MODES:
            raise LayercutError(f"unknown --train '{self.train}': choose one of {', '.join(TRAIN_MODES)}")
        if self.lr is None:
            self.lr = DEFAULT_LR[self.train]
        self._check_counts()
        self._check_weights()
        if self.mixed_precision not in ("auto", "no", "bf16"):
            raise LayercutError(f"unknown mixed_precision '{self.mixed_precision}': use auto, no or bf16")

    def _check_counts(self) -> None:
        positive = {"steps": self.steps, "batch-size": self.batch_size, "grad-accum": self.grad_accum,
                    "lora-r": self.lora_r, "log-every": self.log_every}
        for name, value in positive.items():
            if not isinstance(value, int) or value <= 0:
                raise LayercutError(f"--{name} must be a positive integer, got {value}")
        if self.save_every < 0:
            raise LayercutError(f"--save-every must be 0 (only at the end) or positive, got {self.save_every}")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps <= self.steps:
            raise LayercutError(f"--warmup-steps must be in 0..{self.steps} (--steps), got {self.warmup_steps}")

    def _check_weights(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise LayercutError(f"--lr must be a positive number, got {self.lr}")
        nonnegative = {"mse-weight": self.mse_weight, "kl-weight": self.kl_weight, "cosine-reg": self.cosine_reg,
                       "weight-decay": self.weight_decay, "max-grad-norm": self.max_grad_norm,
                       "lora-dropout": self.lora_dropout, "lora-alpha": self.lora_alpha}
        for name, value in nonnegative.items():
            if not (math.isfinite(value) and value >= 0):
                raise LayercutError(f"--{name} must be a finite number >= 0, got {value}")
        if self.mse_weight == 0 and self.kl_weight == 0:
            raise LayercutError("--mse-weight and --kl-weight are both 0: nothing to distill; set one above 0")
        if self.lora_dropout >= 1:
            raise LayercutError(f"--lora-dropout must be below 1, got {self.lora_dropout}")

    @property
    def warmup(self) -> int:
        """Warm-up steps actually used (``warmup_steps``, or 10% of ``steps``)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return int(round(DEFAULT_WARMUP_SHARE * self.steps))

    @property
    def tokens_per_step(self) -> int:
        """Tokens seen per optimizer step (one process)."""
        return self.grad_accum * self.batch_size * self.data.seq_len

    def loss_weights(self) -> dict[str, float]:
        """Registered loss name -> weight, for the terms with a non-zero weight."""
        weights = {"layerwise_mse": self.mse_weight, "teacher_student_kl": self.kl_weight,
                   "consecutive_cosine_distance": self.cosine_reg}
        return {name: weight for name, weight in weights.items() if weight > 0}

    @classmethod
    def from_dict(cls, values: dict) -> DistillConfig:
        """Build from a recipe / ``prune.run`` section; unknown or moved keys give a one-line error."""
        values = dict(values)
        if "seq_len" in values:
            raise LayercutError("distill: 'seq_len' moved; write it as distill: {data: {seq_len: ...}}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise LayercutError(f"distill: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)

    def to_dict(self) -> dict:
        """JSON-ready copy (for reports and checkpoints)."""
        return dataclasses.asdict(self)
