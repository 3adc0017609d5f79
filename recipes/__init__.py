"""The recipes layercut ships: YAML files, installed with the package so an installed layercut lists and runs them.

``methods/`` holds one recipe per method of the field (``python -m eval.compare --methods list``),
``repairs/`` the variants the reports under ``reports/`` measure, and the files here whole runs
(``python -m prune.run --recipe recipes/smollm2-drop4.yaml``). ``prune.pipeline.recipes`` reads them.
"""
