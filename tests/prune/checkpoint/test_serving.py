"""A checkpoint folder's serving entry: its ``layercut.json`` says it, else its files show the layout."""

import json

from prune.checkpoint.serving import folder_serving, layout_of_folder
from prune.model.layouts import DECILM, LAYERCUT, VANILLA, serving_entry


def test_the_layout_of_a_folder_is_read_from_its_report_else_from_its_files(tmp_path):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert layout_of_folder(plain) == VANILLA
    assert folder_serving(plain) == serving_entry(VANILLA)

    maps = tmp_path / "maps"
    maps.mkdir()
    (maps / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (maps / "replacements.safetensors").write_bytes(b"")  # only its presence is read
    assert layout_of_folder(maps) == LAYERCUT
    assert folder_serving(maps) == serving_entry(LAYERCUT)

    # the report wins over the files, and its serving entry is returned as written
    written = {**serving_entry(DECILM), "note": "as written"}
    (maps / "layercut.json").write_text(json.dumps({"serving": written}))
    assert layout_of_folder(maps) == DECILM
    assert folder_serving(maps) == written
    # a report from before the serving entry: its files show the layout (prune.checkpoint.report.migrate)
    (maps / "layercut.json").write_text(json.dumps({"dropped": [1]}))
    assert layout_of_folder(maps) == LAYERCUT
