"""layercut's base: loading, architecture adapters, capture, scores, selection, surgery, export.

``prune.load(path)`` loads any checkpoint layercut wrote (with its replacement maps) or any model
``prune.loading.loader.load_model`` takes. It is imported on first use, so ``import prune`` stays light.
"""

from prune.errors import LayercutError

__all__ = ["LayercutError", "load", "save"]


def __getattr__(name: str):
    if name in ("load", "save"):
        from prune.checkpoint import save_load as checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'prune' has no attribute '{name}'")
