"""The options a replacement method takes: the fields of its :class:`MethodOptions` subclass (PEFT's ``config_cls``).

A method declares each option it reads as a dataclass field made by :func:`option`: its default for that
method, and as metadata (an :class:`OptionSpec`) its help text, its ``prune.run`` flag, the check on a
given value, the value that means "not given" and, for an option added after results were recorded, the
value that does what was done before it existed. ``prune.run``'s flags and a recipe's ``replace:`` keys
are the union of the registered methods' fields (``prune.replace.registry.option_specs``), so a new option
is one field in its method's module. Options that several methods take have a maker here
(:func:`ridge_option`, :func:`steps_option`, :func:`lr_option`, :func:`update_scale_option`) so that
they agree on the flag and the checks; a method's own option calls :func:`option` directly. Options that
code outside a method reads sit on a base class those methods' options derive from
(:class:`LeastSquaresOptions`), so that code reads a typed field instead of asking for a name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import Any, ClassVar

from prune.errors import LayercutError

# The key of an option's OptionSpec in its field's metadata.
SPEC_KEY = "layercut_option"


class _NoNeutral:
    """The neutral value of an option as old as the results: there is none."""

    def __repr__(self) -> str:
        return "NO_NEUTRAL"


NO_NEUTRAL = _NoNeutral()


@dataclass(frozen=True)
class OptionSpec:
    """How one option is set, checked and shown; the metadata of its field.

    Attributes:
        help: what it does, with units, for ``--help`` (the methods taking it and their defaults are appended).
        flag: its ``prune.run`` flag; None: set in a recipe's ``replace:`` section only.
        label: how messages name it (default: the flag).
        check: ``(value) -> bool``: whether a given value is valid.
        expect: what a valid value is, completing "``<label>`` ...": ``"must be >= 0"``.
        unset: the value that means "not given": a method that does not take the option accepts it, and
            reads as it; a method that takes it uses its default instead.
        neutral: for an option added after results were recorded, the value that does what was done
            before it existed (``update_scale``: 1, the whole least-squares update); ``eval.compare`` leaves
            an option at this value out of its digests, so adding it keeps every finished cell current.
            ``NO_NEUTRAL``: the option is as old as the results.
        type: the flag's value type.
        metavar: the flag's value in ``--help``.
        default_help: the default as ``--help`` says it, when the field's default needs words.
    """

    help: str
    flag: str | None = None
    label: str | None = None
    check: Callable[[Any], bool] | None = None
    expect: str = ""
    unset: Any = None
    neutral: Any = NO_NEUTRAL
    type: Callable[[str], Any] = float
    metavar: str | None = None
    default_help: str | None = None

    @property
    def name_in_messages(self) -> str:
        """The label, else the flag."""
        return self.label or self.flag or "this option"

    def validate(self, value: Any) -> None:
        """Raise the option's one-line error when ``value`` (not the unset value) fails its check."""
        if self.check is not None and not _same(value, self.unset) and not self.check(value):
            raise LayercutError(f"{self.name_in_messages} {self.expect}, got {value}")


def _same(value: Any, other: Any) -> bool:
    return value is other or value == other


def is_unset(value: Any, spec: OptionSpec) -> bool:
    """Whether ``value`` means "not given" for the option of ``spec``."""
    return _same(value, spec.unset)


def option(default: Any, help: str, **spec: Any) -> Any:
    """A method option: a dataclass field with ``default`` and an :class:`OptionSpec` made of ``help`` and ``spec``."""
    return field(default=default, metadata={SPEC_KEY: OptionSpec(help=help, **spec)})


def spec_of(item: Field) -> OptionSpec:
    """The :class:`OptionSpec` of an options field.

    Raises:
        TypeError: the field was not made by :func:`option`.
    """
    if SPEC_KEY not in item.metadata:
        raise TypeError(f"option field '{item.name}' needs its metadata: declare it with prune.replace.options.option")
    return item.metadata[SPEC_KEY]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def whole_number(value: Any) -> bool:
    """An int, not a bool: a count of steps or rounds (``inf`` or ``2.5`` is none)."""
    return isinstance(value, int) and not isinstance(value, bool)


def ridge_option(default: float = 0.0) -> Any:
    """``ridge``: a closed-form fit's ridge, relative to the mean diagonal of the input Gram (0: pseudo-inverse)."""
    return option(default, "ridge of the closed-form fits, relative to the mean input variance", flag="--ridge",
                  check=lambda v: _number(v) and math.isfinite(v) and v >= 0, expect="must be a finite number >= 0",
                  unset=0.0)


def steps_option(default: int) -> Any:
    """``steps``: Adam steps of a trained replacement (0 skips training)."""
    return option(default, "Adam steps of the trained replacements (0: none)", flag="--replace-steps", type=int,
                  check=lambda v: whole_number(v) and v >= 0, expect="must be a whole number >= 0", metavar="N")


def lr_option(default: float) -> Any:
    """``lr``: the Adam learning rate of those steps (a recipe key; no flag)."""
    return option(default, "Adam learning rate of the trained replacements", label="replacement lr",
                  check=lambda v: _number(v) and math.isfinite(v) and v > 0, expect="must be a positive number")


def update_scale_option(default: float) -> Any:
    """``update_scale``: the share of a closed-form map's fitted update ``f(h) - h`` that it applies.

    1 is the least-squares map, towards 0 it approaches removal of the span. Every map applied the whole
    update before the option existed: its neutral value is 1.
    """
    return option(default, "share of the fitted update f(h) - h that the map applies, in (0, 1]: 1 is least "
                  "squares, towards 0 removal", flag="--update-scale", metavar="S", neutral=1.0,
                  check=lambda v: _number(v) and 0 < v <= 1,
                  expect="takes a share in (0, 1] (1: the fitted map; for 0 remove the blocks, --replace none)")


@dataclass
class MethodOptions:
    """The options one method takes; a method without options uses it as it is, the others subclass it.

    A subclass declares each option it reads as a field made by :func:`option` (or a shared maker such as
    :func:`ridge_option`), with the method's default. ``default_short`` is the ``--fit-short`` length
    when none is given (0: off).
    """

    default_short: ClassVar[int] = 0

    def __post_init__(self):
        for item in fields(self):
            spec_of(item).validate(getattr(self, item.name))

    @classmethod
    def specs(cls) -> dict[str, OptionSpec]:
        """Option name -> its :class:`OptionSpec`, in declaration order."""
        return {item.name: spec_of(item) for item in fields(cls)}

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Option name -> this method's default."""
        return {item.name: item.default for item in fields(cls)}

    def values(self) -> dict[str, Any]:
        """Option name -> value."""
        return {item.name: getattr(self, item.name) for item in fields(self)}


@dataclass
class LeastSquaresOptions(MethodOptions):
    """``ridge`` and ``update_scale``: the options of a method applying a share of a least-squares fit.

    The options of ``linear``, ``fold``, ``fold-rotate`` and ``local`` derive from it (``linear``'s and
    ``fold``'s say why 0.7 of the update is the default). Code outside those methods, such as the one-pass
    map error of ``--select repaired-fast``, reads ``update_scale`` from options of this class, and takes
    the whole update (1) for any other method.
    """

    ridge: float = ridge_option()
    update_scale: float = update_scale_option(0.7)
