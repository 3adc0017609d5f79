"""The ``eval.bench`` subcommands, one registry: each subcommand's module registers itself.

A subcommand is a module of :mod:`eval.bench` that calls :func:`register_subcommand` with its name, help
line, a function adding its arguments to its parser and the function that runs it. ``eval.bench.cli``
imports every module of the package (``pkgutil``) and builds one sub-parser per registered subcommand,
so a new subcommand is one module here, plus its test.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from prune.registry import Registry


@dataclass(frozen=True)
class Subcommand:
    """One ``eval.bench`` subcommand: its help line, its arguments and what it runs."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMANDS: Registry[Subcommand] = Registry("eval.bench subcommand")


def register_subcommand(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None],
                        run: Callable[[argparse.Namespace], int]) -> Subcommand:
    """Add a subcommand to ``python -m eval.bench``; returns it.

    Raises:
        ValueError: ``name`` is already registered.
    """
    return SUBCOMMANDS.register(name, Subcommand(help, add_arguments, run))
