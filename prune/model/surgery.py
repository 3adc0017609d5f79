"""Remove decoder blocks, permanently (``drop_blocks_``) or for the length of a ``with`` (``blocks_removed``).

After removal every per-layer index is renumbered: attention ``layer_idx`` (the KV cache is indexed
by it), per-layer config lists such as ``layer_types``, and the layer count under the config's own
attribute name (``num_hidden_layers``, GPT-2's ``n_layer``).

Surgery also records the *layout* in ``model.config.layercut_layout``: for each current block
position, the original block indices whose computation it now covers (``[[0], [1], [2, 3, 4], ...]``
after blocks 3 and 4 were replaced by a map attached to block 2). A config attribute survives
``save_pretrained`` / ``from_pretrained``, so a reloaded checkpoint still knows which teacher state
each of its blocks should reproduce (distillation aligns on it).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from prune.errors import LayercutError
from prune.model.adapters import PER_LAYER_CONFIG_LISTS, arch_spec, get_blocks, text_config
from prune.model.remote_code import RECORDS_KEY, SUBLAYERS_KEY
from prune.model.tiny import quiet

LAYOUT_ATTR = "layercut_layout"
RECORDS_ATTR = RECORDS_KEY
_ABSENT = object()


def check_block_indices(indices: Sequence[int], num_blocks: int) -> list[int]:
    """Sorted unique block indices, validated against the model's depth."""
    unique = sorted(set(int(i) for i in indices))
    if any(not 0 <= i < num_blocks for i in unique):
        raise LayercutError(f"block indices {unique} out of range: the model has blocks 0..{num_blocks - 1}")
    if len(unique) >= num_blocks:
        raise LayercutError(f"cannot remove {len(unique)} of {num_blocks} blocks: at least one must stay")
    return unique


def block_layout(model: nn.Module) -> list[list[int]]:
    """For each current block position, the original block indices it covers (identity if never surgered).

    Raises:
        LayercutError: the recorded layout does not match the number of blocks (blocks were removed
            by hand, not through ``prune.model.surgery``).
    """
    _, blocks = get_blocks(model)
    layout = getattr(model.config, LAYOUT_ATTR, None)
    if layout is None:
        return [[i] for i in range(len(blocks))]
    if len(layout) != len(blocks):
        raise LayercutError(
            f"config.{LAYOUT_ATTR} has {len(layout)} entries but the model has {len(blocks)} blocks: blocks were "
            f"removed without prune.model.surgery; delete config.{LAYOUT_ATTR} or use prune.model.surgery.drop_blocks_"
        )
    return [[int(i) for i in entry] for entry in layout]


def replacement_records(model: nn.Module) -> list[dict]:
    """The replacements recorded on the model (``config.layercut_replacements``), as a list of dicts."""
    return [dict(r) for r in getattr(model.config, RECORDS_ATTR, None) or []]


def host_position(layout: list[list[int]], replaces: Sequence[int]) -> int | None:
    """Current position of the block whose layout covers all of ``replaces`` (None if it was removed)."""
    wanted = set(replaces)
    for position, entry in enumerate(layout):
        if wanted <= set(entry):
            return position
    return None


def _layer_index_owners(block: nn.Module) -> list[nn.Module]:
    return [m for m in block.modules() if isinstance(getattr(m, "layer_idx", None), int)]


# Lists of a config's own length that do not describe layers (sizes, limits, MTP heads).
_NOT_PER_LAYER = {"architectures", "time_step_limit", "mrope_section", "bad_words_ids", "suppress_tokens",
                  "begin_suppress_tokens", "forced_decoder_ids", "image_size", "patch_size"}
# Integer lists of layer *indices* (not one value per layer); others are recognised by name and shape.
_INDEX_LISTS = {"mlp_only_layers", "attn_layer_indices", "full_attn_idxs", "hybrid_layer_ids", "moe_layers",
                "swa_layers", "global_attn_layers", "dense_layers", "sparse_layers"}
_INDEX_HINTS = ("idx", "indices", "ids", "_layers")
# Interval patterns: layer i has the feature when i % period == offset.
_PERIOD_PAIRS = (("attn_layer_period", "attn_layer_offset"), ("expert_layer_period", "expert_layer_offset"))


def _is_index_list(name: str, values, count: int) -> bool:
    if not (isinstance(values, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in values)):
        return False
    if name in PER_LAYER_CONFIG_LISTS:
        return False
    in_range = all(0 <= v < count for v in values) and list(values) == sorted(set(values))
    return in_range and (name in _INDEX_LISTS or any(h in name for h in _INDEX_HINTS))


def _scalar(value) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, dict))


def _config_entries(config) -> dict:
    return {k: v for k, v in config.to_dict().items() if not k.startswith("_") and not k.startswith("mtp")}


def _per_layer_entries(config, count: int) -> dict[str, tuple[str, object]]:
    """Config entries that describe layers: name -> (kind, value); kinds: list, string, index, keys."""
    entries = {}
    for name, value in _config_entries(config).items():
        if name in _NOT_PER_LAYER or name in (LAYOUT_ATTR, RECORDS_ATTR, SUBLAYERS_KEY):
            continue
        if _is_index_list(name, value, count):
            entries[name] = ("index", list(value))
        elif isinstance(value, (list, tuple)) and len(value) == count and all(_scalar(v) for v in value):
            entries[name] = ("list", list(value))
        elif isinstance(value, str) and len(value) == count and "pattern" in name:
            entries[name] = ("string", value)
        elif (isinstance(value, dict) and value and all(str(k).isdigit() for k in value)
              and all(int(k) < count for k in value) and "layer" in name):
            entries[name] = ("keys", dict(value))
    return entries


def _remap(kind: str, value, sources: Sequence[int]):
    if kind == "list":
        return [value[i] for i in sources]
    if kind == "string":
        return "".join(value[i] for i in sources)
    if kind == "index":
        return [position for position, source in enumerate(sources) if source in set(value)]
    # keys: per-layer dicts keep their key type (JSON turns int keys into strings)
    by_index = {int(k): (k, v) for k, v in value.items()}
    return {(str(p) if isinstance(by_index[s][0], str) else p): by_index[s][1]
            for p, s in enumerate(sources) if s in by_index}


def _solve_period(flags: list[bool]) -> tuple[int, int] | None:
    """(period, offset) with flags[i] == (i % period == offset) for every i, if any."""
    for period in range(1, len(flags) + 1):
        for offset in range(period):
            if all(flag == (i % period == offset) for i, flag in enumerate(flags)):
                return period, offset
    return None


def _remapped_cycles(values: dict, remapped: dict, sources: Sequence[int], count: int) -> dict[str, list]:
    """Cyclic patterns shorter than the stack (("recurrent", "recurrent", "attention") repeated), per kept block."""
    cycles = {}
    for name, value in values.items():
        if (("type" in name or "pattern" in name) and name not in remapped and isinstance(value, (list, tuple))
                and 1 < len(value) < count and all(isinstance(v, str) for v in value)):
            cycles[name] = [value[s % len(value)] for s in sources]
    return cycles


def _remapped_depth(values: dict, sources: Sequence[int], count: int) -> dict[str, object]:
    """Entries that count layers: ``scale_depth`` and ``first_k_dense_replace``."""
    new: dict[str, object] = {}
    scale = values.get("scale_depth")
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        # residual branches scaled by scale_depth / sqrt(layers): keep each kept branch's scale
        new["scale_depth"] = scale * math.sqrt(len(sources) / count)
    dense = values.get("first_k_dense_replace")
    if isinstance(dense, int) and not isinstance(dense, bool):
        new["first_k_dense_replace"] = sum(1 for s in sources if s < dense)
    return new


def _remapped_sparse_step(values: dict, sources: Sequence[int]) -> dict[str, object]:
    """Turn ``decoder_sparse_step`` into an explicit ``mlp_only_layers`` list, since kept blocks lose the step."""
    step = values.get("decoder_sparse_step")
    if not (isinstance(step, int) and step > 1):
        return {}
    if "mlp_only_layers" not in values:
        raise LayercutError(
            f"config entry decoder_sparse_step={step} cannot describe the kept blocks (no mlp_only_layers to "
            "list the dense ones): keep the blocks of one sparse step together or prune another model"
        )
    only = set(values.get("mlp_only_layers") or [])
    return {"mlp_only_layers": [p for p, s in enumerate(sources) if s in only or (s + 1) % step != 0],
            "decoder_sparse_step": 1}


def _remapped_periods(values: dict, sources: Sequence[int]) -> dict[str, int]:
    """Period/offset pairs solved again for the kept blocks."""
    new = {}
    for period_name, offset_name in _PERIOD_PAIRS:
        period, offset = values.get(period_name), values.get(offset_name)
        if not (isinstance(period, int) and isinstance(offset, int)) or period < 1:
            continue
        solved = _solve_period([s % period == offset for s in sources])
        if solved is None:
            raise LayercutError(
                f"config entries {period_name}/{offset_name} ({period}/{offset}) cannot describe the kept blocks: "
                f"the kept layers no longer repeat with one period; choose other blocks"
            )
        new[period_name], new[offset_name] = solved
    return new


def _check_moe_freq(values: dict, new: dict, sources: Sequence[int]) -> None:
    """``moe_layer_freq`` has no list form: the kept blocks must still follow it, counted from the new start."""
    freq = values.get("moe_layer_freq")
    if not (isinstance(freq, int) and freq > 1):
        return
    start = values.get("first_k_dense_replace") or 0
    flags = [s >= start and s % freq == 0 for s in sources]
    if flags != [p >= new.get("first_k_dense_replace", 0) and p % freq == 0 for p in range(len(sources))]:
        raise LayercutError(
            f"config entry moe_layer_freq={freq} cannot describe the kept blocks: the dense / MoE pattern "
            f"of the kept layers is no longer every {freq}th layer; choose other blocks"
        )


def remapped_config_entries(config, sources: Sequence[int], count: int) -> dict[str, object]:
    """New values of every per-layer config entry after blocks ``sources`` (old positions) are kept in order.

    Raises:
        LayercutError: an entry (named) cannot describe the kept blocks.
    """
    new = {name: _remap(kind, value, sources) for name, (kind, value) in _per_layer_entries(config, count).items()}
    values = _config_entries(config)
    new.update(_remapped_cycles(values, new, sources, count))
    new.update(_remapped_depth(values, sources, count))
    new.update(_remapped_sparse_step(values, sources))
    new.update(_remapped_periods(values, sources))
    _check_moe_freq(values, new, sources)
    return new


def set_blocks_(model: nn.Module, blocks: Sequence[nn.Module], sources: Sequence[int], layout: list[list[int]]) -> None:
    """Install a new block list in place and make every per-layer index agree with it.

    Args:
        model: a supported model.
        blocks: the new blocks, in order (kept blocks, wrappers, new blocks).
        sources: for each new position, the current position whose per-layer config entries
            (``layer_types``, ...) it takes over.
        layout: for each new position, the original block indices it covers (recorded on the config).
    """
    path, current = get_blocks(model)
    if not len(blocks) == len(sources) == len(layout):
        raise ValueError("blocks, sources and layout must have the same length")
    config = text_config(model)
    entries = remapped_config_entries(config, sources, len(current))
    check_config_rules(model, len(blocks), entries)
    model.set_submodule(path, nn.ModuleList(blocks))
    for position, block in enumerate(blocks):
        for owner in _layer_index_owners(block):
            owner.layer_idx = position
    setattr(config, arch_spec(model).layer_count, len(blocks))
    for name, value in entries.items():
        setattr(config, name, value)
    layout = [sorted(int(i) for i in entry) for entry in layout]
    setattr(model.config, LAYOUT_ATTR, layout)
    # a replacement whose host block is gone went with it
    records = [r for r in replacement_records(model) if host_position(layout, r["replaces"]) is not None]
    setattr(model.config, RECORDS_ATTR, records)


def check_config_rules(model: nn.Module, count: int, entries: dict) -> None:
    """Raise a one-line ``LayercutError`` when transformers' own rules refuse the config with ``count`` blocks.

    Checked on a copy, before anything changes: some configs tie the layer count to fields no rule here
    rewrites (transformers 5.24's ``dory`` splits it into input, recurrent and output groups), and
    ``save_pretrained`` would refuse them only at export, after every measurement and distillation step.
    """
    from huggingface_hub.errors import StrictDataclassClassValidationError  # not at the top: it slows every start

    config = copy.deepcopy(model.config)
    text = text_config(config)
    setattr(text, arch_spec(model).layer_count, count)
    for name, value in entries.items():
        setattr(text, name, value)
    for part in {id(config): config, id(text): text}.values():
        validate = getattr(part, "validate", None)
        if validate is None:
            continue
        try:
            validate()
        except StrictDataclassClassValidationError as err:
            cause = str(err.__cause__ or err).strip().splitlines()[0]
            raise LayercutError(f"transformers refuses the {text.model_type} config with {count} blocks ({cause}): "
                                "this architecture cannot lose blocks with layercut yet") from None


def check_removable(model: nn.Module, indices: Sequence[int]) -> None:
    """Raise the one-line ``LayercutError`` that ``drop_blocks_(model, indices)`` would, changing nothing.

    Selection strategies can skip block sets whose kept layers the config cannot describe (a hybrid's
    attention period broken by the removal).
    """
    _, blocks = get_blocks(model)
    dropped = check_block_indices(indices, len(blocks))
    kept = [i for i in range(len(blocks)) if i not in dropped]
    check_config_rules(model, len(kept), remapped_config_entries(text_config(model), kept, len(blocks)))


def _signature(block: nn.Module) -> list[tuple[str, str]]:
    return [(name, type(module).__name__) for name, module in block.named_modules()]


def check_config_rebuilds_blocks(model: nn.Module, kept: Sequence[int]) -> None:
    """Check that the config after keeping ``kept`` rebuilds every kept block as the same kind of block.

    The model is rebuilt on the meta device (no memory, no weights).

    This catches per-layer config entries that no rule here knows (a new counter deciding which
    layers are MoE): the export would otherwise load with the wrong module in some position.
    Models with replacements or custom (remote) code are not rebuilt.

    Raises:
        LayercutError: a kept block would come back as another kind of block.
    """
    if replacement_records(model) or not type(model).__module__.startswith("transformers."):
        return
    if getattr(model, "hf_quantizer", None) is not None:
        return
    path, blocks = get_blocks(model)
    config = copy.deepcopy(model.config)
    text = text_config(config)
    entries = remapped_config_entries(text, kept, len(blocks))
    setattr(text, arch_spec(model).layer_count, len(kept))
    for name, value in entries.items():
        setattr(text, name, value)
    try:
        with torch.device("meta"), quiet():
            rebuilt = type(model)(config).get_submodule(path)
    except Exception:  # noqa: BLE001 - a config this check cannot build is for the reload to report
        return
    for position, source in enumerate(kept):
        want, got = _signature(blocks[source]), _signature(rebuilt[position])
        if want != got:
            diff = next(((w, g) for w, g in zip(want, got, strict=False) if w != g), (want[-1:], got[-1:]))
            raise LayercutError(
                f"after removing blocks, block {source} would reload as a different block (its {diff[0]} "
                f"becomes {diff[1]}): a per-layer config entry cannot describe the kept blocks; choose "
                "other blocks"
            )


def drop_blocks_(model: nn.Module, indices: Sequence[int]) -> list[int]:
    """Remove blocks ``indices`` (0-based, current numbering) in place; returns the kept indices."""
    _, blocks = get_blocks(model)
    dropped = check_block_indices(indices, len(blocks))
    kept = [i for i in range(len(blocks)) if i not in dropped]
    check_config_rebuilds_blocks(model, kept)
    layout = block_layout(model)
    set_blocks_(model, [blocks[i] for i in kept], kept, [layout[i] for i in kept])
    return kept


@contextmanager
def blocks_replaced(
    model: nn.Module, blocks: Sequence[nn.Module], sources: Sequence[int], layout: list[list[int]]
) -> Iterator[None]:
    """``set_blocks_`` for the length of a ``with``: modules, indices and config are restored on exit."""
    path, current = get_blocks(model)
    original = list(current)
    config = text_config(model)
    names = [arch_spec(model).layer_count, *remapped_config_entries(config, range(len(original)), len(original))]
    saved_text = {n: copy.deepcopy(getattr(config, n, _ABSENT)) for n in names}
    saved_config = {n: getattr(model.config, n, _ABSENT) for n in (LAYOUT_ATTR, RECORDS_ATTR)}
    owners = {id(m): m for block in [*original, *blocks] for m in _layer_index_owners(block)}
    saved_index = [(m, m.layer_idx) for m in owners.values()]
    try:
        set_blocks_(model, blocks, sources, layout)
        yield
    finally:
        model.set_submodule(path, nn.ModuleList(original))
        for target, saved in ((config, saved_text), (model.config, saved_config)):
            for name, value in saved.items():
                if value is _ABSENT:
                    if hasattr(target, name):
                        delattr(target, name)
                else:
                    setattr(target, name, value)
        for owner, index in saved_index:
            owner.layer_idx = index


@contextmanager
def blocks_removed(model: nn.Module, indices: Sequence[int]) -> Iterator[list[int]]:
    """Temporarily remove blocks; everything (modules, indices, config) is restored on exit."""
    _, blocks = get_blocks(model)
    dropped = check_block_indices(indices, len(blocks))
    kept = [i for i in range(len(blocks)) if i not in dropped]
    layout = block_layout(model)
    with blocks_replaced(model, [blocks[i] for i in kept], kept, [layout[i] for i in kept]):
        yield kept
