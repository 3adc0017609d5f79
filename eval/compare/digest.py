"""Whether a finished cell is still its recipe's: the recipe digest and the stale marks of the leaderboard."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from prune.errors import LayercutError
from prune.pipeline.recipes import config_from_recipe, read_recipe
from prune.replace.registry import neutral_options

# A cell's own keys: the model, data and amount come from the comparison, not the method.
RUN_KEYS = ("load", "data", "drop", "target_params", "target_speedup", "out", "overwrite")
STALE_MARKS = {"changed": "†", "missing": "‡"}


def _without_neutral_options(node: Any, neutral: dict[str, tuple]) -> Any:
    """``node`` less every option at a value that does what was done before the option existed.

    Adding an option must not make every finished cell look stale and run again; anything else, a changed
    method default included, is hashed like every other option.
    """
    if isinstance(node, dict):
        return {key: _without_neutral_options(value, neutral) for key, value in node.items()
                if not (key in neutral and value in neutral[key])}
    if isinstance(node, list):
        return [_without_neutral_options(value, neutral) for value in node]
    return node


def resolved_method(path: Path) -> dict:
    """The recipe's method as it runs, defaults filled in, without the run's own keys (model, data, amount)."""
    config = config_from_recipe(path, {"drop": 1, "load": {"model": "digest"}})
    # replace: and distill: in the layout they had before their options became fields, so digests stay put
    resolved = {**dataclasses.asdict(config), "replace": config.replace.to_dict()}
    method = {key: value for key, value in resolved.items() if key not in RUN_KEYS}
    if not method.get("auto_replace"):
        method.pop("auto_replace", None)  # added after results were recorded: absent unless a recipe says auto
    for step in config.build_steps():  # a step's section is a raw mapping until its step fills in the defaults
        options = getattr(step, "config", None)
        if dataclasses.is_dataclass(options):
            legacy = getattr(options, "legacy_dict", None)
            method[step.name] = legacy() if legacy is not None else dataclasses.asdict(options)
    return _without_neutral_options(method, neutral_options())


def recipe_digest(path: Path) -> str:
    """Changes when the method does: a finished cell is run again after its recipe changed.

    The recipe's mapping is hashed with the resolved method configuration, so a changed default that the
    recipe leaves unset (``replace.short`` of ``linear``, say, or the text ``distill`` reads) reruns the cell
    too, and a comment or the layout of the file does not.
    """
    return _digest(path, _method_json(path))


def _method_json(path: Path) -> bytes:
    return json.dumps(resolved_method(path), sort_keys=True, default=str).encode()


def _digest(path: Path, method: bytes) -> str:
    recipe = json.dumps(read_recipe(path), sort_keys=True, default=str).encode()
    return hashlib.sha256(b"recipe 2\n" + recipe + b"\n" + method).hexdigest()[:16]


def upgrade_digest(row: dict) -> None:
    """Re-key a format-1 row whose recipe is unchanged since it ran; any other row keeps its digest (stale)."""
    path = Path(row.get("recipe") or "")
    if not row.get("recipe") or not path.is_file():
        return
    try:
        method = _method_json(path)  # resolved once for both digests
        # format 1 hashed the file's bytes (comments included) with the resolved method
        if hashlib.sha256(path.read_bytes() + method).hexdigest()[:16] == row.get("recipe_digest"):
            row["recipe_digest"] = _digest(path, method)
    except LayercutError:  # the recipe no longer reads: its rows are stale either way
        return


def recipe_state(row: dict) -> str | None:
    """Whether a row's figures are still its recipe's: None (they are), "changed" or "missing".

    "changed": the recipe, or a default it leaves unset, has changed since the row ran; "missing": there is no
    recipe at the row's path, so it cannot be checked.
    """
    path = Path(row.get("recipe") or "")
    if not row.get("recipe") or not path.is_file():
        return "missing"
    try:
        return None if recipe_digest(path) == row.get("recipe_digest") else "changed"
    except LayercutError:  # the recipe no longer reads: not the method the row ran
        return "changed"


def stale_note(states: dict[str, str | None]) -> list[str]:
    """The leaderboard's lines explaining the stale marks present in ``states`` (none: no lines)."""
    found = set(states.values()) - {None}
    if not found:
        return []
    notes = {"changed": f"{STALE_MARKS['changed']}: its recipe, or a default the recipe leaves unset, has changed "
                        "since this row ran; its figures are the method's as it was, not as the recipe runs now "
                        "(the same command runs the cell again)",
             "missing": f"{STALE_MARKS['missing']}: its recipe is not at the path it ran from, so whether it has "
                        "changed cannot be checked"}
    return ["; ".join(notes[state] for state in ("changed", "missing") if state in found) + ".", ""]
