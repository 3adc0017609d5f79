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

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn

from prune.adapters import PER_LAYER_CONFIG_LISTS, arch_spec, get_blocks
from prune.errors import LayercutError

LAYOUT_ATTR = "layercut_layout"
RECORDS_ATTR = "layercut_replacements"
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
            by hand, not through ``prune.surgery``).
    """
    _, blocks = get_blocks(model)
    layout = getattr(model.config, LAYOUT_ATTR, None)
    if layout is None:
        return [[i] for i in range(len(blocks))]
    if len(layout) != len(blocks):
        raise LayercutError(
            f"config.{LAYOUT_ATTR} has {len(layout)} entries but the model has {len(blocks)} blocks: blocks were "
            f"removed without prune.surgery; delete config.{LAYOUT_ATTR} or use prune.surgery.drop_blocks_"
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


def _per_layer_lists(model: nn.Module, num_blocks: int) -> dict[str, list]:
    lists = {}
    for name in PER_LAYER_CONFIG_LISTS:
        values = getattr(model.config, name, None)
        if isinstance(values, (list, tuple)) and len(values) == num_blocks:
            lists[name] = list(values)
    return lists


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
    lists = _per_layer_lists(model, len(current))
    model.set_submodule(path, nn.ModuleList(blocks))
    for position, block in enumerate(blocks):
        for owner in _layer_index_owners(block):
            owner.layer_idx = position
    setattr(model.config, arch_spec(model).layer_count, len(blocks))
    for name, values in lists.items():
        setattr(model.config, name, [values[i] for i in sources])
    layout = [sorted(int(i) for i in entry) for entry in layout]
    setattr(model.config, LAYOUT_ATTR, layout)
    # a replacement whose host block is gone went with it
    records = [r for r in replacement_records(model) if host_position(layout, r["replaces"]) is not None]
    setattr(model.config, RECORDS_ATTR, records)


def drop_blocks_(model: nn.Module, indices: Sequence[int]) -> list[int]:
    """Remove blocks ``indices`` (0-based, current numbering) in place; returns the kept indices."""
    _, blocks = get_blocks(model)
    dropped = check_block_indices(indices, len(blocks))
    kept = [i for i in range(len(blocks)) if i not in dropped]
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
    config_names = [arch_spec(model).layer_count, *PER_LAYER_CONFIG_LISTS, LAYOUT_ATTR, RECORDS_ATTR]
    saved_config = {n: getattr(model.config, n, _ABSENT) for n in config_names}
    owners = {id(m): m for block in [*original, *blocks] for m in _layer_index_owners(block)}
    saved_index = [(m, m.layer_idx) for m in owners.values()]
    try:
        set_blocks_(model, blocks, sources, layout)
        yield
    finally:
        model.set_submodule(path, nn.ModuleList(original))
        for name, value in saved_config.items():
            if value is _ABSENT:
                if hasattr(model.config, name):
                    delattr(model.config, name)
            else:
                setattr(model.config, name, value)
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
