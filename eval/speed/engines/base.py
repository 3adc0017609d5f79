"""What every serving engine shares: the :class:`Engine` base, its settings, its loaded model, the registry.

An engine is one module of :mod:`eval.speed.engines` (``transformers.py``, ``llamacpp.py``, ``vllm.py``)
whose ``ENGINE`` is an :class:`Engine`. The package registers each module lazily, as the string
``"eval.speed.engines.<name>:ENGINE"`` under the module's name (lm-eval's lazy registry), so a module is
imported when its engine is first named and the engine's own package (``llama_cpp``, ``vllm``) when it
loads a model. Each engine declares:

* ``name``: its ``--engine`` value, the name of its module (``llamacpp``); ``display`` is how text
  names it (``llama.cpp``);
* ``module``, ``distribution`` and ``extra``: its package, the package's PyPI name and layercut's extra
  that installs it (``pip install 'layercut[llamacpp]'``, from ``[project.optional-dependencies]``);
* ``layouts``: the checkpoint layouts it serves as they ship (``prune.model.layouts``); a checkpoint's
  ``serving`` entry may still name it under ``why_not`` (:meth:`Engine.refusal`);
* ``options``: its own settings, a subclass of :class:`EngineOptions` whose fields (made by
  :func:`setting`) are its ``eval.bench`` flags (:func:`add_setting_arguments`).

Settings every engine reads (loading, threads, context, how many models share the machine) are the
fields of :class:`EngineSettings`; each engine's own are in its ``engines`` mapping.

Which engines run a checkpoint is this registry's answer, never a list kept elsewhere: :func:`engines_for` and
:func:`serves_label` (``eval.compare``'s "serves" column, ``eval.bench serving``), ``Engine.refusal`` (the
engines' checks), and the ``--engine`` choices of ``eval.bench``, ``eval.compare`` and ``prune.ship``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
from collections.abc import Callable, Mapping
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from prune.checkpoint.load_config import LoadConfig
from prune.errors import LayercutError
from prune.model.adapters import num_blocks
from prune.registry import Registry

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
GGUF_EXPORT_FOLDER = "gguf-export"  # under prune.loading.gguf.cache_dir(): engines' copies of checkpoint folders
REFERENCE = "transformers"  # the engine the others are compared with, and the default --engine

# ---- an engine's own settings ----

# The key of a setting's SettingSpec in its field's metadata.
SETTING_KEY = "layercut_engine_setting"


@dataclass(frozen=True)
class SettingSpec:
    """How one engine setting is given on the command line and checked; the metadata of its field.

    Attributes:
        flag: its ``eval.bench`` flag (``--gpu-layers``).
        help: what it does, for ``--help``: the engine's name goes before it, the default after it.
        type: the flag's value type; None for a switch (``store_true``, its default False).
        check: ``(value) -> bool``: whether a given value is valid.
        expect: what a valid value is, completing "``<flag>`` ...".
        default_help: the default as ``--help`` says it, when the value needs words.
    """

    flag: str
    help: str
    type: Callable[[str], Any] | None = None
    check: Callable[[Any], bool] | None = None
    expect: str = ""
    default_help: str | None = None

    def validate(self, value: Any) -> None:
        """Raise the setting's one-line error when ``value`` fails its check."""
        if self.check is not None and not self.check(value):
            raise LayercutError(f"{self.flag} {self.expect}, got {value}")

    def help_text(self, engine: str, default: Any) -> str:
        """``--help``'s line: ``<engine>: <help> (default: ...)``; a switch says no default."""
        if self.type is None:
            return f"{engine}: {self.help}"
        return f"{engine}: {self.help} (default: {self.default_help or default})"


def setting(default: Any, help: str, *, flag: str, **spec: Any) -> Any:
    """An engine setting: a dataclass field of ``default``, its metadata a :class:`SettingSpec` of the rest."""
    return field(default=default, metadata={SETTING_KEY: SettingSpec(flag=flag, help=help, **spec)})


def _spec_of(item: Field) -> SettingSpec:
    if SETTING_KEY not in item.metadata:
        raise TypeError(f"engine setting '{item.name}' needs its metadata: declare it with "
                        "eval.speed.engines.base.setting")
    return item.metadata[SETTING_KEY]


@dataclass(frozen=True)
class EngineOptions:
    """An engine's own settings; an engine without any uses this class as it is, the others subclass it.

    A subclass declares each setting as a field made by :func:`setting`; the values are checked here.
    """

    def __post_init__(self) -> None:
        for item in fields(self):
            _spec_of(item).validate(getattr(self, item.name))

    @classmethod
    def specs(cls) -> dict[str, SettingSpec]:
        """Setting name -> its :class:`SettingSpec`, in declaration order."""
        return {item.name: _spec_of(item) for item in fields(cls)}

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Setting name -> its default."""
        return {item.name: item.default for item in fields(cls)}

    def values(self) -> dict[str, Any]:
        """Setting name -> value."""
        return {item.name: getattr(self, item.name) for item in fields(self)}


@dataclass(frozen=True)
class EngineSettings:
    """How an engine loads a model: what every engine reads, and each engine's own settings.

    Attributes:
        load: transformers' loading (dtype, device, tokenizer); vLLM takes its dtype and tokenizer.
        threads: CPU threads of an engine that sets its own (llama.cpp; None: torch's thread count).
        context: Tokens one sequence may hold (llama.cpp ``n_ctx``, vLLM ``max_model_len``).
        sharing: How many models are loaded together (vLLM gives each its share of the GPU's memory).
        engines: Engine name -> its own settings (:class:`EngineOptions`); an engine not there takes its
            defaults. :meth:`build` fills it from setting names.
    """

    load: LoadConfig = field(default_factory=LoadConfig)
    threads: int | None = None
    context: int = 2048
    sharing: int = 1
    engines: Mapping[str, EngineOptions] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise LayercutError(f"--threads must be a positive integer, got {self.threads}")
        if self.context < 2:
            raise LayercutError(f"an engine context of {self.context} tokens holds no prediction: use 2 or more")
        if self.sharing < 1:
            raise LayercutError(f"sharing counts the models loaded together: at least 1, got {self.sharing}")

    @classmethod
    def build(cls, *, load: LoadConfig | None = None, threads: int | None = None, context: int = 2048,
              sharing: int = 1, **values: Any) -> EngineSettings:
        """Settings whose engine-specific ``values`` (setting name -> value) go to each engine that declares them.

        Every registered engine's own settings are made (and checked) here, the ones not given at their
        defaults: ``EngineSettings.build(context=64, gpu_memory=0.8)``.

        Raises:
            TypeError: a name no registered engine declares.
            LayercutError: a value its setting's check refuses (one line naming its flag).
        """
        known = setting_specs()
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise TypeError(f"no engine has the setting(s) {', '.join(unknown)}: the settings are {', '.join(known)}")
        own = {}
        for name, engine in ENGINES.items():
            options = options_class(engine)
            own[name] = options(**{key: value for key, value in values.items() if key in options.specs()})
        return cls(load=load or LoadConfig(), threads=threads, context=context, sharing=sharing, engines=own)

    def of(self, engine: Engine) -> EngineOptions:
        """``engine``'s own settings: the ones given, else its defaults."""
        given = self.engines.get(engine.name)
        return given if given is not None else options_class(engine)()

    def thread_count(self) -> int:
        """The threads of an engine that sets its own: ``threads``, else torch's (``--threads`` or the free cores)."""
        return self.threads or torch.get_num_threads()


@dataclass
class EngineModel:
    """A model one engine has loaded, with what a speed report says of it.

    Attributes:
        model: The engine's own object (a ``PreTrainedModel``, a ``llama_cpp.Llama``, a ``vllm.LLM``).
        source: What was loaded: a folder, hub id or GGUF file.
        blocks: Decoder blocks, as the engine reads them.
        params: Parameter count.
        weights_bytes: Bytes of the weights the engine holds.
        checkpoint_bytes: Bytes of the weight files on disk, None when unknown.
        vocab_size: Rows of the embedding (prompt ids stay below it).
        max_positions: Positions the model was trained for, None when unknown.
        device: Where it runs, in words.
        settings: The settings it was loaded with.
        context: Tokens one request may hold in the engine, None for no fixed limit.
        scorer: What the engine keeps for scoring besides ``model`` (llama.cpp: a context that returns every
            position's logits, opened at the first window and reused for the others), None until then.
    """

    model: Any
    source: str
    blocks: int
    params: int
    weights_bytes: int
    checkpoint_bytes: int | None
    vocab_size: int
    max_positions: int | None
    device: str
    settings: EngineSettings
    context: int | None = None
    scorer: Any = None


# ---- the engine ----


class Engine:
    """One serving engine: its package, the layouts it runs, its settings, how it loads, times and scores a model.

    Attributes:
        name: The ``--engine`` value, the name of its module in :mod:`eval.speed.engines`.
        display: How text names it (``llama.cpp``, ``vLLM``).
        summary: How it runs the models, in a few words, for ``--engine``'s help (after its name).
        module: The package's import name.
        distribution: The package's name on PyPI.
        extra: layercut's extra that installs it, None for a core dependency.
        install_note: what its install costs, said where it is missing (a package built from source).
        layouts: The checkpoint layouts it serves as they ship (``prune.model.layouts``).
        options: Its own settings (fields made by :func:`setting`: its flags).
        max_batch: Sequences one timing may hold, None for any.
    """

    name = ""
    display = ""
    summary = ""
    module = ""
    distribution = ""
    extra: str | None = None
    install_note: str = ""
    layouts: tuple[str, ...] = ()
    options: type[EngineOptions] = EngineOptions
    max_batch: int | None = None

    def available(self) -> bool:
        """Whether the package is installed (without importing it)."""
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules (tests)
            return False

    def missing_message(self) -> str:
        """The one line for a missing package."""
        install = f"pip install 'layercut[{self.extra}]'" if self.extra else f"pip install {self.distribution}"
        return f"--engine {self.name} needs {self.distribution}: {install}" + (f" ({self.install_note})"
                                                                             if self.install_note else "")

    def check(self) -> None:
        """Raise the one-line error when the package is missing.

        Raises:
            LayercutError: the package is not installed; the message names the extra.
        """
        if not self.available():
            raise LayercutError(self.missing_message())

    def import_module(self):
        """The engine's package, imported; a missing or broken install is one line."""
        self.check()
        try:
            return importlib.import_module(self.module)
        except ImportError as err:
            detail = " ".join(str(err).split())
            raise LayercutError(f"{self.missing_message()} ({self.distribution} fails to import: {detail})") from None

    def version(self) -> str | None:
        """The installed package's version, None when it is not installed."""
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            module = importlib.import_module(self.module) if self.available() else None
            return getattr(module, "__version__", None)

    def serves(self, serving: dict) -> bool:
        """Whether the engine serves a checkpoint with this ``serving`` entry as it ships.

        Its layout is one of ``layouts``, and the entry does not name the engine under ``why_not`` (a fact of that
        checkpoint, such as llama.cpp's DeciLM converter limits).
        """
        return serving.get("layout") in self.layouts and not (serving.get("why_not") or {}).get(self.name)

    def refusal(self, serving: dict) -> str | None:
        """Why a checkpoint with this ``serving`` entry is not given to the engine (None: it is, :meth:`serves`)."""
        if self.serves(serving):
            return None
        return (serving.get("why_not") or {}).get(self.name) or serving.get("why") or "not servable"

    def describe(self, settings: EngineSettings) -> dict:
        """The settings that matter to this engine, as a speed report records them (JSON-ready)."""
        return {"dtype": settings.load.dtype, "device": settings.load.device, "threads": torch.get_num_threads()}

    def check_batch(self, batch_size: int) -> None:
        """Refuse a batch the engine's timing cannot hold, in one line."""
        if self.max_batch is not None and batch_size > self.max_batch:
            raise LayercutError(f"--engine {self.name} times {self.max_batch} sequence(s) at a time: "
                                f"use --batch-size {self.max_batch}")

    def load(self, path: str, settings: EngineSettings | None = None) -> EngineModel:
        """Load ``path`` (alias, folder, hub id or, for llama.cpp, a GGUF file)."""
        raise NotImplementedError

    def prefill_seconds(self, handle: EngineModel, prompt_ids: torch.Tensor) -> float:
        """Seconds of one prefill over ``prompt_ids`` ``[batch, prompt_len]``."""
        raise NotImplementedError

    def decode_seconds(self, handle: EngineModel, prompt_ids: torch.Tensor, new_tokens: int) -> float:
        """Seconds of ``new_tokens`` greedy decode steps with the KV cache, after the prompt's prefill."""
        raise NotImplementedError

    def block_count(self, handle: EngineModel) -> int:
        """Decoder blocks of the loaded model, as the engine reads them."""
        return handle.blocks

    def nll(self, handle: EngineModel, token_ids) -> tuple[float, int]:
        """``(sum of -log p(token[i] | tokens[:i]) for i in 1..n-1, n - 1)``, the sum in float64."""
        raise NotImplementedError

    def greedy(self, handle: EngineModel, prompt_ids, new_tokens: int) -> list[int]:
        """The ``new_tokens`` ids greedy decoding gives after the prompt (one sequence), as the engine serves them."""
        raise NotImplementedError

    def close(self, handle: EngineModel) -> None:
        """Free what the engine holds for ``handle``; on a GPU, hand the freed memory back to the device."""
        handle.model = None
        gc.collect()
        if torch.cuda.is_initialized():  # a vLLM model loaded next in this process asks the device what is free
            torch.cuda.empty_cache()


def options_class(engine: Any) -> type[EngineOptions]:
    """An engine's settings class (:class:`EngineOptions` for an engine that declares none)."""
    return getattr(engine, "options", EngineOptions)


# ---- the registry ----


class EngineRegistry(Registry[Engine]):
    """Engines by name; an entry may be the string ``"module:object"``, imported when the engine is first named.

    ``names()`` and ``in`` import nothing; ``get``, ``[]``, ``items`` and ``values`` import what they return.
    """

    def register(self, name: str, entry: Engine | str) -> Engine | str:
        """Add ``entry`` (an engine, or ``"module:object"`` naming one) under ``name``; returns it.

        Raises:
            ValueError: ``name`` is already registered, or a string is not ``"module:object"``.
        """
        if isinstance(entry, str) and entry.count(":") != 1:
            raise ValueError(f"engine '{name}': a lazy entry is 'module:object', got {entry!r}")
        return super().register(name, entry)

    def _resolve(self, name: str) -> Engine:
        entry = self._entries[name]
        if isinstance(entry, str):
            module, _, attribute = entry.partition(":")
            engine = getattr(importlib.import_module(module), attribute)
            if isinstance(engine, type):
                engine = engine()
            if engine.name != name:
                raise ValueError(f"engine '{name}' ({entry}) calls itself '{engine.name}': one name for both")
            self._entries[name] = entry = engine
        return entry

    def get(self, name: str) -> Engine:
        """The engine registered as ``name``, imported on first use (one line listing the known ones otherwise)."""
        super().get(name)  # an unknown name: the one-line error
        return self._resolve(name)

    def __getitem__(self, name: str) -> Engine:
        super().__getitem__(name)
        return self._resolve(name)

    def items(self):
        """``(name, engine)`` pairs, in registration order, every engine imported."""
        return [(name, self._resolve(name)) for name in self.names()]

    def values(self):
        """The engines, in registration order, every one imported."""
        return [self._resolve(name) for name in self.names()]


ENGINES = EngineRegistry("engine", flag="--engine")


def register_engine(engine: Engine | str, name: str | None = None) -> Engine | str:
    """Add an engine under its name, or ``"module:object"`` (imported when named) under ``name``."""
    if isinstance(engine, str):
        if name is None:
            raise ValueError(f"a lazy engine entry ({engine}) needs its name")
        return ENGINES.register(name, engine)
    return ENGINES.register(name or engine.name, engine)


def get_engine(name: str) -> Engine:
    """The engine registered as ``name`` (one line listing the known ones otherwise)."""
    return ENGINES.get(name)


def display_name(name: str) -> str:
    """How text names the engine ``name`` (its ``display``; an unregistered name as it is)."""
    return (getattr(ENGINES.get(name), "display", "") or name) if name in ENGINES else name


def engines_for(serving: dict) -> list[str]:
    """The registered engines that serve a checkpoint with this ``serving`` entry as it ships, in registry order."""
    return [name for name, engine in ENGINES.items() if engine.serves(serving)]


def serves_label(serving: dict | None) -> str:
    """The short "serves" label of a ``serving`` entry: ``llama.cpp, vLLM (DeciLM layout)``, ``no (maps)``.

    The engines' display names (:func:`engines_for`), then the layout's note (``prune.model.layouts``);
    ``-`` for no entry.
    """
    from prune.model.layouts import LAYOUTS

    if not serving:
        return "-"
    layout = LAYOUTS.get(serving.get("layout", ""))
    note = layout.note if layout is not None else serving.get("layout")
    names = ", ".join(display_name(name) for name in engines_for(serving))
    if not names:
        return f"no ({note})" if note else "no"
    return f"{names} ({note})" if note else names


# ---- the settings as flags ----


def setting_specs() -> dict[str, SettingSpec]:
    """Setting name -> its spec, over every registered engine (a name two engines declare: the first one's spec)."""
    specs: dict[str, SettingSpec] = {}
    for engine in ENGINES.values():
        for key, spec in options_class(engine).specs().items():
            specs.setdefault(key, spec)
    return specs


def add_setting_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Every registered engine's own settings as flags, each prefixed in ``--help`` by the engines reading it.

    A flag not given sets nothing (``argparse.SUPPRESS``): each engine keeps its own default.
    """
    readers: dict[str, list[str]] = {}
    declared: dict[str, tuple[SettingSpec, Any]] = {}
    for name, engine in ENGINES.items():
        options = options_class(engine)
        defaults = options.defaults()
        for key, spec in options.specs().items():
            readers.setdefault(key, []).append(name)
            declared.setdefault(key, (spec, defaults[key]))
    for key, (spec, default) in declared.items():
        text = spec.help_text(", ".join(readers[key]), default)
        if spec.type is None:
            parser.add_argument(spec.flag, dest=key, action="store_true", default=argparse.SUPPRESS, help=text)
        else:
            parser.add_argument(spec.flag, dest=key, type=spec.type, default=argparse.SUPPRESS, help=text)


def setting_values(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings given to :func:`add_setting_arguments`' flags, for :meth:`EngineSettings.build`."""
    return {key: getattr(args, key) for key in setting_specs() if hasattr(args, key)}


# ---- what engines share ----


def checkpoint_bytes(folder: str | Path | None) -> int | None:
    """Total size of the weight files in a checkpoint folder, None when it is not a folder."""
    if folder is None or not Path(folder).is_dir():
        return None
    files = [p for p in Path(folder).rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)]
    if any(p.suffix != ".gguf" for p in files):  # a GGUF written beside the weights (--export gguf) is a copy
        files = [p for p in files if p.suffix != ".gguf"]
    return sum(p.stat().st_size for p in files) or None


def checkpoint_folder(name: str) -> str | None:
    """The folder whose weight files give the checkpoint size (a GGUF alias: its converted safetensors copy)."""
    from prune.loading.loader import hf_checkpoint

    try:
        folder = hf_checkpoint(name)
    except LayercutError:
        return None
    return folder if Path(folder).is_dir() else None


def block_count(model: torch.nn.Module) -> int:
    """Return the number of decoder blocks; read the config for architectures without an adapter."""
    try:
        return num_blocks(model)
    except LayercutError:
        value = getattr(model.config, "num_hidden_layers", None)
        if value is None:
            raise
        return int(value)


def files_stamp(path: Path) -> list[str]:
    """What a copy or a measurement of ``path`` depends on: its place, and each file's name, size and time.

    A folder's files are every one a converter or an engine may read (tokenizer files too), not the GGUFs
    written beside them.
    """
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file() and p.suffix != ".gguf")
    return [str(path.resolve())] + [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]


def export_path(folder: Path, suffix: str) -> Path:
    """Where an engine's copy of a checkpoint folder is cached: keyed by its path and its files' sizes and times.

    ``suffix``: what the copy is (``.f32.gguf``, ``.decilm``).
    """
    from prune.loading.gguf import cache_dir

    digest = hashlib.sha256(json.dumps(files_stamp(folder)).encode()).hexdigest()[:16]
    return cache_dir() / GGUF_EXPORT_FOLDER / f"{folder.name}-{digest}{suffix}"


def token_list(token_ids) -> list[int]:
    """Token ids as a flat list of ints; refuses fewer than two (nothing to predict)."""
    ids = token_ids.reshape(-1).tolist() if isinstance(token_ids, torch.Tensor) else [int(t) for t in token_ids]
    if len(ids) < 2:
        raise LayercutError(f"perplexity needs at least 2 tokens, got {len(ids)}")
    return ids


def prompt_rows(prompt_ids) -> list[list[int]]:
    """``[batch, prompt_len]`` ids as lists of ints."""
    if isinstance(prompt_ids, torch.Tensor):
        return prompt_ids.reshape(-1, prompt_ids.shape[-1]).tolist()
    rows = list(prompt_ids)
    return [list(map(int, row)) for row in rows] if rows and not isinstance(rows[0], int) else [list(map(int, rows))]
