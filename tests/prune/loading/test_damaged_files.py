"""A damaged checkpoint is one line naming the file and the fix, never a safetensors traceback."""

import os

import pytest
import torch

import prune
from prune.errors import LayercutError
from prune.loading.loader import load_model
from prune.replace import ReplaceConfig, replace_blocks_
from tests.helpers import make_tiny_model, make_tiny_tokenizer


def truncate_to_half(path):
    os.truncate(path, path.stat().st_size // 2)


def save(tmp_path, maps: bool):
    model = make_tiny_model("llama")
    if maps:
        calibration = torch.randint(3, 320, (8, 32), generator=torch.Generator().manual_seed(0))
        replace_blocks_(model, [1], calibration, ReplaceConfig(method="linear", progress=False))
    return prune.save(model, make_tiny_tokenizer(), tmp_path / ("maps" if maps else "plain"), {"dropped": []})


def assert_one_line(caught, file):
    message = str(caught.value)
    assert "\n" not in message and str(file) in message and "damaged" in message, message
    assert "re-export" in message and "restore" in message, message


@pytest.mark.parametrize("loader", [prune.load, load_model])
def test_truncated_weights(tmp_path, one_thread, loader):
    out = save(tmp_path, maps=False)
    truncate_to_half(out / "model.safetensors")
    with pytest.raises(LayercutError) as caught:
        loader(str(out))
    assert_one_line(caught, out / "model.safetensors")


def test_truncated_maps(tmp_path, one_thread):
    out = save(tmp_path, maps=True)
    truncate_to_half(out / "replacements.safetensors")
    with pytest.raises(LayercutError) as caught:
        prune.load(out)
    assert_one_line(caught, out / "replacements.safetensors")


def test_maps_with_a_corrupted_header(tmp_path, one_thread):
    out = save(tmp_path, maps=True)
    data = bytearray((out / "replacements.safetensors").read_bytes())
    data[8:40] = b"#" * 32  # the JSON header's first bytes
    (out / "replacements.safetensors").write_bytes(bytes(data))
    with pytest.raises(LayercutError) as caught:
        prune.load(out)
    assert_one_line(caught, out / "replacements.safetensors")


@pytest.mark.parametrize("name", ["layercut.json", "config.json"])
def test_corrupt_json(tmp_path, one_thread, name):
    out = save(tmp_path, maps=False)
    text = (out / name).read_text()
    (out / name).write_text(text[: len(text) // 2])
    with pytest.raises(LayercutError) as caught:
        prune.load(out)
    assert_one_line(caught, out / name)
    if name == "config.json":
        with pytest.raises(LayercutError) as caught:
            load_model(str(out))
        assert_one_line(caught, out / name)


def test_cli_exits_2_with_one_line(tmp_path, one_thread, capsys):
    from distill.run import main

    out = save(tmp_path, maps=False)
    truncate_to_half(out / "model.safetensors")
    assert main(["--student", str(out), "--teacher", str(out), "--out", str(tmp_path / "distilled")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and "model.safetensors is damaged" in err[-1]


def without_weights(tmp_path):
    """A checkpoint as an eval.compare cell keeps it without --keep-checkpoints: its report and config only."""
    out = save(tmp_path, maps=False)
    for file in out.glob("*.safetensors"):
        file.unlink()
    assert {"config.json", "layercut.json", "README.md"} <= {p.name for p in out.iterdir()}
    return out


@pytest.mark.parametrize("loader", [prune.load, load_model])
def test_a_folder_without_weights_is_one_line(tmp_path, one_thread, loader):
    out = without_weights(tmp_path)
    with pytest.raises(LayercutError) as caught:
        loader(str(out))
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{out} holds no weights"), message
    assert "kept only its report" in message and "--keep-checkpoints" in message and "prune.run" in message


def test_eval_run_of_a_folder_without_weights_exits_2(tmp_path, one_thread, capsys, sample_text):
    from eval.run import main

    out = without_weights(tmp_path)
    text = tmp_path / "text.txt"
    text.write_text(sample_text)
    code = main(["--model", str(out), "--tasks", f"ppl:{text}", "--seq-len", "32", "--out", str(tmp_path / "report"),
                 "--no-progress", "--threads", "1"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"error: {out} holds no weights") and not (tmp_path / "report").exists()
