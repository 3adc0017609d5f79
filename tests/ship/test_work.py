"""``ship.work``: each stage's result read back typed; a damaged file is one line saying how to start over."""

from __future__ import annotations

import json

import pytest

from prune.errors import LayercutError
from ship.plan import Plan
from ship.shortlist import Candidate, Shortlist
from ship.work import PLAN, SETTINGS, SHORTLIST, WorkFolder


def shortlist(**changes) -> dict:
    data = Shortlist(count=2, params_before=100, chosen=0,
                     candidates=[Candidate([1, 2], "fold", ["topk/linearity"], params=80, kl=0.1, ppl=5.0)]).to_json()
    return {**data, **changes}


def test_a_kept_result_reads_back_as_it_was_written(tmp_path):
    work = WorkFolder(tmp_path)
    work.write(SHORTLIST, Shortlist(**shortlist()))
    back = work.read(SHORTLIST, Shortlist)
    assert back.best == Candidate([1, 2], "fold", ["topk/linearity"], params=80, kl=0.1, ppl=5.0)
    assert work.read(PLAN, Plan) is None  # no run finished that stage


@pytest.mark.parametrize(("text", "why"), [
    ("{not json", "JSONDecodeError"),
    ("[1, 2]", "not a JSON object"),
    (json.dumps(shortlist(chosen=7)), "'chosen' is 7, and it lists 1 candidates"),
    (json.dumps(shortlist(chosen="0")), "'chosen' is '0'"),
    (json.dumps({k: v for k, v in shortlist().items() if k != "count"}), "has no 'count'"),
    (json.dumps(shortlist(candidates=[{"blocks": [1], "colour": "red"}])), "colour"),
])
def test_a_damaged_result_is_one_line_that_says_how_to_start_over(tmp_path, text, why):
    (tmp_path / SHORTLIST).write_text(text)
    with pytest.raises(LayercutError) as raised:
        WorkFolder(tmp_path).read(SHORTLIST, Shortlist)
    message = str(raised.value)
    assert "\n" not in message and why in message and "to start over" in message, message
    assert message.count("is damaged") == 1, message  # said once, not wrapped in itself


def test_a_file_in_the_way_of_the_work_folder_and_damaged_settings_are_one_line(tmp_path):
    (tmp_path / "o.work").write_text("something else")
    with pytest.raises(LayercutError, match="is a file where prune.ship keeps its work folder"):
        WorkFolder(tmp_path / "o.work").open({"model": "m"})
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / SETTINGS).write_bytes(b"\xff\x00")
    with pytest.raises(LayercutError, match="damaged .*to start over"):
        WorkFolder(tmp_path / "w").open({"model": "m"})


def test_the_settings_are_matched_and_marked_only_when_asked(tmp_path):
    work = WorkFolder(tmp_path / "w")
    assert work.open({"model": "m"}) is False and not (tmp_path / "w").exists()
    work.mark({"model": "m"})
    assert work.open({"model": "m"}) is True
    with pytest.raises(LayercutError, match=r"holds a run with other settings \(model\)"):
        work.open({"model": "other"})
    # a setting one of the runs does not have (another version's) is named too
    with pytest.raises(LayercutError, match=r"other settings \(heal, model\): type that run's command again"):
        work.open({"model": "other", "heal": {"lora_r": 64}})


def test_a_stage_keeps_the_most_bytes_any_gpu_held_during_it_and_none_without_cuda(tmp_path, monkeypatch):
    import ship.work as work_module

    class FakeCuda:  # two GPUs; each stage starts from a reset, as torch's peak statistics do
        def __init__(self):
            self.peaks = [0, 0]

        def device_count(self):
            return 2

        def reset_peak_memory_stats(self, index):
            self.peaks[index] = 0

        def max_memory_allocated(self, index):
            return self.peaks[index]

    work = WorkFolder(tmp_path)
    monkeypatch.setattr(work_module, "_cuda_in_use", lambda: None)  # no CUDA started (as in CI; not on a GPU)
    assert work.stage(PLAN, Plan, lambda: Plan(num_blocks=4)).cuda_peak is None
    cuda = FakeCuda()
    cuda.peaks = [7, 9]  # an earlier stage's
    monkeypatch.setattr(work_module, "_cuda_in_use", lambda: cuda)

    def stage():
        cuda.peaks[1] += 5  # what this stage itself held on the second GPU
        return Shortlist(**shortlist())

    assert work.stage(SHORTLIST, Shortlist, stage).cuda_peak == 5
    assert work.read(SHORTLIST, Shortlist).cuda_peak == 5  # kept with the result
