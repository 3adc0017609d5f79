"""One prune run's options: :class:`PruneConfig`, which a recipe maps onto key for key."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from prune.checkpoint.load_config import LoadConfig
from prune.data.calibration import DataConfig, numeric_fields, typed_fields
from prune.data.sources import parse_sources
from prune.errors import LayercutError
from prune.measure.scores import get_score
from prune.pipeline.resolve import Amounts, resolve_for_model
from prune.pipeline.steps import SurgeryStep, build_step
from prune.replace import ReplaceConfig
from prune.replace.options import is_unset
from prune.replace.registry import AUTO, default_method, get_method, offloadable_methods, option_specs
from prune.selection.strategies import DEFAULT_PROTECT, SELECTIONS, unit_selections
from prune.selection.sublayers import is_sublayer, parse_units

# Post-surgery steps a PruneConfig can switch on, in the order they run: config field -> step name.
STEP_SECTIONS = ("distill",)


def _section(value, cls, name: str, example: str):
    """A recipe section as its dataclass: a mapping of its keys, or the dataclass itself; one line otherwise."""
    if isinstance(value, dict):
        return cls(**value)
    if not isinstance(value, cls):
        raise LayercutError(f"{name} must be a mapping of {cls.__name__} keys, such as {example}, got {value!r}")
    return value


@dataclass
class PruneConfig:
    """One prune run; a recipe maps key for key onto it (sections ``load``, ``data``, ``replace``, ``distill``).

    Attributes:
        load: model and how to load it (:class:`prune.checkpoint.load_config.LoadConfig`).
        data: calibration text (:class:`prune.data.calibration.DataConfig`).
        drop: blocks to remove, a count (4) or a share ("25%"); None only scores (or meets a target).
        target_params: remove the fewest blocks that bring the parameters to this ("110M", "1.2B", "85%");
            in place of ``drop`` (``prune.selection.budget``).
        target_speedup: remove the fewest blocks whose ideal decode speed-up ``L / (L - K)`` reaches this
            (1.25); in place of ``drop``.
        unit: what is removed: "block" (default), or sub-layers "attention", "mlp" or "attention,mlp"
            (``prune.selection.sublayers``; ``drop`` then counts sub-layers, ranked by ``score`` with ``select`` topk,
            or by the measured cost of skipping each with ``select`` measured).
        score: criterion used to rank blocks (all registered scores are reported).
        select: a registered selection (``prune.selection.strategies.SELECTIONS``): topk, span, greedy, greedy-ppl,
            measured, last, repaired-greedy (-kl, -crossfit), repaired-once, repaired-fast
            (``prune.selection.repaired``).
        protect: blocks never removed ("0,-1" = first and last; "none").
        batch_size: sequences per forward pass while streaming statistics and fitting.
        replace: what takes the removed blocks' place (:class:`prune.replace.ReplaceConfig`); a method
            name alone (``replace: linear``) is short for ``{method: linear}``. ``auto`` (``prune.run``'s
            default) is the best training-free repair whose checkpoint every engine runs, chosen for the loaded
            model (``prune.replace.registry.default_method``); removal where none applies, or where the run
            scores only, removes sub-layers or runs block by block.
        distill: options of the distillation step after surgery (``distill.config.DistillConfig`` keys,
            ``steps`` > 0 switches it on); prune hands them to the ``distill`` step unread.
        oracle: also measure the calibration perplexity with each block alone removed (one pass per block)
            and each score's Spearman rank correlation with it (``prune.selection.oracle``; into the report and
            ``scores.md``).
        out: output folder; None writes nothing when only scoring, and ``<model>-drop<K>`` when
            dropping, so the first command a user types keeps its result.
        overwrite: replace a non-empty ``out``.
        auto_replace: ``replace`` was ``auto``: the method is chosen once the model is loaded
            (:meth:`with_default_repair`); set by ``replace: auto``, not by hand.
    """

    load: LoadConfig = field(default_factory=LoadConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drop: str | int | None = None
    target_params: str | int | None = None
    target_speedup: float | None = None
    unit: str = "block"
    score: str = "linearity"
    select: str = "topk"
    protect: str | list[int] | None = DEFAULT_PROTECT
    batch_size: int = 4
    replace: ReplaceConfig | str = "none"
    distill: dict = field(default_factory=dict)
    oracle: bool = False
    out: str | None = None
    overwrite: bool = False
    auto_replace: bool = False

    def __post_init__(self):
        numeric_fields(self, "")  # a recipe's batch_size: "8" is 8
        typed_fields(self, "", {"protect": "write block indices as text or a list, '0,-1' or [0, -1], or none",
                                "drop": "write a count like 4 or a share like '25%'",
                                "target_params": "write a count like 110M or a share like '85%'",
                                "distill": "write DistillConfig keys, such as distill: {steps: 100}"})
        self.load = _section(self.load, LoadConfig, "load", "load: {model: smollm2-135m}")
        self.data = _section(self.data, DataConfig, "data", "data: {samples: 64, seq_len: 512}")
        if self.load.model is None:
            raise LayercutError("load: model is none: name the model to prune (--model, or load: {model: ...})")
        get_score(self.score)
        SELECTIONS.get(self.select)
        if self.batch_size <= 0:
            raise LayercutError(f"--batch-size must be positive, got {self.batch_size}")
        self.replace = _replace_config(self._take_auto(self.replace), self.batch_size)
        steps = self.distill.get("steps", 0)
        if not isinstance(steps, int) or steps < 0:
            raise LayercutError(f"--distill-steps (distill.steps) must be an integer >= 0, got {steps}")
        amounts = [flag for flag, value in (("--drop", self.drop), ("--target-params", self.target_params),
                                            ("--target-speedup", self.target_speedup)) if value is not None]
        if len(amounts) > 1:
            raise LayercutError(f"{' and '.join(amounts)} both say how much to remove: pass one of them")
        if not self.removes and (self.replace.method != "none" or self.step_sections()):
            flag = "--replace" if self.replace.method != "none" else "--distill-steps"
            raise LayercutError(f"{flag} needs blocks to remove: pass --drop (a count or a share), --target-params "
                                "or --target-speedup")
        units = parse_units(self.unit)
        self.unit = ",".join(units)
        if is_sublayer(units):
            self._check_sublayer_options()
        if self.load.offload == "sequential":
            self._check_offload_options()
        if self.auto_replace and (not self.removes or is_sublayer(units)):
            self.auto_replace = False  # nothing to repair, or no repair applies: removal
        if self.out is None and self.removes:
            self.out = self._default_out(units)

    def _take_auto(self, replace):
        """``replace`` with ``auto`` read as removal until the model is loaded (``auto_replace`` remembers it)."""
        method = replace if isinstance(replace, str) else replace.get("method") if isinstance(replace, dict) else None
        if method != AUTO:
            return replace
        self.auto_replace = True
        if isinstance(replace, str):
            return "none"
        specs = option_specs()
        given = sorted(specs[key].name_in_messages for key, value in replace.items()
                       if key in specs and not is_unset(value, specs[key]))
        if given:
            raise LayercutError(f"{', '.join(given)}: an option of a method, and --replace auto chooses the method "
                                "once the model is loaded; name it (--replace fold, fold-rotate, ...)")
        return {**replace, "method": "none"}

    def with_default_repair(self, model) -> PruneConfig:
        """The config with ``replace: auto`` turned into the method it means for ``model`` (itself otherwise)."""
        if not self.auto_replace or self.replace.method != "none":
            return self
        chosen = default_method(model, offloaded=self.load.offload == "sequential")
        if chosen == "none":
            return self
        settings = self.replace.to_dict()
        replace = ReplaceConfig(method=chosen, fit=settings["fit"], fit_rows=settings["fit_rows"], short=None,
                                batch_size=self.batch_size, cache_bytes=settings["cache_bytes"], seed=settings["seed"],
                                progress=settings["progress"])
        chosen_config = dataclasses.replace(self, replace=replace)
        chosen_config.out = self.out  # as given: None writes nothing (prune.slim), not a default folder
        return chosen_config

    def _check_sublayer_options(self) -> None:
        """Refuse, in one line, what sub-layer removal does not do (yet)."""
        if not self.removes:
            raise LayercutError(f"--unit {self.unit} needs an amount: pass --drop N (sub-layers) or --target-params")
        for flag, bad, fix in (("--select", self.select not in unit_selections(),
                                f"ranks sub-layers with --select {' or '.join(unit_selections())}"),
                               ("--replace", self.replace.method != "none", "removes them (--replace none)"),
                               ("--target-speedup", self.target_speedup is not None,
                                "meets --target-params or --drop (a speed-up counts whole blocks)"),
                               ("--distill-steps", bool(self.step_sections()), "does not distill yet"),
                               ("--oracle", self.oracle, "has no oracle yet (it measures whole blocks)")):
            if bad:
                raise LayercutError(f"{flag} with --unit {self.unit}: sub-layer removal {fix}; drop {flag} "
                                    "or use --unit block")

    def offload_refusals(self) -> list[tuple[str, str]]:
        """(flag, what a block-by-block run does instead) for each option ``--offload sequential`` cannot run.

        The one statement of what a skeleton runs: the config refuses these under ``--offload sequential``, and
        the planner proposes that offload as a fix only where they are none (``prune.planner.estimate``).
        """
        units = parse_units(self.unit)
        method = get_method(self.replace.method)
        refusals = (
            ("--unit", is_sublayer(units), "rates whole blocks (--unit block)"),
            ("--select", needed_cosine_pairs(self) == "all",
             "keeps two states at a time, and a span's score compares every pair of states (--select topk, "
             "greedy, repaired-fast, repaired-greedy, ...)"),
            ("--replace", not method.offloadable or self.replace.fit != "independent",
             (f"cannot run --replace {method.name}, which {method.blockwise_refusal}" if method.blockwise_refusal
              else "fits each span on the original model's states")
             + f"; it runs --replace {', '.join(offloadable_methods())} with --fit independent"),
            ("--distill-steps", bool(self.step_sections()),
             "exports the pruned checkpoint; distil it afterwards with python -m distill.run"),
            ("--data", any(source.is_self for source in parse_sources(self.data.data)),
             "cannot sample text from the model (the default calibration's self half): pass --data builtin, a "
             "file or a dataset"),
        )
        return [(flag, fix) for flag, bad, fix in refusals if bad]

    def _check_offload_options(self) -> None:
        """Refuse, in one line and before any weight is read, what a skeleton cannot run block by block."""
        refusals = self.offload_refusals()
        if refusals:
            flag, fix = refusals[0]
            raise LayercutError(f"{flag} with --offload sequential: a block-by-block run {fix}; change {flag} "
                                "or use --offload none")

    def _default_out(self, units: tuple[str, ...]) -> str:
        """``<model>-drop<K>[-<units>][-<method>]``: the first command a user types keeps its result."""
        stem = Path(self.load.model.rstrip("/")).name.removesuffix(".gguf")
        method = "" if self.replace.method == "none" else f"-{self.replace.method}"
        amount = (f"drop{str(self.drop).replace('%', 'pct')}" if self.drop is not None else
                  f"params{str(self.target_params).replace('%', 'pct')}" if self.target_params is not None
                  else f"speedup{self.target_speedup}x")
        unit = "" if not is_sublayer(units) else "-" + self.unit.replace(",", "-")
        return f"{stem}-{amount}{unit}{method}"

    @property
    def removes(self) -> bool:
        """Whether this run removes blocks (``drop`` or a target), rather than only scoring."""
        return self.drop is not None or self.target_params is not None or self.target_speedup is not None

    def step_sections(self) -> list[str]:
        """The post-surgery steps this config switches on (a section with ``steps`` > 0)."""
        return [name for name in STEP_SECTIONS if getattr(self, name).get("steps", 0)]

    def build_steps(self) -> list[SurgeryStep]:
        """The post-surgery steps this config asks for, built (and so validated) before any heavy work."""
        return [build_step(name, dict(getattr(self, name)), self) for name in self.step_sections()]

    def resolve(self, model) -> Amounts:
        """Amounts, protected blocks and units read against ``model`` once, every one checked (:class:`Amounts`)."""
        return resolve_for_model(self, model)


def _replace_config(value, batch_size: int) -> ReplaceConfig:
    if isinstance(value, str):
        value = {"method": value}
    if isinstance(value, dict):
        if "batch_size" in value:
            raise LayercutError("replace: batch_size is the run's top-level batch_size; move it there")
        return ReplaceConfig(**value, batch_size=batch_size)
    if not isinstance(value, ReplaceConfig):
        raise LayercutError(f"replace must be a method name or a mapping, got {type(value).__name__}")
    if value.batch_size != batch_size:
        raise LayercutError(f"replace.batch_size {value.batch_size} differs from batch_size {batch_size}: set one")
    return value


def needed_cosine_pairs(config: PruneConfig) -> str:
    """The cosine sums ``config``'s selection reads: every pair for a span ranked by a score of states."""
    return "all" if config.select == "span" and get_score(config.score).span is not None else "adjacent"
