"""Replacement methods, registered by name and looked up by name (PEFT's ``register_peft_method``).

A method module builds one :class:`Method` and calls :func:`register_method` once. Everything else
(the driver, ``prune.checkpoint.save_load``, the CLIs, the benchmarks) asks the registry and never names a
method, so a new method is one module plus its test.

The options of the methods are the fields of their :class:`~prune.replace.options.MethodOptions`
subclasses; :func:`option_specs` is their union, from which ``prune.run`` makes its flags and
:class:`~prune.replace.config.ReplaceConfig` takes a recipe's keys, so a new option is one field.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from prune.errors import LayercutError
from prune.model.layouts import LAYERCUT, VANILLA
from prune.registry import Registry
from prune.replace.options import NO_NEUTRAL, MethodOptions, OptionSpec, is_unset

if TYPE_CHECKING:
    from prune.replace.fitter import SpanFitter

FITS = ("independent", "sequential")


def params_added(record: dict) -> str:
    """What a replacement added, as the CLI says it: ``"1056 parameters"``."""
    return f"{record['params']} parameters"


@dataclass(frozen=True)
class Method:
    """A registered replacement method: all that the rest of layercut needs to know of it.

    Attributes:
        name: the ``--replace`` value; also the map ``type`` in ``replacements.safetensors``.
        description: one line, for ``--help``.
        serving: how its checkpoints reach serving engines (``prune.model.layouts``): "vanilla" (a plain
            transformers checkpoint every engine runs, no ``replacements.safetensors``) or "layercut" (maps no
            engine runs).
        closed_form: it is fitted in closed form, from moments summed over the calibration, with no training
            steps (``--plan`` counts a fit that trains as one such fit).
        offloadable: its fit reads only the original model's activations (the span's input and output,
            hooks inside the blocks) and rewrites block weights only through their patches, so a skeleton
            whose blocks stay on disk can run it (``--offload sequential``, with ``--fit independent``).
        blockwise_refusal: for a method that is not ``offloadable``, why (the refusal's one line says it).
        options: its :class:`MethodOptions` subclass (which options it takes, their defaults).
        fitter: the :class:`~prune.replace.fitter.SpanFitter` class that fits one span; None: the
            blocks are only removed.
        fits: the ``--fit`` values it supports.
        check_model: ``(model, method) -> None``, raises when the architecture cannot take the method (no
            calibration pass needed, so it runs before scoring). ``method`` is the name it was registered
            under, for the one-line error to name the ``--replace`` given: one check serves every method that
            registers it.
        check_spans: ``(model, spans, method) -> None``, raises when these spans cannot be replaced (before
            fitting); ``method`` as for ``check_model``.
        min_span: the fewest contiguous blocks one replacement may stand for (a method that puts a whole
            block in a span's place needs 2: a span of one would get a copy of itself).
        module: the ``nn.Module`` type it puts on a kept block, saved in ``replacements.safetensors``.
        spec: ``(module) -> dict``, JSON-ready constructor arguments of such a module.
        build: ``(spec) -> module``, a module of that shape (its weights are loaded after).
        trained_module: ``(model, block, record) -> module | None``, what ``--train replacements``
            trains for a record whose replacement sits on ``block``.
        describe: ``(record) -> str``, what the replacement added, for the CLI's summary line.
        default_for: ``(model) -> int``, how strongly it stands as ``prune.run``'s default repair of ``model``
            (``--replace auto``): 0 where it does not apply; the highest wins, and removal where none applies.
            Only training-free methods whose checkpoint every engine runs declare it, ranked by what the
            selection split measured.
        adds_params: ``(model) -> int``, parameters its checkpoint of ``model`` carries beyond the kept blocks',
            whatever the spans (fold-rotate's untied head); None: none beyond what ``describe`` reports per
            record. Read before any fit (``prune.ship`` sizes its candidates with it).
        measured_as: ``(config) -> ReplaceConfig``, what a repaired selection (``--select repaired-*``) fits and
            measures in this method's place, for a method whose own fit trains: fitting it for each of a
            greedy loop's hundreds of candidate sets would cost its training every time. None: the method itself.
        fit_width: ``(hidden, intermediate) -> int``, the width of what its closed-form fit regresses on (the
            span input's: hidden; a fold's MLP activations: intermediate). The planner sizes the fit's
            float64 sums and, block by block, the activations a span keeps until its output, with it.
        fit_rounds: the alternating rounds its closed-form fit takes at most with its default options, each an
            SVD of the hidden width and a solve (fold-rotate's); 0 for a fit solved once. The planner times it.
    """

    name: str
    description: str
    serving: str
    closed_form: bool = False
    offloadable: bool = False
    blockwise_refusal: str = ""
    options: type[MethodOptions] = MethodOptions
    fitter: type[SpanFitter] | None = None
    fits: tuple[str, ...] = FITS
    check_model: Callable[[nn.Module, str], None] | None = None
    check_spans: Callable[[nn.Module, Sequence[tuple[int, ...]], str], None] | None = None
    min_span: int = 1
    module: type[nn.Module] | None = None
    spec: Callable[[nn.Module], dict] | None = None
    build: Callable[[dict], nn.Module] | None = None
    trained_module: Callable[[nn.Module, nn.Module, dict], nn.Module | None] | None = None
    describe: Callable[[dict], str] = params_added
    default_for: Callable[[nn.Module], int] | None = None
    adds_params: Callable[[nn.Module], int] | None = None
    measured_as: Callable[[Any], Any] | None = None  # ReplaceConfig -> ReplaceConfig (config imports this module)
    fit_width: Callable[[int, int], int] = lambda hidden, _intermediate: hidden
    fit_rounds: int = 0

    def __post_init__(self):
        if self.serving not in (VANILLA, LAYERCUT):
            raise ValueError(f"method {self.name}: serving must be '{VANILLA}' or '{LAYERCUT}', got '{self.serving}'")
        saved = (self.module, self.spec, self.build)
        if not self.servable and any(part is None for part in saved):
            raise ValueError(f"method {self.name}: a method serving as '{LAYERCUT}' needs module, spec and build "
                             "to be saved")

    @property
    def servable(self) -> bool:
        """Whether its export is a plain transformers checkpoint (``serving`` is "vanilla"): no maps to save."""
        return self.serving == VANILLA


# name -> Method, in registration order (the order --help and error messages list them in)
METHODS: Registry[Method] = Registry("replacement")


def register_method(method: Method) -> Method:
    """Make ``method`` available by its name; returns it.

    Raises:
        ValueError: a method of that name is already registered, or one of its options is declared
            with another flag, label, type, unset or neutral value than the registered methods taking it.
    """
    known = option_specs()
    for name, spec in method.options.specs().items():
        if name in known and _shown(spec) != _shown(known[name]):
            raise ValueError(f"method {method.name}: option '{name}' differs from the one of --replace "
                             f"{', '.join(option_takers(name))} (flag, label, type, unset or neutral value): "
                             "declare it the same way (prune.replace.options has makers for shared options)")
    return METHODS.register(method.name, method)


def _shown(spec: OptionSpec) -> tuple:
    # what must agree between methods taking one option: the flag and recipe key read it once for all of them
    return spec.flag, spec.label, spec.type, spec.unset, spec.neutral


def unregister_method(name: str) -> None:
    """Undo :func:`register_method` (tests)."""
    METHODS.unregister(name)


AUTO = "auto"


def default_method(model: nn.Module, offloaded: bool = False) -> str:
    """What ``--replace auto`` runs on ``model``: the registered method ranking highest for it, else ``"none"``.

    ``offloaded``: only methods a skeleton can run (``offloadable``) compete.
    """
    ranked = [(method.default_for(model), index, method.name) for index, method in enumerate(METHODS.values())
              if method.default_for is not None and (method.offloadable or not offloaded)]
    best = max(((rank, -index, name) for rank, index, name in ranked if rank > 0), default=None)
    return best[2] if best is not None else "none"


def get_method(name: str) -> Method:
    """The method registered as ``name``.

    Raises:
        LayercutError: no such method; the message lists the known ones.
    """
    return METHODS.get(name)


def closed_form_methods() -> tuple[str, ...]:
    """The registered methods that declare ``closed_form``, in registration order."""
    return tuple(name for name, method in METHODS.items() if method.closed_form)


def offloadable_methods() -> tuple[str, ...]:
    """The registered methods that declare ``offloadable`` (``--offload sequential`` runs them)."""
    return tuple(name for name, method in METHODS.items() if method.offloadable)


def option_specs() -> dict[str, OptionSpec]:
    """Every option of the registered methods -> its :class:`OptionSpec`, in order of first declaration.

    These are ``prune.run``'s option flags and the option keys of a recipe's ``replace:`` section.
    """
    specs: dict[str, OptionSpec] = {}
    for method in METHODS.values():
        for name, spec in method.options.specs().items():
            specs.setdefault(name, spec)
    return specs


def option_takers(name: str) -> list[str]:
    """The registered methods that take the option ``name``."""
    return [method.name for method in METHODS.values() if name in method.options.specs()]


def unset_options() -> dict[str, object]:
    """Option name -> the value that means "not given" (what a method that does not take it reads)."""
    return {name: spec.unset for name, spec in option_specs().items()}


def neutral_options() -> dict[str, tuple]:
    """Option name -> the values at which it does what was done before it existed: ``(unset, neutral)``.

    Only options added after results were recorded have them (``{"update_scale": (None, 1.0)}``): a
    method that does not take the option reads it as unset, one that does behaves as before at the
    neutral value. ``eval.compare`` leaves an option at these values out of its digests.
    """
    return {name: (spec.unset, spec.neutral) for name, spec in option_specs().items() if spec.neutral is not NO_NEUTRAL}


def describe_option(name: str) -> str:
    """``--help`` of the option ``name``: its help, the methods taking it and their defaults."""
    spec = option_specs()[name]
    takers = option_takers(name)
    defaults = {method: METHODS[method].options.defaults()[name] for method in takers}
    if spec.default_help is not None:
        default = spec.default_help
    elif len(set(map(repr, defaults.values()))) == 1:
        default = f"{next(iter(defaults.values())):g}"
    else:
        default = ", ".join(f"{method} {value:g}" for method, value in defaults.items())
    return f"{spec.help} (--replace {', '.join(takers)}; default: {default})"


def resolve_options(method: Method, given: dict) -> MethodOptions:
    """``method``'s options from the ``given`` ones (a flag or recipe key each), its defaults for the rest.

    A value equal to the option's unset value counts as not given.

    Raises:
        LayercutError: an unknown option, a value its check refuses, or an option ``method`` does not
            take (the one-line message names the methods that take it).
    """
    specs = option_specs()
    unknown = sorted(set(given) - set(specs))
    if unknown:
        raise LayercutError(f"unknown replacement option(s) {', '.join(unknown)}; known: {', '.join(specs)}")
    given = {name: value for name, value in given.items() if not is_unset(value, specs[name])}
    for name, value in given.items():  # every value first: a bad one is named even where it does not apply
        specs[name].validate(value)
    takes = method.options.specs()
    for name in given:
        if name not in takes:
            label = specs[name].name_in_messages
            raise LayercutError(f"{label} applies to --replace {', '.join(option_takers(name))} only (got --replace "
                                f"{method.name}); drop {label}")
    return method.options(**given)


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
    """The one line for a replacement record, as the CLI prints it and the model card lists it.

    Example: ``replaced blocks [1, 2] by linear (1056 parameters, 0.7 of the fitted update, independent fit, 0.1s)``.
    """
    name = record["method"]
    added = get_method(name).describe(record) if name in METHODS else f"{record.get('params', '?')} parameters"
    if record.get("update_scale", 1) != 1:  # the default is not least squares: say which map was built
        added += f", {record['update_scale']:g} of the fitted update"
    if record.get("fit"):
        added += f", {record['fit']} fit"
    if isinstance(record.get("fit_seconds"), (int, float)):
        added += f", {record['fit_seconds']:.1f}s"
    if record.get("where") in ("before", "after"):  # a map's side of the cut (a fold says where it went already)
        added += f", placed {record['where']}"
    if isinstance(record.get("tokens"), int):
        added += f", fitted on {record['tokens']:,} tokens"
    return f"replaced blocks {record.get('replaces', '?')} by {name} ({added})"
