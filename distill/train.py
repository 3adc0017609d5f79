"""Layerwise distillation: train a surgered student to reproduce its teacher's block outputs.

Each step draws ``grad_accum`` micro-batches of packed calibration sequences, runs the teacher
(eval, no grad) and the student with hooks on their blocks, and minimises the weighted losses of
``distill.losses`` (by default the sum over student blocks ``j`` of the MSE between block ``j``'s
output and the teacher's state ``max(layout[j]) + 1``). Teacher activations are computed on the fly,
so memory depends on the batch, never on the number of calibration sequences.

``accelerate.Accelerator`` places the student, runs bf16 autocast on a GPU and accumulates gradients;
the same path runs on the CPU in float32 (``python -m distill.run``) and under ``accelerate launch``.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from distill.batches import BatchOrder
from distill.checkpoints import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    restore_model,
    save_checkpoint,
    set_rng_state,
)
from distill.checks import check_models
from distill.config import DistillConfig
from distill.layout import Layout, check_layout, resolve_layout, teacher_targets
from distill.losses import NEEDS_LOGITS, LossInputs, total_loss
from distill.trainable import Trainable, merge_lora, select_trainable
from prune.adapters import input_device, num_blocks
from prune.capture import residual_states
from prune.data import calibration_data
from prune.errors import LayercutError
from prune.memory import peak_rss_bytes

logger = logging.getLogger(__name__)

LOG_FILE = "train_log.jsonl"


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
        }


def make_accelerator(config: DistillConfig, on_cpu: bool = False):
    """An ``Accelerator`` for the run: bf16 autocast on a bf16-capable GPU unless told otherwise.

    ``on_cpu``: the student was loaded on the CPU (``--device cpu``), so it stays there (in float32: a CUDA
    autocast leaves CPU arithmetic alone) even where a GPU is visible; accelerate would otherwise move it
    to the GPU, away from its teacher. Placement, not ``cpu=True``: accelerate's state is one per process,
    and a later GPU run in the same process could not change it back.
    """
    import os

    from accelerate import Accelerator

    precision = config.mixed_precision
    if precision == "auto":
        if os.environ.get("ACCELERATE_MIXED_PRECISION"):
            precision = None  # `accelerate launch --mixed_precision` decides
        elif torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            precision = "bf16"
        else:
            precision = "no"
    return Accelerator(mixed_precision=precision, gradient_accumulation_steps=config.grad_accum,
                       device_placement=not on_cpu)


def _logits_kwargs(model: nn.Module, want_logits: bool) -> dict:
    """Skip most of the LM head when no loss needs logits (``logits_to_keep=1``), if the model supports it."""
    if want_logits or "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return {}
    return {"logits_to_keep": 1}


def forward_states(call, hooked: nn.Module, input_ids, mask, keep: set[int] | None, want_logits: bool,
                   extra: dict | None = None):
    """Run ``call`` (the model or its accelerate wrapper) and collect ``hooked``'s residual states.

    Args:
        call: what to call with the token ids (the model, or its accelerate-prepared wrapper).
        hooked: the plain model whose blocks get the hooks.
        input_ids: [batch, seq] token ids on the model's input device.
        mask: [batch, seq] attention mask.
        keep: state indices to keep (None: all).
        want_logits: return the logits.
        extra: more keyword arguments for ``call`` (default: ``logits_to_keep=1`` when logits are not wanted).

    Returns:
        (states by index, logits [batch, seq, vocab] or None).
    """
    states: dict[int, torch.Tensor] = {}

    def record(index: int, hidden: torch.Tensor) -> None:
        if keep is None or index in keep:
            states[index] = hidden

    with residual_states(hooked, record):
        kwargs = _logits_kwargs(hooked, want_logits) if extra is None else extra
        output = call(input_ids=input_ids, attention_mask=mask, use_cache=False, **kwargs)
    return states, output.logits if want_logits else None


@torch.no_grad()
def evaluate_losses(student: nn.Module, teacher: nn.Module, token_ids: torch.Tensor, config: DistillConfig,
                    layout: Layout | None = None) -> dict[str, float]:
    """Each loss term of ``config`` (unweighted) and their weighted total ``loss``, averaged over ``token_ids``.

    ``token_ids`` is [samples, seq_len]; nothing is trained. ``loss`` is what training minimises.
    Runs both models in eval mode in batches of ``config.batch_size``; for before/after comparisons.
    """
    layout = layout or resolve_layout(student, teacher)
    targets = teacher_targets(layout)
    weights = config.loss_weights()
    want_logits = bool(NEEDS_LOGITS & set(weights))
    was_training, teacher_was_training = student.training, teacher.training
    student.eval()
    teacher.eval()
    sums: dict[str, float] = {}
    try:
        for rows in torch.split(token_ids, config.batch_size):
            mask = torch.ones_like(rows)
            t_dev, s_dev = input_device(teacher), input_device(student)
            t_states, t_logits = forward_states(teacher, teacher, rows.to(t_dev), mask.to(t_dev), set(targets),
                                                want_logits)
            s_states, s_logits = forward_states(student, student, rows.to(s_dev), mask.to(s_dev), None, want_logits)
            total, terms = total_loss(LossInputs(s_states, t_states, targets, mask.to(s_dev), s_logits, t_logits),
                                      weights)
            for name, value in {"loss": float(total), **terms}.items():
                sums[name] = sums.get(name, 0.0) + value * rows.shape[0]
    finally:
        student.train(was_training)
        teacher.train(teacher_was_training)
    return {name: value / token_ids.shape[0] for name, value in sums.items()}


def _seen_rows(order: BatchOrder, quotas: list[int], row_sources: torch.Tensor | None, batches: int) -> torch.Tensor:
    """Distinct rows from the first ``batches`` micro-batches training draws: ``quotas[i]`` of source ``i``.

    ``row_sources`` gives each row's source (None: one source, ``quotas`` of one entry).
    """
    wanted = list(quotas)
    rows: list[int] = []
    for index in range(batches):
        for row in order.rows(index).tolist():
            source = 0 if row_sources is None else int(row_sources[row])
            if row not in rows and wanted[source] > 0:
                rows.append(row)
                wanted[source] -= 1
        if not any(wanted):
            break
    return torch.tensor(rows, dtype=torch.long)


class _Generalisation:
    """The loss on held-out sequences beside the loss on training sequences, before and after training.

    The per-step loss in the log is measured on the batch being fitted, so it keeps falling while the model
    memorises a small text; the same loss on sequences training never draws shows whether the steps still
    pay. Both sets are scored the same way (eval mode, :func:`evaluate_losses`) and, for a mixture, hold as
    many sequences of each source (self-sampled text and a novel sit at different loss levels). Before
    training neither set has been fitted, so their levels differ only by which sequences they hold; how far
    each falls is what to compare. A resumed run keeps the first measurement in its checkpoints.
    """

    def __init__(self, run: _Run, heldout_ids: torch.Tensor | None, layout: Layout,
                 sources: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.run, self.layout, self.sets = run, layout, {}
        self.measured: dict[str, dict] = {}
        self.first_step = 0
        if heldout_ids is None or heldout_ids.shape[0] == 0:
            return
        row_sources, heldout_sources = sources if sources is not None else (None, None)
        if row_sources is None or heldout_sources is None:
            row_sources, quotas = None, [heldout_ids.shape[0]]
        else:
            quotas = torch.bincount(heldout_sources, minlength=int(row_sources.max()) + 1).tolist()
        # within one pass over the sequences every row comes up once, so every quota a source can fill is filled
        batches = min(run.micro_batches(), math.ceil(run.token_ids.shape[0] / run.config.batch_size) + 1)
        seen = run.token_ids[_seen_rows(run.order, quotas, row_sources, batches)]
        self.sets = {"training": seen, "held_out": heldout_ids.long()}
        self.measured = {name: {} for name in self.sets}

    def measure(self, when: str) -> None:
        for name, ids in self.sets.items():
            with self.run.accelerator.autocast():
                self.measured[name][when] = evaluate_losses(self.run.student, self.run.teacher, ids, self.run.config,
                                                            self.layout)

    def start(self, step: int, kept: dict | None) -> None:
        """Measure "before" at step 0; a resumed run takes it from its checkpoint, else measures it at ``step``."""
        if not self.sets:
            return
        if step > 0 and kept and all(name in kept and "before" in kept[name] for name in self.sets):
            self.first_step = int(kept.get("first_step", 0))
            for name in self.sets:
                self.measured[name]["before"] = kept[name]["before"]
            return
        self.first_step = step
        self.measure("before")

    def kept(self) -> dict | None:
        """What a checkpoint keeps: the first measurement, so a resumed run reports from where it began."""
        if not self.sets:
            return None
        return {"first_step": self.first_step, **{name: {"before": self.measured[name]["before"]}
                                                  for name in self.sets}}

    def summary(self) -> dict | None:
        if not self.sets:
            return None
        return {"sequences": {name: int(ids.shape[0]) for name, ids in self.sets.items()},
                "before_step": self.first_step, "reads": round(reads_per_sequence(self.run), 2), **self.measured}


# A warning, not a default: on SmolLM2-135M at drop 8 (reports/smollm2-135m-tasks-draw/), 2,000 steps that read
# 512 sequences 16 times each left the tasks where 200 steps had (+0.7 +- 1.8 points) while the training KL kept
# falling; on 2,048 sequences, 4 reads each, the same steps gained +3.5 +- 1.5.
MANY_READS = 8
FEW_READS = 4


def reads_per_sequence(run: _Run) -> float:
    """How many times the run's steps draw each training sequence, over every step of ``run.config``."""
    return run.micro_batches() * run.config.batch_size / run.token_ids.shape[0]


def _warn_many_reads(run: _Run) -> None:
    reads = reads_per_sequence(run)
    if reads <= MANY_READS:
        return
    samples = run.token_ids.shape[0]
    logger.warning(
        "%d steps read each of the %d distillation sequences %.0f times: text read this often is memorised, the "
        "training loss falls while held-out quality stands still; give about %d sequences (distill.run --samples, "
        "prune.run --distill-samples, distill.data.samples in a recipe) for %d reads, and compare the held-out "
        "loss with the training one",
        run.config.steps, samples, reads, math.ceil(samples * reads / FEW_READS), FEW_READS)


class _JsonLog:
    """Append-only JSON-lines log; on resume, lines past the checkpoint's step are dropped."""

    def __init__(self, path: Path | None, keep_until: int | None):
        self.path = path
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if keep_until is not None and path.is_file():
            rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
            kept = [row for row in rows if row.get("step", 0) <= keep_until]
        path.write_text("".join(json.dumps(row) + "\n" for row in kept), encoding="utf-8")

    def write(self, row: dict) -> None:
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(row) + "\n")


def _nan_error(what: str, value: float, step: int, work: Path | None) -> LayercutError:
    found = list_checkpoints(work) if work is not None else []
    if found:
        kept = f"the last good checkpoint is {found[-1][1]} (step {found[-1][0]}): continue from it with --resume"
    else:
        kept = "no checkpoint was written yet"
    return LayercutError(
        f"{what} became {value} at step {step}: training stopped; {kept}; lower --lr or --max-grad-norm, "
        "or check the student's weights for inf/nan"
    )


class _Run:
    """The state of one distillation run: models, optimizer, schedule, data order and log."""

    def __init__(self, student, teacher, token_ids, config: DistillConfig, layout: Layout, work: Path | None):
        from transformers import get_cosine_schedule_with_warmup

        self.config, self.work, self.token_ids = config, work, token_ids
        self.targets = teacher_targets(layout)
        self.weights = config.loss_weights()
        self.want_logits = bool(NEEDS_LOGITS & set(self.weights))
        # decided before accelerate may wrap the student's forward (and hide its signature)
        self.call_kwargs = (_logits_kwargs(teacher, self.want_logits), _logits_kwargs(student, self.want_logits))
        self.requires_grad = {name: p.requires_grad for name, p in student.named_parameters()}
        on_cpu = all(p.device.type == "cpu" for p in student.parameters())
        self.accelerator = make_accelerator(config, on_cpu)
        self.trainable: Trainable = select_trainable(student, config)
        self.student, self.teacher = student, teacher
        optimizer = torch.optim.AdamW(self.trainable.parameters, lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = get_cosine_schedule_with_warmup(optimizer, config.warmup, config.steps)
        self.model, self.optimizer = self.accelerator.prepare(student, optimizer)
        self.order = BatchOrder(token_ids.shape[0], config.batch_size, config.seed)
        self.losses: list[float] = []
        self.last: tuple[float, dict[str, float]] = (math.nan, {})
        self.restored_generalisation: dict | None = None  # the first measurement, from a checkpoint
        self.kept_generalisation: dict | None = None  # the first measurement, for the checkpoints

    def micro_batches(self) -> int:
        """Micro-batches of ``config.batch_size`` sequences drawn over every step, across processes."""
        return self.config.steps * self.config.grad_accum * self.accelerator.num_processes

    def restore(self, path: Path) -> int:
        """Load a checkpoint; returns its step."""
        payload = load_checkpoint(path)
        restore_model(self.student, payload, self.trainable.names)
        self.optimizer.load_state_dict(payload["optimizer"])
        self.scheduler.load_state_dict(payload["scheduler"])
        set_rng_state(payload["rng"])
        info = payload.get("config", {})  # what save() handed save_checkpoint: the options, the last loss and more
        self.last = (info.get("loss", math.nan), info.get("terms", {}))
        self.restored_generalisation = info.get("generalisation")
        saved = info.get("config", {})
        changed = sorted(k for k, v in self.config.to_dict().items() if saved.get(k) != v)
        if changed:
            logger.warning("resuming with other options than the checkpoint's: %s", ", ".join(changed))
        logger.info("resumed from %s (step %d)", path, payload["step"])
        return int(payload["step"])

    def _micro_batch(self, batch_index: int) -> tuple[torch.Tensor, dict[str, float]]:
        acc = self.accelerator
        ids = self.order.batch(self.token_ids, batch_index * acc.num_processes + acc.process_index)
        mask = torch.ones_like(ids)  # packed sequences: no padding
        with torch.no_grad(), acc.autocast():
            device = input_device(self.teacher)
            t_states, t_logits = forward_states(
                self.teacher, self.teacher, ids.to(device), mask.to(device), set(self.targets), self.want_logits,
                self.call_kwargs[0],
            )
        device = input_device(self.student)
        s_states, s_logits = forward_states(
            self.model, self.student, ids.to(device), mask.to(device), None, self.want_logits, self.call_kwargs[1]
        )
        inputs = LossInputs(s_states, t_states, self.targets, mask.to(device), s_logits, t_logits)
        return total_loss(inputs, self.weights)

    def step(self, step: int) -> tuple[float, dict[str, float], float, float]:
        """One optimizer step (0-based ``step``); returns (loss, terms, grad norm, lr used)."""
        acc, k = self.accelerator, self.config.grad_accum
        loss_sum, term_sums = 0.0, {}
        for micro in range(k):
            with acc.accumulate(self.model):
                loss, terms = self._micro_batch(step * k + micro)
                if not torch.isfinite(loss.detach()):
                    raise _nan_error("the loss", float(loss.detach()), step + 1, self.work)
                acc.backward(loss)
            loss_sum += float(loss.detach()) / k
            for name, value in terms.items():
                term_sums[name] = term_sums.get(name, 0.0) + value / k
        limit = self.config.max_grad_norm if self.config.max_grad_norm > 0 else float("inf")
        grad_norm = float(acc.clip_grad_norm_(self.trainable.parameters, limit))
        if not math.isfinite(grad_norm):
            raise _nan_error("the gradient norm", grad_norm, step + 1, self.work)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, term_sums, grad_norm, lr

    def save(self, step: int) -> None:
        if self.work is None:
            return
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            info = {"config": self.config.to_dict(), "loss": self.last[0], "terms": self.last[1],
                    "generalisation": self.kept_generalisation}
            save_checkpoint(self.work, step, self.student, self.trainable.names, self.optimizer, self.scheduler, info)
        self.accelerator.wait_for_everyone()


# the terms that pull the student towards the teacher (the cosine term only regularises)
_MATCHING = ("layerwise_mse", "teacher_student_kl")


def _check_something_to_learn(terms: dict[str, float]) -> None:
    """Refuse a run whose matching terms are all exactly 0 at the first step: it would train nothing.

    This is the case when the removed blocks are the last ones: every kept block is the teacher's own and
    meets its layerwise target, so a report of "distilled" would describe plain removal.
    """
    matching = [name for name in _MATCHING if name in terms]
    if matching and all(terms[name] == 0.0 for name in matching):
        raise LayercutError("distillation has nothing to learn: the student already reproduces every teacher "
                            f"state its loss compares ({', '.join(matching)} = 0 at the first step; were the last "
                            "blocks removed?): distil the logits with --kl-weight 1 (and --mse-weight 0)")


def _should_save(config: DistillConfig, done: int) -> bool:
    return done == config.steps or (config.save_every > 0 and done % config.save_every == 0)


def _train_loop(run: _Run, start: int, log: _JsonLog) -> float:
    """Steps ``start .. config.steps - 1``; returns the loop's wall seconds."""
    config = run.config
    run.student.train()
    run.teacher.eval()
    bar = tqdm(total=config.steps, initial=start, desc="distill", unit="step",
               disable=not run.accelerator.is_local_main_process)
    started = time.perf_counter()
    try:
        for step in range(start, config.steps):
            loss, terms, grad_norm, lr = run.step(step)
            if step == 0:
                _check_something_to_learn(terms)
            run.losses.append(loss)
            run.last = (loss, terms)
            done = step + 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4g}")
            if done % config.log_every == 0 or done == config.steps:
                log.write({"step": done, "loss": loss, **terms, "lr": lr, "grad_norm": grad_norm,
                           "seconds": round(time.perf_counter() - started, 3), "tokens": done * config.tokens_per_step})
            if _should_save(config, done):
                run.save(done)
    finally:
        bar.close()  # before any error message, so the message is the last line
    return time.perf_counter() - started


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
    student: nn.Module,
    teacher: nn.Module,
    tokenizer,
    config: DistillConfig,
    *,
    out: str | Path | None = None,
    resume: bool = False,
    token_ids: torch.Tensor | None = None,
    heldout_ids: torch.Tensor | None = None,
    layout: Layout | None = None,
) -> DistillResult:
    """Train ``student`` in place to match ``teacher`` block by block.

    Args:
        student: the surgered model (its ``config.layercut_layout`` says which teacher states its
            blocks stand for). LoRA adapters are merged back into it before returning.
        teacher: the original model; only run forward (eval mode, no grad), never changed.
        tokenizer: packs ``config.data`` into sequences (unused when ``token_ids`` is given).
        config: the run's options.
        out: work folder for ``train_log.jsonl`` and ``checkpoints/``; None writes nothing.
        resume: continue from the latest checkpoint in ``out``.
        token_ids: pre-packed sequences [samples, seq_len] to draw batches from instead of ``config.data``.
        heldout_ids: sequences [n, seq_len] training never draws, scored before and after training beside
            as many training sequences (``DistillResult.generalisation``). With ``token_ids`` None they
            are ``config.data``'s held-out sequences (``--heldout-samples``).
        layout: the student's layout, overriding what it records.

    Returns:
        The run's :class:`DistillResult`.

    Raises:
        LayercutError: incompatible models, no layout, ``resume`` without a checkpoint, NaN/inf loss.
    """
    check_models(student, teacher)
    layout = check_layout(layout, num_blocks(student), num_blocks(teacher)) if layout else resolve_layout(
        student, teacher)
    work, checkpoint = _prepare_work(out, resume)
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    sources = None
    if token_ids is None:
        data = calibration_data(tokenizer, config.data, model=teacher)
        token_ids = data.token_ids  # [samples, seq_len] int64
        if heldout_ids is None:
            heldout_ids = data.heldout_ids
            sources = _heldout_strata(data)
    if token_ids.dim() != 2 or token_ids.shape[1] < 2:
        raise LayercutError(f"token_ids must be [samples, seq_len >= 2], got shape {tuple(token_ids.shape)}")
    if heldout_ids is not None and (heldout_ids.dim() != 2 or heldout_ids.shape[1] != token_ids.shape[1]):
        raise LayercutError(f"heldout_ids must be [n, {token_ids.shape[1]}] like token_ids, got shape "
                            f"{tuple(heldout_ids.shape)}")
    teacher_was_training = teacher.training
    run = _Run(student, teacher, token_ids.long(), config, layout, work)
    start = run.restore(checkpoint) if checkpoint is not None else 0
    _warn_many_reads(run)
    log = _JsonLog(work / LOG_FILE if work is not None and run.accelerator.is_main_process else None, start)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    check = _Generalisation(run, heldout_ids, layout, sources)
    check.start(start, run.restored_generalisation)
    run.kept_generalisation = check.kept()
    seconds = _train_loop(run, start, log)
    check.measure("after")
    return _finish(run, start, seconds, teacher_was_training, log, check.summary())


def _heldout_strata(data) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each calibration row's source and each held-out row's, for a mixture; None for one source."""
    if data.row_sources is None or data.heldout_ids is None:
        return None
    counts = torch.tensor([ids.shape[0] for ids in data.heldout_by_source.values()])
    return data.row_sources, torch.repeat_interleave(torch.arange(len(counts)), counts)


def _finish(run: _Run, start: int, seconds: float, teacher_was_training: bool, log: _JsonLog,
            generalisation: dict | None) -> DistillResult:
    """Merge LoRA, drop accelerate's wrappers, restore modes, and summarise."""
    run.accelerator.unwrap_model(run.model, keep_fp32_wrapper=False)  # removes the autocast forward wrapper
    if run.trainable.peft_model is not None:
        merge_lora(run.trainable.peft_model)
    for name, param in run.student.named_parameters():  # as the caller had them (LoRA names are gone now)
        param.requires_grad_(run.requires_grad.get(name, False))
    run.student.eval()
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
    )
