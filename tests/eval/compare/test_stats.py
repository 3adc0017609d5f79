"""``eval.compare.stats``: two models' task figures on the same rows, their paired gaps and retention above chance."""

from __future__ import annotations

import math

import pytest

from eval.compare.stats import paired_tasks


def test_two_models_on_the_same_rows_give_each_task_s_paired_gap_and_their_retention_above_chance():
    def scored(rows: dict) -> dict:
        tasks = {t: sum(r) / len(r) for t, r in rows.items()}
        return {"tasks": tasks, "task_rows": rows,
                "task_stderr": {t: (v * (1 - v) / (len(rows[t]) - 1)) ** 0.5 for t, v in tasks.items()}}

    original = scored({"arc_easy": [1] * 6 + [0] * 4, "piqa": [1] * 8 + [0] * 2})
    model = scored({"arc_easy": [1] * 5 + [0] * 5, "piqa": [1] * 7 + [0] * 3})  # one row of each lost
    figures = paired_tasks(original, model, ["arc_easy", "piqa"])
    arc = figures["tasks"]["arc_easy"]
    assert arc["original"] == 0.6 and arc["model"] == 0.5 and arc["rows"] == 10 and arc["paired"]
    assert arc["kept"] == pytest.approx(5 / 6) and arc["gap"] == pytest.approx(-0.1)
    # the difference is one -1 among ten rows: its spread (an unbiased variance of 0.1) over sqrt(10)
    assert arc["gap_stderr"] == pytest.approx(0.1) and arc["original_stderr"] == pytest.approx((0.24 / 9) ** 0.5)
    # both clearly above chance (0.35 > 2 x 0.163, 0.30 > 2 x 0.133): (0.25 + 0.20) / (0.35 + 0.30)
    assert figures["retention_tasks"] == ["arc_easy", "piqa"] and figures["excluded_tasks"] == {}
    assert figures["retention"] == pytest.approx(0.45 / 0.65)
    assert figures["retention_stderr"] == pytest.approx((0.1 ** 2 + 0.1 ** 2) ** 0.5 / 0.65)
    # rows that do not pair: the gap's standard error from the two standard errors
    unpaired = paired_tasks(original, {**model, "task_rows": {}}, ["piqa"])["tasks"]["piqa"]
    assert not unpaired["paired"] and unpaired["gap_stderr"] == pytest.approx(math.hypot((0.16 / 9) ** 0.5,
                                                                                        (0.21 / 9) ** 0.5))
    # a task with no chance level known is left out of the retention and named; the others still count
    other = {key: {**value, "copa_like": value["piqa"]} for key, value in original.items()}
    mixed = paired_tasks(other, {key: {**value, "copa_like": value["piqa"]} for key, value in model.items()},
                         ["arc_easy", "piqa", "copa_like"])
    assert mixed["retention_tasks"] == ["arc_easy", "piqa"]
    assert mixed["excluded_tasks"] == {"copa_like": "no chance level known"}
    assert mixed["retention"] == pytest.approx(figures["retention"])
    assert mixed["retention_stderr"] == pytest.approx(figures["retention_stderr"])
    assert mixed["tasks"]["copa_like"]["gap"] == pytest.approx(-0.1)  # still in the table
    alone = paired_tasks(other, other, ["copa_like"])  # none counted: no retention, and why
    assert "retention" not in alone and alone["excluded_tasks"] == {"copa_like": "no chance level known"}
