"""Finer units: remove a block's attention or its MLP alone (``--unit attention,mlp``).

BlockPruner, FinerCut and NVIDIA's Puzzletron report that removing sub-layers beats removing whole
blocks at equal parameters: attention is often the more removable half. A unit is one sub-layer,
numbered ``2 * block`` (attention) and ``2 * block + 1`` (MLP), and its residual states are the block
input, the *middle* state (input + attention's contribution) and the block output. The middle state
is the output minus the MLP's contribution (the MLP's output, or its output norm's where the
architecture has one), so one streamed pass with one extra hook per block scores every sub-layer
with every registered score (``prune.measure.moments.stream_moments(..., mlp_contribution=)``).

A removed sub-layer becomes a ``ZeroSublayer`` (``prune.model.remote_code``) that adds nothing and costs
nothing; a block whose attention and MLP both go is dropped whole. No transformers architecture can
leave a sub-layer out, so the export is a layercut checkpoint: the list of removed sub-layers sits in
its config and ``prune.load`` (or ``from_pretrained(..., trust_remote_code=True)``) rebuilds them; plain
``from_pretrained`` refuses it (it would load random weights in their place). Families:

- every architecture whose blocks have an attention and an MLP sub-module (Llama, Mistral, Qwen2/3,
  Gemma 1-3, Phi, GPT-2, GPT-NeoX, Falcon, MoE blocks, ...): both units;
- OPT: attention only (its feed-forward is two bare layers on the block, not one module);
- blocks without an attention module (Mamba mixers of hybrids): their MLP only.

The first block with attention of each attention kind keeps it (the first block overall, and on
sliding-window and hybrid models the first of each ``layer_types`` entry): transformers' KV cache
reads the positions seen, and each kind's mask size, at those layers. After surgery probe passes
check that every block with a removed sub-layer adds exactly the other one's contribution (an
architecture where it does not, such as a biased norm on the sub-layer output, is refused in one
line) and that decoding through the KV cache still gives the full pass's states.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from prune.errors import LayercutError
from prune.measure.heldout import packed_perplexity
from prune.measure.moments import StateMoments, stream_moments
from prune.measure.scores import SCORES, block_scores
from prune.model.adapters import arch_spec, cache_keyword, get_blocks, input_device, is_dense, num_blocks, text_config
from prune.model.capture import block_input, block_output, hooks_held
from prune.model.remote_code import SUBLAYERS_KEY, remove_sublayers, sublayer_records
from prune.model.surgery import drop_blocks_
from prune.replace.modules import parameter_count

UNITS = ("block", "attention", "mlp")
KINDS = ("attention", "mlp")


def parse_units(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"attention,mlp"`` -> ``("attention", "mlp")``; ``block`` alone is whole blocks (the default).

    ``block`` beside sub-layers adds nothing: a block whose two sub-layers are chosen is removed whole.
    """
    items = [v.strip() for v in (value.split(",") if isinstance(value, str) else value or ["block"]) if v.strip()]
    unknown = [v for v in items if v not in UNITS]
    if unknown or not items:
        raise LayercutError(f"--unit takes block, attention, mlp or a comma list of them, got {value!r}")
    kinds = tuple(k for k in KINDS if k in items)
    return kinds or ("block",)


def is_sublayer(units: Sequence[str]) -> bool:
    """Whether ``units`` (from :func:`parse_units`) removes sub-layers rather than whole blocks."""
    return tuple(units) != ("block",)


@dataclass(frozen=True)
class Unit:
    """One sub-layer: block index (current numbering) and kind."""

    block: int
    kind: str

    @property
    def index(self) -> int:
        """Position in the sub-layer scores: ``2 * block`` for attention, ``2 * block + 1`` for the MLP."""
        return 2 * self.block + KINDS.index(self.kind)

    @classmethod
    def at(cls, index: int) -> Unit:
        """The unit at a sub-layer score position."""
        return cls(index // 2, KINDS[index % 2])

    def label(self) -> str:
        """``"12.attention"``."""
        return f"{self.block}.{self.kind}"


def _bare_mlp(model: nn.Module) -> bool:
    """OPT-like: the feed-forward is dense layers on the block (fc1, fc2), not one module to replace."""
    spec = arch_spec(model)
    _, blocks = get_blocks(model)
    return _has(blocks[0], spec.mlp) and is_dense(blocks[0].get_submodule(spec.mlp))


def sublayer_path(model: nn.Module, kind: str) -> str:
    """Path of the ``kind`` sub-module inside a block ("" when blocks have none to remove whole)."""
    spec = arch_spec(model)
    if kind == "attention":
        return spec.attention
    return "" if _bare_mlp(model) else spec.mlp


def contribution_path(model: nn.Module) -> str:
    """The sub-module whose output is the MLP's whole contribution to the residual (its output norm, if any)."""
    spec = arch_spec(model)
    return spec.mlp_out_norm or (spec.mlp_out if _bare_mlp(model) else spec.mlp)


def _has(block: nn.Module, path: str) -> bool:
    if not path:
        return False
    try:
        block.get_submodule(path)
    except AttributeError:
        return False
    return True


def check_units_supported(model: nn.Module, kinds: Sequence[str]) -> None:
    """Refuse, in one line, sub-layer units the architecture has no module for."""
    if not is_sublayer(kinds):
        return
    model_type = model.config.model_type
    if not contribution_path(model):
        raise LayercutError(f"--unit {','.join(kinds)}: {model_type} blocks have no MLP module to measure the "
                            "sub-layers by; use --unit block")
    _, blocks = get_blocks(model)
    for kind in kinds:
        path = sublayer_path(model, kind)
        if not any(_has(block, path) for block in blocks):
            why = " (its feed-forward is bare layers on the block)" if kind == "mlp" and _bare_mlp(model) else ""
            raise LayercutError(f"--unit {','.join(kinds)}: {model_type} blocks have no {kind} module to remove "
                                f"alone{why}; use --unit {'attention' if kind == 'mlp' else 'mlp'} or --unit block")


def anchor_attentions(model: nn.Module) -> set[int]:
    """Blocks whose attention must stay: the first with attention, and the first of each attention kind.

    transformers' KV cache reads the sequence length at its first attention layer and each mask's size
    at the first layer of that kind (``config.layer_types``: sliding, full, linear, ...); a removed
    attention there leaves an empty cache layer that the others would be measured by.
    """
    _, blocks = get_blocks(model)
    path = sublayer_path(model, "attention")
    with_attention = [i for i, block in enumerate(blocks) if _has(block, path)]
    anchors = set(with_attention[:1])
    types = getattr(text_config(model), "layer_types", None)
    if isinstance(types, (list, tuple)) and len(types) == len(blocks):
        for kind in set(types):
            anchors.update([i for i in with_attention if types[i] == kind][:1])
    return anchors


def candidate_units(model: nn.Module, kinds: Sequence[str], protected: Sequence[int]) -> list[Unit]:
    """Every removable sub-layer of the kinds asked for, outside protected blocks and cache anchors."""
    _, blocks = get_blocks(model)
    anchors = anchor_attentions(model)
    units = []
    for index, block in enumerate(blocks):
        if index in protected:
            continue
        for kind in kinds:
            if kind == "attention" and index in anchors:
                continue
            if _has(block, sublayer_path(model, kind)):
                units.append(Unit(index, kind))
    return units


def unit_parameters(model: nn.Module, unit: Unit) -> int:
    """Parameters the unit's removal frees."""
    return parameter_count(get_blocks(model)[1][unit.block].get_submodule(sublayer_path(model, unit.kind)))


def rank_units(values: Sequence[float], removability, candidates: Sequence[Unit]) -> list[Unit]:
    """Candidates, most removable first, by a score's values over every sub-layer."""
    ranked = removability(list(values))
    return sorted(candidates, key=lambda u: -ranked[u.index])


def unit_moments(model: nn.Module, token_ids: torch.Tensor, batch_size: int,
                 memo: dict) -> tuple[StateMoments, dict[str, list[float]]]:
    """One streamed pass with the middle states, and every registered score of every sub-layer.

    Value ``u`` of a score rates ``Unit.at(u)``. The pass is kept in ``memo`` (one model, one calibration):
    it serves every sub-layer run on them.
    """
    if "sublayer-moments" not in memo:
        moments = stream_moments(model, token_ids, batch_size=batch_size, cosine_pairs="adjacent",
                                 mlp_contribution=contribution_path(model))
        memo["sublayer-moments"] = moments, block_scores(moments, list(SCORES))
    return memo["sublayer-moments"]


# ``--select measured`` reads this many calibration sequences per sub-layer: a model has twice as
# many sub-layers as blocks, and a full calibration pass for each would cost twice the whole of
# SLEB's first step.
MEASURE_SEQUENCES = 8


def _zero_output(_module, _args, output):
    if isinstance(output, (tuple, list)):
        return (torch.zeros_like(output[0]), *output[1:])
    return torch.zeros_like(output)


@contextmanager
def units_skipped(model: nn.Module, units: Sequence[Unit]) -> Iterator[None]:
    """The sub-layers ``units`` add nothing inside the block (their output is zeroed) until exit.

    The same function as their removal (``remove_units_``) without any surgery: a zero output adds
    nothing to the residual, and a norm on a sub-layer's output maps zero to zero.
    """
    _, blocks = get_blocks(model)
    with hooks_held([blocks[u.block].get_submodule(sublayer_path(model, u.kind)).register_forward_hook(_zero_output)
                     for u in units]):
        yield


@torch.no_grad()
def measured_costs(model: nn.Module, token_ids: torch.Tensor, candidates: Sequence[Unit], batch_size: int = 4,
                   cache: dict | None = None) -> dict[str, float]:
    """Calibration perplexity of the whole model (``"dense"``) and with each candidate alone skipped.

    Reads the first :data:`MEASURE_SEQUENCES` sequences of ``token_ids``; ``cache`` (one model, one
    calibration) keeps the figures by unit label so later drops measure nothing again.
    """
    ids = token_ids[:MEASURE_SEQUENCES]
    cache = {} if cache is None else cache
    if "dense" not in cache:
        cache["dense"] = packed_perplexity(model, ids, batch_size, progress=False)
    for unit in tqdm([u for u in candidates if u.label() not in cache], desc="measured: skip each sub-layer",
                     unit="sub-layer"):
        with units_skipped(model, [unit]):
            cache[unit.label()] = packed_perplexity(model, ids, batch_size, progress=False)
    return cache


def rank_measured(costs: dict[str, float], sizes: dict[Unit, int], candidates: Sequence[Unit]) -> list[Unit]:
    """Candidates, cheapest first: calibration log-perplexity added per parameter freed.

    Per parameter because the budget counts parameters, and the units differ in size: in SmolLM2-135M
    an attention holds a third of an MLP's parameters.
    """
    dense = math.log(costs["dense"])
    return sorted(candidates, key=lambda u: (math.log(costs[u.label()]) - dense) / max(sizes[u], 1))


def check_unit_count(count: int, candidates: Sequence[Unit]) -> None:
    """``count`` sub-layers can go only if that many are candidates."""
    if count > len(candidates):
        raise LayercutError(f"cannot remove {count} sub-layers: only {len(candidates)} can go (the first attention "
                            "of each kind and protected blocks stay); lower --drop or pass --protect none")


@torch.no_grad()
def _probe(model: nn.Module, probe_ids: torch.Tensor, handles: list) -> None:
    """One forward pass over ``probe_ids`` with hooks whose ``handles`` are removed after, even on error."""
    with hooks_held(handles):
        model.base_model(input_ids=probe_ids.to(input_device(model)), use_cache=False)


def _arities(model: nn.Module, units: Sequence[Unit], probe_ids: torch.Tensor) -> dict[Unit, int]:
    """What each unit's module returns: 0 for a tensor, else the tuple's length (the zero module mimics it)."""
    _, blocks = get_blocks(model)
    found: dict[Unit, int] = {}

    def record(unit):
        def hook(_module, _args, output):
            found[unit] = len(output) if isinstance(output, (tuple, list)) else 0

        return hook

    _probe(model, probe_ids, [blocks[u.block].get_submodule(sublayer_path(model, u.kind)).register_forward_hook(
        record(u)) for u in units])
    missing = [u.label() for u in units if u not in found]
    if missing:
        raise LayercutError(f"--unit: the sub-layers {', '.join(missing)} never ran in a forward pass; "
                            "use --unit block")
    return found


def _verify(model: nn.Module, units: Sequence[Unit], probe_ids: torch.Tensor) -> None:
    """Each block with a removed sub-layer must add exactly what its other sub-layer contributes."""
    _, blocks = get_blocks(model)
    contribution = contribution_path(model)
    seen: dict[str, torch.Tensor] = {}

    def keep(name, output=False):
        # pre-hooks with kwargs get (module, args, kwargs); forward hooks (module, args[, kwargs], output)
        def hook(_module, args, kwargs_or_output, *rest):
            # copies: a block may add into a sub-layer's output in place (Falcon)
            if output:
                seen[name] = block_output(rest[0] if rest else kwargs_or_output).detach().float().clone()
            else:
                seen[name] = block_input(args, kwargs_or_output).detach().float().clone()

        return hook

    handles = []
    for block_index in sorted({u.block for u in units}):
        block = blocks[block_index]
        handles.append(block.register_forward_pre_hook(keep(f"{block_index}.in"), with_kwargs=True))
        handles.append(block.register_forward_hook(keep(f"{block_index}.out", output=True), with_kwargs=True))
        handles.append(block.get_submodule(contribution).register_forward_hook(keep(f"{block_index}.mlp", True)))
    _probe(model, probe_ids, handles)
    for unit in units:
        b = unit.block
        out, mlp = seen[f"{b}.out"], seen.get(f"{b}.mlp")
        scale = float(out.norm()) or 1.0
        if unit.kind == "mlp":
            error = float(mlp.norm()) / scale if mlp is not None else 0.0
        else:
            error = float((out - seen[f"{b}.in"] - mlp).norm()) / scale
        tolerance = 1e-5 if next(model.parameters()).dtype == torch.float32 else 1e-2
        if not math.isfinite(error) or error > tolerance:
            raise LayercutError(f"--unit {unit.kind}: in {model.config.model_type}, block {b} still adds something "
                                f"without its {unit.kind} (relative {error:.1e}; a biased norm on the sub-layer's "
                                "output?), so it cannot be removed alone; use --unit block")


@torch.no_grad()
def _verify_cache(model: nn.Module, probe_ids: torch.Tensor) -> None:
    """Decoding the probe's second half through the KV cache must give the full pass's last states."""
    ids = probe_ids.to(input_device(model))
    half = ids.shape[1] // 2
    full = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
    try:  # a cache sized at an emptied layer may not even broadcast (eager attention on Gemma 2)
        prefix = model.base_model(input_ids=ids[:, :half], use_cache=True)
        cache = cache_keyword(model.base_model)
        step = model.base_model(input_ids=ids[:, half:], **{cache: getattr(prefix, cache)},
                                use_cache=True).last_hidden_state
        error = float((step.float() - full[:, half:].float()).norm() / full[:, half:].float().norm().clamp_min(1e-12))
    except (RuntimeError, IndexError, ValueError):
        error = math.inf
    tolerance = 1e-4 if next(model.parameters()).dtype == torch.float32 else 3e-2
    if not math.isfinite(error) or error > tolerance:
        raise LayercutError(f"--unit attention: in {model.config.model_type}, decoding through the KV cache no longer "
                            f"matches the full pass once these attentions are gone (relative {error:.1e}); use "
                            "--unit mlp or --unit block")


def remove_units_(model: nn.Module, units: Sequence[Unit], probe_ids: torch.Tensor) -> dict:
    """Remove the sub-layers ``units`` in place; a block losing both goes whole. Returns the record.

    ``probe_ids`` [1, seq]: a few tokens for the passes that learn what each module returns and check
    the surgery. The record (also in ``model.config.layercut_removed_sublayers``) gives current positions.
    """
    units = sorted(set(units), key=lambda u: u.index)
    if sublayer_records(model.config):
        raise LayercutError("this model already has sub-layers removed: prune the original model instead")
    anchored = [u.label() for u in units if u.kind == "attention" and u.block in anchor_attentions(model)]
    if anchored:
        raise LayercutError(f"--unit attention: {', '.join(anchored)} is the first attention of its kind, which the "
                            "KV cache reads positions and mask sizes at; choose other sub-layers")
    both = sorted({u.block for u in units if Unit(u.block, "attention") in units and Unit(u.block, "mlp") in units})
    if both:  # first: the check that the config rebuilds the kept blocks compares them as transformers builds them
        drop_blocks_(model, both)
    alone = [Unit(u.block - sum(1 for b in both if b < u.block), u.kind) for u in units if u.block not in both]
    returns = _arities(model, alone, probe_ids) if alone else {}
    records = [{"block": u.block, "kind": u.kind, "module": sublayer_path(model, u.kind), "returns": returns[u]}
               for u in alone]
    remove_sublayers(model, records, get_blocks(model)[0])
    if alone:
        _verify(model, alone, probe_ids)
    if any(u.kind == "attention" for u in alone):
        _verify_cache(model, probe_ids)
    originals = [u.block for u in units if u.block not in both]
    for record, original in zip(records, originals, strict=True):
        record["original_block"] = original
    setattr(model.config, SUBLAYERS_KEY, [{k: r[k] for k in ("block", "kind", "module", "returns")}
                                          for r in records])
    return {"units": [u.label() for u in units], "blocks_removed_whole": both,
            "sublayers": records, "num_blocks_after": num_blocks(model)}

