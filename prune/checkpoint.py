"""Save and load layercut checkpoints, vanilla or with replacement maps.

A checkpoint is always a vanilla ``save_pretrained`` folder of the kept blocks (plus tokenizer,
``layercut.json`` and a model card). The maps of methods that are not vanilla (``linear``,
``lowrank``) are not part of any transformers architecture, so they go next to it in
``replacements.safetensors`` (tensors plus, in the file's metadata, where each map sits and its
method's ``spec``); the layout and replacement records live in ``config.json``. The registry
(``prune.replace.METHODS``) says how each method's maps are described and rebuilt.
``load`` rebuilds the maps; plain ``AutoModelForCausalLM.from_pretrained`` on such a folder gives the
model without its maps (blocks removed), which the model card says.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from prune.adapters import get_blocks
from prune.errors import LayercutError
from prune.export import export_checkpoint
from prune.loading import LoadedModel, load_model
from prune.replace import METHODS, ReplacedBlock, method_for_module, record_method
from prune.surgery import block_layout, replacement_records

logger = logging.getLogger(__name__)

REPLACEMENTS_FILE = "replacements.safetensors"
_METADATA_KEY = "layercut_maps"
_SIDES = ("before", "after")


def _map_spec(module: nn.Module) -> dict:
    """What ``replacements.safetensors`` records of a map: its method's name (``type``) and shape."""
    method = method_for_module(module)
    return {"type": method.name, **method.spec(module)}


def _build_map(spec: dict) -> nn.Module:
    """An untrained map of the shape ``spec`` records (its weights are loaded after)."""
    method = METHODS.get(spec["type"])
    if method is None or method.build is None:
        raise LayercutError(f"{REPLACEMENTS_FILE} holds a map of unknown type '{spec['type']}': update layercut")
    return method.build(spec)


@contextmanager
def vanilla_blocks(model: nn.Module) -> Iterator[dict[str, nn.Module]]:
    """Swap every :class:`ReplacedBlock` for its inner block while inside; yields the maps by name.

    Names are ``"<position>.<before|after>"``. The model is a plain transformers model inside the
    ``with`` (what ``save_pretrained`` writes) and gets its wrappers back on exit, even on error.
    """
    path, blocks = get_blocks(model)
    original = list(blocks)
    maps = {}
    for position, block in enumerate(original):
        if isinstance(block, ReplacedBlock):
            maps.update({f"{position}.{side}": getattr(block, side) for side in _SIDES if getattr(block, side)})
    try:
        if maps:
            model.set_submodule(path, nn.ModuleList([b.block if isinstance(b, ReplacedBlock) else b for b in original]))
        yield maps
    finally:
        model.set_submodule(path, nn.ModuleList(original))


def _write_maps(maps: dict[str, nn.Module], path: Path) -> None:
    tensors, specs = {}, {}
    for name, module in maps.items():
        specs[name] = _map_spec(module)
        for key, value in module.state_dict().items():
            tensors[f"{name}.{key}"] = value.detach().cpu().contiguous()
    save_file(tensors, str(path), metadata={"format": "pt", _METADATA_KEY: json.dumps(specs)})


_CARD_NOTE = """
## Loading

This checkpoint carries replacement maps for the removed blocks in `{file}`: load it with

```python
import prune
loaded = prune.load("{name}")   # loaded.model, loaded.tokenizer
```

Plain `AutoModelForCausalLM.from_pretrained` loads the kept blocks without the maps (plain removal).
"""


def save(model: nn.Module, tokenizer, out: str | Path, report: dict, overwrite: bool = False,
         extra: Callable[[Path], None] | None = None) -> Path:
    """Write ``model`` (vanilla or with replacement maps) and ``tokenizer`` to ``out`` atomically.

    Args:
        model: a (surgered) model; its ``ReplacedBlock`` maps go to ``replacements.safetensors``.
        tokenizer: its tokenizer.
        out: destination folder.
        report: JSON-ready dict for ``layercut.json``; ``replacements`` and ``layout`` are filled in
            from the model when absent.
        overwrite: replace a non-empty ``out``.
        extra: optional callable ``(staging_folder) -> None`` writing more files.
    """
    report = dict(report)
    report.setdefault("replacements", replacement_records(model))
    report.setdefault("layout", block_layout(model))
    with vanilla_blocks(model) as maps:

        def write_extra(staging: Path) -> None:
            if maps:
                _write_maps(maps, staging / REPLACEMENTS_FILE)
                card = staging / "README.md"
                note = _CARD_NOTE.format(file=REPLACEMENTS_FILE, name=Path(out).name)
                card.write_text(card.read_text(encoding="utf-8") + note, encoding="utf-8")
            if extra is not None:
                extra(staging)

        return export_checkpoint(model, tokenizer, out, report, overwrite, write_extra)


def attach_maps_(model: nn.Module, path: str | Path) -> int:
    """Wrap the blocks named in a ``replacements.safetensors`` file with their maps; returns how many maps."""
    with safe_open(str(path), framework="pt") as handle:
        specs = json.loads((handle.metadata() or {}).get(_METADATA_KEY, "{}"))
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    blocks_path, blocks = get_blocks(model)
    wrapped = list(blocks)
    for name, spec in specs.items():
        position_text, side = name.split(".")
        position = int(position_text)
        if not 0 <= position < len(wrapped) or side not in _SIDES:
            raise LayercutError(f"{path} names block {name} but the model has {len(wrapped)} blocks: mismatched files")
        host = wrapped[position]
        param = next(host.parameters())
        module = _build_map(spec)
        state = {key[len(name) + 1 :]: value for key, value in tensors.items() if key.startswith(name + ".")}
        module.load_state_dict(state)
        module.to(device=param.device, dtype=param.dtype).eval()
        if not isinstance(host, ReplacedBlock):
            host = ReplacedBlock(host)
        setattr(host, side, module)
        wrapped[position] = host
    model.set_submodule(blocks_path, nn.ModuleList(wrapped))
    return len(specs)


def load(path: str | Path, **load_model_kwargs) -> LoadedModel:
    """Load a layercut checkpoint with its replacement maps, or any model ``load_model`` takes.

    Args:
        path: a folder written by :func:`save` / ``prune.run`` (vanilla or with maps), or any alias,
            hub id, folder or ``.gguf`` file that ``prune.loading.load_model`` loads.
        **load_model_kwargs: passed to ``prune.loading.load_model`` as they are (``dtype``, ``device``,
            ``load_in_4bit``, ``load_in_8bit``, ``tokenizer``, ...).
    """
    loaded = load_model(str(path), **load_model_kwargs)
    folder = Path(str(path)).expanduser()
    maps_file = folder / REPLACEMENTS_FILE
    if folder.is_dir() and maps_file.is_file():
        count = attach_maps_(loaded.model, maps_file)
        logger.info("attached %d replacement map(s) from %s", count, maps_file)
    else:
        # records name their method under "method" ("kind" in checkpoints written before the rename)
        methods = [record_method(r) for r in replacement_records(loaded.model)]
        needing = [m for m in methods if m in METHODS and not METHODS[m].vanilla]
        if needing:
            raise LayercutError(
                f"{path} records {needing[0]} replacements but has no {REPLACEMENTS_FILE}: copy that file "
                "next to config.json (or re-export the checkpoint)"
            )
    return loaded
