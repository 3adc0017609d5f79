r"""Distill a layercut student back towards its teacher and export it.

The student learns the teacher's next-token distribution (KL on the logits); ``--loss NAME=WEIGHT``
chooses the registered losses (``distill.losses``) and their weights instead:
``--loss layerwise_mse=1`` is Secretly Linear's objective (``--mse-weight 1 --kl-weight 0`` still works).

    python -m distill.run --student slim-lin/ --teacher smollm2-135m --steps 500 --out slim-lin-distilled/
    python -m distill.run --student slim/ --steps 200 --train lora --out slim-healed/
    python -m distill.run --student slim/ --loss teacher_student_kl=1 --loss layerwise_mse=0.1 --out slim-d/
    python -m distill.run --student slim/ --teacher-cache topk=64 --steps 500 --out slim-cached/
    accelerate launch -m distill.run --student opt-slim/ --teacher opt-1.3b --teacher-load-in-4bit \
        --batch-size 16 --seq-len 512 --steps 2000 --out opt-slim-distilled/

Checkpoints and ``train_log.jsonl`` go to a work folder (``<out>.work/`` unless ``--work-dir``);
``--resume`` continues from its latest checkpoint. The final ``--out`` is written atomically at the
end: the trained student, its tokenizer, and ``layercut.json`` = the student's report plus a
``distill`` section (options, steps, losses, steps/s, peak memory).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path

from distill.config import DEFAULT_LOSSES, DEFAULT_LR, TRAIN_MODES, DistillConfig
from distill.job import DistillJob, run_job
from distill.losses import LOSSES
from distill.train import DistillResult
from prune.checkpoint.write import describe_generalisation
from prune.errors import CommandParser, LayercutError, cli_entry
from prune.options import (
    add_data_arguments,
    add_load_arguments,
    add_threads_argument,
    apply_threads,
    data_config_from_args,
    load_config_from_args,
)
from prune.planner.estimate import add_plan_arguments, format_plan, hardware_from_args, write_plan_json

logger = logging.getLogger(__name__)

_DEFAULTS = DistillConfig()


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("student")
    group.add_argument("--student", required=True, help="folder of a layercut student (written by prune.run)")
    add_load_arguments(parser, prefix="teacher", model_default=None, device_default="auto", title="teacher",
                       model_default_help="the model the student's layercut.json names")


def _add_training_arguments(parser: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    group = parser.add_argument_group("training")
    group.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default: {d.steps})")
    group.add_argument("--lr", type=float, default=None, help="peak AdamW learning rate (default: "
                       + ", ".join(f"{lr:g} for --train {mode}" for mode, lr in DEFAULT_LR.items()) + ")")
    group.add_argument("--batch-size", type=int, default=d.batch_size,
                       help=f"sequences per micro-batch (default: {d.batch_size})")
    group.add_argument("--grad-accum", type=int, default=d.grad_accum,
                       help=f"micro-batches per optimizer step (default: {d.grad_accum})")
    group.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up steps (default: 10%% of --steps)")
    group.add_argument("--train", default=d.train, choices=TRAIN_MODES,
                       help="replacements: only the replacement modules; all: every parameter but the embeddings "
                       "and LM head; lora: LoRA on the blocks' Linear layers + the replacements, merged at the "
                       f"end (default: {d.train})")
    _add_loss_arguments(group)
    group.add_argument("--lora-r", type=int, default=d.lora_r, help=f"LoRA rank (default: {d.lora_r})")
    group.add_argument("--lora-alpha", type=float, default=d.lora_alpha, help=f"LoRA alpha (default: {d.lora_alpha})")
    group.add_argument("--lora-dropout", type=float, default=d.lora_dropout,
                       help=f"LoRA dropout (default: {d.lora_dropout})")
    group.add_argument("--lora-targets", default=d.lora_targets, metavar="NAMES",
                       help="the blocks' Linear layers LoRA adapts: all-linear, or a comma list of their names "
                       f"(q_proj,v_proj; a misspelt name is refused with the model's own) (default: {d.lora_targets})")
    group.add_argument("--weight-decay", type=float, default=d.weight_decay,
                       help=f"AdamW weight decay (default: {d.weight_decay})")
    group.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm,
                       help=f"gradient clipping L2 norm, 0 = off (default: {d.max_grad_norm})")
    group.add_argument("--mixed-precision", default=d.mixed_precision, choices=["auto", "no", "bf16"],
                       help="auto: bf16 autocast on a bf16 GPU, float32 on the CPU (default: auto)")
    group.add_argument("--teacher-cache", default=None, metavar="topk=K",
                       help="run the teacher once, keep its top K logits per token (and the log-sum-exp of the rest) "
                       "in the work folder, and train from them without the teacher in memory; losses on the "
                       "logits only (default: off, the teacher runs at every step)")


def _add_loss_arguments(group: argparse._ArgumentGroup) -> None:
    """``--loss NAME=WEIGHT``, and the older weight flag of each loss registered with a key (``--mse-weight``)."""
    default = ", ".join(f"{name}={weight:g}" for name, weight in DEFAULT_LOSSES.items())
    group.add_argument("--loss", action="append", default=None, metavar="NAME=WEIGHT",
                       help="a loss of the objective and its weight, repeated for each: "
                       + "; ".join(f"{name}: {loss.help}" for name, loss in LOSSES.items())
                       + f" (default: {default}; any --loss replaces the default)")
    for name, loss in LOSSES.items():
        if loss.key is not None:
            group.add_argument("--" + loss.key.replace("_", "-"), dest=loss.key, type=float, default=None,
                               help=f"weight of {loss.help}: sets --loss {name}=WEIGHT (default: "
                               f"{DEFAULT_LOSSES.get(name, 0.0):g})")


def parse_losses(entries: list[str]) -> dict[str, float]:
    """``["teacher_student_kl=1", ...]`` (the ``--loss`` values) as ``{name: weight}``."""
    losses: dict[str, float] = {}
    for entry in entries:
        name, sep, weight = entry.partition("=")
        try:
            value = float(weight)
        except ValueError:
            value = None
        if not sep or not name.strip() or value is None:
            raise LayercutError(f"--loss takes NAME=WEIGHT (teacher_student_kl=1), got '{entry}'")
        losses[name.strip()] = value
    return losses


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    group = parser.add_argument_group("output")
    group.add_argument("--out", required=True, help="folder for the distilled checkpoint (written at the end)")
    group.add_argument("--work-dir", default=None, help="checkpoints and train_log.jsonl (default: <out>.work)")
    group.add_argument("--save-every", type=int, default=d.save_every,
                       help=f"checkpoint every N steps, 0 = only at the end (default: {d.save_every})")
    group.add_argument("--log-every", type=int, default=d.log_every,
                       help=f"train_log.jsonl line every N steps (default: {d.log_every})")
    group.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the work folder")
    group.add_argument("--overwrite", action="store_true",
                       help="replace a non-empty --out and discard old checkpoints in the work folder")
    group.add_argument("--keep-checkpoints", action="store_true",
                       help="keep the work folder's checkpoints after a successful export")
    group.add_argument("--save-total-limit", type=int, default=1,
                       help="checkpoints kept in the work folder while training, the newest ones (default: 1)")


def build_parser() -> argparse.ArgumentParser:
    """The ``distill.run`` argument parser."""
    parser = CommandParser(prog="python -m distill.run", description=__doc__.split("\n")[0])
    _add_model_arguments(parser)
    _add_training_arguments(parser)
    add_plan_arguments(parser)
    d = _DEFAULTS.data
    add_data_arguments(parser, samples=d.samples, seq_len=d.seq_len, title="data", data=d.data,
                       heldout_samples=d.heldout_samples,
                       heldout_help="sequences of the same text training never draws; the loss on them and on as "
                       "many training sequences, before and after training, shows whether the steps overfit",
                       data_help=f"{d.data}, chosen on texts no reported figure uses; sampling half of "
                       "--samples from the model takes minutes on a CPU, where --data builtin skips it")
    for action in parser._actions:  # not typed: as many sequences as the steps read (_data_config)
        if action.dest == "samples":
            action.default = None
            action.help = (f"packed sequences of training text (default: as many as --steps x --batch-size x "
                           f"--grad-accum read, at most {d.samples})")
    _add_output_arguments(parser)
    add_threads_argument(parser)
    return parser


def _data_config(args: argparse.Namespace, config: DistillConfig):
    """The data flags; without ``--samples``, only the sequences the steps will read (each read once).

    Sampling half of them from the model is the slow part (minutes per hundred on a CPU): ``--steps 20`` read 80
    sequences and sampled 256 for the default 512 before this. The counts are ``config``'s, checked already: a
    ``--steps -1`` read as a count of sequences was refused as "--samples 1", a flag nobody typed.
    """
    data = data_config_from_args(args)
    if args.samples is None:
        processes = max(1, int(os.environ.get("WORLD_SIZE", "1")))  # accelerate launch: each process reads its own
        read = config.steps * config.batch_size * config.grad_accum * processes
        data = dataclasses.replace(data, samples=max(1, min(_DEFAULTS.data.samples, read)))
    return data


def config_from_args(args: argparse.Namespace) -> DistillConfig:
    """Map parsed flags onto :class:`DistillConfig` (the older weight flags set their loss over ``--loss``).

    The training options are checked first (their own one-line errors), then the data flags that depend on them.
    """
    losses = {} if args.loss is None else {"losses": parse_losses(args.loss)}
    legacy = {loss.key: getattr(args, loss.key) for loss in LOSSES.values()
              if loss.key is not None and getattr(args, loss.key) is not None}
    config = DistillConfig.from_dict(dict(
        steps=args.steps, lr=args.lr, batch_size=args.batch_size, grad_accum=args.grad_accum,
        warmup_steps=args.warmup_steps, train=args.train, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout, lora_targets=args.lora_targets,
        weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        log_every=args.log_every, save_every=args.save_every, seed=args.seed, mixed_precision=args.mixed_precision,
        teacher_cache=args.teacher_cache, **losses, **legacy,
    ))
    return dataclasses.replace(config, data=_data_config(args, config))


def loss_trend(losses: list[float], final: float) -> str:
    """The training loss at the start and the end of this call, each a mean over a tenth of its steps.

    One step's loss is one batch's: comparing the first with the last read as getting worse whenever the last
    batch happened to be harder (0.440 -> 0.451 on a resumed run whose mean loss fell).
    """
    if len(losses) < 2:
        return f"loss {final:.5g}"
    n = max(1, len(losses) // 10)
    head, tail = sum(losses[:n]) / n, sum(losses[-n:]) / n
    return f"loss {head:.5g} -> {tail:.5g} (means of the first and last {n} step{'s' if n > 1 else ''})"


def _summary(result: DistillResult, out: Path) -> str:
    return (f"distilled {result.steps} steps (from step {result.start_step}): "
            f"{loss_trend(result.losses, result.final_loss)}; "
            f"{result.steps_per_second:.3f} steps/s; peak RSS {result.peak_memory_bytes / 2**20:.0f} MiB\n"
            + (_cache_line(result.teacher_cache) if result.teacher_cache else "")
            + (f"{fit}\n" if (fit := describe_generalisation(result.generalisation)) else "")
            + f"wrote {out}/")


def _cache_line(cache: dict) -> str:
    how = f"written in {cache['write_seconds']:.1f} s" if cache["written"] else "reused"
    size = cache["bytes"] / 2**20
    return f"teacher cache: top-{cache['k']} of {cache['sequences']} sequences, {size:.0f} MiB, {how}\n"


@cli_entry
def main(argv: list[str] | None = None) -> int:
    """Run the distillation CLI; returns the exit code."""
    args = build_parser().parse_args(argv)
    apply_threads(args)
    job = DistillJob(student=args.student, teacher=load_config_from_args(args, prefix="teacher", model=args.teacher),
                     config=config_from_args(args), out=args.out, work_dir=args.work_dir, resume=args.resume,
                     overwrite=args.overwrite, keep_checkpoints=args.keep_checkpoints,
                     save_total_limit=args.save_total_limit)
    if args.plan:
        from distill.planning import plan_job

        plan = plan_job(job, hardware_from_args(args, job.teacher.device))
        print(format_plan(plan))
        write_plan_json(plan, args.plan_json)
        return 0
    result, out = run_job(job)
    if out is not None:  # under `accelerate launch`, the main process alone writes and reports
        print(_summary(result, out))
    return 0


def console_main() -> None:
    """Console-script entry point."""
    raise SystemExit(main())


if __name__ == "__main__":
    console_main()
