"""The ``eval.bench`` subcommands, one registry: each subcommand's module registers itself.

A new subcommand is one module of :mod:`eval.bench`: its options dataclass, its run, one
:func:`register_subcommand` call (plus its test). Each field of the options dataclass is made by
:func:`bench_option` (one flag) or by one of the shared groups several subcommands take
(:func:`load_option`, :func:`data_option`, :func:`threads_option`, :func:`engine_settings_option`), which hold
their typed config (:class:`~prune.checkpoint.load_config.LoadConfig`, :class:`~prune.data.calibration.DataConfig`,
the engine settings, the thread count). The sub-parser is derived from the fields, in their order, and ``run``
receives the options object the parsed flags build (:func:`options_from_args`); Python callers build it with
keywords. ``eval.bench.cli`` imports every module of the package (``pkgutil``) and builds one sub-parser per
registered subcommand.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from eval.speed.engines import add_setting_arguments, setting_values
from prune.options import (
    add_data_arguments,
    add_load_arguments,
    add_threads_argument,
    data_config_from_args,
    load_config_from_args,
)
from prune.registry import Registry

OPTION_KEY = "eval.bench"  # the metadata key of an options field: its BenchOption or SharedOption

Target = argparse.ArgumentParser | argparse._ArgumentGroup


@dataclass(frozen=True)
class BenchOption:
    """How one field of a subcommand's options is given on the command line; the metadata of its field.

    Attributes:
        help: what it does, for ``--help`` (with its default in words); a callable when the text names
            registered things (engines) and is written when the parser is built.
        flag: its flag (default: ``--`` and the field's name, ``_`` as ``-``).
        type: the flag's value type (None: the string as given).
        choices: the values it takes; a callable when they are a registry's names, read when the parser is built.
        action: ``"append"`` (a repeatable flag: a list, None when not given) or ``"store_true"`` (a switch).
        required: whether the command line must give it.
        metavar: the value's name in ``--help`` (default: the field's name in capitals).
        group: the title of the ``--help`` group it sits in (None: the parser's own ``options``).
    """

    help: str | Callable[[], str]
    flag: str | None = None
    type: Callable[[str], Any] | None = None
    choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None
    action: str | None = None
    required: bool = False
    metavar: str | None = None
    group: str | None = None

    def add_to(self, target: Target, item: Field) -> None:
        """Add the flag of ``item`` (this option's field) to ``target``."""
        keywords: dict[str, Any] = {"dest": item.name, "help": self.help() if callable(self.help) else self.help}
        if item.default is not MISSING:
            keywords["default"] = item.default
        elif item.default_factory is not MISSING:
            keywords["default"] = item.default_factory()
        for name in ("type", "action", "metavar"):
            if getattr(self, name) is not None:
                keywords[name] = getattr(self, name)
        if self.choices is not None:
            keywords["choices"] = self.choices() if callable(self.choices) else self.choices
        if self.required:
            keywords["required"] = True
        target.add_argument(self.flag or f"--{item.name.replace('_', '-')}", **keywords)


@dataclass(frozen=True)
class SharedOption:
    """A group of flags several subcommands share, held by one field as its typed config.

    Attributes:
        add: ``(target)``: adds the group's flags (a function of :mod:`prune.options` or the engine registry).
        build: ``(parsed flags) -> value``: the field's typed value.
        group: the title of the ``--help`` group ``add`` is given (None: the parser itself).
    """

    add: Callable[[Target], None]
    build: Callable[[argparse.Namespace], Any]
    group: str | None = None

    def add_to(self, target: Target, item: Field) -> None:
        """Add the group's flags to ``target``."""
        self.add(target)


def bench_option(default: Any, help: str | Callable[[], str], *, flag: str | None = None,
                 type: Callable[[str], Any] | None = None,
                 choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None, action: str | None = None,
                 required: bool = False, metavar: str | None = None, group: str | None = None,
                 default_factory: Callable[[], Any] | None = None) -> Any:
    """A subcommand option: a dataclass field of ``default``, its metadata a :class:`BenchOption` of the rest.

    ``default_factory`` (with ``default`` None) instead: a default read from a registry when the parser or the
    options are built, so a method registered later is in it.
    """
    spec = BenchOption(help=help, flag=flag, type=type, choices=choices,
                       action=action, required=required, metavar=metavar, group=group)
    if default_factory is not None:
        return field(default_factory=default_factory, metadata={OPTION_KEY: spec})
    return field(default=default, metadata={OPTION_KEY: spec})


def shared_option(add: Callable[[Target], None], build: Callable[[argparse.Namespace], Any], *,
                  default: Any = None, group: str | None = None, from_flags: bool = False) -> Any:
    """A field holding the typed value of a group of shared flags (see :class:`SharedOption`).

    ``from_flags``: the field's default is what the group's flags give when none is typed (for a Python caller,
    the same default as the command line's), instead of ``default``.
    """
    spec = SharedOption(add, build, group)
    if from_flags:
        return field(default_factory=lambda: _unparsed(spec), metadata={OPTION_KEY: spec})
    return field(default=default, metadata={OPTION_KEY: spec})


def _unparsed(spec: SharedOption) -> Any:
    parser = argparse.ArgumentParser(add_help=False)
    spec.add(parser)
    return spec.build(parser.parse_args([]))


def load_option(*, model_from: str | None = None, **load: Any) -> Any:
    """The model-loading flags of :func:`prune.options.add_load_arguments` (given ``load``), as a ``LoadConfig``.

    ``model_from``: the field whose value is the model loaded, for a subcommand whose own flags name its models.
    """
    return shared_option(lambda target: add_load_arguments(target, **load),
                         lambda args: load_config_from_args(args, model=getattr(args, model_from)
                                                            if model_from else None))


def data_option(**data: Any) -> Any:
    """The calibration flags of :func:`prune.options.add_data_arguments` (given ``data``), as a ``DataConfig``."""
    return shared_option(lambda target: add_data_arguments(target, **data), data_config_from_args, from_flags=True)


def threads_option() -> Any:
    """``--threads`` (:func:`prune.options.add_threads_argument`): torch's CPU threads, None for the free cores."""
    return shared_option(add_threads_argument, lambda args: args.threads)


def engine_settings_option(group: str | None = None) -> Any:
    """Every engine's own settings as flags; the field holds those given, by name.

    They are ``EngineSettings.build``'s keywords: a setting not given is not among them, so each engine keeps its
    own default.
    """
    return field(default_factory=dict, metadata={OPTION_KEY: SharedOption(add_setting_arguments, setting_values,
                                                                            group)})


def _spec_of(item: Field) -> BenchOption | SharedOption:
    if OPTION_KEY not in item.metadata:
        raise TypeError(f"eval.bench option '{item.name}' needs its metadata: declare it with "
                        "eval.bench.registry.bench_option or a shared group (load_option, data_option, ...)")
    return item.metadata[OPTION_KEY]


def add_option_arguments(parser: argparse.ArgumentParser, options: type) -> None:
    """Add the flags of every field of ``options`` to ``parser``, in field order, each in its ``--help`` group."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for item in fields(options):
        spec = _spec_of(item)
        target: Target = parser
        if spec.group is not None:
            if spec.group not in groups:
                groups[spec.group] = parser.add_argument_group(spec.group)
            target = groups[spec.group]
        spec.add_to(target, item)


def options_from_args(options: type, args: argparse.Namespace) -> Any:
    """The ``options`` object of flags added by :func:`add_option_arguments`."""
    values = {}
    for item in fields(options):
        spec = _spec_of(item)
        values[item.name] = spec.build(args) if isinstance(spec, SharedOption) else getattr(args, item.name)
    return options(**values)


@dataclass(frozen=True)
class Subcommand:
    """One ``eval.bench`` subcommand: its help line, its options dataclass and what it runs with them."""

    help: str
    options: type
    run: Callable[[Any], int]

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Add the subcommand's flags, derived from its options dataclass, to ``parser``."""
        add_option_arguments(parser, self.options)

    def parse(self, args: argparse.Namespace) -> Any:
        """The options object of parsed flags."""
        return options_from_args(self.options, args)


SUBCOMMANDS: Registry[Subcommand] = Registry("eval.bench subcommand")


def register_subcommand(name: str, help: str, options: type, run: Callable[[Any], int]) -> Subcommand:
    """Add a subcommand to ``python -m eval.bench``; returns it.

    Args:
        name: the subcommand's word.
        help: its line in ``python -m eval.bench --help``, and its description.
        options: a dataclass whose every field is made by :func:`bench_option` or a shared group.
        run: ``(options) -> exit code``.

    Raises:
        ValueError: ``name`` is already registered.
        TypeError: a field of ``options`` is not declared with :func:`bench_option` or a shared group.
    """
    for item in fields(options):
        _spec_of(item)
    return SUBCOMMANDS.register(name, Subcommand(help, options, run))
