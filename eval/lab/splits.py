"""The texts that choose defaults and the prompts ``eval.mapfit`` reads: kept apart from every reported figure."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from eval.quality.lmeval import answered_prompts, local_tasks
from eval.quality.task_specs import resolve_data_dir
from prune.errors import LayercutError

SELECTION_TASKS = ("arc_easy", "hellaswag", "piqa")
PROMPT_TASKS = ("arc_easy", "hellaswag", "piqa", "lambada_openai")
SELECTION_ROWS = 500
REPORTED_ROWS = 1000


def _write_jsonl(path: Path, texts: Sequence[str]) -> None:
    with open(path, "w", encoding="utf-8") as file:
        for text in texts:
            file.write(json.dumps({"text": text}) + "\n")


def write_selection_split(data_dir: str | Path, out: str | Path, tasks: Sequence[str] = SELECTION_TASKS,
                          rows: int = SELECTION_ROWS, reported: int = REPORTED_ROWS) -> list[Path]:
    """Write the selection split under ``out``; the files written.

    The last fifth of Tiny Shakespeare (the reported "plays" domain reads its start) and the last ``rows``
    rows of each task as lm-eval builds them (reports read the first ``reported``; a task with fewer than
    ``reported + rows`` rows would let the two meet, and is refused), one prompt plus its right answer per line.

    Raises:
        LayercutError: no such data folder or no Tiny Shakespeare in it; a task too short to keep the two apart.
    """
    folder = resolve_data_dir(data_dir) if str(data_dir).strip() else None
    plays_file = folder / "tinyshakespeare" / "input.txt" if folder is not None else None
    if plays_file is None or not plays_file.is_file():
        raise LayercutError(f"no tinyshakespeare/input.txt in the data folder {str(data_dir)!r}: point it at a "
                            "folder laid out like shared/data")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plays = plays_file.read_text(encoding="utf-8")
    written = [out / "plays_last_fifth.txt"]
    written[0].write_text(plays[len(plays) * 4 // 5:], encoding="utf-8")
    for name, task in local_tasks(tasks, data_dir).items():
        texts = answered_prompts(task)
        if len(texts) < reported + rows:
            raise LayercutError(f"{name} has {len(texts)} rows: its last {rows} would meet the reported first "
                                f"{reported}; pass fewer rows")
        written.append(out / f"{name}.jsonl")
        _write_jsonl(written[-1], texts[-rows:])
    return written


def write_task_prompts(data_dir: str | Path, out: str | Path, tasks: Sequence[str] = PROMPT_TASKS,
                       rows: int = REPORTED_ROWS) -> list[Path]:
    """The first ``rows`` rows of each task (prompt and right answer, one document per row) as ``<task>.jsonl``.

    One document per row keeps each prompt's own short length when ``eval.mapfit`` reads them.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, task in local_tasks(tasks, data_dir).items():
        written.append(out / f"{name}.jsonl")
        _write_jsonl(written[-1], answered_prompts(task)[:rows])
    return written
