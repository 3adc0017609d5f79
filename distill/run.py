r"""Distill a layercut student back towards its teacher, block by block, and export it.

    python -m distill.run --student slim-lin/ --teacher smollm2-135m --steps 500 --out slim-lin-distilled/
    python -m distill.run --student slim/ --steps 200 --train lora --kl-weight 1 --out slim-healed/
    accelerate launch -m distill.run --student opt-slim/ --teacher opt-1.3b --teacher-load-in-4bit \
        --batch-size 16 --seq-len 512 --steps 2000 --out opt-slim-distilled/

Checkpoints and ``train_log.jsonl`` go to a work folder (``<out>.work/`` unless ``--work-dir``);
``--resume`` continues from its latest checkpoint. The final ``--out`` is written atomically at the
end: the trained student, its tokenizer, and ``layercut.json`` = the student's report plus a
``distill`` section (options, steps, losses, steps/s, peak memory).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

import torch

from distill.checkpoints import checkpoint_dir, default_work_folder, latest_checkpoint, list_checkpoints
from distill.compat import check_compatible
from distill.config import DEFAULT_LR, TRAIN_MODES, DistillConfig
from distill.layout import LAYOUT_ATTRIBUTE, resolve_layout
from distill.train import LOG_FILE, DistillResult, distill
from prune.adapters import num_blocks
from prune.data import DataConfig
from prune.errors import LayercutError, cli_entry
from prune.export import REPORT_FILE, check_output_dir, library_versions
from prune.loading import LoadedModel, load_model

logger = logging.getLogger(__name__)

_DEFAULTS = DistillConfig()


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("models")
    group.add_argument("--student", required=True, help="folder of a layercut student (written by prune.run)")
    group.add_argument("--teacher", default=None,
                       help="the model the student was pruned from: alias, hub id, folder or .gguf "
                       "(default: the model named in the student's layercut.json)")
    group.add_argument("--teacher-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="teacher weights dtype (default: auto = float32 on CPU, the checkpoint's dtype on GPU)")
    group.add_argument("--teacher-device", default="auto",
                       help="cpu, cuda, cuda:N or auto (the GPUs when there are any, each process's own under "
                       "accelerate launch, else the CPU; default: auto)")
    group.add_argument("--teacher-load-in-4bit", action="store_true", help="bitsandbytes 4-bit teacher (CUDA only)")
    group.add_argument("--teacher-load-in-8bit", action="store_true", help="bitsandbytes 8-bit teacher (CUDA only)")


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
    group.add_argument("--mse-weight", type=float, default=d.mse_weight,
                       help=f"weight of the layerwise block-output MSE (default: {d.mse_weight})")
    group.add_argument("--kl-weight", type=float, default=d.kl_weight,
                       help="weight of KL(teacher || student) on the logits, float32 (default: 0 = off)")
    group.add_argument("--cosine-reg", type=float, default=d.cosine_reg,
                       help="weight of the sum of 1 - cos(h_i, h_{i-1}) over consecutive student states (default: 0)")
    group.add_argument("--lora-r", type=int, default=d.lora_r, help=f"LoRA rank (default: {d.lora_r})")
    group.add_argument("--lora-alpha", type=float, default=d.lora_alpha, help=f"LoRA alpha (default: {d.lora_alpha})")
    group.add_argument("--lora-dropout", type=float, default=d.lora_dropout,
                       help=f"LoRA dropout (default: {d.lora_dropout})")
    group.add_argument("--weight-decay", type=float, default=d.weight_decay,
                       help=f"AdamW weight decay (default: {d.weight_decay})")
    group.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm,
                       help=f"gradient clipping L2 norm, 0 = off (default: {d.max_grad_norm})")
    group.add_argument("--mixed-precision", default=d.mixed_precision, choices=["auto", "no", "bf16"],
                       help="auto: bf16 autocast on a bf16 GPU, float32 on the CPU (default: auto)")
    group.add_argument("--threads", type=int, default=None,
                       help="CPU threads for torch (default: torch's choice, one per core); 1 is much faster on a "
                       "CPU that other jobs keep busy")


def _add_data_arguments(parser: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    group = parser.add_argument_group("data")
    group.add_argument("--data", default=None,
                       help=".txt/.jsonl/.parquet file or datasets spec name[:config[:split]] "
                       "(default: built-in corpus)")
    group.add_argument("--text-field", default="text",
                       help="text column of jsonl/parquet/datasets rows (default: text)")
    group.add_argument("--samples", type=int, default=d.data.samples,
                       help=f"packed calibration sequences batches are drawn from (default: {d.data.samples})")
    group.add_argument("--seq-len", type=int, default=d.seq_len, help=f"tokens per sequence (default: {d.seq_len})")
    group.add_argument("--seed", type=int, default=d.seed, help=f"data choice and order, LoRA init (default: {d.seed})")


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


def build_parser() -> argparse.ArgumentParser:
    """The ``distill.run`` argument parser."""
    parser = argparse.ArgumentParser(prog="python -m distill.run", description=__doc__.split("\n")[0])
    _add_model_arguments(parser)
    _add_training_arguments(parser)
    _add_data_arguments(parser)
    _add_output_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> DistillConfig:
    """Map parsed flags onto :class:`DistillConfig`."""
    return DistillConfig(
        steps=args.steps, lr=args.lr, batch_size=args.batch_size, seq_len=args.seq_len, grad_accum=args.grad_accum,
        warmup_steps=args.warmup_steps, mse_weight=args.mse_weight, kl_weight=args.kl_weight,
        cosine_reg=args.cosine_reg, train=args.train, lora_r=args.lora_r, lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        log_every=args.log_every, save_every=args.save_every, seed=args.seed, mixed_precision=args.mixed_precision,
        data=DataConfig(args.data, args.samples, args.seq_len, args.seed, args.text_field),
    )


def work_folder(out: str, work_dir: str | None) -> Path:
    """Where checkpoints and the log live: ``--work-dir``, else a sibling ``<out>.work``."""
    return Path(work_dir).expanduser() if work_dir else default_work_folder(out)


def check_work_folder(work: Path, resume: bool, overwrite: bool) -> None:
    """Fail before loading anything: ``--resume`` needs a checkpoint; old checkpoints need --resume/--overwrite."""
    if resume and latest_checkpoint(work) is None:
        raise LayercutError(
            f"--resume: no checkpoint in {checkpoint_dir(work)}; run without --resume to start from step 0"
        )
    found = list_checkpoints(work)
    if found and not resume and not overwrite:
        raise LayercutError(
            f"{work} holds a checkpoint of an earlier run (step {found[-1][0]}): pass --resume to continue it or "
            "--overwrite to start over"
        )


def load_student(path: str) -> LoadedModel:
    """``prune.load`` (replacement-aware); plain ``load_model`` while it is not available. float32 master weights."""
    try:
        from prune.checkpoint import load
    except ImportError:
        load = load_model
    return load(path, dtype="float32")


def read_report(folder: str) -> dict:
    """The student's ``layercut.json``, or an empty dict when it has none."""
    path = Path(folder).expanduser() / REPORT_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise LayercutError(f"{path} is not valid JSON ({err.msg}): re-export the student with prune.run") from None


def teacher_name(args: argparse.Namespace, report: dict) -> str:
    """``--teacher``, else the model the student's report says it came from."""
    name = args.teacher or report.get("model_name") or report.get("source_model")
    if not name:
        raise LayercutError("--teacher is required: the student's layercut.json does not name its original model")
    return name


def load_teacher(args: argparse.Namespace, name: str) -> LoadedModel:
    """Load the teacher with the ``--teacher-*`` flags; "auto" means the GPU when there is one."""
    from accelerate import PartialState

    device, state = args.teacher_device, PartialState()
    if device == "auto" and not torch.cuda.is_available():
        device = "cpu"
    elif device == "auto" and state.num_processes > 1:
        device = f"cuda:{state.local_process_index}"  # one teacher per process, on that process's GPU
    return load_model(name, dtype=args.teacher_dtype, device=device, load_in_4bit=args.teacher_load_in_4bit,
                      load_in_8bit=args.teacher_load_in_8bit)


def final_report(student_report: dict, student: LoadedModel, teacher: LoadedModel, layout, config: DistillConfig,
                 result: DistillResult) -> dict:
    """``layercut.json`` of the distilled model: the student's report plus a ``distill`` section."""
    report = dict(student_report)
    if not report:
        covered = {i for group in layout for i in group}
        before = num_blocks(teacher.model)
        report = {"source_model": teacher.source, "model_name": teacher.name, "num_blocks_before": before,
                  "num_blocks_after": len(layout), "dropped": [i for i in range(before) if i not in covered],
                  "versions": library_versions()}
    report["distill"] = {"student": student.source, "teacher": teacher.name, "teacher_source": teacher.source,
                         "layout": layout, **result.report(config)}
    return report


def export(student: LoadedModel, report: dict, out: str, overwrite: bool, log_path: Path | None) -> Path:
    """Write the distilled checkpoint with ``prune.checkpoint.save`` (replacement-aware) or plain export."""
    try:
        from prune.checkpoint import save
    except ImportError:
        from prune.export import export_checkpoint as save

    def extra(staging: Path) -> None:
        if log_path is not None and log_path.is_file():
            shutil.copy2(log_path, staging / LOG_FILE)

    return Path(save(student.model, student.tokenizer, out, report, overwrite=overwrite, extra=extra))


def _clean_work(work: Path, keep: bool, default_location: bool) -> None:
    if keep:
        return
    shutil.rmtree(checkpoint_dir(work), ignore_errors=True)
    if default_location:  # the log was copied into --out; nothing else lives in <out>.work
        shutil.rmtree(work, ignore_errors=True)


def _summary(result: DistillResult, out: Path) -> str:
    first = f"{result.losses[0]:.5g} -> " if result.losses else ""
    return (f"distilled {result.steps} steps (from step {result.start_step}): loss {first}{result.final_loss:.5g}; "
            f"{result.steps_per_second:.3f} steps/s; peak RSS {result.peak_memory_bytes / 2**20:.0f} MiB\n"
            f"wrote {out}/")


@cli_entry
def main(argv: list[str] | None = None) -> int:
    """Run the distillation CLI; returns the exit code."""
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    if args.threads is not None:
        if args.threads <= 0:
            raise LayercutError(f"--threads must be a positive integer, got {args.threads}")
        torch.set_num_threads(args.threads)
    check_output_dir(args.out, args.overwrite)
    work = work_folder(args.out, args.work_dir)
    check_work_folder(work, args.resume, args.overwrite)
    student_report = read_report(args.student)
    name = teacher_name(args, student_report)
    student = load_student(args.student)
    teacher = load_teacher(args, name)
    check_compatible(student.model, teacher.model, student.tokenizer, teacher.tokenizer)
    layout = resolve_layout(student.model, teacher.model, student_report)
    if getattr(student.model.config, LAYOUT_ATTRIBUTE, None) is None:
        setattr(student.model.config, LAYOUT_ATTRIBUTE, layout)  # the export records it for the next tool
    result = distill(student.model, teacher.model, student.tokenizer, config, out=work, resume=args.resume,
                     layout=layout)
    from accelerate import PartialState

    if not PartialState().is_main_process:  # under `accelerate launch`, one process writes the checkpoint
        return 0
    report = final_report(student_report, student, teacher, layout, config, result)
    out = export(student, report, args.out, args.overwrite, result.log_path)
    _clean_work(work, args.keep_checkpoints, default_location=args.work_dir is None)
    print(_summary(result, out))
    return 0


def console_main() -> None:
    """Console-script entry point."""
    raise SystemExit(main())


if __name__ == "__main__":
    console_main()
