"""layercut's base: loading, architecture adapters, capture, scores, selection, surgery, export.

The Python API (:mod:`prune.api`), for a model already in memory:

- ``prune.slim(model, tokenizer, drop=4, data=None, recipe=None, replace=None, **options)`` removes blocks in
  place and returns a :class:`~prune.api.SlimResult`; it writes nothing.
- ``prune.score(model, tokenizer, data=None)`` is every registered score of every block, nothing removed.
- ``prune.save(result, path, export=None)`` writes a result as ``prune.run --out`` does (``export="gguf"``
  also converts it); ``prune.save(model, tokenizer, out, report)`` writes any model.
- ``prune.load(path)`` loads any checkpoint layercut wrote (with its replacement maps) or any model
  ``prune.loading.loader.load_model`` takes.

They are imported on first use, so ``import prune`` stays light.
"""

from prune.errors import LayercutError

__all__ = ["LayercutError", "ScoreTable", "SlimResult", "load", "save", "score", "slim"]

_API = ("ScoreTable", "SlimResult", "save", "score", "slim")


def __getattr__(name: str):
    if name == "load":
        from prune.checkpoint import save_load as checkpoint

        return checkpoint.load
    if name in _API:
        from prune import api

        return getattr(api, name)
    raise AttributeError(f"module 'prune' has no attribute '{name}'")
