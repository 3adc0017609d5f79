"""Export targets of ``prune.run --export``: each declares its flags, its up-front check and how it writes.

A target is one module of this package that calls :func:`register_export` (the GGUF for llama.cpp is
``prune.checkpoint.gguf``); ``prune.run`` finds every module here, so adding a target is that file and
its test. A target checks, before any work, what would make it fail after hours of pruning (no output
folder, a layout its engine cannot run, a missing tool), then writes into the finished checkpoint folder.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prune.errors import LayercutError
from prune.registry import Registry


@dataclass(frozen=True)
class ExportTarget:
    """One ``--export`` value.

    Attributes:
        name: the ``--export`` value.
        help: one line for ``--export``'s help.
        add_arguments: adds the target's own flags to the ``serving export`` argument group.
        check: ``(config, args) -> None``: refuses in one line, before any work, what would make the export fail.
        write: ``(folder, args) -> str``: writes the export for a finished checkpoint folder; returns the
            line ``prune.run`` prints.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse._ArgumentGroup], None]
    check: Callable[[object, argparse.Namespace], None]
    write: Callable[[Path, argparse.Namespace], str]


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


def check_removes(config, name: str) -> None:
    """An export converts the pruned checkpoint: a run that only scores has none."""
    if not config.removes:
        raise LayercutError(f"--export {name} converts the pruned checkpoint: pass --drop K (or a --target-*)")
