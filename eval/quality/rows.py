"""Which rows of each task a ``--limit`` reads: a count, a fraction, a range ``START:END`` or a seeded draw.

    from eval.quality.rows import task_rows, describe_rows
    task_rows("3~2:8", 10)     # [2, 5, 6]: 3 rows drawn with TASK_SEED from rows 2..7
    describe_rows("-500:")     # "rows -500: of each task, as Python slices them"

:func:`eval.quality.lmeval.run_lm_eval` reads rows by these rules; scripts that pair a results file's per-row
answers with a task's rows call :func:`task_rows` rather than rebuild them. :mod:`eval.quality.lmeval` re-exports
every public name but :func:`parse_limit`, the commands' ``--limit`` (``eval.run``, ``eval.compare``,
``prune.ship``), here so that a command's parser does not import the evaluation.
"""

from __future__ import annotations

import argparse
import math
import random
from typing import Any

from prune.errors import LayercutError

# Seeds lm-eval's samplers and which rows a draw N~START:END picks: a draw is the same rows every run.
TASK_SEED = 1234


def _split_draw(limit: Any) -> tuple[str, str | None] | None:
    """``limit``'s range and its draw (``"N~START:END"``: N of those rows at random), or ``None`` for a count."""
    if not isinstance(limit, str) or (":" not in limit and "~" not in limit):
        return None
    draw, _, rows = limit.rpartition("~")
    return rows, (draw if "~" in limit else None)


def row_range(limit: Any) -> slice | None:
    """``limit``'s range of rows as a slice, else ``None`` (a count or fraction).

    ``"START:END"`` has Python's slice bounds; a draw ``"N~START:END"`` is taken from that range.

    A range scores rows a count cannot reach: ``"-500:"`` is each task's last 500 rows, so defaults can be
    chosen on rows that a report on ``--limit 1000`` (the first 1,000) never reads.
    """
    split = _split_draw(limit)
    if split is None:
        return None
    bounds = split[0].split(":")
    try:
        if len(bounds) != 2:
            raise ValueError
        start, stop = (int(b) if b.strip() else None for b in bounds)
    except ValueError:
        raise LayercutError(
            f"a range of rows is START:END in whole numbers (-500: is the last 500), got {limit!r}"
        ) from None
    return slice(start, stop)


def row_draw(limit: Any) -> int | None:
    """How many rows ``"N~START:END"`` draws at random from its range; ``None`` for a plain range or count.

    The tail of a task is not a sample of it (HellaSwag's last rows are all WikiHow, its first none), so a
    split to choose defaults on is drawn across the rows a report does not read: ``"1000~1000:"``.
    """
    split = _split_draw(limit)
    if split is None or split[1] is None:
        return None
    row_range(limit)
    try:
        count = int(split[1])
        if count < 1:
            raise ValueError
    except ValueError:
        raise LayercutError(f"a draw of rows is N~START:END with N a positive whole number (1000~1000: is 1,000 "
                            f"rows drawn at random from row 1000 on), got {limit!r}") from None
    return count


def describe_rows(limit: Any) -> str:
    """Which rows of each task ``limit`` reads, in words: a selection run and a report read different rows."""
    if limit is None:
        return "every row of each task"
    draw = row_draw(limit)
    if draw is not None:
        return (f"{draw:,} rows of each task drawn at random, seed {TASK_SEED}, from its rows {_split_draw(limit)[0]} "
                "as Python slices them")
    if row_range(limit) is not None:
        return f"rows {limit} of each task, as Python slices them"
    return f"the first {limit:,} rows of each task" if limit >= 1 else f"the first {limit:.0%} of each task"


def check_limit(limit: int | float | str | None) -> Any:
    """Validate ``limit``; return it as lm-eval reads it (a float below 1 is a fraction, else rows).

    A range of rows (``"START:END"``) or a draw (``"N~START:END"``) is returned as it came:
    :func:`eval.quality.lmeval.run_lm_eval` turns it into each task's row indices once it knows how many rows the
    task has.

    Raises:
        LayercutError: ``limit`` is none of a count, a fraction in (0, 1), a range or a draw.
    """
    row_draw(limit)
    if limit is not None and row_range(limit) is None:
        whole = isinstance(limit, int) or (isinstance(limit, float) and limit.is_integer())
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0 or (limit >= 1 and not whole):
            raise LayercutError(f"limit must be a number of rows, a fraction in (0, 1), a range of rows START:END "
                                f"or a draw N~START:END, got {limit!r}")
        limit = limit if limit < 1 else int(limit)
    return limit


def task_rows(limit: Any, total: int, name: str = "the task", seed: int = TASK_SEED) -> list[int]:
    """The indices of the rows ``limit`` reads from a task of ``total`` rows, as :func:`run_lm_eval` reads them.

    ``None`` is every row, a count the first rows, a fraction that share of the first rows (rounded up, as
    lm-eval does), a range ``START:END`` Python's slice of them and a draw ``N~START:END``
    ``sorted(random.Random(seed).sample(range(total)[START:END], N))``. Scripts that pair a results file's
    per-row answers with the task's rows call this rather than rebuild the rule.
    """
    rows, span = list(range(total)), row_range(limit)
    if span is None:
        limit = check_limit(limit)
        if limit is None:
            return rows
        return rows[:math.ceil(total * limit) if limit < 1 else limit]
    picked, draw = rows[span], row_draw(limit)
    if not picked:
        raise LayercutError(f"rows {_split_draw(limit)[0]} of {name} are none of its {total} rows: pick a range "
                            f"inside 0:{total}")
    if draw is None:
        return picked
    if draw > len(picked):
        raise LayercutError(f"{limit} draws {draw} rows from {len(picked)} of {name}: draw fewer or widen the range")
    return sorted(random.Random(seed).sample(picked, draw))


def parse_limit(text: str) -> int | float | str:
    """Parse ``--limit``: a row count or fraction as lm-eval reads them, a range of rows, or a draw from a range.

    Below 1 a fraction of each task, else a row count. A range (``START:END``, ``-500:``) or a draw
    (``1000~1000:``) comes back as its text: results files keep it as typed.
    """
    if ":" in text or "~" in text:
        try:
            row_range(text)
            row_draw(text)
        except LayercutError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a row count, a fraction in (0, 1), a range START:END or a draw "
                                         f"N~START:END: {text}") from None
    if value < 1:
        return value
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"a row count must be a whole number, got {text}")
    return int(value)
