"""What a task's scoring code can need besides lm-eval, each a check that refuses in one line when it is missing.

A task's YAML names its needs (``needs: [ifeval]`` in its ``layercut`` block); :func:`eval.quality.task_specs.
check_task_needs` runs their checks before lm-eval imports that task's code. Each module of this package provides
one need and registers its check in :data:`TASK_NEEDS` where it is defined: adding a need is one file here.
"""

from __future__ import annotations

import importlib
import pkgutil

from prune.registry import Registry

TASK_NEEDS: Registry = Registry("task need")

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")  # a need added as one new file registers here

__all__ = ["TASK_NEEDS"]
