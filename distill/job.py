"""One distillation job between folders: open the student (with its maps) and its teacher, train, export.

``distill.run`` (the CLI) builds a :class:`DistillJob` and calls :func:`run_job`. Checkpoints and the
training log go to a work folder (``<out>.work`` unless ``work_dir``); the final ``out`` is written
atomically: the trained student, its tokenizer, and ``layercut.json`` = the student's report plus a
``distill`` section.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from distill.checkpoints import checkpoint_dir, default_work_folder, latest_checkpoint, list_checkpoints
from distill.checks import check_compatible
from distill.config import DistillConfig
from distill.layout import resolve_layout
from distill.train import LOG_FILE, DistillResult, distill
from prune.adapters import num_blocks
from prune.checkpoint import load, save
from prune.errors import LayercutError
from prune.export import HELDOUT_BEFORE_DISTILL, check_output_dir, library_versions, read_report
from prune.loading import LoadedModel
from prune.options import LoadConfig
from prune.surgery import LAYOUT_ATTR


@dataclass
class DistillJob:
    """Everything a distillation between folders needs.

    Attributes:
        student: folder of a layercut student (written by ``prune.run``).
        teacher: how to load the teacher; its ``model`` None means the model named in the student's
            ``layercut.json``, its device "auto" the GPU when there is one (each process's own under
            ``accelerate launch``), else the CPU.
        config: the training run.
        out: folder for the distilled checkpoint.
        work_dir: checkpoints and ``train_log.jsonl`` (None: ``<out>.work``).
        resume: continue from the latest checkpoint in the work folder.
        overwrite: replace a non-empty ``out`` and discard old checkpoints.
        keep_checkpoints: keep the work folder's checkpoints after the export.
    """

    student: str
    teacher: LoadConfig
    config: DistillConfig
    out: str
    work_dir: str | None = None
    resume: bool = False
    overwrite: bool = False
    keep_checkpoints: bool = False


def run_job(job: DistillJob) -> tuple[DistillResult, Path | None]:
    """Check, load, distil and export; returns the result and the written folder (None off the main process)."""
    from accelerate import PartialState

    check_output_dir(job.out, job.overwrite)
    work = work_folder(job.out, job.work_dir)
    check_work_folder(work, job.resume, job.overwrite)
    student_report = read_report(job.student)
    student = load(job.student, dtype="float32")  # float32 master weights
    teacher = load_teacher(job.teacher, teacher_name(job.teacher.model, student_report))
    check_compatible(student.model, teacher.model, student.tokenizer, teacher.tokenizer)
    layout = resolve_layout(student.model, teacher.model, student_report)
    if getattr(student.model.config, LAYOUT_ATTR, None) is None:
        setattr(student.model.config, LAYOUT_ATTR, layout)  # the export records it for the next tool
    result = distill(student.model, teacher.model, student.tokenizer, job.config, out=work, resume=job.resume,
                     layout=layout)
    if not PartialState().is_main_process:  # under `accelerate launch`, one process writes the checkpoint
        return result, None
    report = final_report(student_report, student, teacher, layout, job.config, result)
    out = export(student, report, job.out, job.overwrite, result.log_path)
    _clean_work(work, job.keep_checkpoints, default_location=job.work_dir is None)
    return result, out


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


def teacher_name(given: str | None, report: dict) -> str:
    """``given`` (``--teacher``), else the model the student's report says it came from."""
    name = given or report.get("model_name") or report.get("source_model")
    if not name:
        raise LayercutError("--teacher is required: the student's layercut.json does not name its original model")
    return name


def load_teacher(options: LoadConfig, name: str) -> LoadedModel:
    """Load the teacher ``name`` with ``options``; device "auto" means the GPU when there is one."""
    import dataclasses

    from accelerate import PartialState

    config = dataclasses.replace(options, model=name)
    if config.device == "auto" and not torch.cuda.is_available():
        config.device = "cpu"
    elif config.device == "auto" and PartialState().num_processes > 1:
        config.device = f"cuda:{PartialState().local_process_index}"  # one teacher per process, on its own GPU
    return config.load()


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
    if isinstance(report.get("heldout"), dict):  # measured on the student: say so rather than pass it for this model
        report["heldout"] = {**report["heldout"], "stage": HELDOUT_BEFORE_DISTILL}
    report["distill"] = {"student": student.source, "teacher": teacher.name, "teacher_source": teacher.source,
                         "layout": layout, **result.report(config)}
    return report


def export(student: LoadedModel, report: dict, out: str, overwrite: bool, log_path: Path | None) -> Path:
    """Write the distilled checkpoint (replacement maps included) with ``prune.checkpoint.save``."""
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
