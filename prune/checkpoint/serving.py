"""A checkpoint folder's serving entry: its layout as ``layercut.json`` says it, or as its files show.

The layouts themselves and the engines that run each are :mod:`prune.model.layouts`.
"""

from __future__ import annotations

import json
from pathlib import Path

from prune.model.layouts import DECILM, LAYERCUT, LAYOUTS, VANILLA, serving_entry


def sublayer_layout(config: dict) -> str:
    """``decilm`` when the engines' DeciLM layout can hold these sub-layer removals, else ``layercut``."""
    return DECILM if sublayer_refusal(config) is None else LAYERCUT


def sublayer_refusal(config: dict) -> str | None:
    """Why the DeciLM layout cannot hold this config's sub-layer removals (None: it can)."""
    from prune.checkpoint.decilm import decilm_config
    from prune.errors import LayercutError
    from prune.model.remote_code import sublayer_records

    try:
        decilm_config(config, sublayer_records(config))
    except LayercutError as err:
        return str(err)
    return None


def folder_serving(folder: str | Path) -> dict:
    """A checkpoint folder's ``serving`` entry: its ``layercut.json``'s, else the one its layout gives."""
    report = Path(folder) / "layercut.json"
    written = json.loads(report.read_text(encoding="utf-8")).get("serving") if report.is_file() else None
    return written or serving_entry(layout_of_folder(folder))


def layout_of_folder(folder: str | Path) -> str:
    """The layout of a checkpoint folder: its ``layercut.json`` says it; older folders are read from their files."""
    folder = Path(folder)
    report = folder / "layercut.json"
    if report.is_file():
        serving = json.loads(report.read_text(encoding="utf-8")).get("serving") or {}
        if serving.get("layout") in LAYOUTS:
            return serving["layout"]
    if (folder / "replacements.safetensors").is_file():
        return LAYERCUT
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    from prune.model.remote_code import MODEL_TYPE, SUBLAYERS_KEY, unwrap_config_dict

    if config.get("model_type") == MODEL_TYPE:
        # written before serving entries: a wrapped config holds maps or sub-layer removals
        inner = unwrap_config_dict(config)
        return sublayer_layout(inner) if inner.get(SUBLAYERS_KEY) else LAYERCUT
    return VANILLA
