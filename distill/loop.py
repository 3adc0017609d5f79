"""The training loop of a distillation run: its state, one optimizer step, the steps in turn and their log.

:class:`Run` holds what the steps share (models, optimizer, schedule, data order); :func:`train_loop`
runs the steps, writes the JSON-lines log and saves checkpoints. ``distill.train.distill`` sets a run up
and summarises it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from distill.batches import BatchOrder
from distill.checkpoints import (
    check_trained_names,
    list_checkpoints,
    load_checkpoint,
    restore_model,
    save_checkpoint,
    set_rng_state,
)
from distill.config import DistillConfig
from distill.forward import OnlineTeacher, TeacherSource, forward_head, forward_states, head_for_losses, logits_kwargs
from distill.layout import Layout, teacher_targets
from distill.losses import NEEDS_LOGITS, LossInputs, total_loss
from distill.processes import many_on_cpu
from distill.sharded import (
    check_sharded_options,
    full_model_state,
    full_optimizer_state,
    is_sharded,
    load_full_state,
    use_fsdp_on_cpu,
)
from distill.trainable import Trainable, select_trainable
from prune.errors import LayercutError
from prune.model.adapters import input_device

logger = logging.getLogger(__name__)


def make_accelerator(config: DistillConfig, on_cpu: bool = False):
    """An ``Accelerator`` for the run: bf16 autocast on a bf16-capable GPU unless told otherwise.

    ``on_cpu``: the student was loaded on the CPU (``--device cpu``), so it stays there (in float32: a CUDA
    autocast leaves CPU arithmetic alone) even where a GPU is visible; accelerate would otherwise move it
    to the GPU, away from its teacher. Placement, not ``cpu=True``: accelerate's state is one per process,
    and a later GPU run in the same process could not change it back.
    """
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
                       device_placement=not on_cpu, cpu=many_on_cpu())


class JsonLog:
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
        """Append ``row`` as one line (nothing without a path)."""
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(row) + "\n")


def nan_error(what: str, value: float, step: int, work: Path | None) -> LayercutError:
    """The error for a non-finite ``what`` at ``step``, naming the checkpoint to resume from if there is one."""
    found = list_checkpoints(work) if work is not None else []
    if found:
        kept = f"the last good checkpoint is {found[-1][1]} (step {found[-1][0]}): continue from it with --resume"
    else:
        kept = "no checkpoint was written yet"
    return LayercutError(
        f"{what} became {value} at step {step}: training stopped; {kept}; lower --lr or --max-grad-norm, "
        "or check the student's weights for inf/nan"
    )


class Run:
    """The state of one distillation run: models, optimizer, schedule, data order and log."""

    def __init__(self, student, teacher, token_ids, config: DistillConfig, layout: Layout, work: Path | None,
                 source: TeacherSource | None = None):
        from transformers import get_cosine_schedule_with_warmup

        self.config, self.work, self.token_ids = config, work, token_ids
        self.targets = teacher_targets(layout)
        self.weights = config.loss_weights()
        self.want_logits = bool(NEEDS_LOGITS & set(self.weights))
        # the teacher's side of each batch: the teacher run online, or its cache (then teacher may be None)
        self.source = source if source is not None else OnlineTeacher(teacher, self.targets, self.want_logits)
        # decided before accelerate may wrap the student's forward (and hide its signature)
        self.call_kwargs = logits_kwargs(student, self.want_logits)
        self.requires_grad = {name: p.requires_grad for name, p in student.named_parameters()}
        on_cpu = all(p.device.type == "cpu" for p in student.parameters())
        self.accelerator = make_accelerator(config, on_cpu)
        use_fsdp_on_cpu(self.accelerator)
        check_sharded_options(self.accelerator, config.train)
        self.trainable: Trainable = select_trainable(student, config)
        # from the teacher's top-K cache, the KL through the frozen head a chunk of positions at a time (head_kl)
        self.head_kwargs = (head_for_losses(student, self.weights, is_sharded(self.accelerator))
                            if source is not None and self.want_logits else None)
        self.student, self.teacher = student, teacher
        optimizer = torch.optim.AdamW(self.trainable.parameters, lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = get_cosine_schedule_with_warmup(optimizer, config.warmup, config.steps)
        self.model, self.optimizer = self.accelerator.prepare(student, optimizer)
        # the parameters the optimizer steps: FSDP2 swaps each for a sharded one, in the optimizer too
        self.trained = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.order = BatchOrder(token_ids.shape[0], config.batch_size, config.seed)
        self.losses: list[float] = []
        self.last: tuple[float, dict[str, float]] = (math.nan, {})
        self.restored_generalisation: dict | None = None  # the first measurement, from a checkpoint
        self.kept_generalisation: dict | None = None  # the first measurement, for the checkpoints
        self.save_total_limit = 1  # checkpoints kept in the work folder, newest first

    def micro_batches(self) -> int:
        """Micro-batches of ``config.batch_size`` sequences drawn over every step, across processes."""
        return self.config.steps * self.config.grad_accum * self.accelerator.num_processes

    def restore(self, path: Path) -> int:
        """Load a checkpoint; returns its step."""
        payload = load_checkpoint(path)
        if payload.get("optimizer_format") == "names":  # written from a sharded student: whole tensors, by name
            check_trained_names(payload, self.trainable.names)
            sharded, main = is_sharded(self.accelerator), self.accelerator.is_main_process
            if sharded and not main:  # the main process sends each one its shards
                payload["model"], payload["optimizer"] = {}, {}
            load_full_state(self.model, self.optimizer, payload["model"], payload["optimizer"], from_main=sharded)
        elif is_sharded(self.accelerator):
            raise LayercutError(f"{path} stores the optimizer by position (written without FSDP): resume it without "
                                "FSDP, or start over with --overwrite")
        else:
            restore_model(self.student, payload, self.trainable.names)
            self.optimizer.load_state_dict(payload["optimizer"])
        self.scheduler.load_state_dict(payload["scheduler"])
        set_rng_state(payload["rng"])
        info = payload.get("config", {})  # what save() handed save_checkpoint: the options, the last loss and more
        self.last = (info.get("loss", math.nan), info.get("terms", {}))
        self.restored_generalisation = info.get("generalisation")
        saved = info.get("config", {})
        changed = sorted(k for k, v in self.config.to_dict().items() if saved.get(k) != v)
        processes, now = info.get("processes", 1), self.accelerator.num_processes
        drawn, draws = (saved.get("batch_size", 0) * saved.get("grad_accum", 0) * processes,
                        self.config.batch_size * self.config.grad_accum * now)
        if {"grad_accum", "batch_size"} & set(changed) and drawn == draws:
            # the same sequences per step, spread over another process count or micro-batch size: a step takes the
            # same stretch of BatchOrder's stream, so the same rows
            changed = [name for name in changed if name not in ("grad_accum", "batch_size")]
        elif processes != now:
            per_step = saved.get("grad_accum", 1) * processes
            fix = (f"pass --grad-accum {per_step // now} to draw" if per_step % now == 0 else
                   "no --grad-accum draws")
            logger.warning("resuming on %d process(es) after %d: %s the same %d micro-batches per step", now,
                           processes, fix, per_step)
        if changed:
            logger.warning("resuming with other options than the checkpoint's: %s", ", ".join(changed))
        logger.info("resumed from %s (step %d)", path, payload["step"])
        return int(payload["step"])

    def _micro_batch(self, batch_index: int) -> tuple[torch.Tensor, dict[str, float]]:
        acc = self.accelerator
        rows = self.order.rows(batch_index * acc.num_processes + acc.process_index)
        ids = self.token_ids[rows]
        mask = torch.ones_like(ids)  # packed sequences: no padding
        with torch.no_grad(), acc.autocast():
            teacher = self.source.targets(rows, ids, mask)
        device = input_device(self.student)
        head = None
        if self.head_kwargs is not None and teacher.topk is not None:
            s_states, head, _ = forward_head(self.model, self.student, ids.to(device), mask.to(device), None,
                                             self.head_kwargs)
            s_logits = None
        else:
            s_states, s_logits = forward_states(
                self.model, self.student, ids.to(device), mask.to(device), None, self.want_logits, self.call_kwargs
            )
        inputs = LossInputs(s_states, teacher.states, self.targets, mask.to(device), s_logits, teacher.logits,
                            teacher.topk, head)
        if head is None:
            return total_loss(inputs, self.weights)
        with acc.autocast():  # the head's products in the precision the model's forward gave its own (bf16 on GPUs)
            return total_loss(inputs, self.weights)

    def step(self, step: int) -> tuple[float, dict[str, float], float, float]:
        """One optimizer step (0-based ``step``); returns (loss, terms, grad norm, lr used)."""
        acc, k = self.accelerator, self.config.grad_accum
        loss_sum, term_sums = 0.0, {}
        for micro in range(k):
            with acc.accumulate(self.model):
                loss, terms = self._micro_batch(step * k + micro)
                if not torch.isfinite(loss.detach()):
                    raise nan_error("the loss", float(loss.detach()), step + 1, self.work)
                acc.backward(loss)
            loss_sum += float(loss.detach()) / k
            for name, value in terms.items():
                term_sums[name] = term_sums.get(name, 0.0) + value / k
        if acc.num_processes > 1:  # the log shows the step's loss over every process's micro-batches
            loss_sum, term_sums = _mean_over_processes(acc, loss_sum, term_sums)
        limit = self.config.max_grad_norm if self.config.max_grad_norm > 0 else float("inf")
        grad_norm = float(acc.clip_grad_norm_(self.trained, limit))
        if not math.isfinite(grad_norm):
            raise nan_error("the gradient norm", grad_norm, step + 1, self.work)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, term_sums, grad_norm, lr

    def _non_finite(self) -> str | None:
        """The first trained tensor holding NaN or inf on any process (every process learns the same answer)."""
        local = [name for name, param in zip(self.trainable.names, self.trained, strict=True)
                 if not bool(torch.isfinite(_local(param.detach())).all())]
        if self.accelerator.num_processes == 1:
            return local[0] if local else None
        flags = torch.tensor([name in local for name in self.trainable.names], dtype=torch.float32,
                             device=self.accelerator.device)
        flags = self.accelerator.reduce(flags, reduction="sum")  # a shard's NaN stops every process, not one
        return next((name for name, flag in zip(self.trainable.names, flags.tolist(), strict=True) if flag), None)

    def save(self, step: int) -> None:
        """Checkpoint ``step`` into the work folder (none without one), from the main process only."""
        if self.work is None:
            return
        bad = self._non_finite()
        if bad is not None:  # keep the last good checkpoint rather than this one
            raise nan_error(f"the weight {bad}", float("nan"), step, self.work)
        whole = None
        if is_sharded(self.accelerator):  # every process takes part in gathering the shards
            whole = (full_model_state(self.model, self.trainable.names),
                     full_optimizer_state(self.model, self.optimizer))
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            info = {"config": self.config.to_dict(), "loss": self.last[0], "terms": self.last[1],
                    "generalisation": self.kept_generalisation, "processes": self.accelerator.num_processes}
            save_checkpoint(self.work, step, self.student, self.trainable.names, self.optimizer, self.scheduler, info,
                            keep=self.save_total_limit, whole=whole)
        self.accelerator.wait_for_everyone()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) parameter's own shard; a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _mean_over_processes(acc, loss: float, terms: dict[str, float]) -> tuple[float, dict[str, float]]:
    """``loss`` and ``terms`` averaged over the processes (every process calls it: it is a collective)."""
    names = sorted(terms)
    values = torch.tensor([loss, *(terms[name] for name in names)], dtype=torch.float64, device=acc.device)
    values = acc.reduce(values, reduction="mean")
    return float(values[0]), {name: float(value) for name, value in zip(names, values[1:], strict=True)}


# the terms that pull the student towards the teacher (the cosine term only regularises)
_MATCHING = ("layerwise_mse", "teacher_student_kl")


def check_something_to_learn(terms: dict[str, float]) -> None:
    """Refuse a run whose matching terms are all exactly 0 at the first step: it would train nothing.

    This is the case when the removed blocks are the last ones: every kept block is the teacher's own and
    meets its layerwise target, so a report of "distilled" would describe plain removal.
    """
    matching = [name for name in _MATCHING if name in terms]
    if matching and all(terms[name] == 0.0 for name in matching):
        raise LayercutError("distillation has nothing to learn: the student already reproduces every teacher "
                            f"state its loss compares ({', '.join(matching)} = 0 at the first step; were the last "
                            "blocks removed?): distil the logits with --kl-weight 1 (and --mse-weight 0)")


def should_save(config: DistillConfig, done: int) -> bool:
    """Whether to checkpoint after ``done`` steps: every ``save_every`` steps, and after the last."""
    return done == config.steps or (config.save_every > 0 and done % config.save_every == 0)


def train_loop(run: Run, start: int, log: JsonLog) -> float:
    """Steps ``start .. config.steps - 1``; returns the loop's wall seconds."""
    config = run.config
    run.student.train()  # the teacher, when it runs, is in eval mode since OnlineTeacher took it
    bar = tqdm(total=config.steps, initial=start, desc="distill", unit="step",
               disable=not run.accelerator.is_local_main_process)
    started = time.perf_counter()
    try:
        for step in range(start, config.steps):
            loss, terms, grad_norm, lr = run.step(step)
            if step == 0:
                check_something_to_learn(terms)
            run.losses.append(loss)
            run.last = (loss, terms)
            done = step + 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4g}")
            if done % config.log_every == 0 or done == config.steps:
                log.write({"step": done, "loss": loss, **terms, "lr": lr, "grad_norm": grad_norm,
                           "seconds": round(time.perf_counter() - started, 3), "tokens": done * config.tokens_per_step})
            if should_save(config, done):
                run.save(done)
    finally:
        bar.close()  # before any error message, so the message is the last line
    return time.perf_counter() - started
