"""A checkpoint folder's serving entry: its layout as ``layercut.json`` says it, or as its files show.

The layouts themselves are :mod:`prune.model.layouts`; a report of any format has its entry
(:func:`prune.checkpoint.report.migrate`), and a folder without a report has the one its files show.
"""

from __future__ import annotations

from pathlib import Path

from prune.checkpoint.report import layout_of_files, read_report
from prune.model.layouts import serving_entry


def folder_serving(folder: str | Path) -> dict:
    """A checkpoint folder's ``serving`` entry: its ``layercut.json``'s, else the one its files' layout gives."""
    return read_report(folder).get("serving") or serving_entry(layout_of_files(folder))


def layout_of_folder(folder: str | Path) -> str:
    """The layout of a checkpoint folder: its ``layercut.json`` says it; a folder without one shows it in its files."""
    return folder_serving(folder)["layout"]
