"""A checkpoint's ``layercut.json``: its format number, the one :func:`migrate` and the one reader, :func:`read_report`.

Every writer stamps :data:`FORMAT` (:func:`stamped`); every reader goes through :func:`read_report`, which brings
a report of an earlier format up to date step by step, so the rest of the code reads the current keys only. Each
step is a function whose docstring says what the next format changed and which commit changed it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from prune.checkpoint.decilm_config import LLAMACPP, sublayer_layout
from prune.errors import LayercutError
from prune.model import remote_code as hf_remote_code
from prune.model.layouts import LAYERCUT, VANILLA, serving_entry

REPORT_FILE = "layercut.json"
# 1: every report written before the format was numbered; 2: ``format`` is written; 3: ``serving`` names no engine
FORMAT = 3
# layercut.json's key for the original model's file or folder, relative to the checkpoint folder: the report names
# the model portably (no path of this machine), and read_report re-opens it from here
MODEL_PATH = "model_path"


def stamped(report: dict) -> dict:
    """``report`` with the format it is written in: what every writer of ``layercut.json`` writes."""
    return {"format": FORMAT, **{key: value for key, value in report.items() if key != "format"}}


def read_report(folder: str | Path) -> dict:
    """The ``layercut.json`` of a checkpoint folder in the current format, or an empty dict when it has none.

    Raises:
        LayercutError: the file exists but is not a JSON object (a report we cannot read is never guessed), or was
            written by a newer layercut.
    """
    path = Path(folder).expanduser() / REPORT_FILE
    if not path.is_file():
        return {}
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        why = err.msg if isinstance(err, json.JSONDecodeError) else "not UTF-8 text"
        raise LayercutError(f"{path} is damaged, not valid JSON ({why}): re-export the checkpoint with prune.run "
                            "or restore the file from a copy") from None
    if not isinstance(report, dict):
        raise LayercutError(f"{path} is damaged (a JSON {type(report).__name__}, not an object): re-export the "
                            "checkpoint with prune.run or restore the file from a copy")
    report = migrate(report, path.parent, where=str(path))
    local = report.get(MODEL_PATH)
    if isinstance(local, str) and local and not os.path.isabs(local) and (path.parent / local).exists():
        report["model_name"] = str((path.parent / local).resolve())  # re-opened where it lies (distill.run)
    return report


def migrate(report: dict, folder: str | Path | None = None, where: str = REPORT_FILE) -> dict:
    """Bring a ``layercut.json`` mapping of an earlier format up to :data:`FORMAT`; the one place that knows them.

    Args:
        report: the mapping as read (not changed; a new one is returned).
        folder: the checkpoint folder it came from, whose files show the layout of a report from before the
            ``serving`` entry; without it the layout is read from the report's replacement records.
        where: the file named in the error.

    Raises:
        LayercutError: the report was written by a newer layercut, or its format is no format number.
    """
    report = dict(report)
    version = report.get("format", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise LayercutError(f"{where} is damaged (format {version!r} is no format number): re-export the checkpoint "
                            "with prune.run or restore the file from a copy")
    if version > FORMAT:
        raise LayercutError(f"{where} has format {version}, written by a newer layercut (this one reads up to "
                            f"{FORMAT}): upgrade with pip install -U layercut")
    for step in _STEPS[version - 1:FORMAT - 1]:
        for change in step:
            report = change(report, Path(folder) if folder is not None else None)
    report["format"] = FORMAT
    return report


def upgrade_records(records: list[dict]) -> list[dict]:
    """Replacement records of any format (``layercut.json``'s ``replacements``, or a config's) in the current one.

    A checkpoint's ``config.json`` holds the same records as its report (``layercut_replacements``) and has no
    format number of its own: :func:`prune.load` reads them through here.
    """
    return [_record_maps_flagged(_record_method_named(dict(r))) if isinstance(r, dict) else r for r in records]


# ----------------------------------------------------------------------------------------------------------------
# Format 1 -> 2


def _record_method_named(record: dict) -> dict:
    """Commit 5046a79 (2026-11-23) renamed a replacement record's ``kind`` to ``method``."""
    if "kind" in record and "method" not in record:
        record["method"] = record.pop("kind")
    return record


def _record_maps_flagged(record: dict) -> dict:
    """Commit b6499bd (2026-11-27): a record whose map lives in ``replacements.safetensors`` says so (``maps``).

    Before, such a record named a method whose maps are a module of the shipped modeling file.
    """
    if "maps" not in record and record.get("method") in hf_remote_code.MAP_TYPES:
        record["maps"] = True
    return record


def _records_upgraded(report: dict, folder: Path | None) -> dict:
    """Replacement records: ``kind`` became ``method`` (5046a79), then maps got their flag (b6499bd)."""
    if isinstance(report.get("replacements"), list):
        report["replacements"] = upgrade_records(report["replacements"])
    return report


# the weight keys of a distillation's options before ``losses`` -> the loss each weighed (distill.losses' names)
_LOSS_KEYS = {"mse_weight": "layerwise_mse", "kl_weight": "teacher_student_kl",
              "cosine_reg": "consecutive_cosine_distance"}


def _distill_losses_named(report: dict, folder: Path | None) -> dict:
    """Commit cca58a3 (2026-11-26) gave a distillation's options ``losses`` (``{name: weight}``).

    Before, ``distill.config`` held one weight key per loss (``kl_weight: 1.0``, ``mse_weight: 0.0``, ...).
    """
    distill = report.get("distill")
    config = distill.get("config") if isinstance(distill, dict) else None
    if not isinstance(config, dict) or "losses" in config or not set(_LOSS_KEYS) & set(config):
        return report
    config = dict(config)
    weights = {name: config.pop(key) for key, name in _LOSS_KEYS.items() if key in config}
    config["losses"] = {name: weight for name, weight in weights.items() if weight}
    report["distill"] = {**distill, "config": config}
    return report


def _serving_added(report: dict, folder: Path | None) -> dict:
    """Commit 900f015 (2026-11-27) added ``serving``: the layout, the engines that run it, what ships instead.

    A report from before it gets the entry its folder's files show (replacement maps, or sub-layer removals in a
    wrapped config); without the folder, its replacement records say whether it has maps.
    """
    if report.get("serving"):
        return report
    if folder is not None:
        layout = layout_of_files(folder)
    else:
        maps = any(isinstance(r, dict) and r.get("maps") for r in report.get("replacements") or [])
        layout = LAYERCUT if maps or report.get("sublayers") else VANILLA  # sub-layers: DeciLM needs the config
    report["serving"] = serving_entry(layout)
    return report


def layout_of_files(folder: str | Path) -> str:
    """The layout a checkpoint folder's files show: maps, sub-layer removals in a wrapped config, or vanilla.

    For a folder whose report does not say it (one written before ``serving``, or a folder layercut did not write).
    """
    folder = Path(folder)
    if (folder / hf_remote_code.MAPS_FILE).is_file():
        return LAYERCUT
    config_file = folder / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        config = {}  # the loader names a damaged config.json when it opens the folder
    if isinstance(config, dict) and hf_remote_code.is_wrapped(config):
        inner = hf_remote_code.unwrap_config_dict(config)
        return sublayer_layout(inner) if inner.get(hf_remote_code.SUBLAYERS_KEY) else LAYERCUT
    return VANILLA


# ----------------------------------------------------------------------------------------------------------------
# Format 2 -> 3


def upgrade_serving(entry: dict) -> dict:
    """A ``serving`` entry of format 2 or earlier in the current format (``eval.compare``'s rows hold copies).

    Format 3 (2026-12-02) left the engines to the engines' registry (``eval.speed.engines``, where each declares
    the layouts it runs): ``engines``, ``vllm`` and ``llama_cpp`` are gone, and ``llama_cpp_why_not`` (llama.cpp's
    converter limits of a DeciLM config) became ``why_not: {"llamacpp": ...}``.
    """
    entry = {key: value for key, value in entry.items() if key not in ("engines", "vllm", "llama_cpp")}
    why_not = entry.pop("llama_cpp_why_not", None)
    if why_not:
        entry["why_not"] = {**entry.get("why_not", {}), LLAMACPP: why_not}
    return entry


def _serving_engines_left_out(report: dict, folder: Path | None) -> dict:
    """Format 3: ``serving`` names no engine (:func:`upgrade_serving`)."""
    if isinstance(report.get("serving"), dict):
        report["serving"] = upgrade_serving(report["serving"])
    return report


# _STEPS[n - 1]: the changes from format n to n + 1, in order
_STEPS: list[list[Callable[[dict, Path | None], dict]]] = [
    [_records_upgraded, _distill_losses_named, _serving_added],
    [_serving_engines_left_out],
]
