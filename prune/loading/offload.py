"""Models too large for memory: a skeleton whose blocks stay in the checkpoint until a pass needs them.

:func:`load_offloaded` builds the model on the meta device (``accelerate.init_empty_weights``), reads
the few tensors outside the blocks (embeddings, final norm, an untied LM head) and leaves every block to
:class:`CheckpointBlocks`. :func:`write_offloaded` exports a surgered skeleton by copying each
kept tensor from the source checkpoint under its new name, one output shard at a time in CPU memory: removing
blocks never needs the whole model in memory. A repair that rewrites block weights (a fold, a compensation)
registers the change with :func:`rewrite_tensors`; passes and the export read the tensor through it.
Under :func:`streamed` the skeleton runs whole forward passes, each block read as it is called (what a
selection that measures perplexity needs), and :func:`materialized` copies one block into memory (what a
repair that trains a block needs).
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from prune.errors import LayercutError
from prune.loading.loader import LoadedModel
from prune.model.adapters import OFFLOAD_ATTR, get_blocks

logger = logging.getLogger(__name__)

# a shard of the exported checkpoint holds about this many bytes (transformers' default is 5 GB too)
SHARD_BYTES = 5 * 1024**3

# every module inside a skeleton's blocks -> (its CheckpointBlocks, the checkpoint name of its tensors' prefix)
_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _local_folder(name: str, checkpoint: str) -> Path:
    """The local folder holding ``checkpoint``'s safetensors: a folder as given, a hub id's snapshot."""
    folder = Path(checkpoint).expanduser()
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(checkpoint, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as err:  # noqa: BLE001 - any hub failure is the same one-line fix
        raise LayercutError(f"{name}: --offload sequential reads the checkpoint's safetensors and could not fetch "
                            f"them ({type(err).__name__}): download the model to a folder and pass that") from None


def _dtype(dtype: str, config) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    # transformers >= 4.56 reads a config.json's torch_dtype into dtype; asking torch_dtype only logs a deprecation
    stored = getattr(config, "dtype", None)
    return getattr(torch, stored) if isinstance(stored, str) else stored or torch.float32


def load_offloaded(name: str, *, dtype: str = "auto", device: str = "cpu", tokenizer: str | None = None,
                   load_in_4bit: bool = False, load_in_8bit: bool = False) -> LoadedModel:
    """``name`` as a skeleton: every tensor outside the blocks loaded, every block's left in the checkpoint.

    Args:
        name: alias, hub id, checkpoint folder or ``.gguf`` file (as ``prune.loading.loader.load_model``).
        dtype: the weights' dtype ("auto": the checkpoint's).
        device: where the non-block tensors live and each block runs ("cpu", "cuda", "cuda:N").
        tokenizer: the tokenizer to use instead of the checkpoint's.
        load_in_4bit: refused (a block is read in ``dtype``); taken so the caller's options pass through.
        load_in_8bit: refused, as ``load_in_4bit``.

    Raises:
        LayercutError: quantized loading or a device map asked for, or no safetensors to read.
    """
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from transformers import AutoModelForCausalLM

    from prune.loading.loader import _finish_model, _open_config, check_block_count, load_tokenizer, resolve_model_name

    if load_in_4bit or load_in_8bit or device == "auto":
        raise LayercutError("--offload sequential runs one block at a time on one device, in --dtype: drop "
                            "--load-in-4bit/--load-in-8bit and pass --device cpu or cuda[:N]")
    resolved = resolve_model_name(name)
    checkpoint, config = _open_config(name, resolved, allow_maps=False)
    folder = _local_folder(name, checkpoint)
    check_block_count(folder, config)
    torch_dtype = _dtype(dtype, config)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    blocks = CheckpointBlocks(folder, model, torch_dtype, device)
    for key, _ in _outside_blocks(model, blocks.prefix):
        set_module_tensor_to_device(model, key, device, value=blocks.read(key))
    if getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        model.tie_weights()
    setattr(model, OFFLOAD_ATTR, blocks)
    tok = load_tokenizer(tokenizer or checkpoint)
    _finish_model(model, tok)
    logger.info("loaded %s as a skeleton from %s: its blocks are read from there one at a time", name, folder)
    return LoadedModel(model=model, tokenizer=tok, name=name, source=resolved)


def _tied_keys(model: nn.Module) -> set[str]:
    """The tensors a tied model shares with another and a checkpoint does not hold (its LM head)."""
    if not getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        return set()
    return set(getattr(model, "_tied_weights_keys", None) or ())


def _outside_blocks(model: nn.Module, prefix: str) -> list[tuple[str, torch.Tensor]]:
    """The persistent meta tensors of ``model`` outside its blocks, tied ones left to ``tie_weights``."""
    persistent = set(model.state_dict(keep_vars=True)) - _tied_keys(model)
    seen: set[int] = set()
    found = []
    for key, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if key.startswith(prefix + ".") or not tensor.is_meta or key not in persistent or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        found.append((key, tensor))
    return found


def write_offloaded(model: nn.Module, folder: Path) -> None:
    """Write a (surgered) skeleton's checkpoint into ``folder``: its config and every tensor, copied across.

    Each block's tensors are read under the index the block had in the source and written under its
    index now, with the changes repairs made to it (:func:`rewrite_tensors`); everything else keeps its
    name and is written from memory, where the skeleton holds it (as loaded, or as a repair changed it:
    fold-rotate's turned embedding, the LM head it unties). Shards of about :data:`SHARD_BYTES` and their
    index, as ``save_pretrained`` writes them.
    """
    from safetensors.torch import save_file

    blocks: CheckpointBlocks = getattr(model, OFFLOAD_ATTR)
    names = _export_names(model, blocks)
    tensors = model.state_dict(keep_vars=True)
    shards: list[dict[str, str]] = [{}]
    size = 0
    for target, source in names.items():
        bytes_ = tensors[target].numel() * tensors[target].element_size()
        if shards[-1] and size + bytes_ > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][target] = source
        size += bytes_
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))] \
        if len(shards) > 1 else ["model.safetensors"]
    for file, shard in zip(files, shards, strict=True):
        # contiguous copies: a tensor read from a file may share storage with nothing else
        read = blocks.read_many([s for t, s in shard.items() if tensors[t].is_meta], device="cpu")  # never the GPU
        save_file({t: (read[s] if tensors[t].is_meta else tensors[t].detach().cpu()).contiguous()
                   for t, s in shard.items()}, folder / file, metadata={"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {}, "weight_map": {t: f for f, shard in zip(files, shards, strict=True) for t in shard}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    # as save_pretrained writes it: llama.cpp's converter and vLLM pick the model class by this name, and a source
    # config written without it (a config-only folder) would otherwise ship a checkpoint they refuse
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)


def _export_names(model: nn.Module, blocks: CheckpointBlocks) -> dict[str, str]:
    """Every tensor the export writes: its name now -> its name in the source checkpoint."""
    from prune.model.adapters import get_blocks

    prefix, modules = get_blocks(model)
    names: dict[str, str] = {}
    skip = _tied_keys(model)
    for key in model.state_dict(keep_vars=True):
        if key in skip:
            continue
        if not key.startswith(prefix + "."):
            names[key] = key
            continue
        index, rest = key[len(prefix) + 1:].split(".", 1)
        names[key] = blocks.source_name(modules[int(index)], int(index), rest)
    return names


class CheckpointBlocks:
    """Reads a skeleton model's block weights from its checkpoint's safetensors, one block at a time.

    Args:
        folder: the checkpoint folder (``model.safetensors`` or shards with ``model.safetensors.index.json``).
        model: the skeleton (blocks on the meta device); its blocks' positions are recorded now, so a
            surgered skeleton still finds each block's tensors under the index it had in the checkpoint.
        dtype: the dtype the weights are cast to.
        device: where a loaded block runs.
    """

    def __init__(self, folder: str | Path, model: nn.Module, dtype: torch.dtype, device: torch.device | str):
        self.folder, self.dtype, self.device = Path(folder), dtype, torch.device(device)
        self.files = weight_files(self.folder)
        self.prefix, blocks = get_blocks(model)
        self.originals = list(blocks)  # the checkpoint's blocks, whatever list a surgery puts them in later
        self.origin = {id(block): index for index, block in enumerate(blocks)}
        self.base_prefix = getattr(model, "base_model_prefix", "") or ""
        # checkpoint name -> the changes a repair made to that tensor (rewrite_tensors), applied on every read
        self.changes: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {}
        for index, block in enumerate(blocks):
            for path, module in block.named_modules():
                _SOURCES[module] = (self, f"{self.prefix}.{index}" + (f".{path}" if path else ""))

    def key(self, name: str) -> str:
        """The checkpoint's name for the model's tensor ``name`` (some checkpoints omit the base prefix)."""
        if name in self.files:
            return name
        short = name.removeprefix(self.base_prefix + ".")
        if short in self.files:
            return short
        raise LayercutError(f"{self.folder}: no tensor {name} in its safetensors (the model renames or fuses "
                            "weights when it loads): score it with --offload none")

    def read(self, name: str, device: torch.device | str | None = None) -> torch.Tensor:
        """The checkpoint's tensor for the model's ``name``, in the run's dtype, on ``device`` (the run's)."""
        return self.read_many([name], device)[name]

    def read_many(self, names: list[str], device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors for the model's ``names``, each file opened once (its header parsed once).

        A tensor a repair changed (:func:`rewrite_tensors`) is returned changed.
        """
        from safetensors import safe_open

        keys = {name: self.key(name) for name in names}
        by_file: dict[str, list[str]] = {}
        for name, key in keys.items():
            by_file.setdefault(self.files[key], []).append(name)
        found = {}
        for file, wanted in by_file.items():
            with safe_open(self.folder / file, framework="pt", device="cpu") as handle:
                for name in wanted:
                    tensor = handle.get_tensor(keys[name])
                    found[name] = tensor.to(device=device or self.device,
                                            dtype=self.dtype if tensor.is_floating_point() else tensor.dtype)
                    for change in self.changes.get(name, ()):
                        found[name] = change(found[name])
        return found

    def source_name(self, block: nn.Module, index: int, name: str) -> str:
        """The model's name, in the checkpoint, of tensor ``name`` of ``block`` (now at ``index``)."""
        return f"{self.prefix}.{self.origin.get(id(block), index)}.{name}"

    @contextmanager
    def loaded(self, index: int, block: nn.Module) -> Iterator[nn.Module]:
        """``block`` with its weights read in, put back on the meta device on exit (even on error)."""
        names = []
        try:
            names = self._read_in(index, block)
            yield block
        finally:
            _to_meta(block, names)

    def _read_in(self, index: int, block: nn.Module) -> list[str]:
        """Read ``block``'s meta tensors in (through the repairs' changes); their names, for :func:`_to_meta`."""
        from accelerate.utils import set_module_tensor_to_device

        names = [name for name, _ in _meta_tensors(block)]
        values = self.read_many([self.source_name(block, index, name) for name in names])
        for name in names:
            value = values.pop(self.source_name(block, index, name))
            set_module_tensor_to_device(block, name, self.device, value=value)
        return names

    @contextmanager
    def streamed(self) -> Iterator[None]:
        """The skeleton's own forward runs: each block reads its weights as it is called and drops them after.

        For what runs whole forward passes (a selection measuring perplexity, a model with some blocks removed
        and repaired): the block objects are hooked, so a surgered list of them (a removal, a wrapper holding
        a map) streams too, and a repair's changes are read with each block. One block is in memory at a
        time: a block whose forward was cut short (a pass stopped at a state) goes when the next one loads. A
        block already in memory (a block-by-block pass loaded it) is left as it is.
        """
        held: dict[nn.Module, list[str]] = {}

        def drop_all() -> None:
            for block, names in list(held.items()):
                _to_meta(block, names)
                del held[block]

        def enter(index: int):
            def read_in(block, _args, _kwargs):
                if block not in held and _meta_tensors(block):
                    drop_all()
                    held[block] = self._read_in(index, block)
            return read_in

        def leave(block, _args, _kwargs, _output):
            if block in held:
                _to_meta(block, held.pop(block))

        handles = []
        try:
            for index, block in enumerate(self.originals):
                handles.append(block.register_forward_pre_hook(enter(index), with_kwargs=True))
                handles.append(block.register_forward_hook(leave, with_kwargs=True))
            yield
        finally:
            for handle in handles:
                handle.remove()
            drop_all()


def _to_meta(block: nn.Module, names: list[str]) -> None:
    from accelerate.utils import set_module_tensor_to_device

    for name in names:
        set_module_tensor_to_device(block, name, "meta")


@contextmanager
def streamed(model: nn.Module | None) -> Iterator[None]:
    """Whole forward passes of ``model``: a skeleton's blocks stream (:meth:`CheckpointBlocks.streamed`); else as is."""
    blocks = getattr(model, OFFLOAD_ATTR, None)
    if blocks is None:
        yield
        return
    with blocks.streamed():
        yield


def materialized(module: nn.Module) -> nn.Module:
    """A copy of ``module`` in memory: a skeleton block's tensors read from its checkpoint (with the changes made)."""
    import copy

    copied = copy.deepcopy(module)
    for name, tensor in _meta_tensors(module):
        path, _, attr = name.rpartition(".")
        value = current_tensor(module.get_submodule(path), attr)
        if isinstance(tensor, nn.Parameter):
            value = nn.Parameter(value, requires_grad=tensor.requires_grad)
        setattr(copied.get_submodule(path), attr, value)
    return copied


def rewrite_tensors(changes: Iterable[tuple[nn.Module, str, Callable[[torch.Tensor], torch.Tensor]]]
                    ) -> Callable[[], None]:
    """Change tensors of modules inside a skeleton's blocks wherever they are read next; returns the undo.

    A skeleton holds no block weights to overwrite, so a repair that rewrites some (a fold's projection,
    a compensation's scaled writers) registers ``(module, attribute, change)`` triples instead, ``change``
    taking the tensor as read to the new one: every later pass that loads the block, and the export, read
    the tensor through it. Changes of one tensor compose in the order they were made; the undo takes these
    back.
    """
    made = []
    for module, attr, change in changes:
        owner, prefix = _owner(module)
        name = f"{prefix}.{attr}"
        owner.changes.setdefault(name, []).append(change)
        made.append((owner, name, change))

    def undo() -> None:
        for owner, name, change in reversed(made):
            known = owner.changes.get(name, [])
            owner.changes[name] = [c for c in known if c is not change]
            if not owner.changes[name]:
                del owner.changes[name]

    return undo


def current_tensor(module: nn.Module, attr: str) -> torch.Tensor:
    """``module``'s tensor ``attr`` as a pass sees it: itself, or for a skeleton's block, read with its changes."""
    tensor = getattr(module, attr)
    if tensor is None or not tensor.is_meta:
        return tensor
    owner, prefix = _owner(module)
    return owner.read(f"{prefix}.{attr}")


def _owner(module: nn.Module) -> tuple[CheckpointBlocks, str]:
    try:
        return _SOURCES[module]
    except KeyError:
        raise ValueError(f"{type(module).__name__} is not part of a skeleton's blocks") from None


def _meta_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, t) for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]


def weight_files(folder: Path) -> dict[str, str]:
    """Tensor name -> safetensors file name, from the shard index or the single file's header."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    single = folder / "model.safetensors"
    if not single.is_file():
        raise LayercutError(f"{folder}: --offload sequential reads the weights from safetensors files and found "
                            "none: convert the checkpoint to safetensors or use --offload none")
    with safe_open(single, framework="pt", device="cpu") as handle:
        return dict.fromkeys(handle.keys(), single.name)
