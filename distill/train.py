"""Layerwise distillation: train a surgered student to reproduce its teacher's block outputs.

Each step draws ``grad_accum`` micro-batches of packed calibration sequences, runs the teacher
(eval, no grad) and the student with hooks on their blocks, and minimises the weighted losses of
``distill.losses`` (by default the sum over student blocks ``j`` of the MSE between block ``j``'s
output and the teacher's state ``max(layout[j]) + 1``). Teacher activations are computed on the fly,
so memory depends on the batch, never on the number of calibration sequences; with ``teacher_cache``
(``--teacher-cache topk=K``) the teacher runs once before training instead, and its top-K logits are read
back from disk (``distill.teacher_cache``).

``accelerate.Accelerator`` places the student, runs bf16 autocast on a GPU and accumulates gradients;
the same path runs on the CPU in float32 (``python -m distill.run``) and under ``accelerate launch``.

This module sets a run up and summarises it; the steps are ``distill.loop``'s, the hooked forward passes
``distill.forward``'s and the held-out measurement ``distill.generalisation``'s.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from distill.checkpoints import latest_checkpoint, list_checkpoints
from distill.checks import check_models
from distill.config import DistillConfig
from distill.forward import evaluate_losses, forward_states
from distill.generalisation import (
    FEW_READS,
    MANY_READS,
    Generalisation,
    heldout_strata,
    reads_per_sequence,
    warn_many_reads,
)
from distill.layout import Layout, check_layout, resolve_layout
from distill.loop import JsonLog, Run, make_accelerator, train_loop
from distill.sharded import full_model_state, is_sharded
from distill.teacher_cache import TeacherCache, cache_folder, prepare_cache
from distill.trainable import merge_lora
from prune.data.calibration import calibration_data
from prune.errors import LayercutError
from prune.memory import peak_rss_bytes
from prune.model.adapters import num_blocks

# the names callers import from here, though they live in the modules above
__all__ = ["FEW_READS", "LOG_FILE", "MANY_READS", "DistillResult", "distill", "evaluate_losses", "forward_states",
           "make_accelerator", "reads_per_sequence"]

logger = logging.getLogger(__name__)

LOG_FILE = "train_log.jsonl"

# each calibration row's source and each held-out row's, for a mixture (see heldout_strata)
_Strata = tuple[torch.Tensor, torch.Tensor]


@dataclass
class DistillResult:
    """What a distillation run did.

    Attributes:
        steps: optimizer steps completed (including those before a resume).
        final_loss: total loss of the last step.
        losses: total loss of each step run by this call.
        steps_per_second: optimizer steps per second in this call (training loop only).
        peak_memory_bytes: peak resident memory (RSS) of the process so far.
        log_path: the JSON-lines log, or None without a work folder.
        start_step: step this call started from (0, or the resumed checkpoint's).
        final_terms: each loss term of the last step, unweighted.
        seconds: wall time of the training loop in this call.
        trainable_parameters: number of trained scalars.
        peak_gpu_memory_bytes: peak CUDA memory allocated, or None on the CPU.
        generalisation: the loss on held-out sequences of the training text and on as many sequences
            training drew (as many of each source), before the first step (or the step a resumed run's
            first checkpointed measurement was taken, ``before_step``) and after the last; None without
            held-out sequences.
        teacher_cache: the teacher cache's K, size, writing time and whether this run wrote it
            (``TeacherCache.report``); None when the teacher ran online.
        whole_state: the trained tensors gathered from a sharded (FSDP) student on the main process, for the
            export (the student itself stays sharded); None without FSDP. Not part of the report.
    """

    steps: int
    final_loss: float
    losses: list[float]
    steps_per_second: float
    peak_memory_bytes: int
    log_path: Path | None
    start_step: int = 0
    final_terms: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    trainable_parameters: int = 0
    peak_gpu_memory_bytes: int | None = None
    generalisation: dict | None = None
    teacher_cache: dict | None = None
    whole_state: dict | None = None

    def report(self, config: DistillConfig) -> dict:
        """The ``distill`` section of ``layercut.json``."""
        return {
            "config": config.to_dict(),
            "steps": self.steps,
            "start_step": self.start_step,
            "first_loss": self.losses[0] if self.losses else None,
            "final_loss": self.final_loss,
            "final_terms": self.final_terms,
            "steps_per_second": round(self.steps_per_second, 4),
            "seconds": round(self.seconds, 2),
            "tokens_per_step": config.tokens_per_step,
            "trainable_parameters": self.trainable_parameters,
            "peak_memory_bytes": self.peak_memory_bytes,
            "peak_gpu_memory_bytes": self.peak_gpu_memory_bytes,
            "generalisation": self.generalisation,
            **({"teacher_cache": self.teacher_cache} if self.teacher_cache is not None else {}),
        }


def _prepare_work(out: str | Path | None, resume: bool) -> tuple[Path | None, Path | None]:
    """The work folder and the checkpoint to resume from (None for a fresh start)."""
    work = Path(out).expanduser() if out is not None else None
    if resume:
        path = latest_checkpoint(work) if work is not None else None
        if path is None:
            raise LayercutError(
                f"--resume: no checkpoint found in {work / 'checkpoints' if work else '(no work folder given)'}; "
                "run without --resume to start from step 0"
            )
        return work, path
    if work is not None and list_checkpoints(work):
        logger.warning("starting over: removing the old checkpoints in %s", work)
        for _, old in list_checkpoints(work):
            old.unlink()
    return work, None


def distill(
    student: nn.Module, teacher: nn.Module | None, tokenizer, config: DistillConfig, *,
    out: str | Path | None = None, resume: bool = False, token_ids: torch.Tensor | None = None,
    heldout_ids: torch.Tensor | None = None, layout: Layout | None = None, teacher_cache: TeacherCache | None = None,
    save_total_limit: int = 1,
) -> DistillResult:
    """Train ``student`` in place to match ``teacher`` block by block.

    Args:
        student: the surgered model (its ``config.layercut_layout`` says which teacher states its
            blocks stand for). LoRA adapters are merged back into it before returning.
        teacher: the original model; only run forward (eval mode, no grad), never changed (with
            ``config.teacher_cache``, once, to write the cache into ``out``); None with ``teacher_cache``.
        tokenizer: packs ``config.data`` into sequences (unused when ``token_ids`` is given).
        config: the run's options.
        out: work folder for ``train_log.jsonl``, ``checkpoints/`` and ``teacher_cache/``; None writes nothing.
        resume: continue from the latest checkpoint in ``out``.
        token_ids: pre-packed sequences [samples, seq_len] to draw batches from instead of ``config.data``.
        heldout_ids: sequences [n, seq_len] training never draws, scored before and after training beside
            as many training sequences (``DistillResult.generalisation``). With ``token_ids`` None they
            are ``config.data``'s held-out sequences (``--heldout-samples``).
        layout: the student's layout, overriding what it records (required without a teacher).
        teacher_cache: an opened cache of the teacher's top-K logits, whose sequences are the run's
            (``distill.job`` writes it, then frees the teacher); None: written here if the config asks.
        save_total_limit: checkpoints kept in ``out`` (the newest ones); older ones are deleted.

    Returns:
        The run's :class:`DistillResult`.

    Raises:
        LayercutError: incompatible models, no layout, ``resume`` without a checkpoint, NaN/inf loss.
    """
    layout = _checked_layout(student, teacher, layout, teacher_cache)
    work, checkpoint = _prepare_work(out, resume)
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    token_ids, heldout_ids, sources = training_ids(tokenizer, teacher, config, token_ids, heldout_ids, teacher_cache)
    if config.teacher_cache is not None and teacher_cache is None:
        teacher_cache = write_teacher_cache(teacher, config, work, (token_ids, heldout_ids, sources), student)
    teacher_was_training = teacher is not None and teacher.training
    run = Run(student, teacher, token_ids.long(), config, layout, work, teacher_cache)
    run.save_total_limit = save_total_limit
    start, log, check = _start(run, checkpoint, heldout_ids, layout, sources)
    seconds = train_loop(run, start, log)
    check.measure("after")
    return _finish(run, start, seconds, teacher_was_training, log, check.summary(), teacher_cache)


def write_teacher_cache(teacher: nn.Module, config: DistillConfig, work: Path | None,
                        data: tuple[torch.Tensor, torch.Tensor | None, _Strata | None],
                        student: nn.Module | None = None, *, request: dict | None = None,
                        meta: dict | None = None) -> TeacherCache:
    """The valid teacher cache of ``data`` (training ids, held-out ids, strata) in ``work``, written if need be.

    The teacher runs under the autocast training will use (a student on the CPU trains in float32 there);
    ``request`` and ``meta`` go into the header (see ``distill.teacher_cache``).
    """
    device = next((student or teacher).parameters()).device
    accelerator = make_accelerator(config, on_cpu=device.type == "cpu")
    token_ids, heldout_ids, sources = data
    return prepare_cache(cache_folder(work) if work is not None else None, teacher, token_ids.long(), heldout_ids,
                         config.cache_k, precision=str(accelerator.mixed_precision), batch_size=config.batch_size,
                         sources=sources, request=request, meta=meta, autocast=accelerator.autocast)


def _checked_layout(student: nn.Module, teacher: nn.Module | None, layout: Layout | None,
                    cache: TeacherCache | None) -> Layout:
    """Check the models fit together; the given layout checked against them, else the student's own.

    Without a teacher (its cache stands in) the layout must be given; it is checked against the depth the
    cache's header records.
    """
    if teacher is None:
        if cache is None or not layout:
            raise ValueError("distill without a teacher needs its cache (teacher_cache=) and the layout (layout=)")
        vocab = int(student.get_input_embeddings().weight.shape[0])
        if vocab != cache.header["vocab"]:
            raise LayercutError(f"the teacher cache {cache.folder} is of a vocabulary of {cache.header['vocab']}, the "
                                f"student's has {vocab}: pass the student's teacher, or delete the cache")
        depth = cache.header.get("teacher_blocks") or max(map(max, layout)) + 1
        return check_layout(layout, num_blocks(student), int(depth))
    check_models(student, teacher)
    if layout:
        return check_layout(layout, num_blocks(student), num_blocks(teacher))
    return resolve_layout(student, teacher)


def training_ids(tokenizer, teacher: nn.Module | None, config: DistillConfig, token_ids: torch.Tensor | None,
                  heldout_ids: torch.Tensor | None, cache: TeacherCache | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor | None, _Strata | None]:
    """The sequences to train on and to hold out, and their sources for a mixture (see :func:`heldout_strata`).

    A given ``cache`` holds them; given ``token_ids`` are used as they are; otherwise ``config.data`` is packed,
    and its held-out sequences stand in for ``heldout_ids`` when none are given.

    Raises:
        LayercutError: ``token_ids`` not [samples, seq_len >= 2], or ``heldout_ids`` of another length, or
            other sequences than the cache's.
    """
    sources = None
    if cache is not None:
        if token_ids is not None and not torch.equal(token_ids.long(), cache.token_ids):
            raise LayercutError(f"the teacher cache {cache.folder} holds other sequences than token_ids: delete it "
                                "or pass its own sequences")
        return cache.token_ids, cache.heldout_ids, cache.sources
    if token_ids is None:
        data = calibration_data(tokenizer, config.data, model=teacher)
        token_ids = data.token_ids  # [samples, seq_len] int64
        if heldout_ids is None:
            heldout_ids = data.heldout_ids
            sources = heldout_strata(data)
    if token_ids.dim() != 2 or token_ids.shape[1] < 2:
        raise LayercutError(f"token_ids must be [samples, seq_len >= 2], got shape {tuple(token_ids.shape)}")
    if heldout_ids is not None and (heldout_ids.dim() != 2 or heldout_ids.shape[1] != token_ids.shape[1]):
        raise LayercutError(f"heldout_ids must be [n, {token_ids.shape[1]}] like token_ids, got shape "
                            f"{tuple(heldout_ids.shape)}")
    return token_ids, heldout_ids, sources


def _start(run: Run, checkpoint: Path | None, heldout_ids: torch.Tensor | None, layout: Layout,
           sources: _Strata | None) -> tuple[int, JsonLog, Generalisation]:
    """Resume from ``checkpoint`` if given, open the log and take the loss before training.

    Returns:
        (the step to start from, the log, the generalisation check with its "before" measurement).
    """
    start = run.restore(checkpoint) if checkpoint is not None else 0
    warn_many_reads(run)
    log = JsonLog(run.work / LOG_FILE if run.work is not None and run.accelerator.is_main_process else None, start)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # the report's GPU peak is the training's, not an earlier run's
    check = Generalisation(run, heldout_ids, layout, sources)
    check.start(start, run.restored_generalisation)
    run.kept_generalisation = check.kept()
    return start, log, check


def _finish(run: Run, start: int, seconds: float, teacher_was_training: bool, log: JsonLog,
            generalisation: dict | None, cache: TeacherCache | None = None) -> DistillResult:
    """Merge LoRA, drop accelerate's wrappers, restore modes, and summarise."""
    # a sharded student is exported from its gathered tensors (every process takes part in the gather)
    whole = full_model_state(run.model, run.trainable.names) if is_sharded(run.accelerator) else None
    run.accelerator.unwrap_model(run.model, keep_fp32_wrapper=False)  # removes the autocast forward wrapper
    if run.trainable.peft_model is not None:
        merge_lora(run.trainable.peft_model)
    for name, param in run.student.named_parameters():  # as the caller had them (LoRA names are gone now)
        param.requires_grad_(run.requires_grad.get(name, False))
    run.student.eval()
    if run.teacher is not None:
        run.teacher.train(teacher_was_training)
    done = run.config.steps - start
    final_loss, final_terms = run.last
    gpu_peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return DistillResult(
        steps=run.config.steps,
        final_loss=final_loss,
        losses=run.losses,
        steps_per_second=done / seconds if seconds > 0 else 0.0,
        peak_memory_bytes=peak_rss_bytes(),
        log_path=log.path,
        start_step=start,
        final_terms=final_terms,
        seconds=seconds,
        trainable_parameters=run.trainable.count,
        peak_gpu_memory_bytes=gpu_peak,
        generalisation=generalisation,
        whole_state=whole,
        teacher_cache=cache.report() if cache is not None else None,
    )
