"""Recipes: YAML files under ``recipes/`` that map key for key onto :class:`prune.pipeline.config.PruneConfig`.

load: {model: smollm2-135m}
data: {samples: 64, seq_len: 512}
drop: 4
replace: {method: linear}
distill: {steps: 100}
out: slim/

A *method recipe* (``recipes/methods/*.yaml``) names a method only: a top-level ``method:`` line (one
sentence, what ``eval.compare --methods list`` prints) and the ``score`` / ``select`` / ``protect`` /
``replace`` / ``distill`` keys. The model, the calibration data and how much to remove come from the
command line, so the same file runs on any model at any drop.
"""

from __future__ import annotations

import dataclasses
import re
from importlib import resources
from pathlib import Path

import yaml

from prune.checkpoint.load_config import LoadConfig
from prune.data.calibration import DataConfig
from prune.errors import LayercutError
from prune.pipeline.config import PruneConfig
from prune.replace import ReplaceConfig

# Recipe sections that are themselves dataclasses; their keys are checked the same way.
NESTED_SECTIONS = {"load": LoadConfig, "data": DataConfig, "replace": ReplaceConfig}
# The keys a method recipe may hold: how blocks are chosen and what fills their place, nothing about the run.
METHOD_KEYS = ("method", "score", "select", "protect", "unit", "replace", "distill", "batch_size")
# Keys that say how much to remove; a method recipe needs one of them from the command line.
AMOUNT_KEYS = ("drop", "target_params", "target_speedup")
# The recipes ship as the data package ``recipes``: found the same from a checkout and from an installed wheel.
RECIPES_DIR = Path(str(resources.files("recipes")))
METHODS_DIR = RECIPES_DIR / "methods"
# Keys of the earlier flat recipe layout, with their spelling now.
RENAMED_KEYS = {
    "fit": "replace: {fit: ...}",
    "rank": "replace: {rank: ...}",
    "ridge": "replace: {ridge: ...}",
    "replace_steps": "replace: {steps: ...}",
    "distill_steps": "distill: {steps: ...}",
}


class RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading a number in exponent form without a dot (``3e-4``, ``1e5``) as a float.

    PyYAML follows YAML 1.1, whose floats need a dot: ``lr: 3e-4`` would be the text "3e-4". YAML 1.2 takes it
    as the number it looks like, and so does a recipe; quoted text in a number field is read by the config
    classes (``prune.data.calibration.numeric_fields``).
    """


RecipeLoader.add_implicit_resolver("tag:yaml.org,2002:float",
                                   re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                   list("-+0123456789"))


def find_recipe(name: str | Path) -> Path:
    """A recipe by path, or by name from any folder.

    A name is a method's (``layercut-linear-vanilla``) or a shipped recipe's path inside ``recipes/``, with or
    without the folder and suffix (``repairs/fold``, ``recipes/smollm2-drop4.yaml``). The shipped recipes live in
    the installed package, so a name works from any working folder.
    """
    path = Path(name).expanduser()
    if path.is_file():
        return path
    inside = Path(*path.parts[1:]) if path.parts[:1] == ("recipes",) else path
    shipped = {p.relative_to(RECIPES_DIR).with_suffix("").as_posix(): p for p in RECIPES_DIR.rglob("*.yaml")}
    key = inside.with_suffix("").as_posix() if inside.suffix in (".yaml", ".yml") else inside.as_posix()
    methods = method_recipes()
    found = shipped.get(key) or methods.get(key)
    if found is None:
        names = ", ".join(methods)
        raise LayercutError(f"recipe '{name}' not found: pass a YAML file, a method name ({names}) or a shipped "
                            "recipe such as repairs/fold or smollm2-drop4")
    return found


def read_recipe(path: str | Path) -> dict:
    """The YAML mapping in ``path`` (found by :func:`find_recipe`); a clear error for a missing or malformed file."""
    path = find_recipe(path)
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=RecipeLoader)  # a SafeLoader: data only
    except yaml.YAMLError as err:
        raise LayercutError(f"recipe '{path}' is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise LayercutError(f"recipe '{path}' must be a mapping of PruneConfig fields")
    return data


def _check_keys(cls, values: dict, where: str) -> None:
    for key, spelling in RENAMED_KEYS.items():
        if key in values and cls is PruneConfig:
            raise LayercutError(f"{where}: '{key}' moved; write it as {spelling}")
    # a replace: section also takes the registered methods' option fields
    known = set(cls.recipe_keys()) if hasattr(cls, "recipe_keys") else {f.name for f in dataclasses.fields(cls)}
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


def is_method_recipe(values: dict) -> bool:
    """A recipe that names a method only (it has a top-level ``method:`` summary)."""
    return "method" in values


def check_method_recipe(values: dict, where: str) -> None:
    """A method recipe holds only :data:`METHOD_KEYS`: the model, data and amount come from the command line."""
    extra = sorted(set(values) - set(METHOD_KEYS))
    if extra:
        raise LayercutError(f"{where} is a method recipe (it has 'method:'), which names a method only: remove "
                            f"{', '.join(extra)} and pass them on the command line (--model, --drop, ...)")
    if not isinstance(values["method"], str) or not values["method"].strip():
        raise LayercutError(f"{where}: 'method:' must be a one-line summary of the method")


def method_recipes(folder: str | Path = METHODS_DIR) -> dict[str, Path]:
    """The method recipes in ``folder`` by name (the file stem), sorted."""
    folder = Path(folder)
    return {path.stem: path for path in sorted(folder.glob("*.yaml"), key=lambda p: p.stem)} if folder.is_dir() else {}


def method_summary(path: str | Path) -> str:
    """The one-line ``method:`` summary of a method recipe."""
    values = read_recipe(path)
    if not is_method_recipe(values):
        return "(not a method recipe: runs as its own model, data and drop say)"
    check_method_recipe(values, str(path))
    return values["method"].strip()


def resolve_method(name: str, folder: str | Path = METHODS_DIR) -> Path:
    """A method recipe by name (``recipes/methods/<name>.yaml``) or by path; the error lists the known names."""
    known = method_recipes(folder)
    if name in known:
        return known[name]
    path = Path(name).expanduser()
    if path.suffix in (".yaml", ".yml"):
        try:
            return find_recipe(path)
        except LayercutError:
            pass
    raise LayercutError(f"unknown method '{name}': choose one of {', '.join(known) or '(none found)'} or pass a "
                        "recipe file (.yaml)")


def config_from_recipe(path: str | Path, overrides: dict | None = None) -> PruneConfig:
    """Build a :class:`PruneConfig` from a recipe; ``overrides`` (same layout, nested) win over the file.

    A method recipe's ``method:`` summary is not a config key; such a recipe needs the amount to
    remove (``drop`` or a budget) in ``overrides``.
    """
    values = read_recipe(path)
    if is_method_recipe(values):
        check_method_recipe(values, str(path))
        values = {key: value for key, value in values.items() if key != "method"}
        if not any((overrides or {}).get(key) is not None for key in AMOUNT_KEYS):
            raise LayercutError(f"{path} is a method recipe: say how much to remove with --drop N (a count or a "
                                "share like 25%) or a budget (--target-params / --target-speedup)")
    _check_keys(PruneConfig, values, str(path))
    values = merge_sections(values, overrides or {})
    for name, cls in NESTED_SECTIONS.items():
        if isinstance(values.get(name), dict):
            _check_keys(cls, values[name], f"{path}: {name}")
    return PruneConfig(**values)
