"""``prune.ship``'s heal as distillation: its options, the rows it trains and measures on, and its training.

One heal, two callers: ``ship.heal`` runs it once inside a ship run (resuming, on ``--processes N``), and
``eval.bench heal-curve`` runs it at several step counts on one built checkpoint to measure what a step buys.
Both read the options, the rows and the training here, so the bench's healed weights are ship's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from distill.config import LORA_ALL, DistillConfig
from distill.step import DistillStep
from prune.checkpoint.report import read_report
from prune.checkpoint.save_load import load
from prune.data.calibration import DataConfig
from prune.errors import LayercutError
from prune.loading.loader import LoadedModel
from prune.model.surgery import LAYOUT_ATTR
from prune.pipeline.steps import StepResult
from prune.selection.repaired import split_rows

# the healing: KL on the logits (distill's default objective) through LoRA on every Linear of the kept blocks and
# the fold's projections trained in full, merged at the end (a plain checkpoint). LoRA, not the projections alone:
# on the selection split (SmolLM2-135M, drop 8, fold-rotate, 200 steps; reports/servable-repairs/) it left the
# lower perplexity on every text. The teacher's top-256 logits are written once and read at every step: its forward
# was 22 % of an online step (eval.bench teacher-cache --train lora, SmolLM2-135M at drop 8, 40 steps: 2.718 s a step
# against 3.494 s, the held-out KL 0.4117 against 0.4094), and the heal reads its rows several times over
# (4 sequences a step: distill's default, stated here because --processes splits them between the processes)
HEAL_BATCH = 4
# LoRA of rank 64 at alpha 128 (rank 8's scale of 2): on the selection split (SmolLM2-135M drop 8, 100 steps,
# reports/heal-train/) it lowered every text's perplexity, the geometric mean 4.0 % below rank 8's (rank 32: 2.6 %;
# every weight at distillation's lr 2e-5: 4.4 % above), in the same 5-6 minutes; on the reported texts 4.8 % lower
# (as rank 8's 200-400 steps), the tasks' retention a tie (+0.6 +- 1.8 points). On every Linear of the blocks: the
# attention's projections alone were 1.2 % above it, the MLP's alone 3.0 %; rank 128 0.6 % below it for 13 % more
# training, rank 256 0.3 % (the same split and build, 2026-12-05)
HEAL_OPTIONS = {"train": "lora", "lora_r": 64, "lora_alpha": 128.0, "teacher_cache": "topk=256",
                "batch_size": HEAL_BATCH}
# sequences of this many tokens (distill's default length): the heal cuts its calibration rows into them
HEAL_SEQ_LEN = 128
# a checkpoint of the training every this many steps (and at the last): a killed heal resumes from the latest,
# losing at most a tenth of its steps; LoRA's parameters and optimizer state are small beside the model
HEAL_CHECKPOINTS = 10
HEAL_MIN_SAVE_EVERY = 10


def heal_data_config(spec: str, samples: int, calibration: DataConfig, seq_len: int | None = None) -> DataConfig:
    """``--heal-data``'s draw of ``samples`` sequences of ``spec``, refused in the words of its own flags.

    The sequences are the calibration's length (or ``seq_len``), with its seed and text field, none held out.
    """
    try:
        return DataConfig(data=spec, samples=samples, seq_len=seq_len or calibration.seq_len, seed=calibration.seed,
                          text_field=calibration.text_field, heldout_samples=0)
    except LayercutError as err:  # its words name --data and --samples: say which flags they are here
        raise LayercutError(str(err).replace("--samples", "--heal-samples").replace("--data", "--heal-data")) \
            from None


def heal_rows(token_ids: torch.Tensor) -> torch.Tensor:
    """Rows of ``token_ids`` [n, seq] cut into rows of ``HEAL_SEQ_LEN`` tokens (the rows as they are when shorter)."""
    rows, seq = token_ids.shape
    if seq <= HEAL_SEQ_LEN:
        return token_ids
    usable = seq // HEAL_SEQ_LEN * HEAL_SEQ_LEN
    return token_ids[:, :usable].reshape(rows * (usable // HEAL_SEQ_LEN), HEAL_SEQ_LEN)


@dataclass(frozen=True)
class HealRows:
    """The calibration rows as the heal reads them (:meth:`of`).

    Attributes:
        train: the shortlist's fitting rows cut by :func:`heal_rows` [n, HEAL_SEQ_LEN]: what the heal trains on.
        measure: the measuring rows as they are [m, seq]: the KL before and after is measured on them (by
            the caller: distillation is given no held-out rows, see :func:`heal_training`).
    """

    train: torch.Tensor
    measure: torch.Tensor

    @classmethod
    def of(cls, calibration: torch.Tensor, more: torch.Tensor | None = None) -> HealRows:
        """The heal's rows of ``calibration`` [samples, seq] (:func:`prune.selection.repaired.split_rows`).

        ``more`` [rows, seq]: other text it trains on beside the fitting rows (``--heal-data``); what it is
        judged on stays the calibration's measuring rows, so a heal on more text is kept by the same test.
        """
        fit, measure = split_rows(calibration)
        train = heal_rows(fit) if more is None else torch.cat([heal_rows(fit), heal_rows(more)])
        return cls(train, measure)

    def tokens(self, steps: int) -> int:
        """Tokens ``steps`` steps train on: ``HEAL_BATCH`` rows of ``train`` a step (rows read again once seen)."""
        return steps * HEAL_BATCH * int(self.train.shape[1])


def heal_student(checkpoint: str | Path, dtype: str, device: str) -> tuple[LoadedModel, dict]:
    """The built checkpoint loaded to be healed, and its ``layercut.json`` (the layout the teacher cache pairs)."""
    student = load(checkpoint, dtype=dtype, device=device)
    report = read_report(checkpoint)
    if getattr(student.model.config, LAYOUT_ATTR, None) is None:
        setattr(student.model.config, LAYOUT_ATTR, report.get("layout"))
    return student, report


def heal_settings(train: dict | None = None) -> dict:
    """What the heal trains and how, as distillation reads it: ``train``, ``lr`` and, for LoRA, its rank and alpha.

    For LoRA on some layers only, ``lora_targets`` too: absent where it adapts every Linear (the default), so the
    settings of work folders and records written before the option stay as they were.

    ``train``: options in place of :data:`HEAL_OPTIONS`' (as :func:`heal_training` takes them).
    """
    config = DistillConfig.from_dict({**HEAL_OPTIONS, **(train or {})})
    lora = {"lora_r": config.lora_r, "lora_alpha": config.lora_alpha} if config.train == "lora" else {}
    if lora and config.lora_targets != LORA_ALL:
        lora["lora_targets"] = config.lora_targets
    return {"train": config.train, "lr": config.lr, **lora}


def heal_training(student: LoadedModel, original: LoadedModel, rows: HealRows, steps: int, step_config, *,
                  resume: bool = False, processes: int = 1, folder: str | Path | None = None,
                  train: dict | None = None) -> StepResult:
    """Distil ``student`` in place towards ``original`` for ``steps`` steps of the heal (:data:`HEAL_OPTIONS`).

    ``step_config``: the run's ``PruneConfig`` with ``out`` set; its data seed seeds the training and
    ``<out>.work/`` holds the teacher cache and the checkpoints (one every tenth of the steps, at least
    ``HEAL_MIN_SAVE_EVERY`` apart). ``resume``, ``processes`` and ``folder``: :class:`distill.step.DistillStep`'s.
    ``train``: distillation options in place of the heal's own (``{"train": "all"}``, ``{"lora_r": 32}``): what
    ``eval.bench heal-curve --train`` compares on the selection split.

    Distillation scores no held-out rows of its own: both callers measure ``rows.measure`` whole against the
    original before and after, and its loss before and after on those rows cut short (with 32 of the same rows
    read back) was four passes of the student and an eighth more of the teacher's cache, 45 s of a 386 s heal
    (SmolLM2-135M drop 4, 100 steps, profiled, 2026-12-04), for figures no caller read.
    """
    save_every = max(steps // HEAL_CHECKPOINTS, HEAL_MIN_SAVE_EVERY)
    options = {**HEAL_OPTIONS, **(train or {}), "steps": steps, "seed": step_config.data.seed, "save_every": save_every}
    step = DistillStep(options, step_config)
    return step(student, step_config, token_ids=rows.train, heldout_ids=None, teacher=original, resume=resume,
                processes=processes, folder=folder)
