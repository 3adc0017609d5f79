"""A comparison's record, ``results.json``: :class:`Results`, its format version and its one :func:`migrate`.

A row (the dense model's, or a cell's) stays a JSON mapping: its keys are the figures measured so far
(``params``, ``domains``, ``tasks``, ``task_rows``, ``decode_s``, ...), and a resumed run adds the ones it
lacks. :class:`Row` names them for readers and type checkers.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict

from eval.compare.digest import upgrade_digest
from prune.atomic import write_file_atomic
from prune.checkpoint.report import upgrade_serving
from prune.errors import LayercutError
from prune.model.layouts import LAYERCUT, VANILLA, serving_entry

logger = logging.getLogger(__name__)

RESULTS = "results.json"
# 1: every file written before the format was numbered; 2: ``format`` is written and the legacy layouts are gone;
# 3: a row's ``serving`` is in layercut.json's current format (no engine named there) and every cell has one;
# ``setup`` holds every option, those added since the first comparisons included
FORMAT = 3
# ``task_limit`` absent (no task figure yet) differs from None (task figures of whole splits)
NO_TASKS = object()


class Row(TypedDict, total=False):
    """One model's figures (the dense model, or a cell: one method at one drop)."""

    method: str
    recipe: str
    recipe_digest: str
    drop: int
    dropped: list[int]
    replace: str
    distill_steps: int
    vanilla: bool
    serving: dict
    params: int
    blocks: int
    domains: dict[str, float]
    heldout_ppl: float
    heldout_ratio: float
    domain_ratios: dict[str, float]
    tasks: dict[str, float]
    task_stderr: dict[str, float]
    task_rows: dict[str, list[float]]
    decode_s: float
    decode_speedup: float
    seconds: float


@dataclass
class Results:
    """Everything one comparison measured, as ``results.json`` holds it.

    Attributes:
        setup: what every cell shares (model, loading, calibration options, batch size, speed steps).
        dense: the dense model's row; None until measured.
        cells: ``"<method>@<drop>"`` -> the cell's row.
        refused: ``"<method>@<drop>"`` -> ``{method, drop, recipe_digest, why}`` for a cell whose method refused
            this model or drop in one line (a fold on sandwich norms, a span that ends the model); a resumed
            run tries it again only once its recipe changed.
        oracle: SLEB's oracle and its table, with ``--oracle``.
        timing: load and scoring seconds, and one entry per invocation under ``runs``.
        task_limit: the ``--limit`` of every task figure (:data:`NO_TASKS` until one is taken).
        calibration: the calibration's description and the digest of its tokens and the weights.
        heldout: the held-out domains' sources and token counts.
        domains: the domains the figures are summarised over (the ones asked for last).
        analysis: what :func:`eval.compare.stats.analyse` derived, written with the figures.
    """

    setup: dict
    dense: Row | None = None
    cells: dict[str, Row] = field(default_factory=dict)
    refused: dict[str, dict] = field(default_factory=dict)
    oracle: dict | None = None
    timing: dict = field(default_factory=dict)
    task_limit: Any = NO_TASKS
    calibration: dict | None = None
    heldout: dict = field(default_factory=dict)
    domains: list[str] | None = None
    analysis: dict | None = None

    @classmethod
    def from_dict(cls, data: dict) -> Results:
        """Read a ``results.json`` mapping of any format (:func:`migrate` brings it up to date)."""
        data = migrate(dict(data))
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        return cls(**{"setup": {}, **known})

    def to_dict(self) -> dict:
        """The JSON mapping, sections in a fixed order; ``task_limit`` only once a task figure was taken."""
        data: dict[str, Any] = {"format": FORMAT, "setup": self.setup, "dense": self.dense, "cells": self.cells,
                                "oracle": self.oracle, "timing": self.timing}
        if self.refused:
            data["refused"] = self.refused
        if self.task_limit is not NO_TASKS:
            data["task_limit"] = self.task_limit
        for name in ("calibration", "heldout", "domains", "analysis"):
            value = getattr(self, name)
            if value is not None and (value or name != "heldout"):
                data[name] = value
        return data

    def rows(self) -> list[Row]:
        """The dense row (empty when not measured) and every cell's."""
        return [self.dense or {}, *self.cells.values()]

    def save(self, out: Path) -> None:
        """Write ``out/results.json`` whole (a reader never sees half of it)."""
        write_text(out / RESULTS, json.dumps(self.to_dict(), indent=2) + "\n")


def migrate(data: dict) -> dict:
    """Bring a ``results.json`` mapping of an earlier format up to :data:`FORMAT`; the one place that knows them.

    Format 1 (unnumbered) files can hold two older layouts: ``--tasks`` and ``--limit`` inside ``setup`` (the
    limit their task figures have), and, for a single held-out domain, that domain's source and token count
    also at the top of ``heldout``. Their recipe digests hashed the recipe file's bytes: a row whose recipe
    still hashes so gets today's digest (comments and layout left out), any other stays stale. Format 2 rows
    hold their checkpoint's ``serving`` entry as ``layercut.json`` wrote it then, engines and all, and a format 2
    ``setup`` may lack the options added since (:func:`_complete_setup`).
    """
    version = data.get("format", 1)
    if version > FORMAT:
        raise LayercutError(f"results.json has format {version}, written by a newer layercut (this one reads up to "
                            f"{FORMAT}): upgrade with pip install -U layercut")
    if version == 1:
        setup = dict(data.get("setup", {}))
        tasks, limit = setup.pop("tasks", None), setup.pop("limit", None)
        if tasks and "task_limit" not in data:
            data["task_limit"] = limit
        data["setup"] = setup
        heldout = data.get("heldout")
        if isinstance(heldout, dict) and "domains" in heldout:
            data["heldout"] = {"domains": heldout["domains"]}
        for row in (data.get("cells") or {}).values():
            upgrade_digest(row)
    if version <= 2:
        for row in (data.get("cells") or {}).values():
            _upgrade_serving(row)
        _complete_setup(data.get("setup"))
    data["format"] = FORMAT
    return data


def _complete_setup(setup: dict | None) -> None:
    """Format 3: ``setup`` holds the options added after comparisons were first recorded.

    Each at the value that does what was done before it: ``load.offload`` "none" (``--offload`` came with the
    block-by-block pass, 2026-11-26) and ``engine`` "transformers" (``--engine``, commit 900f015, 2026-11-27).
    """
    if not isinstance(setup, dict):
        return
    setup.setdefault("engine", "transformers")
    if isinstance(setup.get("load"), dict):
        setup["load"].setdefault("offload", "none")


def _upgrade_serving(row: dict) -> None:
    """Format 3: a cell's ``serving`` as ``layercut.json`` now writes it (``prune.checkpoint.report.upgrade_serving``).

    A row from before ``serving`` entries (2026-11-27) says only whether its checkpoint was ``vanilla``.
    """
    if isinstance(row.get("serving"), dict):
        row["serving"] = upgrade_serving(row["serving"])
    elif isinstance(row.get("vanilla"), bool):
        row["serving"] = serving_entry(VANILLA if row["vanilla"] else LAYERCUT)


def read_results(path: Path) -> Results:
    """The :class:`Results` in ``path``; one line naming the file when it is not a comparison's record."""
    try:
        return Results.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, AttributeError) as err:
        raise LayercutError(f"{path} is damaged ({type(err).__name__}): delete it to start that comparison afresh, "
                            "or restore it") from None


def write_text(path: Path, text: str) -> None:
    """Write ``text`` so a reader never sees half a file."""
    write_file_atomic(path, lambda p: p.write_text(text, encoding="utf-8"))


def open_results(out: Path, setup: dict, overwrite: bool) -> Results:
    """The results so far in ``out`` (resume), or a fresh record."""
    path = out / RESULTS
    if path.is_file() and not overwrite:
        results = read_results(path)
        differs = differing(results.setup, setup)
        if differs:
            raise LayercutError(f"{out} holds a comparison with another {', '.join(differs)}: pass another --out, "
                                "the same options to resume it, or --overwrite to start afresh")
        return results
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise LayercutError(f"--out {out} exists and is not a comparison folder: pass another --out or "
                                "--overwrite")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    results = Results(setup=setup)
    # at once: a run stopped before its first cell (in the oracle, say) is still a comparison to resume
    results.save(out)
    return results


def differing(stored: dict, now: dict, prefix: str = "") -> list[str]:
    """The options of ``now`` whose value differs from ``stored``'s, as dotted paths (``data.samples: 32 -> 64``)."""
    found = []
    for key in now:
        old, new = stored.get(key), now[key]
        if isinstance(old, dict) and isinstance(new, dict):
            found += differing(old, new, f"{prefix}{key}.")
        elif old != new:
            found.append(f"{prefix}{key} ({old!r} there, {new!r} now)")
    return found


def check_calibration(results: Results, digest: str, out: Path) -> None:
    """Refuse to add cells fitted on other calibration tokens (or weights) to the ones already in ``out``.

    The options can match while the tokens do not: text sampled from the model (``--data self``) is drawn
    again on a machine without the sample cache, and another torch or model build can draw other text.
    A leaderboard mixing the two would pass one calibration's figures off as the other's.
    """
    stored = (results.calibration or {}).get("digest")
    if stored is not None and stored != digest:
        raise LayercutError(f"{out} holds cells fitted on other calibration tokens or weights (digest {stored}, "
                            f"now {digest}: sampled text drawn again differently, or another model build): pass "
                            "another --out, or --overwrite to start afresh")
    if stored is None and results.cells:
        logger.warning("%s has no calibration digest: recording this run's; its %d earlier cell(s) cannot be "
                       "checked against it", out, len(results.cells))


def check_task_limit(results: Results, tasks: list[str], limit, out: Path) -> None:
    """One ``--limit`` for every task figure of a comparison: a gap between rows is then one of models."""
    if not tasks:
        return
    had = results.task_limit
    if had is not NO_TASKS and had != limit and any(row.get("tasks") for row in results.rows()):
        # a range starting with "-" reaches argparse only glued to its flag
        taken, fix = (("on whole splits", "no --limit") if had is None
                      else (f"at --limit {had}", f"--limit={had}" if isinstance(had, str) else f"--limit {had}"))
        raise LayercutError(f"{out} holds task figures taken {taken}: pass {fix} to add tasks to it, or another --out")
    results.task_limit = limit


def cell_key(name: str, drop: int) -> str:
    """The key of a cell in ``results.json``."""
    return f"{name}@{drop}"


def has_tasks(row: Row | None, tasks: list[str]) -> bool:
    """Whether ``row`` has a figure for every one of ``tasks``."""
    return row is not None and all(task in row.get("tasks", {}) for task in tasks)


def has_domains(row: Row | None, names: list[str]) -> bool:
    """Whether ``row`` has a perplexity for every domain in ``names``."""
    return row is not None and all(name in row.get("domains", {}) for name in names)
