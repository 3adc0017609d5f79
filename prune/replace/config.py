"""How removed blocks are replaced: :class:`ReplaceConfig` (a recipe's ``replace:`` section)."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from prune.errors import LayercutError
from prune.replace.options import MethodOptions
from prune.replace.registry import FITS, METHODS, get_method, option_specs, resolve_options, unset_options

# Bound on the captured (input, target) pairs kept for Adam; beyond it only the first batches are used.
DEFAULT_CACHE_BYTES = 1 << 30
# which calibration rows a repair is fitted on (ReplaceConfig.fit_rows)
FIT_ROWS = ("all", "fitting")


@dataclass(init=False)
class ReplaceConfig:
    """How removed blocks are replaced: the settings below, and the options of ``method``.

    Any other keyword (a recipe's ``replace:`` key) is an option of the method, a field of its
    :class:`~prune.replace.options.MethodOptions` (``rank=8``, ``update_scale=0.5``); ``options`` holds
    them resolved, the method's defaults filled in, and is where they are read:
    ``ReplaceConfig(method="lowrank", rank=8).options.rank``. :meth:`to_dict` lists every registered
    option, flat, with the unset value of those the method does not take.

    Attributes:
        method: a registered method (``prune.replace.METHODS``: none | linear | lowrank | fold | block | ...).
        fit: independent (original model's inputs) | sequential (the surgered model's inputs).
        fit_rows: all (every calibration row) | fitting (the rows a repaired selection fits on, one in
            ``prune.selection.repaired.MEASURE_EVERY`` left to measure: the checkpoint is the repair that
            selection measured, and its KL on the other rows describes it; ``prune.ship``'s build).
        short: also fit on the calibration tokens cut into sequences of this many tokens (0: off; None:
            the method's default, 64 for ``linear``, else 0). Task prompts are short: their states are
            those of early positions, which long calibration sequences hold few of (on SmolLM2 a
            least-squares map fitted on 512-token sequences had a higher KL at the logits than removal
            on ARC prompts; fitted on both cuts, a lower one).
        batch_size: sequences per forward pass while capturing.
        cache_bytes: most bytes of captured activations kept for the Adam steps.
        seed: seeds the Adam batch order.
        progress: show tqdm bars.
        options: the method's options, resolved (given as a mapping or the method's options object,
            the option keywords win over it).
    """

    method: str = "linear"
    fit: str = "independent"
    fit_rows: str = "all"
    short: int | None = None
    batch_size: int = 4
    cache_bytes: int = DEFAULT_CACHE_BYTES
    seed: int = 0
    progress: bool = True
    options: MethodOptions = field(default_factory=MethodOptions)

    def __init__(self, **values: Any):
        settings = {item.name: item for item in fields(ReplaceConfig)}
        for name, item in settings.items():
            default = item.default_factory() if item.default is MISSING else item.default
            setattr(self, name, values.pop(name, default))
        if not isinstance(self.options, (MethodOptions, dict, type(None))):
            raise LayercutError(f"replace: options must be a mapping of the method's options, such as {{rank: 8}}, "
                                f"got {self.options!r}")
        given = self.options.values() if isinstance(self.options, MethodOptions) else dict(self.options or {})
        self._resolve({**given, **values})

    def _resolve(self, given: dict) -> None:
        spec = get_method(self.method)
        if self.fit not in FITS:
            raise LayercutError(f"unknown --fit '{self.fit}': choose one of {', '.join(FITS)}")
        if self.fit not in spec.fits:
            takers = "|".join(m.name for m in METHODS.values() if self.fit in m.fits)
            raise LayercutError(f"--fit {self.fit} applies to replacements: pass --replace {takers}")
        if self.fit_rows not in FIT_ROWS:
            raise LayercutError(f"--fit-rows {self.fit_rows}: choose one of {', '.join(FIT_ROWS)}")
        if self.fit_rows != "all" and self.fit != "independent":
            raise LayercutError("--fit-rows fitting reuses the independent fits a repaired selection measured: "
                                "drop --fit sequential, or use --fit-rows all")
        if self.fit_rows != "all" and spec.measured_as is not None:  # before any pass, not at the build
            raise LayercutError(f"--fit-rows fitting ships the fit a repaired selection measured, and --replace "
                                f"{self.method} is measured through another method's fit: use --fit-rows all")
        self.options = resolve_options(spec, given)
        if self.short is None:
            self.short = spec.options.default_short
        if not isinstance(self.short, int) or self.short < 0 or self.short == 1:
            raise LayercutError(f"--fit-short takes a sequence length of at least 2 (0: off), got {self.short}")
        if self.batch_size <= 0:
            raise LayercutError(f"--batch-size must be positive, got {self.batch_size}")

    @classmethod
    def recipe_keys(cls) -> list[str]:
        """The keys a recipe's ``replace:`` section may hold: the settings and every registered method option."""
        return [item.name for item in fields(cls)] + list(option_specs())

    def to_dict(self) -> dict:
        """Flat JSON-ready view: the settings and every registered option (unset where the method does not take it)."""
        settings = {item.name: getattr(self, item.name) for item in fields(self) if item.name != "options"}
        return {**settings, **unset_options(), **self.options.values()}
