"""Serving engines that time and score a model, one registry: transformers, llama.cpp and vLLM, one module each.

    python -m eval.bench speed --engine llamacpp --baseline dense/ --model slim/ --threads 2
    python -m eval.bench speed --engine vllm --baseline dense/ --model slim/

Each :class:`Engine` loads a checkpoint into an :class:`EngineModel` and answers four questions about it:
the seconds of a prefill, the seconds of a greedy decode with the KV cache, its block count as the
engine itself reads it (so the ideal ``L / (L - k)`` is the engine's), and the summed negative
log-likelihood of given token ids (perplexity in that engine). How each engine times is said in its
module: :mod:`eval.speed.engines.transformers`, :mod:`eval.speed.engines.llamacpp`,
:mod:`eval.speed.engines.vllm`. The models of one comparison are loaded together. Peak memory is measured
for transformers only. An engine's package is an extra: a missing one is a one-line error naming it
(``pip install 'layercut[llamacpp]'``).

A new engine is one module here, ``<name>.py``, whose ``ENGINE`` is an :class:`Engine` called ``<name>``
(what it declares: :mod:`eval.speed.engines.base`), plus its test. Every module of this package but
``base`` is registered under its name as ``"eval.speed.engines.<name>:ENGINE"`` and imported when the
engine is first named; ``eval.bench``'s ``--engine``/``--engines`` and each engine's flags,
``eval.compare --engine``, ``prune.ship --engine`` (the engines that serve a plain checkpoint), which engines
refuse a checkpoint (:meth:`Engine.refusal`) and the "serves" label of a comparison (:func:`serves_label`)
follow. Its name (``llamacpp``) is its key everywhere; its ``display`` (``llama.cpp``) is text only.
"""

from __future__ import annotations

import importlib
import pkgutil

from eval.speed.engines.base import (
    ENGINES,
    GGUF_EXPORT_FOLDER,
    REFERENCE,
    WEIGHT_SUFFIXES,
    Engine,
    EngineModel,
    EngineOptions,
    EngineRegistry,
    EngineSettings,
    SettingSpec,
    add_setting_arguments,
    block_count,
    checkpoint_bytes,
    checkpoint_folder,
    display_name,
    engines_for,
    get_engine,
    register_engine,
    serves_label,
    setting,
    setting_specs,
    setting_values,
)

__all__ = ["ENGINES", "GGUF_EXPORT_FOLDER", "REFERENCE", "WEIGHT_SUFFIXES", "Engine", "EngineModel",
           "EngineOptions", "EngineRegistry", "EngineSettings", "SettingSpec", "add_setting_arguments", "block_count",
           "checkpoint_bytes", "checkpoint_folder", "display_name", "engines_for", "get_engine", "register_engine",
           "serves_label", "setting", "setting_specs", "setting_values"]

NOT_ENGINES = {"base"}  # modules of this package that are no engine


def _engine_modules() -> list[str]:
    """The engine modules of this package: the reference engine first, then by name."""
    names = [info.name for info in pkgutil.iter_modules(__path__)
             if info.name not in NOT_ENGINES and not info.name.startswith("_")]
    return sorted(names, key=lambda name: (name != REFERENCE, name))


for _name in _engine_modules():
    ENGINES.register(_name, f"{__name__}.{_name}:ENGINE")


def __getattr__(name: str):
    """A class or function an engine module defines (``from eval.speed.engines import VllmEngine``), imported then."""
    if not name.startswith("_"):
        for module in _engine_modules():
            loaded = importlib.import_module(f"{__name__}.{module}")
            found = getattr(loaded, name, None)
            if getattr(found, "__module__", None) == loaded.__name__:
                return found
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
