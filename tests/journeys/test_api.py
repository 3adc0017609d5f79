"""The Python API in a notebook: ``prune.slim`` on a model in memory, ``prune.score``, ``prune.save`` of a result."""

import json
import subprocess
import sys

import pytest
import torch

import prune
from prune.api import check_quantized
from prune.checkpoint.gguf import default_output
from prune.errors import LayercutError
from prune.measure.scores import SCORES
from tests.helpers import (
    _TEXT,
    BLOCKS,
    CONVERTER,
    NO_CONVERTER,
    assert_cache_and_generate,
    byte_fallback_tokenizer,
    make_tiny_model,
)

SMALL = {"samples": 8, "seq_len": 32, "heldout_samples": 2}


@pytest.fixture
def nothing_written(tmp_path, monkeypatch):
    """A clean working folder, home and layercut cache: the test asserts they stay empty."""
    folders = {name: tmp_path / name for name in ("cwd", "home", "cache")}
    for folder in folders.values():
        folder.mkdir()
    monkeypatch.chdir(folders["cwd"])
    monkeypatch.setenv("HOME", str(folders["home"]))
    monkeypatch.setenv("LAYERCUT_CACHE", str(folders["cache"]))
    yield folders
    for name, folder in folders.items():
        assert [str(p.relative_to(folder)) for p in folder.rglob("*")] == [], f"slim wrote into {name}"


def test_notebook_example(tmp_path, tokenised_novel, one_thread):
    # the README's "Python API" example, on a tiny llama
    model, tokenizer = make_tiny_model("llama"), tokenised_novel
    result = prune.slim(model, tokenizer, drop=1, replace="fold", **SMALL)
    assert result.model is model and len(result.dropped) == 1
    assert model.config.num_hidden_layers == BLOCKS - 1 and len(model.model.layers) == BLOCKS - 1
    assert result.report["replace"] == "fold" and result.report["data"]["source"].startswith("built-in:")
    assert repr(result).startswith(f"SlimResult(llama: {BLOCKS} -> {BLOCKS - 1} blocks, dropped {result.dropped}, "
                                   "replace fold, held-out perplexity")
    ids = torch.randint(3, 320, (2, 16))
    assert_cache_and_generate(result.model, ids)

    folder = prune.save(result, tmp_path / "slim")
    assert {"config.json", "model.safetensors", "layercut.json", "README.md", "scores.md",
            "linearity_profile.png"} <= {p.name for p in folder.iterdir()}
    written = json.loads((folder / "layercut.json").read_text())
    assert written["dropped"] == result.dropped and written["serving"]["layout"] == "vanilla"
    with torch.no_grad():
        torch.testing.assert_close(prune.load(folder).model(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
    with pytest.raises(LayercutError, match="exists and is not empty"):
        prune.save(result, folder)


def test_slim_writes_nothing(nothing_written, tiny_tokenizer, one_thread):
    model = make_tiny_model("llama")
    result = prune.slim(model, tiny_tokenizer, drop=1, replace="linear", data=[_TEXT * 40], **SMALL)
    assert result.report["data"]["source"] == "texts(1)" and result.report["config"]["data"]["data"] == "texts(1)"
    assert result.report["config"]["out"] is None and result.report["config"]["load"]["dtype"] == "float32"
    scores = prune.score(model, tiny_tokenizer, data=[_TEXT * 40], samples=8, seq_len=32)
    assert len(scores) == BLOCKS - 1
    # nor does the default repair, chosen once the model is known
    default = prune.slim(make_tiny_model("llama"), tiny_tokenizer, drop=1, data=[_TEXT * 40], **SMALL)
    assert default.report["replace"] == "fold-rotate" and default.report["config"]["out"] is None


def test_drop_share_and_data_file_take_what_prune_run_takes(tmp_path, tiny_tokenizer, one_thread):
    text = tmp_path / "text.txt"
    text.write_text(_TEXT * 40, encoding="utf-8")
    result = prune.slim(make_tiny_model("llama"), tiny_tokenizer, drop="50%", data=str(text), protect="0",
                        **SMALL)
    assert len(result.dropped) == 2 and 0 not in result.dropped and result.report["protect"] == [0]
    # the default repair is prune.run's: the best servable one this layout takes (untied head: fold-rotate)
    assert result.report["replace"] == "fold-rotate" and result.report["config"]["auto_replace"]
    tied = prune.slim(make_tiny_model("llama", tie_word_embeddings=True), tiny_tokenizer, drop=1, data=str(text),
                      **SMALL)
    assert tied.report["replace"] == "fold"
    # a list of texts calibrates on the windows the same text read from a file gives
    model = make_tiny_model("llama")
    assert prune.score(model, tiny_tokenizer, data=[_TEXT * 40], **SMALL).scores == \
        prune.score(model, tiny_tokenizer, data=str(text), **SMALL).scores


def test_score_is_one_row_per_block_with_every_score(tokenised_novel, one_thread):
    model = make_tiny_model("qwen2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    table = prune.score(model, tokenised_novel, samples=8, seq_len=32)
    assert [row["block"] for row in table] == list(range(BLOCKS))
    assert all(set(row) == {"block", *SCORES} for row in table)
    assert table.data["source"].startswith("built-in:")
    assert str(table).splitlines()[0].startswith("| block | ") and len(str(table).splitlines()) == BLOCKS + 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing removed or changed


def test_recipe_by_name_or_file(tiny_tokenizer, tmp_path, monkeypatch, one_thread):
    result = prune.slim(make_tiny_model("llama"), tiny_tokenizer, drop=1, recipe="layercut-linear-vanilla",
                        data=[_TEXT * 40], **SMALL)
    assert result.report["replace"] == "fold" and result.report["score"] == "linearity"
    # a whole-run recipe: its drop and options hold unless given; its model and out are not slim's
    recipe = tmp_path / "run.yaml"
    recipe.write_text("load: {model: smollm2-135m}\ndrop: 2\nprotect: '0'\nselect: last\nout: written/\n")
    monkeypatch.chdir(tmp_path)
    result = prune.slim(make_tiny_model("llama"), tiny_tokenizer, drop=None, recipe=str(recipe), data=[_TEXT * 40],
                        **SMALL)
    assert result.dropped == [2, 3] and result.report["config"]["load"]["model"] == "in-memory llama"
    assert not (tmp_path / "written").exists()
    with pytest.raises(LayercutError, match="prune.slim does not run distill"):
        prune.slim(make_tiny_model("llama"), tiny_tokenizer, drop=1, recipe="layercut-linear-distill")
    with pytest.raises(LayercutError, match="unknown method 'no-such-recipe'"):
        prune.slim(make_tiny_model("llama"), tiny_tokenizer, drop=1, recipe="no-such-recipe")


def test_peft_model_is_refused_naming_merge_and_unload(tiny_tokenizer):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(make_tiny_model("llama"), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    for call in (lambda: prune.slim(model, tiny_tokenizer, drop=1), lambda: prune.score(model, tiny_tokenizer)):
        with pytest.raises(LayercutError, match=r"merge_and_unload\(\)") as caught:
            call()
        assert "\n" not in str(caught.value)
    assert len(model.base_model.model.model.layers) == BLOCKS


def test_quantized_model_is_refused_for_a_method_that_rewrites_weights(tiny_tokenizer):
    model = make_tiny_model("llama")
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    for method in ("fold", "magcomp"):
        with pytest.raises(LayercutError, match=f"replace {method} rewrites the kept blocks' weights, which this "
                           "bitsandbytes 4-bit model holds quantized: load the model without quantization") as caught:
            prune.slim(model, tiny_tokenizer, drop=1, replace=method)
        assert "replace='none'" in str(caught.value) and "\n" not in str(caught.value)
    assert len(model.model.layers) == BLOCKS
    for method in ("none", "linear", "lowrank", "linearpatch"):  # these read activations only
        check_quantized(model, method)
    for method in ("cosine", "block"):  # these write into the kept weights, as fold and magcomp do
        with pytest.raises(LayercutError, match=f"replace {method} rewrites"):
            check_quantized(model, method)


@pytest.mark.parametrize("options, message", [
    ({"out": "x"}, "out=: slim writes nothing: save the result with prune.save(result, path)"),
    ({"samplez": 8}, "unknown option(s) samplez; known: "),
    ({"target_params": "80%"}, "pass drop=None with target_params"),
    ({"data": 5}, "data must be None (the shipped novel), a --data spec"),
    ({"data": ["some text"], "seq_len": 512}, "--seq-len 512 exceeds the model's 256 positions"),
])  # fmt: skip
def test_bad_options_are_one_line(tiny_tokenizer, options, message):
    with pytest.raises(LayercutError) as caught:
        prune.slim(make_tiny_model("llama"), tiny_tokenizer, drop=1, **options)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_save_keeps_its_model_signature_and_export_needs_a_result(tmp_path, tiny_tokenizer):
    folder = prune.save(make_tiny_model("llama"), tiny_tokenizer, tmp_path / "plain", {"dropped": []})
    assert (folder / "model.safetensors").is_file()
    with pytest.raises(LayercutError, match="takes the result of prune.slim"):
        prune.save(make_tiny_model("llama"), tiny_tokenizer, tmp_path / "other", {}, export="gguf")


def test_gguf_export_of_a_result_with_maps_is_refused_before_writing(tmp_path, tiny_tokenizer, one_thread):
    result = prune.slim(make_tiny_model("llama"), tiny_tokenizer, drop=1, replace="linear", data=[_TEXT * 40],
                        **SMALL)
    with pytest.raises(LayercutError, match="writes maps that no serving engine runs"):
        prune.save(result, tmp_path / "slim", export="gguf")
    with pytest.raises(LayercutError, match="export 'gguf' takes no option outtype; its options: gguf_type, converter"):
        prune.save(result, tmp_path / "slim", export="gguf", outtype="f16")
    assert not (tmp_path / "slim").exists()


def test_gguf_export_without_a_converter_is_refused_before_writing(tmp_path, tiny_tokenizer, monkeypatch, one_thread):
    monkeypatch.delenv("LLAMA_CPP_CONVERTER", raising=False)
    monkeypatch.setenv("LAYERCUT_CACHE", str(tmp_path / "cache"))  # none fetched there
    result = prune.slim(make_tiny_model("llama"), tiny_tokenizer, drop=1, replace="fold", data=[_TEXT * 40], **SMALL)
    with pytest.raises(LayercutError, match="llama-cpp-python"):
        prune.save(result, tmp_path / "slim", export="gguf")
    assert not (tmp_path / "slim").exists()


@pytest.mark.skipif(CONVERTER is None, reason=NO_CONVERTER)
def test_save_with_gguf_export_writes_a_checked_gguf(tmp_path, one_thread):
    result = prune.slim(make_tiny_model("llama"), byte_fallback_tokenizer(), drop=1, replace="fold",
                        data=[_TEXT * 40], **SMALL)
    folder = prune.save(result, tmp_path / "slim", export="gguf", gguf_type="f16", converter=str(CONVERTER))
    assert default_output(folder, "f16").is_file() and (folder / "model.safetensors").is_file()


def test_import_prune_stays_light():
    code = ("import sys, prune; prune.slim; prune.save; prune.score; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'yaml'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
