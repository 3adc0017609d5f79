"""Save and load layercut checkpoints, vanilla or with replacement maps.

A checkpoint is always a ``save_pretrained`` folder of the kept blocks (plus tokenizer,
``layercut.json`` and a model card); the layout and replacement records live in its config. A vanilla
one (no maps) is a plain transformers checkpoint. The maps of methods that are not vanilla
(``linear``, ``lowrank``) are not part of any transformers architecture, so they go next to it in
``replacements.safetensors`` (tensors plus, in the file's metadata, where each map sits and its
method's ``spec``), and the folder follows the Hugging Face convention for custom layers so that it
never loads silently as another model: ``config.json`` becomes a ``model_type: "layercut"`` config
wrapping the model's own (``base_config``, stored so that no transformers config class adopts it) with an
``auto_map`` to the ``modeling_layercut.py`` it carries (a copy of :mod:`prune.model.remote_code`). Plain
``AutoModelForCausalLM.from_pretrained`` and the concrete classes (``LlamaForCausalLM``) refuse it; with
``trust_remote_code=True`` it loads the model with its maps, and :func:`load` does the same without
remote code. Its ``layercut.json`` and model card say that serving engines cannot run it, and what can.
The registry (``prune.replace.METHODS``) says how each method's maps are described and rebuilt.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from torch import nn

from prune.atomic import atomic_directory
from prune.checkpoint.decilm_config import decilm_config, decilm_serving, sublayer_refusal
from prune.checkpoint.report import read_report, upgrade_records
from prune.checkpoint.write import write_checkpoint
from prune.errors import LayercutError
from prune.loading.loader import LoadedModel, check_safetensors, damaged, load_model
from prune.model import remote_code as hf_remote_code
from prune.model.adapters import get_blocks
from prune.model.layouts import DECILM, LAYERCUT, VANILLA, serving_entry
from prune.model.surgery import RECORDS_ATTR, block_layout, replacement_records
from prune.replace import METHODS, ReplacedBlock, method_for_module

logger = logging.getLogger(__name__)

REPLACEMENTS_FILE = hf_remote_code.MAPS_FILE
_METADATA_KEY = hf_remote_code.MAPS_METADATA_KEY
_SIDES = hf_remote_code.SIDES


def _map_spec(module: nn.Module) -> dict:
    """What ``replacements.safetensors`` records of a map: its method's name (``type``) and shape."""
    method = method_for_module(module)
    return {"type": method.name, **method.spec(module)}


def _build_map(spec: dict) -> nn.Module:
    """An untrained map of the shape ``spec`` records (its weights are loaded after)."""
    method = METHODS[spec["type"]] if spec["type"] in METHODS else None
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
    from safetensors.torch import save_file

    tensors, specs = {}, {}
    for name, module in maps.items():
        specs[name] = _map_spec(module)
        for key, value in module.state_dict().items():
            tensors[f"{name}.{key}"] = value.detach().cpu().contiguous()
    save_file(tensors, str(path), metadata={"format": "pt", _METADATA_KEY: json.dumps(specs)})


def _write_remote_code(staging: Path, blocks_path: str) -> None:
    """Make a folder with maps self-describing: wrapped ``config.json`` and the modeling file it names."""
    config_file = staging / "config.json"
    base = json.loads(config_file.read_text(encoding="utf-8"))
    wrapped = hf_remote_code.wrap_config_dict(base, blocks_path)
    config_file.write_text(json.dumps(wrapped, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    shutil.copyfile(hf_remote_code.__file__, staging / hf_remote_code.MODELING_FILE)


# layercut.json of a checkpoint that only layercut and trust_remote_code load: what serves, and what to export instead
SERVING = serving_entry(LAYERCUT)


def serving_report(model: nn.Module, maps: bool) -> dict:
    """``layercut.json``'s ``serving`` entry for ``model``: vanilla, DeciLM layout (sub-layers) or layercut (maps)."""
    if maps:
        return serving_entry(LAYERCUT)
    config = model.config.to_dict()
    records = hf_remote_code.sublayer_records(config)
    if records:
        refusal = sublayer_refusal(config)
        if refusal is not None:  # the DeciLM layout cannot hold them: whole blocks are what ships
            return serving_entry(LAYERCUT, instead="--unit block (whole blocks: a plain checkpoint)",
                                 why=f"removed sub-layers outside the DeciLM layout: {refusal}")
        # as prune.checkpoint.gguf writes it for llama.cpp: removed MLPs as zero MLPs
        # (llama.cpp skips an FFN-free layer)
        entry = decilm_serving(decilm_config(config, records, zero_mlps=True))
        entry["export"] = serving_entry(DECILM)["export"]
        return entry
    return serving_entry(VANILLA)


def save(model: nn.Module, tokenizer, out: str | Path, report: dict, overwrite: bool = False,
         extra: Callable[[Path], None] | None = None) -> Path:
    """Write ``model`` (vanilla or with replacement maps) and ``tokenizer`` to ``out`` atomically.

    A model without maps gives a plain transformers checkpoint. With maps, the folder also holds
    ``replacements.safetensors`` and ``modeling_layercut.py``, and its ``config.json`` wraps the
    model's config (``model_type: "layercut"``): see the module docstring. :func:`write_model` into a
    staging folder, then one rename; layercut's own writers with more files own the staging folder and call
    :func:`write_model` and their writers in turn.

    Args:
        model: a (surgered) model; its ``ReplacedBlock`` maps go to ``replacements.safetensors``.
        tokenizer: its tokenizer.
        out: destination folder.
        report: JSON-ready dict for ``layercut.json``; ``replacements`` and ``layout`` are filled in
            from the model when absent.
        overwrite: replace a non-empty ``out``.
        extra: optional callable ``(staging_folder) -> None`` writing more files (``prune.save``'s own
            argument, kept for its callers).
    """
    with atomic_directory(out, overwrite) as staging:
        write_model(staging, model, tokenizer, out, report)
        if extra is not None:
            extra(staging)
    return Path(out)


def write_model(staging: Path, model: nn.Module, tokenizer, out: str | Path, report: dict) -> dict:
    """Write ``model`` and ``tokenizer`` into ``staging`` (to be renamed ``out``): weights, maps, code, report, card.

    Returns the report as written (``layercut.json``).
    """
    report = dict(report)
    report.setdefault("replacements", replacement_records(model))
    report.setdefault("layout", block_layout(model))
    blocks_path = get_blocks(model)[0]
    sublayers = len(hf_remote_code.sublayer_records(model.config))
    with vanilla_blocks(model) as maps:
        report["serving"] = serving_report(model, bool(maps))
        plain = not maps and not sublayers
        remote = (bool(maps), sublayers) if maps or sublayers else None
        written = write_checkpoint(staging, model, tokenizer, out, report, plain=plain, remote=remote)
        if maps:
            _write_maps(maps, staging / REPLACEMENTS_FILE)
        if maps or sublayers:
            _write_remote_code(staging, blocks_path)
    return written


def attach_maps_(model: nn.Module, path: str | Path) -> int:
    """Wrap the blocks named in a ``replacements.safetensors`` file with their maps; returns how many maps.

    The code is the one a checkpoint carries for ``trust_remote_code``; maps are built by the registry.

    Raises:
        LayercutError: the file is cut short or damaged (one line naming it), or names blocks the model lacks.
    """
    from safetensors import SafetensorError

    path = Path(path)
    check_safetensors(path)
    try:
        return hf_remote_code.attach_maps(model, str(path), get_blocks(model)[0], build=_build_map)
    except LayercutError:
        raise
    except json.JSONDecodeError as err:  # metadata that is not the specs layercut wrote
        raise damaged(path, f"its map specs are not JSON: {err.msg}") from None
    except ValueError as err:  # maps naming blocks the model lacks: the folder's files do not belong together
        raise LayercutError(str(err)) from None
    except (SafetensorError, RuntimeError, KeyError, TypeError) as err:  # tensors that do not fit their specs
        raise damaged(path, f"unreadable maps: {type(err).__name__}: {str(err).splitlines()[0]}") from None


def _maps_needed(model: nn.Module) -> list[str]:
    """The methods of the model's replacement records whose maps live in ``replacements.safetensors``."""
    methods = [r["method"] for r in replacement_records(model)]
    return [m for m in methods if m in METHODS and not METHODS[m].servable]


def _maps_file(path: str | Path, source: str, fetch: bool) -> Path | None:
    """The checkpoint's ``replacements.safetensors``: in its folder, or (``fetch``) from the hub repo it came from."""
    folder = Path(str(path)).expanduser()
    if folder.is_dir():
        file = folder / REPLACEMENTS_FILE
        return file if file.is_file() else None
    if not fetch or Path(source).exists():
        return None
    from transformers.utils import cached_file

    try:
        found = cached_file(source, REPLACEMENTS_FILE)
    except OSError:
        return None
    return Path(found) if found else None


def load(path: str | Path, **load_model_kwargs) -> LoadedModel:
    """Load a layercut checkpoint with its replacement maps, or any model ``load_model`` takes.

    Needs no remote code: the maps are rebuilt with layercut's own modules (``prune.replace``), so
    ``--train replacements`` and the reports find them. Checkpoints written before the maps' folders
    carried a wrapped config (their ``config.json`` is the base model's) load the same way.

    Args:
        path: a folder written by :func:`save` / ``prune.run`` (vanilla or with maps), or any alias,
            hub id, folder or ``.gguf`` file that ``prune.loading.loader.load_model`` loads.
        **load_model_kwargs: passed to ``prune.loading.loader.load_model`` as they are (``dtype``, ``device``,
            ``load_in_4bit``, ``load_in_8bit``, ``tokenizer``, ...).
    """
    read_report(path)  # a damaged or newer layercut.json is a one-line error now, not in the tool that reads it later
    loaded = load_model(str(path), allow_maps=True, **load_model_kwargs)
    records = replacement_records(loaded.model)
    if records:  # config.json has no format number: its records are read as the report's are
        setattr(loaded.model.config, RECORDS_ATTR, upgrade_records(records))
    records = hf_remote_code.sublayer_records(loaded.model.config)
    if records:
        try:
            hf_remote_code.remove_sublayers(loaded.model, records, get_blocks(loaded.model)[0])
        except ValueError as err:
            raise LayercutError(str(err)) from None
        logger.info("removed %d attention/MLP sub-layer(s) as the checkpoint records", len(records))
    needing = _maps_needed(loaded.model)
    maps_file = _maps_file(path, loaded.source, fetch=bool(needing))
    if maps_file is not None:
        count = attach_maps_(loaded.model, maps_file)
        logger.info("attached %d replacement map(s) from %s", count, maps_file)
    elif needing:
        raise LayercutError(
            f"{path} records {needing[0]} replacements but has no {REPLACEMENTS_FILE}: copy that file "
            "next to config.json (or re-export the checkpoint)"
        )
    return loaded
