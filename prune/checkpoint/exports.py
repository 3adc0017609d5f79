"""Export targets of ``prune.run --export``: each declares its options, its up-front check and how it writes.

A target is one module of this package that calls :func:`register_export` (the GGUF for llama.cpp is
``prune.checkpoint.gguf``); ``prune.run`` finds every module here, so adding a target is that file and
its test. A target checks, before any work, what would make it fail after hours of pruning (no output
folder, a layout its engine cannot run, a missing tool), then writes into the finished checkpoint folder.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from prune.errors import LayercutError
from prune.registry import Registry

# the key of an export option's spec in its field's metadata
OPTION_KEY = "layercut_export_option"


@dataclass(frozen=True)
class ExportOption:
    """How one option of an export target is given: its ``prune.run`` flag, its help and its values."""

    flag: str
    help: str
    choices: tuple[str, ...] | None = None
    metavar: str | None = None


def export_option(default: Any, help: str, *, flag: str, choices: Sequence[str] | None = None,
                  metavar: str | None = None) -> Any:
    """A field of a target's options: its default, and its ``prune.run`` flag, help and choices as metadata."""
    return field(default=default, metadata={OPTION_KEY: ExportOption(flag, help, tuple(choices) if choices else None,
                                                                      metavar)})


@dataclass(frozen=True)
class ExportTarget:
    """One ``--export`` value.

    Attributes:
        name: the ``--export`` value.
        help: one line for ``--export``'s help.
        options: a dataclass whose fields (made by :func:`export_option`) are the target's options: its
            ``prune.run`` flags, ``prune.save(..., export=NAME, **options)``'s keywords, their defaults.
        check: ``(config, options) -> None``: refuses in one line, before any work, what would make it fail.
        write: ``(folder, options) -> str``: writes the export for a finished checkpoint folder; returns the
            line ``prune.run`` prints.
    """

    name: str
    help: str
    options: type
    check: Callable[[object, Any], None]
    write: Callable[[Path, Any], str]

    def specs(self) -> dict[str, ExportOption]:
        """Option name -> its spec, in declaration order."""
        return {item.name: item.metadata[OPTION_KEY] for item in fields(self.options)}

    def add_arguments(self, group: argparse._ArgumentGroup) -> None:
        """The target's flags, from its options' fields."""
        defaults = self.options()
        for name, spec in self.specs().items():
            default = getattr(defaults, name)
            group.add_argument(spec.flag, dest=name, default=default, choices=spec.choices, metavar=spec.metavar,
                               help=f"--export {self.name}: {spec.help} (default: {default})")

    def options_of(self, values: dict) -> Any:
        """The options of ``values`` (name -> value); a name the target does not take is one line."""
        unknown = sorted(set(values) - set(self.specs()))
        if unknown:
            raise LayercutError(f"export {self.name!r} takes no option {', '.join(unknown)}; its options: "
                                f"{', '.join(self.specs()) or '(none)'}")
        for name, value in values.items():
            choices = self.specs()[name].choices
            if choices and value not in choices:
                raise LayercutError(f"export {self.name!r}: {name} {value!r} is not one of {', '.join(choices)}")
        return self.options(**values)

    def options_from_args(self, args: argparse.Namespace) -> Any:
        """The options the parsed flags give."""
        return self.options(**{name: getattr(args, name) for name in self.specs() if hasattr(args, name)})


EXPORTS: Registry[ExportTarget] = Registry("export target")


def register_export(target: ExportTarget) -> ExportTarget:
    """Register ``target`` under its name (a name registered twice is a bug)."""
    EXPORTS.register(target.name, target)
    return target


def export_targets() -> Registry[ExportTarget]:
    """Every target: the modules of this package are imported once, each registering its own."""
    package = importlib.import_module(__package__)
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{__package__}.{info.name}")
    return EXPORTS


def export_dests() -> set[str]:
    """``export`` and every target's option names (the dests of their flags: none is a ``PruneConfig`` key)."""
    return {"export", *(name for target in export_targets().values() for name in target.specs())}


def check_removes(config, name: str) -> None:
    """An export converts the pruned checkpoint: a run that only scores has none."""
    if not config.removes:
        raise LayercutError(f"--export {name} converts the pruned checkpoint: pass --drop K (or a --target-*)")
