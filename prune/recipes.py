"""Recipes: YAML files under ``recipes/`` that map key for key onto :class:`prune.pipeline.PruneConfig`.

load: {model: smollm2-135m}
data: {samples: 64, seq_len: 512}
drop: 4
replace: {method: linear}
distill: {steps: 100}
out: slim/
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from prune.data import DataConfig
from prune.errors import LayercutError
from prune.options import LoadConfig
from prune.pipeline import PruneConfig
from prune.replace import ReplaceConfig

# Recipe sections that are themselves dataclasses; their keys are checked the same way.
NESTED_SECTIONS = {"load": LoadConfig, "data": DataConfig, "replace": ReplaceConfig}
# Keys of the earlier flat recipe layout, with their spelling now.
RENAMED_KEYS = {
    "fit": "replace: {fit: ...}",
    "rank": "replace: {rank: ...}",
    "ridge": "replace: {ridge: ...}",
    "replace_steps": "replace: {steps: ...}",
    "distill_steps": "distill: {steps: ...}",
}


def read_recipe(path: str | Path) -> dict:
    """The YAML mapping in ``path``; a clear error for a missing or malformed file."""
    path = Path(path)
    if not path.is_file():
        raise LayercutError(f"recipe '{path}' not found: pass a YAML file such as recipes/smollm2-drop4.yaml")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise LayercutError(f"recipe '{path}' is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise LayercutError(f"recipe '{path}' must be a mapping of PruneConfig fields")
    return data


def _check_keys(cls, values: dict, where: str) -> None:
    for key, spelling in RENAMED_KEYS.items():
        if key in values and cls is PruneConfig:
            raise LayercutError(f"{where}: '{key}' moved; write it as {spelling}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise LayercutError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")


def merge_sections(base: dict, overrides: dict) -> dict:
    """``base`` with ``overrides`` on top; nested mappings merge key by key (a method name merges as ``method``)."""
    merged = dict(base)
    for key, value in overrides.items():
        current = merged.get(key)
        if key == "replace" and isinstance(current, str):
            current = {"method": current}
        if isinstance(current, dict) and isinstance(value, dict):
            merged[key] = merge_sections(current, value)
        else:
            merged[key] = value
    return merged


def config_from_recipe(path: str | Path, overrides: dict | None = None) -> PruneConfig:
    """Build a :class:`PruneConfig` from a recipe; ``overrides`` (same layout, nested) win over the file."""
    values = read_recipe(path)
    _check_keys(PruneConfig, values, str(path))
    values = merge_sections(values, overrides or {})
    for name, cls in NESTED_SECTIONS.items():
        if isinstance(values.get(name), dict):
            _check_keys(cls, values[name], f"{path}: {name}")
    return PruneConfig(**values)
