"""The Jump-to-Conclusions lens: what each layer already predicts, and how many layers early exit saves.

Modules, from the bottom up: :mod:`~eval.lens.shortcuts` (the maps from a layer's state to the last,
fitted and saved), :mod:`~eval.lens.metrics` (R^2, Precision@k, surprisal, early exit, heatmap),
:mod:`~eval.lens.standins` (sub-module stand-ins), :mod:`~eval.lens.plots` and
:mod:`~eval.lens.report` (figures and text), :mod:`~eval.lens.pipeline` (one run as a function:
:class:`~eval.lens.pipeline.LensConfig`, :func:`~eval.lens.pipeline.run_lens`) and the CLI
:mod:`~eval.lens.run` (``python -m eval.lens``). Nothing is imported here, so ``import eval.lens`` is light.
"""
