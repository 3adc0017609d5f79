"""``--export gguf`` / ``python -m prune.export_gguf``: llama.cpp's converter, then the file read back and checked.

The round trip is judged by transformers' own GGUF loader: the logits of the model it rebuilds from the file
must be those of the checkpoint folder. Without llama.cpp's converter (``LLAMA_CPP_CONVERTER``) the
conversions skip; the refusals and the read-back checks do not need it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from prune.checkpoint.gguf import check_gguf, convert, export_gguf, find_converter
from prune.checkpoint.save_load import save
from prune.errors import LayercutError
from prune.export_gguf import main
from prune.model.surgery import drop_blocks_
from tests.helpers import CONVERTER, NO_CONVERTER, byte_fallback_tokenizer, make_tiny_model, run_prune_cli

needs_converter = pytest.mark.skipif(CONVERTER is None, reason=NO_CONVERTER)


@pytest.fixture(scope="module")
def tiny_llama_folder(tmp_path_factory):
    """A tiny random Llama (Llama-2 style vocabulary: one llama.cpp's converter reads) saved as a checkpoint."""
    folder = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    model = make_tiny_model("llama")
    tokenizer = byte_fallback_tokenizer()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def _gguf_logits(path, ids):
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return _logits(model, ids)


@needs_converter
def test_a_pruned_llama_goes_through_gguf_and_back_with_its_logits(tiny_llama_folder, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_folder).eval()
    drop_blocks_(model, [1])  # a pruned model: 3 blocks, renumbered
    slim = save(model, byte_fallback_tokenizer(), tmp_path / "slim", {"dropped": [1]})
    report = json.loads((slim / "layercut.json").read_text())
    assert report["serving"]["layout"] == "vanilla" and "why_not" not in report["serving"]
    path, checked = convert(slim, converter=CONVERTER)
    assert path == slim / "gguf" / "slim-f32.gguf" and path.is_file() and not list(slim.rglob(".*partial"))
    assert checked["blocks"] == 3 and checked["architecture"] == "llama"
    assert checked["compared"] >= 3 * 5 and checked["max_rel_diff"] == 0.0  # norms, MLP, o_proj, v of every block
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    expected = _logits(model, ids)
    got = _gguf_logits(path, ids)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()


@needs_converter
def test_f16_output_is_checked_within_its_rounding(tiny_llama_folder, tmp_path):
    path = export_gguf(tiny_llama_folder, tmp_path / "tiny-f16.gguf", outtype="f16", converter=CONVERTER)
    checked = check_gguf(path, tiny_llama_folder, "f16")
    assert 0 < checked["max_rel_diff"] <= 1e-3 and checked["blocks"] == 4


@needs_converter
def test_a_tensor_that_differs_from_the_checkpoint_is_caught(tiny_llama_folder, tmp_path):
    path = export_gguf(tiny_llama_folder, tmp_path / "tiny.gguf", converter=CONVERTER)
    other = tmp_path / "other"
    model = make_tiny_model("llama", seed=1)  # same shapes, other weights
    model.save_pretrained(other)
    with pytest.raises(LayercutError, match="differs from the checkpoint"):
        check_gguf(path, other)


def _write_gguf(gguf, path, block_count, blocks, head_count=None):
    """A GGUF of norms only: ``block_count`` in its metadata, tensors for ``blocks``."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(block_count)
    if head_count is not None:
        writer.add_array("llama.attention.head_count", head_count)
    for block in blocks:
        writer.add_tensor(f"blk.{block}.attn_norm.weight", np.ones(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unsliced_per_layer_array_is_refused(tmp_path):
    """The failure of llama.cpp's --prune-layers (llama.cpp#27976): per-layer metadata left at the original depth."""
    gguf = pytest.importorskip("gguf")
    folder = tmp_path / "slim"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    (folder / "layercut.json").write_text(json.dumps({"layout": [[0], [1]], "dropped": [2, 3]}))
    path = _write_gguf(gguf, tmp_path / "bad.gguf", 2, range(2), head_count=[4, 4, 4, 4])  # the depth before pruning
    with pytest.raises(LayercutError, match="original depth"):
        check_gguf(path, folder)


def test_a_missing_block_is_refused(tmp_path):
    gguf = pytest.importorskip("gguf")
    folder = tmp_path / "slim"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": 3}))
    path = _write_gguf(gguf, tmp_path / "short.gguf", 3, (0, 2))
    with pytest.raises(LayercutError, match=r"blocks \[1\] are missing"):
        check_gguf(path, folder)


def test_maps_are_refused_in_one_line_naming_the_vanilla_recipe(tiny_folder, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LLAMA_CPP_CONVERTER", raising=False)
    code, _, err = run_prune_cli(capsys, "--model", str(tiny_folder), "--drop", "1", "--replace", "linear",
                                 "--export", "gguf", "--samples", "4", "--seq-len", "32", "--out",
                                 str(tmp_path / "maps"))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "layercut-linear-vanilla.yaml" in err and "no serving engine" in err
    assert not (tmp_path / "maps").exists()  # refused before any work


def test_a_map_checkpoint_folder_is_refused(tiny_folder, tmp_path, capsys):
    code, _, _ = run_prune_cli(capsys, "--model", str(tiny_folder), "--drop", "1", "--replace", "linear",
                               "--samples", "4", "--seq-len", "32", "--out", str(tmp_path / "maps"))
    assert code == 0
    report = json.loads((tmp_path / "maps" / "layercut.json").read_text())
    assert report["serving"]["layout"] == "layercut"
    assert main([str(tmp_path / "maps"), "--converter", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not servable" in err and "layercut-linear-vanilla" in err


_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


def test_the_gguf_goes_apart_from_the_checkpoint_tokenizer_and_loads_whole(tmp_path, monkeypatch):
    """Beside the checkpoint's tokenizer.json, transformers would read that instead of the GGUF's own tokenizer,
    and its chat template and special tokens from neither; the export's own folder keeps them."""
    from transformers import AutoTokenizer

    import prune.checkpoint.gguf as export
    from tests.prune.loading.test_loader import _byte_level_tokenizer, _tiny_llama, _write_tiny_gguf

    tokenizer = _byte_level_tokenizer()
    tokenizer.chat_template = _TEMPLATE
    model = _tiny_llama(len(tokenizer))
    slim = save(model, tokenizer, tmp_path / "slim8", {"dropped": []})

    def stand_in(script, source, out, outtype):  # llama.cpp's converter: the tokenizer and its template go in
        _write_tiny_gguf(out, model, tokenizer, chat_template=tokenizer.chat_template)

    monkeypatch.setattr(export, "_run_converter", stand_in)
    monkeypatch.setattr(export, "check_gguf", lambda *args: {})
    (tmp_path / "convert_hf_to_gguf.py").touch()
    path = export_gguf(slim, converter=tmp_path)
    assert path == slim / "gguf" / "slim8-f32.gguf" and sorted(p.name for p in path.parent.iterdir()) == [path.name]
    loaded = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert loaded.chat_template == _TEMPLATE and loaded.eos_token == tokenizer.eos_token


@needs_converter
def test_an_exported_gguf_keeps_the_chat_template_and_special_tokens(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = byte_fallback_tokenizer()
    tokenizer.chat_template = _TEMPLATE
    tokenizer.eos_token = "<unk>"  # not transformers' default "</s>": read from the GGUF or from nowhere
    slim = save(make_tiny_model("llama"), tokenizer, tmp_path / "slim8", {"dropped": []})
    path = export_gguf(slim, converter=CONVERTER)
    loaded = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert (loaded.chat_template, loaded.eos_token, loaded.bos_token) == (_TEMPLATE, "<unk>", "<s>")


def test_no_converter_is_one_line_saying_where_to_get_it(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_CPP_CONVERTER", raising=False)
    monkeypatch.setenv("LAYERCUT_CACHE", str(tmp_path / "cache"))  # none fetched there
    with pytest.raises(LayercutError, match="llama-cpp-python") as err:
        find_converter(None)
    assert "\n" not in str(err.value)
    with pytest.raises(LayercutError, match="no convert_hf_to_gguf.py"):
        find_converter(tmp_path)


@needs_converter
def test_prune_run_export_gguf_writes_a_checked_gguf_beside_the_checkpoint(tmp_path, capsys):
    source = tmp_path / "src"
    model = make_tiny_model("llama")
    model.save_pretrained(source)
    byte_fallback_tokenizer().save_pretrained(source)
    out = tmp_path / "slim"
    code, stdout, err = run_prune_cli(capsys, "--model", str(source), "--drop", "1", "--replace", "fold",
                                      "--samples", "4", "--seq-len", "32", "--out", str(out), "--export", "gguf",
                                      "--converter", str(CONVERTER))
    assert code == 0, err
    assert (out / "gguf" / "slim-f32.gguf").is_file() and "read back" in stdout
    pruned = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(3, 300, (1, 16), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(_gguf_logits(out / "gguf" / "slim-f32.gguf", ids), _logits(pruned, ids), atol=1e-4,
                          rtol=1e-4)


@pytest.mark.slow
@needs_converter
def test_smollm2_drop4_fold_through_gguf_keeps_its_logits(tmp_path, capsys):
    """The embedded SmolLM2-135M, pruned and folded, written as GGUF f32 and read back by transformers."""
    out = tmp_path / "smol"
    code, _, err = run_prune_cli(capsys, "--model", "smollm2-135m", "--drop", "4", "--replace", "fold",
                                 "--samples", "16", "--seq-len", "256", "--heldout-samples", "0", "--out", str(out),
                                 "--export", "gguf", "--converter", str(CONVERTER))
    assert code == 0, err
    path = out / "gguf" / "smol-f32.gguf"
    checked = check_gguf(path, out)
    assert checked["blocks"] == 26 and checked["max_rel_diff"] == 0.0
    pruned = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 49152, (1, 32), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(_gguf_logits(path, ids), _logits(pruned, ids), atol=1e-4, rtol=1e-3)


needs_quantizer = pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("llama_cpp") is None,
    reason="llama.cpp's quantizer comes with llama-cpp-python: pip install 'layercut[llamacpp]'")


# llama.cpp runs in a child process, as the quantizer does: its OpenMP runtime is never loaded beside torch's here
# loaded as the llamacpp engine loads it, with llama.cpp's extra buffer types on (its default) and off (--no-repack)
_LOAD_CHILD = """
import sys, numpy, llama_cpp
from pathlib import Path
from eval.speed.engines import EngineSettings
from eval.speed.engines.llamacpp import LlamaCppEngine
default = llama_cpp.llama_cpp.llama_model_default_params
load, loaded = llama_cpp.llama_cpp.llama_model_load_from_file, []
def recording_load(path, params):  # what llama.cpp was asked for
    loaded.append(bool(params.use_extra_bufts))
    return load(path, params)
llama_cpp.llama_cpp.llama_model_load_from_file = recording_load
scores = []
for no_repack in (False, True):
    model = LlamaCppEngine()._open(Path(sys.argv[1]), EngineSettings.build(no_repack=no_repack), 32, True)
    model.eval([5, 6, 7])
    scores.append(numpy.asarray(model.scores[:3]).copy())
    model.close()
finite = all(bool(numpy.isfinite(s).all()) for s in scores)
gap = float(numpy.abs(scores[0] - scores[1]).max() / numpy.abs(scores[0]).max())
print(finite and gap < 0.05 and loaded == [True, False] and llama_cpp.llama_cpp.llama_model_default_params is default)
"""


@needs_converter
@needs_quantizer
def test_q4_k_m_is_written_by_llama_cpps_quantizer_and_runs_there(tiny_llama_folder, tmp_path):
    import subprocess
    import sys

    import gguf

    path, checked = convert(tiny_llama_folder, tmp_path / "tiny-q4.gguf", outtype="q4_k_m", converter=CONVERTER)
    assert checked["blocks"] == 4 and not list(tmp_path.glob(".*partial"))
    reader = gguf.GGUFReader(str(path))
    from prune.checkpoint.gguf import gguf_field

    assert gguf_field(reader, "general.file_type") == gguf.LlamaFileType.MOSTLY_Q4_K_M
    types = {t.tensor_type.name for t in reader.tensors}
    assert types & {"Q4_K", "Q5_0", "Q8_0", "Q6_K"}, types  # quantized blocks (small rows fall back to other types)
    done = subprocess.run([sys.executable, "-c", _LOAD_CHILD, str(path)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.split()[-1] == "True", done.stderr[-2000:]


@needs_converter
def test_a_crash_in_llama_cpps_quantizer_is_one_line_and_leaves_no_file(tiny_llama_folder, tmp_path, monkeypatch):
    from prune.checkpoint import gguf as module

    # a quantizer that dies as a llama.cpp built for another CPU does: by a signal, half a file written
    monkeypatch.setattr(module, "_QUANTIZE_CHILD", "import os, signal, sys\n"
                        "open(sys.argv[2], 'wb').write(b'GGUF')\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    monkeypatch.setattr(module, "check_quantizer", lambda outtype: None)
    with pytest.raises(LayercutError, match=r"quantizer ended by SIGSEGV writing q4_k_m: reinstall") as err:
        convert(tiny_llama_folder, tmp_path / "q.gguf", outtype="q4_k_m", converter=CONVERTER)
    assert "\n" not in str(err.value) and not list(tmp_path.iterdir())


def test_q4_k_m_without_llama_cpp_python_is_one_line(tiny_llama_folder, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    monkeypatch.setenv("LLAMA_CPP_CONVERTER", str(tmp_path / "convert_hf_to_gguf.py"))
    (tmp_path / "convert_hf_to_gguf.py").write_text("")
    with pytest.raises(LayercutError, match=r"pip install 'layercut\[llamacpp\]'") as err:
        convert(tiny_llama_folder, tmp_path / "q.gguf", outtype="q4_k_m")
    assert "\n" not in str(err.value) and not (tmp_path / "q.gguf").exists()


def test_fetch_converter_unpacks_only_the_converter_into_the_cache_and_exports_find_it(tmp_path, monkeypatch):
    import io
    import subprocess
    import tarfile

    from prune.checkpoint import gguf as module

    monkeypatch.setenv("LAYERCUT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LLAMA_CPP_CONVERTER", raising=False)
    calls = []

    def pip(command, **_kwargs):  # what `pip download` leaves: the source distribution
        calls.append(command)
        folder = Path(command[command.index("-d") + 1])
        with tarfile.open(folder / "llama_cpp_python-9.9.9.tar.gz", "w:gz") as archive:
            for name in ("vendor/llama.cpp/convert_hf_to_gguf.py", "vendor/llama.cpp/conversion/base.py",
                         "vendor/llama.cpp/gguf-py/gguf/__init__.py", "vendor/llama.cpp/src/llama.cpp"):
                data = b"# " + name.encode()
                info = tarfile.TarInfo(f"llama_cpp_python-9.9.9/{name}")
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(module.subprocess, "run", pip)
    monkeypatch.setattr(module, "converter_version", lambda: "9.9.9")
    with pytest.raises(LayercutError, match="--fetch-converter"):
        find_converter(None)
    script = module.fetch_converter()
    assert "llama-cpp-python==9.9.9" in calls[0] and "--no-binary" in calls[0] and "--no-deps" in calls[0]
    assert find_converter(None) == script and script.read_text() == "# vendor/llama.cpp/convert_hf_to_gguf.py"
    assert (script.parent / "conversion" / "base.py").is_file()
    assert not (script.parent / "src").exists()  # llama.cpp's sources are not unpacked
    assert module.fetch_converter() == script and len(calls) == 1  # kept: not fetched again
    assert not [p for p in script.parents[4].iterdir() if p.name.startswith(".fetch-")]


def test_a_full_disk_in_the_conversion_is_one_line_and_keeps_the_earlier_file(tiny_llama_folder, tmp_path):
    converter = tmp_path / "convert_hf_to_gguf.py"  # llama.cpp's converter as it fails on a full disk
    converter.write_text(
        "import sys\n"
        "out = sys.argv[sys.argv.index('--outfile') + 1]\n"
        "open(out, 'wb').write(b'GGUF' + bytes(100))\n"
        "print('Traceback (most recent call last):', file=sys.stderr)\n"
        "print('OSError: [Errno 28] No space left on device', file=sys.stderr)\n"
        "sys.exit(1)\n")
    earlier = tmp_path / "tiny.gguf"
    earlier.write_bytes(b"the earlier export")
    with pytest.raises(LayercutError, match="the disk is full") as err:
        convert(tiny_llama_folder, earlier, converter=converter)
    assert "\n" not in str(err.value) and "nothing was replaced" in str(err.value)
    assert earlier.read_bytes() == b"the earlier export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["convert_hf_to_gguf.py", "tiny.gguf"]
