"""Diagnostics behind the defaults: the analyses ``reports/`` quotes, as tested functions (``python -m eval.lab``).

Each one reads what a measurement wrote (an ``eval.compare`` or ``eval.mapfit`` ``results.json``) or the local
task data, and returns rows or writes text files; ``eval/lab/cli.py`` prints them. The reports' ``run.sh``
files call them, so a figure in a report is one a test runs the code of.
"""
