"""Which rows of each task a ``--limit`` reads: a count, a fraction, a range ``START:END`` or a seeded draw."""

import random

import pytest

from eval.quality.rows import TASK_SEED, check_limit, describe_rows, row_draw, row_range, task_rows
from prune.errors import LayercutError


def test_each_spelling_reads_its_rows():
    assert task_rows(None, 5) == [0, 1, 2, 3, 4]
    assert task_rows(3, 10) == task_rows(3.0, 10) == [0, 1, 2]
    assert task_rows(0.25, 10) == [0, 1, 2]  # a fraction rounds up, as lm-eval does
    assert task_rows("-3:", 10) == [7, 8, 9] and task_rows("2:4", 10) == [2, 3]
    drawn = task_rows("3~2:8", 10)
    assert drawn == sorted(random.Random(TASK_SEED).sample(range(2, 8), 3)) == task_rows("3~2:8", 10)
    assert task_rows("3~2:8", 10, seed=7) == sorted(random.Random(7).sample(range(2, 8), 3))
    assert (row_range("3~2:8"), row_draw("3~2:8"), row_range(5), row_draw("2:8")) == (slice(2, 8), 3, None, None)


def test_the_rows_read_are_said_in_words():
    assert describe_rows(None) == "every row of each task"
    assert describe_rows(100) == "the first 100 rows of each task"
    assert describe_rows(0.5) == "the first 50% of each task"
    assert describe_rows("-500:") == "rows -500: of each task, as Python slices them"
    assert describe_rows("10~5:") == (f"10 rows of each task drawn at random, seed {TASK_SEED}, from its rows 5: as "
                                      "Python slices them")


@pytest.mark.parametrize("limit,message", [
    ("a:b", "a range of rows is START:END in whole numbers"),
    ("1:2:3", "a range of rows is START:END in whole numbers"),
    ("0~1:5", "a draw of rows is N~START:END with N a positive whole number"),
    (1.5, "limit must be a number of rows, a fraction in (0, 1)"),
    (0, "limit must be a number of rows"),
    (True, "limit must be a number of rows"),
])
def test_a_bad_limit_is_one_line(limit, message):
    with pytest.raises(LayercutError) as err:
        check_limit(limit)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_range_outside_the_task_or_a_draw_too_large_is_refused():
    with pytest.raises(LayercutError, match=r"rows 20:30 of piqa are none of its 10 rows: pick a range inside 0:10"):
        task_rows("20:30", 10, "piqa")
    with pytest.raises(LayercutError, match="5~0:3 draws 5 rows from 3 of piqa"):
        task_rows("5~0:3", 10, "piqa")
