"""A full disk during export: one line naming the folder, the previous output untouched, no temporary left."""

import errno
import json
import os
from pathlib import Path

import pytest

from prune.atomic import write_file_atomic
from prune.checkpoint import write as export
from prune.checkpoint.write import export_checkpoint
from prune.errors import LayercutError
from tests.helpers import make_tiny_model, make_tiny_tokenizer


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_during_export_keeps_the_previous_output(tmp_path, one_thread, monkeypatch):
    out = tmp_path / "slim"
    out.mkdir()
    (out / "layercut.json").write_text('{"previous": true}')
    monkeypatch.setattr(export, "write_json", full_disk)
    with pytest.raises(LayercutError) as caught:
        export_checkpoint(make_tiny_model("llama"), make_tiny_tokenizer(), out, {}, overwrite=True)
    message = str(caught.value)
    assert "\n" not in message and str(out) in message and "no space left" in message
    assert json.loads((out / "layercut.json").read_text()) == {"previous": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slim"], "no temporary folder stays beside --out"


def test_full_disk_in_write_file_atomic(tmp_path):
    target = tmp_path / "results.json"
    target.write_text("old")

    def write(staging: Path):
        staging.write_text("half")
        full_disk()

    with pytest.raises(LayercutError, match="no space left to write .*results.json"):
        write_file_atomic(target, write)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_other_write_errors_pass_unchanged(tmp_path, monkeypatch):
    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "denied")

    monkeypatch.setattr(export, "write_json", denied)
    with pytest.raises(PermissionError), export.atomic_directory(tmp_path / "x") as staging:
        export.write_json(staging / "a.json", {})
    assert list(tmp_path.iterdir()) == []


def test_an_out_folder_under_a_file_is_refused_before_any_work(tmp_path):
    from prune.atomic import check_output_dir

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(LayercutError, match=r"cannot write in .*notes\.txt"):
        check_output_dir(tmp_path / "notes.txt" / "slim", overwrite=False)
    assert (tmp_path / "notes.txt").read_text() == "mine"
