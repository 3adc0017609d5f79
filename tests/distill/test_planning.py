"""``distill.run --plan``: the teacher cache and the training of a run, sized from the configs before any load."""

from pathlib import Path

import pytest

from distill.config import DistillConfig
from distill.job import DistillJob
from distill.planning import DISTILL_STAGES, _blocks_removed, plan_job
from prune.checkpoint.load_config import LoadConfig
from prune.errors import LayercutError
from prune.planner.estimate import Hardware
from tests.helpers import make_student_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    return make_student_pair(tmp_path_factory.mktemp("plan"))


def job(pair, **config) -> DistillJob:
    return DistillJob(student=str(pair["student"]), teacher=LoadConfig(model=None),
                      config=DistillConfig(steps=5, **config), out=str(pair["student"].parent / "out"))


def test_the_plan_holds_the_stages_distill_run_runs(pair):
    plan = plan_job(job(pair), Hardware())
    assert [stage.name for stage in plan.stages] == ["distillation"]
    # the teacher named in the student's layercut.json, two of its four blocks removed
    assert (plan.inp.model, plan.inp.drop, plan.inp.distill.steps) == (str(pair["teacher"]), 2, 5)
    cached = plan_job(job(pair, teacher_cache="topk=8"), Hardware())
    assert [stage.name for stage in cached.stages] == list(DISTILL_STAGES) == ["teacher cache", "distillation"]


def test_blocks_removed_come_from_the_report_else_from_the_students_config(pair):
    assert _blocks_removed("s", {"num_blocks_before": 8, "num_blocks_after": 5}, 99) == 3
    assert _blocks_removed(str(pair["student"]), {}, 4) == 2  # no counts: the student's config has 2 blocks
    with pytest.raises(LayercutError, match="s has 4 blocks, the teacher 4 .*it is not a pruned model"):
        _blocks_removed("s", {"num_blocks_before": 4, "num_blocks_after": 4}, 4)
    with pytest.raises(LayercutError, match="layercut.json is damaged"):
        _blocks_removed("s", {"num_blocks_before": "four", "num_blocks_after": 2}, 4)
