"""Distillation as a post-surgery step of a prune run (``prune.run --distill-steps N``).

Registered as the ``distill`` entry point of the ``layercut.steps`` group (``pyproject.toml``): prune
finds it by name and never imports ``distill``. The teacher is a fresh load of the model the run
pruned; checkpoints and the training log go to ``<out>.work/``, and the log is copied into the export.
``prune.ship`` calls it with the original in memory, and on several processes (:mod:`distill.launch`).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import shutil
from pathlib import Path

from distill.checkpoints import default_work_folder, list_checkpoints
from distill.config import DistillConfig
from distill.launch import LaunchJob, load_trained, train_on_processes
from distill.layout import resolve_layout
from distill.train import distill, training_ids, write_teacher_cache
from prune.data.calibration import DEFAULT_DATA
from prune.loading.loader import LoadedModel
from prune.model.adapters import num_blocks
from prune.pipeline.steps import StepResult

logger = logging.getLogger(__name__)


def step_config(options: dict, prune_config) -> DistillConfig:
    """The :class:`DistillConfig` of a prune run's ``distill`` section.

    Without its own text (``data: {data: ...}``), distillation reads the run's calibration source (``--data``)
    at its own sequence length and count (``--distill-samples``); without ``--data`` either, its own default
    (``distill.config``).
    """
    config = DistillConfig.from_dict(options)
    own = options.get("data") or {}
    if isinstance(own, dict) and "data" not in own and prune_config.data.data not in (None, DEFAULT_DATA):
        data = dataclasses.replace(config.data, data=prune_config.data.data, text_field=prune_config.data.text_field)
        config = dataclasses.replace(config, data=data)
    return config


class DistillStep:
    """Layerwise distillation of the surgered model towards a fresh copy of the original."""

    name = "distill"

    def __init__(self, options: dict, prune_config):
        self.config = step_config(options, prune_config)

    def __call__(self, loaded: LoadedModel, prune_config, *, token_ids=None, heldout_ids=None,
                 teacher: LoadedModel | None = None, resume: bool = False, processes: int = 1,
                 folder: str | Path | None = None) -> StepResult:
        """Distil ``loaded.model`` in place; the report section, the log to copy and the work folder to delete.

        ``token_ids`` / ``heldout_ids``: the caller's sequences (``prune.ship`` trains on its calibration rows);
        ``teacher``: the original already in memory (else a fresh load of the model the run pruned);
        ``resume``: continue from the work folder's latest checkpoint where it has one (``prune.ship``, whose
        work folder holds only what its same settings made), else start over;
        ``processes``: above 1, the training runs on that many processes launched by accelerate, each loading
        the student from ``folder`` (``loaded``'s checkpoint on disk) and reading the teacher cache written here
        (:mod:`distill.launch`); the trained weights come back into ``loaded.model``.
        """
        if processes > 1 and (self.config.teacher_cache is None or folder is None or prune_config.out is None):
            raise ValueError("several processes read the teacher's cache and the student's folder: give "
                             "teacher_cache, folder= and an out")
        if teacher is None:
            logger.info("loading the teacher (%s) for %d distillation steps", prune_config.load.model,
                        self.config.steps)
            teacher = prune_config.load.load()
        work = default_work_folder(prune_config.out) if prune_config.out is not None else None
        resume = resume and work is not None and bool(list_checkpoints(work))
        if work is not None and work.exists() and not resume:
            shutil.rmtree(work)  # a fresh run: prune.run has no --resume (distill.run has)
        teacher_model, layout, cache = self._teacher_side(loaded, teacher, work, token_ids, heldout_ids)
        del teacher
        gc.collect()  # with a cache, the teacher's weights go before training starts
        if processes > 1:
            return self._launched(loaded, prune_config, work, layout, cache, resume, processes, folder)
        result = distill(loaded.model, teacher_model, loaded.tokenizer, self.config, out=work, layout=layout,
                         teacher_cache=cache, token_ids=token_ids, heldout_ids=heldout_ids, resume=resume)
        del teacher_model
        files = [result.log_path] if result.log_path is not None else []
        report = {"teacher": prune_config.load.model, **result.report(self.config)}
        return StepResult(report, files=files, cleanup=[work] if work is not None else [])

    def _launched(self, loaded: LoadedModel, prune_config, work: Path, layout, cache, resume: bool, processes: int,
                  folder: str | Path) -> StepResult:
        """The training on ``processes`` processes; their weights loaded into ``loaded.model``."""
        job = LaunchJob(student=str(folder), dtype=prune_config.load.dtype, device=prune_config.load.device,
                        config=self.config, layout=layout, cache_key=cache.header["key"], work=str(work),
                        resume=resume, processes=processes)
        report, log = train_on_processes(job, precision=cache.header["precision"])
        load_trained(loaded.model, work)
        report = {"teacher": prune_config.load.model, **report, "teacher_cache": cache.report()}  # written here
        return StepResult(report, files=[log] if log is not None else [], cleanup=[work])

    def _teacher_side(self, student: LoadedModel, teacher: LoadedModel, work, token_ids=None, heldout_ids=None):
        """(teacher model, layout, cache): with ``teacher_cache``, the cache is written and the teacher freed."""
        if self.config.teacher_cache is None:
            return teacher.model, None, None
        layout = resolve_layout(student.model, teacher.model)
        meta = {"teacher_name": teacher.name, "teacher_source": teacher.source,
                "teacher_blocks": num_blocks(teacher.model), "layout": layout}
        data = training_ids(student.tokenizer, teacher.model, self.config, token_ids, heldout_ids)
        cache = write_teacher_cache(teacher.model, self.config, work, data, student.model, meta=meta)
        return None, layout, cache
