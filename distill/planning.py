"""What a distillation run will hold and take, per device, before anything loads (``distill.run --plan``).

The student's ``layercut.json`` names its teacher and how many blocks it lost; the teacher's config alone
(``prune.planner.estimate``) gives the sizes. Only the stages ``distill.run`` runs are kept: the teacher's cache
when one is asked for, and the training.
"""

from __future__ import annotations

from distill.job import DistillJob, teacher_name
from prune.checkpoint.report import REPORT_FILE, read_report
from prune.errors import LayercutError
from prune.planner.estimate import Hardware, PlanInput, RunPlan, distill_spec, plan_run
from prune.planner.shape import shape_of_name

# prune.planner.estimate's stages that distill.run runs
DISTILL_STAGES = ("teacher cache", "distillation")


def plan_job(job: DistillJob, hardware: Hardware) -> RunPlan:
    """The plan of ``job`` on ``hardware``: its teacher cache (if any) and its training."""
    report = read_report(job.student)
    teacher = teacher_name(job.teacher.model, report)
    shape = shape_of_name(teacher)
    options = {**job.config.to_dict(), "data": {"seq_len": job.config.data.seq_len}}
    load = job.teacher
    dropped = _blocks_removed(job.student, report, shape.layers)
    inp = PlanInput(model=teacher, drop=dropped,
                    replace=report.get("replace") or "none", dtype=load.dtype,
                    quant_bits=4 if load.load_in_4bit else 8 if load.load_in_8bit else 16,
                    checkpoint_dtype=shape.dtype, distill=distill_spec(options, job.config.data.seq_len),
                    hardware=hardware)
    plan = plan_run(shape, inp, moments_alive=False)
    return RunPlan(shape, inp, [stage for stage in plan.stages if stage.name in DISTILL_STAGES], plan.limits)


def _blocks_removed(student: str, report: dict, teacher_blocks: int) -> int:
    """Blocks the student lacks: from its ``layercut.json``, else its config's block count against the teacher's.

    Raises:
        LayercutError: the student has as many blocks as its teacher (it is not a pruned model, and a run would
            refuse it), or its report's counts are not numbers.
    """
    counted = "num_blocks_before" in report and "num_blocks_after" in report
    try:
        student_blocks = int(report["num_blocks_after"]) if counted else shape_of_name(student).layers
        teacher_blocks = int(report["num_blocks_before"]) if counted else teacher_blocks
    except (TypeError, ValueError):
        raise LayercutError(f"{student}/{REPORT_FILE} is damaged (num_blocks_before / num_blocks_after are not "
                            "numbers): re-export the student with prune.run") from None
    if student_blocks >= teacher_blocks:
        where = f"its {REPORT_FILE}" if counted else f"its config; it has no {REPORT_FILE}"
        raise LayercutError(f"{student} has {student_blocks} blocks, the teacher {teacher_blocks} (by {where}): it is "
                            "not a pruned model; pass a folder written by prune.run (or a model with blocks removed)")
    return teacher_blocks - student_blocks
