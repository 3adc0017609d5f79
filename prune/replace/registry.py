"""Replacement methods, registered by name and looked up by name (PEFT's ``register_peft_method``).

A method module builds one :class:`Method` and calls :func:`register_method` once. Everything else
(the driver, ``prune.checkpoint``, the CLIs, the benchmarks) asks the registry and never names a
method, so a new method is one module plus its test.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar

from torch import nn

from prune.errors import LayercutError

if TYPE_CHECKING:
    from prune.replace.fitter import SpanFitter

FITS = ("independent", "sequential")
# How each generic option is spelled where the user sets it, for the error messages.
OPTION_FLAGS = {"rank": "--rank", "ridge": "--ridge", "steps": "--replace-steps", "lr": "replacement lr",
                "update_scale": "--update-scale"}
# The value of each generic option that means "not given": a method that does not take the option accepts it.
UNSET = {"rank": None, "ridge": 0.0, "steps": None, "lr": None, "update_scale": None}


@dataclass
class MethodOptions:
    """The generic replacement options as one method takes them; a method subclasses it.

    Subclasses set the class variables: ``accepts`` (the options the method reads; any other one must
    stay unset), ``default_steps``, ``default_lr`` and ``default_update_scale`` (filled in when the option
    is accepted and not given), ``default_short`` (the ``--fit-short`` length when none is given; 0: off).

    Attributes:
        method: the method's name (for the messages).
        rank: rank of a low-rank map; None = the method's default.
        ridge: ridge of a closed-form fit, relative to the mean diagonal of the input Gram.
        steps: Adam steps; None = ``default_steps``.
        lr: Adam learning rate; None = ``default_lr``.
        update_scale: the share of a closed-form map's fitted update ``f(h) - h`` that it applies: 1 is
            the least-squares map, towards 0 it approaches removal of the span; None = ``default_update_scale``.
    """

    method: str
    rank: int | None = None
    ridge: float = 0.0
    steps: int | None = None
    lr: float | None = None
    update_scale: float | None = None

    accepts: ClassVar[tuple[str, ...]] = ()
    default_short: ClassVar[int] = 0
    default_steps: ClassVar[int] = 0
    default_lr: ClassVar[float] = 1e-3
    default_update_scale: ClassVar[float] = 1.0

    def __post_init__(self):
        if self.rank is not None and (not isinstance(self.rank, int) or self.rank <= 0):
            raise LayercutError(f"--rank must be a positive integer, got {self.rank}")
        if not (math.isfinite(self.ridge) and self.ridge >= 0):
            raise LayercutError(f"--ridge must be a finite number >= 0, got {self.ridge}")
        if self.steps is not None and self.steps < 0:
            raise LayercutError(f"--replace-steps must be >= 0, got {self.steps}")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise LayercutError(f"replacement lr must be a positive number, got {self.lr}")
        if self.update_scale is not None and not (isinstance(self.update_scale, (int, float))
                                                  and 0 < self.update_scale <= 1):
            raise LayercutError(f"--update-scale takes a share in (0, 1] (1: the fitted map; for 0 remove the blocks, "
                                f"--replace none), got {self.update_scale}")
        for name, unset in UNSET.items():
            if name not in self.accepts and getattr(self, name) != unset:
                takers = ", ".join(m.name for m in METHODS.values() if name in m.options.accepts)
                flag = OPTION_FLAGS[name]
                raise LayercutError(f"{flag} applies to --replace {takers} only (got --replace {self.method}); "
                                    f"drop {flag}")
        # defaults only for what the method reads: a resolved config validates again unchanged
        if "steps" in self.accepts and self.steps is None:
            self.steps = self.default_steps
        if "lr" in self.accepts and self.lr is None:
            self.lr = self.default_lr
        if "update_scale" in self.accepts and self.update_scale is None:
            self.update_scale = self.default_update_scale

    def values(self) -> dict:
        """The generic options (without ``method``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "method"}


def params_added(record: dict) -> str:
    """What a replacement added, as the CLI says it: ``"1056 parameters"``."""
    return f"{record['params']} parameters"


@dataclass(frozen=True)
class Method:
    """A registered replacement method: all that the rest of layercut needs to know of it.

    Attributes:
        name: the ``--replace`` value; also the map ``type`` in ``replacements.safetensors``.
        description: one line, for ``--help``.
        vanilla: the export stays a plain transformers checkpoint (no ``replacements.safetensors``).
        options: its :class:`MethodOptions` subclass (which options it takes, their defaults).
        fitter: the :class:`~prune.replace.fitter.SpanFitter` class that fits one span; None: the
            blocks are only removed.
        fits: the ``--fit`` values it supports.
        check_model: ``(model) -> None``, raises when the architecture cannot take the method (no
            calibration pass needed, so it runs before scoring).
        check_spans: ``(model, spans) -> None``, raises when these spans cannot be replaced (before fitting).
        min_span: the fewest contiguous blocks one replacement may stand for (a method that puts a whole
            block in a span's place needs 2: a span of one would get a copy of itself).
        module: the ``nn.Module`` type it puts on a kept block, saved in ``replacements.safetensors``.
        spec: ``(module) -> dict``, JSON-ready constructor arguments of such a module.
        build: ``(spec) -> module``, a module of that shape (its weights are loaded after).
        trained_module: ``(model, block, record) -> module | None``, what ``--train replacements``
            trains for a record whose replacement sits on ``block``.
        describe: ``(record) -> str``, what the replacement added, for the CLI's summary line.
    """

    name: str
    description: str
    vanilla: bool
    options: type[MethodOptions] = MethodOptions
    fitter: type[SpanFitter] | None = None
    fits: tuple[str, ...] = FITS
    check_model: Callable[[nn.Module], None] | None = None
    check_spans: Callable[[nn.Module, Sequence[tuple[int, ...]]], None] | None = None
    min_span: int = 1
    module: type[nn.Module] | None = None
    spec: Callable[[nn.Module], dict] | None = None
    build: Callable[[dict], nn.Module] | None = None
    trained_module: Callable[[nn.Module, nn.Module, dict], nn.Module | None] | None = None
    describe: Callable[[dict], str] = params_added

    def __post_init__(self):
        saved = (self.module, self.spec, self.build)
        if not self.vanilla and any(part is None for part in saved):
            raise ValueError(f"method {self.name}: a non-vanilla method needs module, spec and build to be saved")


# name -> Method, in registration order (the order --help and error messages list them in)
METHODS: dict[str, Method] = {}
# The name prune.run's --replace help and older callers know the registry by.
REPLACEMENTS = METHODS


def register_method(method: Method) -> Method:
    """Make ``method`` available by its name; returns it.

    Raises:
        ValueError: a method of that name is already registered.
    """
    if method.name in METHODS:
        raise ValueError(f"replacement method '{method.name}' is already registered")
    METHODS[method.name] = method
    return method


def unregister_method(name: str) -> None:
    """Undo :func:`register_method` (tests)."""
    METHODS.pop(name, None)


def get_method(name: str) -> Method:
    """The method registered as ``name``.

    Raises:
        LayercutError: no such method; the message lists the known ones.
    """
    if name not in METHODS:
        raise LayercutError(f"unknown replacement '{name}': choose one of {', '.join(METHODS)}")
    return METHODS[name]


def record_method(record: dict) -> str:
    """The method name of a replacement record (``"method"``, or ``"kind"`` in checkpoints before the rename)."""
    return record["method"] if "method" in record else record["kind"]


def method_for_module(module: nn.Module) -> Method:
    """The method whose saved module type ``module`` is.

    Raises:
        TypeError: no registered method saves modules of this type.
    """
    for method in METHODS.values():
        if method.module is not None and isinstance(module, method.module):
            return method
    raise TypeError(f"cannot save a replacement map of type {type(module).__name__}")


def describe_replacement(record: dict) -> str:
    """The CLI's line for one replacement record.

    Example: ``replaced blocks [1, 2] by linear (1056 parameters, 0.7 of the fitted update, independent fit, 0.1s)``.
    """
    name = record_method(record)
    added = get_method(name).describe(record)
    if record.get("update_scale", 1) != 1:  # the default is not least squares: say which map was built
        added += f", {record['update_scale']:g} of the fitted update"
    return (f"replaced blocks {record['replaces']} by {name} "
            f"({added}, {record['fit']} fit, {record['fit_seconds']:.1f}s)")
