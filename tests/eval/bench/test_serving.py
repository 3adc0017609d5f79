"""``eval.bench serving``: each checkpoint's perplexity in each engine, on the same ids, with its layout."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eval.bench.cli import main as bench_main
from eval.bench.serving import parse_models, windows_of
from eval.speed.engines import Engine
from prune.checkpoint.save_load import load
from prune.errors import LayercutError
from tests.helpers import CONVERTER, NO_CONVERTER, byte_fallback_tokenizer, make_tiny_model, run_prune_cli


def _direct_ppl(path, windows):
    """Perplexity computed here by hand: the sum of -log p over every window's tokens after the first."""
    model = load(path).model
    total, count = 0.0, 0
    with torch.no_grad():
        for window in windows:
            ids = torch.tensor([window])
            logp = torch.log_softmax(model(ids).logits.double(), -1)[0, :-1]
            total -= logp.gather(-1, ids[0, 1:, None]).sum().item()
            count += len(window) - 1
    return math.exp(total / count)


def test_models_and_windows_are_checked_in_one_line():
    assert parse_models(["a=x/", "y/"]) == {"a": "x/", "y": "y/"}
    with pytest.raises(LayercutError, match="two models are labelled 'x'"):
        parse_models(["x=a", "x=b"])
    assert windows_of(list(range(10)), 4, 100) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(LayercutError, match="fewer than one window"):
        windows_of([1, 2], 4, 100)


def test_transformers_rows_equal_a_direct_computation_and_maps_are_labelled(tiny_folder, tmp_path, capsys,
                                                                             one_thread):
    maps = tmp_path / "maps"
    code, _, err = run_prune_cli(capsys, "--model", tiny_folder, "--drop", "1", "--replace", "linear", "--samples",
                                 "4", "--seq-len", "32", "--out", maps)
    assert code == 0, err
    text = tmp_path / "heldout.txt"
    text.write_text("It is a truth universally acknowledged, that a single man in want of a wife. " * 40)
    out = tmp_path / "serving"
    assert bench_main(["serving", "--model", f"dense={tiny_folder}", "--model", f"maps={maps}", "--heldout",
                       str(text), "--tokens", "256", "--seq-len", "64", "--engines", "transformers",
                       "--out", str(out)]) == 0
    result = json.loads((out / "serving.json").read_text())
    assert result["setup"]["windows"] == 4 and result["setup"]["predicted"] == 4 * 63
    from eval.bench.serving import held_out_ids

    windows = windows_of(held_out_ids(str(text), str(tiny_folder)), 64, 256)
    for label, path in (("dense", tiny_folder), ("maps", maps)):
        row = result["rows"][label]["transformers"]
        assert row["runs"] and row["ppl"] == pytest.approx(_direct_ppl(path, windows), rel=1e-6)
    assert result["rows"]["maps"]["transformers"]["serving"]["layout"] == "layercut"
    assert len(result["rows"]["dense"]["transformers"]["greedy"]) == 32
    table = (out / "serving.md").read_text()
    assert "| maps | no (maps) |" in table and "| dense | transformers, llama.cpp, vLLM |" in table

    # a second engine's run into the same folder adds its column and keeps the first one's
    stored = json.loads((out / "serving.json").read_text())
    stored["rows"]["dense"]["vllm"] = {"engine": "vllm", "runs": True, "ppl": result["rows"]["dense"]["transformers"]
                                       ["ppl"] * 1.01, "serving": {"layout": "vanilla"}}
    (out / "serving.json").write_text(json.dumps(stored))
    assert bench_main(["serving", "--model", f"dense={tiny_folder}", "--model", f"maps={maps}", "--heldout",
                       str(text), "--tokens", "256", "--seq-len", "64", "--engines", "transformers",
                       "--out", str(out)]) == 0
    table = (out / "serving.md").read_text()
    assert "vLLM ppl" in table and "(+1.000 %) (beyond 0.1 %)" in table
    # another model under a label the folder already has: refused, its rows are not mixed with the first's
    assert bench_main(["serving", "--model", f"dense={maps}", "--heldout", str(text), "--tokens", "256",
                       "--seq-len", "64", "--engines", "transformers", "--out", str(out)]) == 2
    assert "a model labelled 'dense' at" in capsys.readouterr().err
    # other tokens into the same folder: refused in one line
    assert bench_main(["serving", "--model", f"dense={tiny_folder}", "--heldout", str(text), "--tokens", "256",
                       "--seq-len", "32", "--engines", "transformers", "--out", str(out)]) == 2
    assert "other tokens" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(CONVERTER is None, reason=NO_CONVERTER)
def test_llama_cpp_gives_transformers_perplexity_and_refuses_maps(tmp_path, capsys):
    if importlib.util.find_spec("llama_cpp") is None:  # not imported: it loads llama.cpp into this process
        pytest.skip("llama-cpp-python is not installed (pip install 'layercut[llamacpp]')")
    source = tmp_path / "src"
    make_tiny_model("llama").save_pretrained(source)
    byte_fallback_tokenizer().save_pretrained(source)
    slim, maps = tmp_path / "slim", tmp_path / "maps"
    for out, method in ((slim, "fold"), (maps, "linear")):
        code, _, err = run_prune_cli(capsys, "--model", source, "--drop", "1", "--replace", method, "--samples",
                                     "4", "--seq-len", "32", "--out", out)
        assert code == 0, err
    text = tmp_path / "heldout.txt"
    text.write_text("abc def ghi jkl mno pqr stu vwx yz ABC DEF " * 60)
    out = tmp_path / "serving"
    # in a child process: llama.cpp's OpenMP runtime is never loaded beside the test process's torch
    done = subprocess.run([sys.executable, "-m", "eval.bench", "serving", "--model", f"slim={slim}", "--model",
                           f"maps={maps}", "--heldout", str(text), "--tokens", "256", "--seq-len", "128",
                           "--converter", str(CONVERTER), "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((out / "serving.json").read_text())["rows"]
    assert rows["slim"]["llamacpp"]["ppl"] == pytest.approx(rows["slim"]["transformers"]["ppl"], rel=1e-3)
    assert rows["slim"]["llamacpp"]["blocks"] == 3
    assert rows["slim"]["llamacpp"]["greedy"] == rows["slim"]["transformers"]["greedy"]
    assert not rows["maps"]["llamacpp"]["runs"] and "vLLM or llama.cpp" in rows["maps"]["llamacpp"]["why"]


class BlockCountEngine(Engine):
    """A stand-in engine timing each checkpoint by its block count, as written in its config.json."""

    name, module, distribution, extra, max_batch = "blocks", "json", "blocks-engine", None, None

    def __init__(self):
        self.loaded = []

    def check(self):
        return None

    def available(self):
        return True

    def version(self):
        return "1"

    def load(self, path, settings=None):
        from eval.speed.engines import EngineModel, EngineSettings
        from prune.checkpoint.gguf import check_servable

        check_servable(Path(path))  # what llama.cpp's export refuses: maps
        blocks = json.loads((Path(path) / "config.json").read_text())["num_hidden_layers"]
        self.loaded.append(str(path))
        return EngineModel(model=None, source=str(path), blocks=blocks, params=0, weights_bytes=0,
                           checkpoint_bytes=None, vocab_size=64, max_positions=None, device="test",
                           settings=settings or EngineSettings())

    def decode_seconds(self, handle, prompt_ids, new_tokens):
        return 0.01 * handle.blocks * new_tokens

    def close(self, handle):
        return None


def test_compare_takes_its_speed_column_from_the_engine(tiny_folder, tmp_path, one_thread):
    from eval.speed.engines import ENGINES

    engine = BlockCountEngine()
    ENGINES.register(engine.name, engine)
    try:
        from eval.compare.config import CompareConfig
        from eval.compare.grid import run_comparison
        from prune.checkpoint.load_config import LoadConfig
        from prune.data.calibration import DataConfig

        config = CompareConfig(load=LoadConfig(model=str(tiny_folder)), data=DataConfig(samples=8, seq_len=32),
                               drops=[1], methods=_recipes("shortgpt", "layercut-linear"), out=tmp_path / "cmp",
                               speed_tokens=4, engine="blocks")
        run_comparison(config)
    finally:
        ENGINES.unregister(engine.name)
    results = json.loads((tmp_path / "cmp" / "results.json").read_text())
    assert results["setup"]["engine"] == "blocks"
    shortgpt, linear = results["cells"]["shortgpt@1"], results["cells"]["layercut-linear@1"]
    assert shortgpt["decode_speedup"] == pytest.approx(4 / 3)  # the engine's own timing of 4 against 3 blocks
    assert "decode_s" not in linear and "not servable" in linear["decode_why"]
    assert shortgpt["serving"]["layout"] == "vanilla" and linear["serving"]["layout"] == "layercut"
    readme = (tmp_path / "cmp" / "README.md").read_text()
    assert "KV cache in blocks" in readme and "| not servable |" in readme and "| no (maps) |" in readme
    assert engine.loaded[0] == str(tiny_folder)  # the dense row is the source checkpoint, timed by the engine


def _recipes(*names):
    from eval.compare.config import parse_methods

    return parse_methods(",".join(names))


def test_greedy_ids_of_the_transformers_engine_are_generates(tiny_folder, one_thread):
    from transformers import AutoModelForCausalLM

    from eval.speed.engines import get_engine

    engine = get_engine("transformers")
    handle = engine.load(str(tiny_folder))
    prompt = list(range(5, 21))
    got = engine.greedy(handle, [prompt], 8)
    model = AutoModelForCausalLM.from_pretrained(tiny_folder).eval()
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert got == expected[0, len(prompt):].tolist() and len(got) == 8


def test_the_serving_table_and_flags_name_the_registered_engines():
    from eval.bench.cli import build_parser
    from eval.bench.serving import markdown

    setup = {"heldout": "t.txt", "windows": 1, "seq_len": 8, "predicted": 7}
    rows = {"m": {"vllm": {"runs": True, "ppl": 10.0}, "other": {"runs": False, "why": "not here"},
                  "transformers": {"runs": True, "ppl": 10.0}}}
    table = markdown({"setup": setup, "rows": rows})
    # the registry's order and display names; an engine this environment does not know keeps its name
    assert "| model | serves | transformers ppl | vLLM ppl | other ppl |" in table
    assert "| m | - | 10.000 | 10.000 (+0.000 %) | no: not here |" in table
    usage = build_parser()._subparsers._group_actions[0].choices["serving"].format_help()
    assert "comma list of transformers, llamacpp, vllm" in " ".join(usage.split())


def test_a_serving_table_of_format_1_reads_its_rows_serving_entries_in_the_current_format():
    from eval.bench.serving import FORMAT, markdown, migrate

    old = {"layout": "decilm", "engines": ["vllm"], "vllm": True, "llama_cpp": False, "llama_cpp_why_not": "no-op FFN"}
    stored = migrate({"setup": {}, "rows": {"m": {"vllm": {"runs": True, "ppl": 9.0, "serving": old}}}})
    assert stored["format"] == FORMAT
    assert stored["rows"]["m"]["vllm"]["serving"] == {"layout": "decilm", "why_not": {"llamacpp": "no-op FFN"}}
    setup = {"heldout": "t.txt", "windows": 1, "seq_len": 8, "predicted": 7}
    assert "| m | vLLM (DeciLM layout) |" in markdown({**stored, "setup": setup})
    with pytest.raises(LayercutError, match="upgrade with pip install -U layercut"):
        migrate({"format": FORMAT + 1})
