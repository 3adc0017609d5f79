"""What a prune run will remove from one model, parsed and checked once: :class:`Amounts`.

A :class:`prune.pipeline.config.PruneConfig` keeps what the user wrote (``drop: 25%``, ``protect: 0,-1``,
``unit: attention,mlp``, ``target_params: 110M``). :func:`resolve_amounts` reads it once, against the
model's config before any weight is read, into numbers and indices; every later stage of the run is
handed the result and never parses an amount again. Once the weights are loaded, :func:`bind_model`
checks them against it and adds the sub-layer candidates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from prune.errors import LayercutError
from prune.measure.scores import check_enough_tokens
from prune.model.adapters import arch_spec, config_layer_count, max_positions, num_blocks, text_config
from prune.model.remote_code import sublayer_records
from prune.replace import check_drop_for_method, check_replacement_supported, parameter_count
from prune.selection.budget import blocks_for_speedup, parse_param_target
from prune.selection.strategies import check_enough_free, parse_drop, parse_protect
from prune.selection.sublayers import (
    Unit,
    candidate_units,
    check_unit_count,
    check_units_supported,
    is_sublayer,
    parse_units,
)


@dataclass(frozen=True)
class Amounts:
    """A run's amounts and protected blocks, read against the model before surgery.

    Attributes:
        num_blocks: the model's blocks.
        params: the model's parameters.
        units: what is removed: ``("block",)``, or sub-layer kinds (``("attention", "mlp")``).
        protected: blocks never removed (nor any sub-layer of theirs), sorted.
        drop: how many units go when that is known before ranking: ``drop`` (sub-layers for a sub-layer
            run) or the blocks ``target_speedup`` needs; None when only scoring or when ``target_params``
            decides it once the units are ranked.
        target_params: the parameter count to reach; None without one.
        target_speedup: the ideal decode speed-up to reach; None without one.
        candidates: the sub-layers that may go (sub-layer runs; empty for whole blocks).
    """

    num_blocks: int
    params: int
    units: tuple[str, ...] = ("block",)
    protected: tuple[int, ...] = ()
    drop: int | None = None
    target_params: int | None = None
    target_speedup: float | None = None
    candidates: tuple[Unit, ...] = ()

    @property
    def is_sublayer(self) -> bool:
        """Whether the run removes attention / MLP sub-layers rather than whole blocks."""
        return is_sublayer(self.units)

    @property
    def removes(self) -> bool:
        """Whether the run removes anything, rather than only scoring."""
        return self.drop is not None or self.target_params is not None

    @property
    def free(self) -> int:
        """Blocks not protected."""
        return self.num_blocks - len(self.protected)

    def with_drop(self, count: int) -> Amounts:
        """The same amounts removing ``count`` units: the count a target asked for, once found."""
        return dataclasses.replace(self, drop=count, target_params=None, target_speedup=None)


def check_counts(config, blocks: int, units: Sequence[str]) -> tuple[list[int], int | None]:
    """``protect`` and ``drop`` against a block count: (protected blocks, units to drop or None).

    A sub-layer ``drop`` counts against twice the blocks here; the candidates bound it once the model is
    at hand (:func:`bind_model`).
    """
    protected = parse_protect(config.protect, blocks)
    if config.drop is None:
        return protected, None
    if is_sublayer(units):
        return protected, parse_drop(config.drop, 2 * blocks)
    count = parse_drop(config.drop, blocks, protected)
    check_enough_free(count, blocks, protected)
    check_drop_for_method(config.replace.method, count)
    return protected, count


def check_positions(config, model_config) -> None:
    """The calibration ``--seq-len`` against the positions of a model config."""
    limit = max_positions(model_config)
    if limit is not None and config.data.seq_len > limit:
        raise LayercutError(
            f"--seq-len {config.data.seq_len} exceeds the model's {limit} positions: lower --seq-len (and raise "
            "--samples to keep the tokens)"
        )


def check_tokens(config, model_config) -> None:
    """``--samples`` x ``--seq-len`` against the tokens the fits need at the hidden size of a model config.

    Known before any text is read or sampled, so too few tokens fail before the model loads, not after
    sampling and a held-out pass. A config that names no width is checked once the model is loaded.
    """
    text = text_config(model_config)
    # the names prune.model.adapters.hidden_size reads first: the width the check after loading measures
    widths = [getattr(text, name, None) for name in ("hidden_size", "n_embd", "d_model")]
    width = next((w for w in widths if isinstance(w, int) and w > 0), None)
    if width is not None:
        check_enough_tokens(config.data.num_tokens, width)


def resolve_amounts(config, model_config, params: int) -> Amounts:
    """Read ``config``'s amounts against a model config, once, before any weight is read: every amount checked.

    Args:
        config: a :class:`prune.pipeline.config.PruneConfig` (what the user wrote: ``25%``, ``0,-1``, ``110M``).
        model_config: the model's config (``config.json``, or a loaded model's ``model.config``).
        params: the model's parameters (counted on the meta device from ``model_config`` before loading).

    Raises:
        LayercutError: an amount, a protected block or a unit the model cannot take (one line).
    """
    blocks = config_layer_count(model_config)
    if blocks is None:
        raise LayercutError(f"{config.load.model}: its config names no layer count, so --drop cannot be read "
                            "against it; pass a model of a supported architecture")
    units = parse_units(config.unit)
    protected, drop = check_counts(config, blocks, units)
    check_positions(config, model_config)
    check_tokens(config, model_config)
    if sublayer_records(model_config):
        raise LayercutError(f"{config.load.model} already has attention/MLP sub-layers removed: prune the original "
                            "model instead")
    target = None if config.target_params is None else parse_param_target(config.target_params, params)
    speedup = None if config.target_speedup is None else float(config.target_speedup)
    if speedup is not None:
        drop = parse_drop(blocks_for_speedup(speedup, blocks), blocks)
        check_enough_free(drop, blocks, protected)
    return Amounts(blocks, params, tuple(units), tuple(protected), drop, target, speedup)


def bind_model(amounts: Amounts, config, model: nn.Module) -> Amounts:
    """The amounts checked against the loaded ``model`` (no amount is parsed again): its blocks, its candidates.

    Raises:
        LayercutError: the weights disagree with the config the amounts were read from, or the model cannot
            take the run's replacement or units (one line).
    """
    arch_spec(model)
    check_replacement_supported(model, config.replace.method)
    if num_blocks(model) != amounts.num_blocks:
        raise LayercutError(f"{config.load.model}: its config says {amounts.num_blocks} blocks but the loaded model "
                            f"has {num_blocks(model)}: the folder's config.json does not describe its weights")
    loaded = parameter_count(model)
    if loaded != amounts.params:
        if amounts.target_params is not None:
            raise LayercutError(f"--target-params counts the architecture's {amounts.params:,} parameters, but the "
                                f"loaded model holds {loaded:,} (quantized or tied differently): pass --drop instead")
        amounts = dataclasses.replace(amounts, params=loaded)
    candidates = _unit_candidates(model, amounts.units, list(amounts.protected))
    if amounts.is_sublayer and amounts.drop is not None:
        check_unit_count(amounts.drop, candidates)
    return dataclasses.replace(amounts, candidates=tuple(candidates))


def resolve_for_model(config, model: nn.Module) -> Amounts:
    """:func:`resolve_amounts` then :func:`bind_model`, for a model already in memory (its config and its count)."""
    arch_spec(model)
    return bind_model(resolve_amounts(config, model.config, parameter_count(model)), config, model)


def _unit_candidates(model: nn.Module, units: tuple[str, ...], protected: list[int]) -> list[Unit]:
    """The sub-layers a sub-layer run may remove (none for whole blocks), once the model supports them."""
    if not is_sublayer(units):
        return []
    check_units_supported(model, units)
    return candidate_units(model, units, protected)
