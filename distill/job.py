"""One distillation job between folders: open the student (with its maps) and its teacher, train, export.

``distill.run`` (the CLI) builds a :class:`DistillJob` and calls :func:`run_job`. Checkpoints, the
training log and a teacher cache (``--teacher-cache``) go to a work folder (``<out>.work`` unless
``work_dir``); the final ``out`` is written atomically: the trained student, its tokenizer, and
``layercut.json`` = the student's report plus a ``distill`` section.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from distill.checkpoints import checkpoint_dir, default_work_folder, latest_checkpoint, list_checkpoints
from distill.checks import check_compatible
from distill.config import DistillConfig
from distill.layout import Layout, check_layout, resolve_layout
from distill.teacher_cache import TeacherCache, cache_folder, files_stamp, open_cache
from distill.train import LOG_FILE, DistillResult, distill, training_ids, write_teacher_cache
from prune.atomic import atomic_directory, check_output_dir
from prune.checkpoint.load_config import LoadConfig
from prune.checkpoint.report import read_report
from prune.checkpoint.save_load import load, write_model
from prune.checkpoint.write import HELDOUT_BEFORE_DISTILL, library_versions
from prune.errors import LayercutError
from prune.loading.loader import LoadedModel, resolve_model_name
from prune.model.adapters import num_blocks
from prune.model.surgery import LAYOUT_ATTR


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
        save_total_limit: checkpoints kept in the work folder while training (the newest ones).
    """

    student: str
    teacher: LoadConfig
    config: DistillConfig
    out: str
    work_dir: str | None = None
    resume: bool = False
    overwrite: bool = False
    keep_checkpoints: bool = False
    save_total_limit: int = 1

    def __post_init__(self):
        if self.save_total_limit < 1:
            raise LayercutError(f"--save-total-limit must be 1 or more, got {self.save_total_limit}")


def run_job(job: DistillJob) -> tuple[DistillResult, Path | None]:
    """Check, load, distil and export; returns the result and the written folder (None off the main process)."""
    from distill.processes import process_state

    check_output_dir(job.out, job.overwrite)
    work = work_folder(job.out, job.work_dir)
    check_work_folder(work, job.resume, job.overwrite)
    student_report = read_report(job.student)
    student = load(job.student, dtype="float32")  # float32 master weights
    teacher, layout, cache = open_teacher(job, student, student_report, work)
    if getattr(student.model.config, LAYOUT_ATTR, None) is None:
        setattr(student.model.config, LAYOUT_ATTR, layout)  # the export records it for the next tool
    # with a cache the teacher was freed once it was written (or never loaded): training runs without it
    result = distill(student.model, None if cache is not None else teacher.model, student.tokenizer, job.config,
                     out=work, resume=job.resume, layout=layout, teacher_cache=cache,
                     save_total_limit=job.save_total_limit)
    if not process_state().is_main_process:  # under `accelerate launch`, one process writes the checkpoint
        return result, None
    if result.whole_state is not None:  # FSDP: the student stays sharded; its gathered tensors go into a fresh copy
        student = load(job.student, dtype="float32")
        setattr(student.model.config, LAYOUT_ATTR, getattr(student.model.config, LAYOUT_ATTR, None) or layout)
        student.model.load_state_dict(result.whole_state, strict=False)
    report = final_report(student_report, student, teacher, layout, job.config, result)
    out = export(student, report, job.out, job.overwrite, result.log_path)
    _clean_work(work, job.keep_checkpoints, default_location=job.work_dir is None)
    return result, out


@dataclass
class TeacherRef:
    """What the report needs of a teacher that is not in memory: freed after writing its cache, or never loaded."""

    name: str
    source: str
    blocks: int


def open_teacher(job: DistillJob, student: LoadedModel, report: dict,
                 work: Path) -> tuple[LoadedModel | TeacherRef, Layout, TeacherCache | None]:
    """The teacher, the student's layout and, with ``--teacher-cache``, the cache the run reads.

    A cache whose request matches (same teacher files, student files, data, K: a resumed run) is read without
    loading the teacher. Otherwise the teacher is loaded and checked against the student; with a cache
    option, the cache is written (or reused, when its digest of the weights and tokens matches) and the
    teacher freed, so its memory is not held while training.
    """
    name = teacher_name(job.teacher.model, report)
    request = cache_request(job, name) if job.config.teacher_cache is not None else None
    if request is not None and request["teacher_files"] is not None and request["student_files"] is not None:
        cache = open_cache(cache_folder(work), request=request)
        if cache is not None:
            header = cache.header
            ref = TeacherRef(header["teacher_name"], header["teacher_source"], int(header["teacher_blocks"]))
            return ref, check_layout(header["layout"], num_blocks(student.model), ref.blocks), cache
    teacher = load_teacher(job.teacher, name)
    check_compatible(student.model, teacher.model, student.tokenizer, teacher.tokenizer)
    layout = resolve_layout(student.model, teacher.model, report)
    if request is None:
        return teacher, layout, None
    ref = TeacherRef(teacher.name, teacher.source, num_blocks(teacher.model))
    meta = {"teacher_name": ref.name, "teacher_source": ref.source, "teacher_blocks": ref.blocks, "layout": layout}
    data = training_ids(student.tokenizer, teacher.model, job.config, None, None)
    cache = write_teacher_cache(teacher.model, job.config, work, data, student.model, request=request, meta=meta)
    del teacher, data
    gc.collect()  # the teacher's weights go now, before the student's optimizer state is made
    return ref, layout, cache


def cache_request(job: DistillJob, name: str) -> dict:
    """What a cache must have been written for to be read without loading the teacher (JSON-normalised).

    The files of both models (``files_stamp``: None for a hub id, which must be loaded to be fingerprinted),
    how the teacher is loaded, the data options, K, the autocast option and whether a GPU runs it.
    """
    load_options = {**dataclasses.asdict(job.teacher), "model": name}
    request = {"teacher_files": files_stamp(resolve_model_name(name)), "student_files": files_stamp(job.student),
               "teacher": load_options, "data": dataclasses.asdict(job.config.data), "cache": job.config.teacher_cache,
               "mixed_precision": job.config.mixed_precision, "cuda": torch.cuda.is_available()}
    return json.loads(json.dumps(request))


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
    from distill.processes import process_state

    config = dataclasses.replace(options, model=name)
    if config.device == "auto" and not torch.cuda.is_available():
        config.device = "cpu"
    elif config.device == "auto" and process_state().num_processes > 1:
        config.device = f"cuda:{process_state().local_process_index}"  # one teacher per process, on its own GPU
    return config.load()


def final_report(student_report: dict, student: LoadedModel, teacher: LoadedModel | TeacherRef, layout,
                 config: DistillConfig, result: DistillResult) -> dict:
    """``layercut.json`` of the distilled model: the student's report plus a ``distill`` section."""
    report = dict(student_report)
    if not report:
        covered = {i for group in layout for i in group}
        before = teacher.blocks if isinstance(teacher, TeacherRef) else num_blocks(teacher.model)
        report = {"source_model": teacher.source, "model_name": teacher.name, "num_blocks_before": before,
                  "num_blocks_after": len(layout), "dropped": [i for i in range(before) if i not in covered],
                  "versions": library_versions()}
    if isinstance(report.get("heldout"), dict):  # measured on the student: say so rather than pass it for this model
        report["heldout"] = {**report["heldout"], "stage": HELDOUT_BEFORE_DISTILL}
    report["distill"] = {"student": student.source, "teacher": teacher.name, "teacher_source": teacher.source,
                         "layout": layout, **result.report(config)}
    return report


def export(student: LoadedModel, report: dict, out: str, overwrite: bool, log_path: Path | None) -> Path:
    """Write the distilled checkpoint (replacement maps included) and the training log, all or nothing."""
    with atomic_directory(out, overwrite) as staging:
        write_model(staging, student.model, student.tokenizer, out, report)
        if log_path is not None and log_path.is_file():
            shutil.copy2(log_path, staging / LOG_FILE)
    return Path(out)


def _clean_work(work: Path, keep: bool, default_location: bool) -> None:
    if keep:
        return
    shutil.rmtree(checkpoint_dir(work), ignore_errors=True)
    shutil.rmtree(cache_folder(work), ignore_errors=True)  # its teacher's logits: only this run's to reuse
    if default_location:  # the log was copied into --out; nothing else lives in <out>.work
        shutil.rmtree(work, ignore_errors=True)
