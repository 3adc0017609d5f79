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

from distill.losses import LOSSES, cache_refusal, legacy_keys
from prune.data.calibration import DEFAULT_DATA, DataConfig, numeric_fields
from prune.errors import LayercutError
from prune.planner.inputs import LORA_ALL, lora_targets_spec

TRAIN_MODES = ("replacements", "all", "lora")
# Peak learning rate per --train mode. Fresh maps tolerate 3e-4; updating every pretrained weight at
# that rate diverged on SmolLM2-135M (layerwise loss 229 -> 6117 within 5 steps), 2e-5 did not.
DEFAULT_LR = {"replacements": 3e-4, "lora": 3e-4, "all": 2e-5}
# AdamW moves each weight by about lr a step: above 1 a step outweighs the weights themselves, and far above it
# (1e38) the step size overflows float32 inside torch's Adam.
MAX_LR = 1.0
DEFAULT_SEQ_LEN = 128
DEFAULT_SAMPLES = 512  # 512 x 128 = 65k tokens; 200 steps of 4 sequences pass over them 1.6 times
DEFAULT_WARMUP_SHARE = 0.1
# KL on the logits, not the layerwise MSE of Secretly Linear: on the selection split (SmolLM2-135M, drop 8,
# 200 steps) the MSE fell only from 587 to 424, and KL left the model at 1.832x dense perplexity (geometric
# mean, seven texts) against 1.965x with the MSE, lower on every text (reports/smollm2-135m-distill-data/).
# {layerwise_mse: 1} is the paper's objective.
DEFAULT_LOSSES = {"teacher_student_kl": 1.0}


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
        losses: registered loss name (``distill.losses.LOSSES``) -> weight; the objective is their weighted
            sum. Weights of 0 are dropped; the rest are kept in registration order (the order the terms
            are summed in). Default: ``{teacher_student_kl: 1.0}``. A recipe may still give the older
            weight keys (``mse_weight``, ``kl_weight``, ``cosine_reg``, :meth:`from_dict`), each setting
            its loss's weight over the default.
        train: what is trained: "replacements" (replacement modules only), "all" (every student
            parameter except the token/position embeddings and the LM head) or "lora" (LoRA adapters
            on every Linear of the kept blocks, plus the replacement modules; merged at the end).
        lora_r: LoRA rank.
        lora_alpha: LoRA scaling numerator (the update is scaled by ``lora_alpha / lora_r``).
        lora_dropout: dropout on the LoRA input.
        lora_targets: which Linear layers of the blocks get adapters: "all-linear" (every one, as peft's
            keyword), or a comma list of their names as the model calls them ("q_proj,v_proj"), each
            matched against the last part of a layer's name, as peft's ``target_modules`` list matches.
        weight_decay: AdamW decoupled weight decay (0: a closed-form map should not be pulled to 0).
        max_grad_norm: gradient clipping threshold (global L2 norm); 0 disables clipping.
        log_every: write a ``train_log.jsonl`` line every this many steps (and at the last one).
        save_every: checkpoint every this many steps (and at the last one); 0 checkpoints only at the end.
        seed: seeds the batch order, LoRA initialisation and dropout.
        mixed_precision: "auto" (bf16 autocast on a GPU that supports it, float32 on the CPU),
            "no" or "bf16".
        data: the text sequences are drawn from; its ``seq_len`` is the training sequence length.
        teacher_cache: None (the teacher runs beside the student at every step) or "topk=K": the teacher's
            top K logits per token and the log-sum-exp of the rest are written once to the work folder
            (``distill.teacher_cache``) and training reads them, without the teacher in memory. Only losses on
            the logits run from it (``teacher_student_kl`` becomes its top-K + rest form).
    """

    steps: int = 100
    lr: float | None = None
    batch_size: int = 4
    grad_accum: int = 1
    warmup_steps: int | None = None
    losses: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_LOSSES))
    train: str = "replacements"
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: str = LORA_ALL
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    log_every: int = 10
    save_every: int = 50
    seed: int = 0
    mixed_precision: str = "auto"
    data: DataConfig = field(default_factory=_default_data)
    teacher_cache: str | None = None

    def __post_init__(self):
        numeric_fields(self, "distill")  # a recipe's lr: 3e-4 is YAML text: read as the number; "fast" refused
        if isinstance(self.data, dict):  # a partial section keeps distillation's own defaults for the rest
            known = [f.name for f in dataclasses.fields(DataConfig)]
            unknown = sorted(set(self.data) - set(known))
            if unknown:
                raise LayercutError(f"distill: data: unknown key(s) {', '.join(map(str, unknown))}; known: "
                                    f"{', '.join(known)}")
            self.data = dataclasses.replace(_default_data(), **self.data)
        if not isinstance(self.data, DataConfig):
            raise LayercutError(f"distill: data must be a mapping of DataConfig keys, such as data: {{samples: 512}}, "
                                f"got {self.data!r}")
        if self.train not in TRAIN_MODES:
            raise LayercutError(f"unknown --train '{self.train}': choose one of {', '.join(TRAIN_MODES)}")
        if self.lr is None:
            self.lr = DEFAULT_LR[self.train]
        self._check_counts()
        self._check_weights()
        if self.mixed_precision not in ("auto", "no", "bf16"):
            raise LayercutError(f"unknown mixed_precision '{self.mixed_precision}': use auto, no or bf16")
        if self.teacher_cache is not None:
            self.teacher_cache = f"topk={cache_k(self.teacher_cache)}"
            refusal = cache_refusal(self.losses)
            if refusal:
                raise LayercutError(refusal)

    @property
    def cache_k(self) -> int | None:
        """K of ``teacher_cache`` ("topk=K"), or None without a cache."""
        return None if self.teacher_cache is None else cache_k(self.teacher_cache)

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
        if not (math.isfinite(self.lr) and 0 < self.lr <= MAX_LR):
            raise LayercutError(f"--lr must be a positive number at most {MAX_LR:g} (AdamW moves each weight by about "
                                f"lr a step; the default is {DEFAULT_LR[self.train]:g}), got {self.lr}")
        self.losses = checked_losses(self.losses)
        nonnegative = {"weight-decay": self.weight_decay, "max-grad-norm": self.max_grad_norm,
                       "lora-dropout": self.lora_dropout, "lora-alpha": self.lora_alpha}
        for name, value in nonnegative.items():
            if not (math.isfinite(value) and value >= 0):
                raise LayercutError(f"--{name} must be a finite number >= 0, got {value}")
        if self.lora_dropout >= 1:
            raise LayercutError(f"--lora-dropout must be below 1, got {self.lora_dropout}")
        self.lora_targets = lora_targets_spec(self.lora_targets)

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
        """Registered loss name -> weight, for the terms with a non-zero weight, in registration order."""
        return dict(self.losses)

    @classmethod
    def from_dict(cls, values: dict) -> DistillConfig:
        """Build from a recipe / ``prune.run`` section; unknown or moved keys give a one-line error.

        The older weight keys (``kl_weight: 0.0``, ...) set their loss's weight in ``losses`` (given, or
        the default).
        """
        values = dict(values)
        if "seq_len" in values:
            raise LayercutError("distill: 'seq_len' moved; write it as distill: {data: {seq_len: ...}}")
        legacy = {key: values.pop(key) for key in legacy_keys() if key in values}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        known |= set(legacy_keys())
        if unknown:
            raise LayercutError(f"distill: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if legacy:
            values["losses"] = with_legacy_weights(values.get("losses", DEFAULT_LOSSES), legacy)
        return cls(**values)

    def to_dict(self) -> dict:
        """JSON-ready copy (for reports and checkpoints)."""
        return dataclasses.asdict(self)

    def legacy_dict(self) -> dict:
        """:meth:`to_dict` in the layout before ``losses``: each loss with an older key at it (0.0 if unused).

        Losses registered without a key stay in ``losses`` (left out when none is used). ``eval.compare``
        hashes this, so the cells distilled before the change keep their digests.
        """
        values = self.to_dict()
        keys = {name: key for key, name in legacy_keys().items()}
        losses = values.pop("losses")
        values.update({key: losses.get(name, 0.0) for name, key in keys.items()})
        rest = {name: weight for name, weight in losses.items() if name not in keys}
        if values["teacher_cache"] is None:  # a field newer than the digests: absent when unused, like ``losses``
            del values["teacher_cache"]
        if values["lora_targets"] == LORA_ALL:  # newer than the digests too: absent at its default
            del values["lora_targets"]
        return {**values, **({"losses": rest} if rest else {})}


def cache_k(spec) -> int:
    """K of a ``--teacher-cache`` value "topk=K" (K a positive integer), or a one-line error."""
    kind, _, count = str(spec).strip().partition("=")
    if kind.strip() != "topk" or not count.strip().isdigit() or int(count) <= 0:
        raise LayercutError(f"--teacher-cache takes topk=K with K a positive integer (topk=64), got {spec!r}")
    return int(count)


def with_legacy_weights(losses: dict, legacy: dict[str, float]) -> dict:
    """``losses`` with the weights the older keys give (``{"mse_weight": 1.0}``) set on their losses."""
    names = legacy_keys()
    return {**losses, **{names[key]: weight for key, weight in legacy.items()}}


def checked_losses(losses: dict) -> dict[str, float]:
    """The positive weights of ``losses``, in registration order.

    Raises:
        LayercutError: not a mapping, an unknown loss, a weight that is not a finite number >= 0, or no
            weight above 0.
    """
    if not isinstance(losses, dict):
        raise LayercutError(f"distill: losses must map loss names to weights ({{teacher_student_kl: 1.0}}), got "
                            f"{losses!r}")
    for name, weight in losses.items():
        LOSSES.get(name)  # an unknown name lists the known ones
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (math.isfinite(weight)
                                                                                     and weight >= 0):
            raise LayercutError(f"loss weight {name}={weight} must be a finite number >= 0")
    if not any(weight > 0 for weight in losses.values()):
        raise LayercutError("no loss has a weight above 0: nothing to distill; give one, e.g. "
                            "--loss teacher_student_kl=1")
    return {name: float(losses[name]) for name in LOSSES if losses.get(name, 0) > 0}
