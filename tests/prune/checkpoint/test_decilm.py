"""The DeciLM layout of sub-layer removals (``prune.checkpoint.decilm``): config, tensors, forward, refusals."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import prune
from prune.checkpoint.decilm import write_decilm
from prune.checkpoint.decilm_config import CONFIG_CODE_FILE, decilm_config, decilm_serving, ffn_mult_for
from prune.checkpoint.save_load import save
from prune.decilm import main
from prune.errors import LayercutError
from prune.model.remote_code import MAPS_FILE, SUBLAYERS_KEY, unwrap_config_dict
from prune.selection.sublayers import Unit, remove_units_
from tests.helpers import CONVERTER, NO_CONVERTER, byte_fallback_tokenizer, make_tiny_model, make_tiny_tokenizer

HIDDEN, INTERMEDIATE = 32, 256  # the engines' FFN widths are multiples of 256: the tiny conftest llama's 64 is not one
REMOVED = [Unit(1, "attention"), Unit(2, "mlp")]
# what each removed sub-layer leaves behind in the layercut checkpoint: its norm, which the DeciLM layout drops
DROPPED_NORMS = {"model.layers.1.input_layernorm.weight", "model.layers.2.post_attention_layernorm.weight"}


def engine_width(ffn_mult: float, hidden: int) -> int:
    """vLLM's and llama.cpp's ``_ffn_mult_to_intermediate_size``, restated for the test."""
    width = int(2 * ffn_mult * hidden / 3)
    return width if width % 256 == 0 else width + 256 - width % 256


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=320, max_position_embeddings=256,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return LlamaForCausalLM(config).eval()


def ids(samples=2, seq=16):
    return torch.randint(3, 320, (samples, seq), generator=torch.Generator().manual_seed(0))


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    found = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            found.update({name: handle.get_tensor(name) for name in handle.keys()})
    return found


def one_line_error(call, match: str) -> str:
    with pytest.raises(LayercutError, match=match) as err:
        call()
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A layercut checkpoint of a tiny llama with block 1's attention and block 2's MLP removed."""
    model = tiny_llama()
    remove_units_(model, REMOVED, ids(1, 16))
    return save(model, make_tiny_tokenizer(), tmp_path_factory.mktemp("units") / "slim", {"source_model": "tiny"})


@pytest.fixture(scope="module")
def decilm(source, tmp_path_factory) -> Path:
    return write_decilm(source, tmp_path_factory.mktemp("decilm") / "slim-decilm")


def base_config(source: Path) -> dict:
    return unwrap_config_dict(json.loads((source / "config.json").read_text()))


def test_block_configs_mark_the_removed_sublayers_as_no_ops(source, decilm):
    config = json.loads((decilm / "config.json").read_text())
    base = base_config(source)
    records = base[SUBLAYERS_KEY]
    assert {(r["block"], r["kind"]) for r in records} == {(1, "attention"), (2, "mlp")}
    assert config["architectures"] == ["DeciLMForCausalLM"] and config["model_type"] == "nemotron-nas"
    assert config["auto_map"]["AutoConfig"] == "configuration_decilm.DeciLMConfig"
    assert len(config["block_configs"]) == config["num_hidden_layers"] == 4
    for block, entry in enumerate(config["block_configs"]):
        assert entry["attention"]["no_op"] == ((block, "attention") in {(r["block"], r["kind"]) for r in records})
        assert entry["ffn"]["no_op"] == ((block, "mlp") in {(r["block"], r["kind"]) for r in records})
        assert entry["attention"]["replace_with_linear"] is False and entry["ffn"]["replace_with_linear"] is False
        assert entry["attention"]["n_heads_in_group"] == (None if entry["attention"]["no_op"] else 4 // 2)
        assert (entry["ffn"]["ffn_mult"] is None) == entry["ffn"]["no_op"]
    # every other key of the plain config is kept; the records live in block_configs now
    assert SUBLAYERS_KEY not in config
    kept = {k: v for k, v in base.items() if k not in (SUBLAYERS_KEY, "model_type", "architectures")}
    assert {k: config[k] for k in kept} == kept


def test_ffn_mult_gives_the_intermediate_size_by_the_engines_formula(decilm):
    config = json.loads((decilm / "config.json").read_text())
    for entry in config["block_configs"]:
        if not entry["ffn"]["no_op"]:
            assert engine_width(entry["ffn"]["ffn_mult"], config["hidden_size"]) == config["intermediate_size"]


@pytest.mark.parametrize("hidden,intermediate", [(4096, 14336), (2048, 8192), (576, 1536), (2048, 5632),
                                                 (4096, 11008), (3072, 8192), (960, 2560), (8192, 28672)])
def test_ffn_mult_of_real_llama_sizes(hidden, intermediate):
    ffn_mult = ffn_mult_for(intermediate, hidden)
    assert ffn_mult is not None and engine_width(ffn_mult, hidden) == intermediate


@pytest.mark.parametrize("hidden,intermediate", [(32, 64), (576, 1000), (2048, 8000)])
def test_no_ffn_mult_gives_a_width_off_the_256_grid(hidden, intermediate):
    assert ffn_mult_for(intermediate, hidden) is None


def test_written_tensors_are_exactly_the_kept_ones(source, decilm):
    before, after = tensors(source), tensors(decilm)
    assert set(after) == set(before) - DROPPED_NORMS
    assert not any(".layers.1.self_attn." in name or ".layers.2.mlp." in name for name in after)
    for name, value in after.items():
        assert value.dtype == before[name].dtype and torch.equal(value, before[name]), name
    assert (decilm / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert (decilm / CONFIG_CODE_FILE).is_file() and not (decilm / "modeling_layercut.py").exists()
    report = json.loads((decilm / "layercut.json").read_text())
    assert report["source_model"] == "tiny"
    assert report["serving"]["layout"] == "decilm" and set(report["serving"]["why_not"]) == {"llamacpp"}
    # block 2 keeps its attention without an MLP: llama.cpp would skip the whole layer
    assert "--llama-cpp" in report["serving"]["why_not"]["llamacpp"]


def _reference(folder: Path, base: dict) -> LlamaForCausalLM:
    """A plain Llama holding the DeciLM folder's tensors, each no-op sub-layer's output projection zeroed."""
    config = json.loads((folder / "config.json").read_text())
    model = LlamaForCausalLM(LlamaConfig.from_dict({k: v for k, v in base.items() if k != SUBLAYERS_KEY})).eval()
    missing, unexpected = model.load_state_dict(tensors(folder), strict=False)
    assert not unexpected
    expected_missing = set()
    with torch.no_grad():
        for block, entry in enumerate(config["block_configs"]):
            layer = model.model.layers[block]
            for kind, module, out, norm in (("attention", "self_attn", "o_proj", "input_layernorm"),
                                            ("ffn", "mlp", "down_proj", "post_attention_layernorm")):
                if entry[kind]["no_op"]:
                    getattr(getattr(layer, module), out).weight.zero_()  # the sub-layer adds nothing
                    expected_missing |= {f"model.layers.{block}.{norm}.weight"} | {
                        f"model.layers.{block}.{module}.{n}" for n, _ in getattr(layer, module).named_parameters()}
    assert set(missing) == expected_missing
    return model


@pytest.mark.parametrize("llama_cpp", [False, True])
def test_the_decilm_folder_computes_the_layercut_model(source, tmp_path, llama_cpp, one_thread):
    out = write_decilm(source, tmp_path / "decilm", llama_cpp=llama_cpp)
    reference = _reference(out, base_config(source))
    loaded = prune.load(source)
    with torch.no_grad():
        torch.testing.assert_close(reference(ids()).logits, loaded.model(ids()).logits, rtol=0, atol=1e-5)
    if llama_cpp:  # block 2's MLP is a zero MLP of width 256, not a no-op: llama.cpp keeps its attention
        config = json.loads((out / "config.json").read_text())
        assert config["block_configs"][2]["ffn"]["no_op"] is False
        assert engine_width(config["block_configs"][2]["ffn"]["ffn_mult"], HIDDEN) == 256
        written = tensors(out)
        assert all(not written[f"model.layers.2.mlp.{p}_proj.weight"].any() for p in ("gate", "up", "down"))
        assert "why_not" not in decilm_serving(config)


def test_the_config_reads_as_vllm_reads_it(decilm):
    config = AutoConfig.from_pretrained(decilm, trust_remote_code=True)
    written = json.loads((decilm / "config.json").read_text())
    assert config.model_type == "nemotron-nas" and config.num_key_value_heads == 2
    assert config.rope_parameters == written["rope_parameters"]
    assert config.block_configs[1].attention.no_op is True and config.block_configs[2].ffn.no_op is True
    assert hasattr(config.block_configs[0].ffn, "ffn_mult") and not hasattr(config.block_configs[0].ffn, "hidden_act")
    # vLLM's KV heads: from the first block with attention
    first = next(b for b in config.block_configs if not b.attention.no_op)
    assert config.num_attention_heads // first.attention.n_heads_in_group == 2
    assert config.to_dict()["block_configs"] == written["block_configs"]
    with pytest.raises((ValueError, OSError)):  # no modeling code: transformers cannot build it
        AutoModelForCausalLM.from_pretrained(decilm, trust_remote_code=True)


def test_a_sharded_source_gives_the_same_tensors_and_an_index(source, decilm, tmp_path):
    sharded = tmp_path / "sharded"
    shutil.copytree(source, sharded)
    whole = tensors(source)
    names = sorted(whole)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: whole[n] for n in part}, str(sharded / file), metadata={"format": "pt"})
    (sharded / "model.safetensors").unlink()
    weight_map = {n: f for f, part in halves.items() for n in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    out = write_decilm(sharded, tmp_path / "out")
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    written = tensors(out)
    assert set(index) == set(written) == set(tensors(decilm))
    assert all(torch.equal(written[n], whole[n]) for n in written)
    assert all(index[n] == weight_map[n] for n in index)


@pytest.mark.parametrize("change,records,match", [
    ({"model_type": "qwen2"}, None, "holds Llama blocks, not 'qwen2'"),
    ({"model_type": "mistral", "sliding_window": 4096}, None, "sliding-window attention"),
    ({"attention_bias": True}, None, "biases"),
    ({"hidden_act": "gelu"}, None, "SiLU"),
    ({"intermediate_size": 64}, None, "intermediate_size 64 is no DeciLM ffn_mult's width"),
    ({}, [{"block": 2, "kind": "attention"}, {"block": 2, "kind": "mlp"}], "removes as a whole block"),
    ({}, [{"block": 0, "kind": "attention", "module": "self_attn"}], "block 0's attention"),
    ({}, [{"block": 7, "kind": "mlp", "module": "mlp"}], "names block 7 but the config has 4"),
    ({}, [{"block": 1, "kind": "mlp", "module": "feed_forward"}], "not a Llama attention"),
])
def test_configs_the_layout_cannot_hold_are_refused_in_one_line(source, change, records, match):
    base = {**base_config(source), **change}
    one_line_error(lambda: decilm_config(base, records if records is not None else base[SUBLAYERS_KEY]), match)


def test_mistral_without_a_window_is_a_llama(source):
    base = {**base_config(source), "model_type": "mistral", "sliding_window": None}
    assert decilm_config(base, base[SUBLAYERS_KEY])["model_type"] == "nemotron-nas"


def test_folders_that_are_not_sublayer_checkpoints_are_refused(source, tiny_folder, tmp_path):
    with_maps = tmp_path / "maps"
    shutil.copytree(source, with_maps)
    (with_maps / MAPS_FILE).write_bytes(b"")
    one_line_error(lambda: write_decilm(with_maps, tmp_path / "a"), "carries replacement maps")
    one_line_error(lambda: write_decilm(tiny_folder, tmp_path / "b"), "not a layercut sub-layer checkpoint")
    one_line_error(lambda: write_decilm(source, source, overwrite=True), "is the source folder")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_cli_writes_the_folder_and_refuses_in_one_line(source, tmp_path, capsys):
    assert main([str(source), "--out", str(tmp_path / "cli"), "--llama-cpp"]) == 0
    assert "--trust-remote-code" in capsys.readouterr().out
    assert main([str(source), "--out", str(tmp_path / "cli")]) == 2
    err = capsys.readouterr().err.strip()
    assert "exists and is not empty" in err and len(err.splitlines()) == 1


@pytest.mark.skipif(CONVERTER is None, reason=NO_CONVERTER)
def test_llama_cpps_converter_reads_the_folder_as_its_deci_architecture(source, tmp_path):
    gguf = pytest.importorskip("gguf")
    out = write_decilm(source, tmp_path / "decilm", llama_cpp=True)
    byte_fallback_tokenizer().save_pretrained(out)  # the converter's DeciLM path reads Llama-2 style vocabularies
    target = tmp_path / "tiny.gguf"
    done = subprocess.run([sys.executable, str(CONVERTER), str(out), "--outfile", str(target), "--outtype", "f32"],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    reader = gguf.GGUFReader(str(target))
    fields = {key: field.contents() for key, field in reader.fields.items() if key.startswith("deci.")}
    assert fields["deci.block_count"] == 4
    assert list(fields["deci.attention.head_count"]) == [4, 0, 4, 4]
    assert list(fields["deci.attention.head_count_kv"]) == [2, 0, 2, 2]
    assert list(fields["deci.feed_forward_length"]) == [256] * 4
    names = {t.name for t in reader.tensors}
    assert not any(n.startswith("blk.1.attn_") for n in names) and "blk.2.attn_norm.weight" in names
    source_tensors = tensors(out)
    down = next(t for t in reader.tensors if t.name == "blk.3.ffn_down.weight")
    expected = source_tensors["model.layers.3.mlp.down_proj.weight"]
    assert torch.equal(torch.from_numpy(down.data.copy()).reshape(expected.shape), expected)


@pytest.fixture(scope="module")
def servable_source(tmp_path_factory) -> Path:
    """The same removals saved with a Llama-2 style vocabulary, the kind llama.cpp's DeciLM converter reads."""
    model = tiny_llama()
    remove_units_(model, REMOVED, ids(1, 16))
    return save(model, byte_fallback_tokenizer(), tmp_path_factory.mktemp("units-bf") / "slim", {"source": "tiny"})


@pytest.mark.skipif(CONVERTER is None, reason=NO_CONVERTER)
def test_export_gguf_writes_sublayer_removals_as_llama_cpps_deci_and_takes_the_decilm_folder_too(servable_source,
                                                                                                  tmp_path):
    from prune.checkpoint.gguf import convert

    report = json.loads((servable_source / "layercut.json").read_text())
    assert report["serving"]["layout"] == "decilm" and "why_not" not in report["serving"]
    path, checked = convert(servable_source, tmp_path / "slim.gguf", converter=CONVERTER)
    assert checked["architecture"] == "deci" and checked["blocks"] == 4 and checked["compared"] > 0
    assert checked["max_rel_diff"] == 0.0
    # the DeciLM folder prune.checkpoint.decilm writes converts as it is (not written again)
    folder = write_decilm(servable_source, tmp_path / "decilm", llama_cpp=True)
    again, checked_again = convert(folder, tmp_path / "again.gguf", converter=CONVERTER)
    assert checked_again["blocks"] == 4 and again.stat().st_size == path.stat().st_size


def test_sublayer_removals_outside_the_layout_say_so_and_name_whole_blocks(tmp_path):
    """A model the DeciLM layout cannot hold (its MLP width): not labelled as maps, and the fix is whole blocks."""
    from prune.checkpoint.gguf import check_servable

    model = make_tiny_model("llama")  # intermediate 64: no ffn_mult gives it
    remove_units_(model, REMOVED, ids(1, 16))
    folder = save(model, make_tiny_tokenizer(), tmp_path / "slim", {"source_model": "tiny"})
    serving = json.loads((folder / "layercut.json").read_text())["serving"]
    assert serving["layout"] == "layercut" and "DeciLM layout" in serving["why"]
    assert serving["servable_instead"].startswith("--unit block")
    message = one_line_error(lambda: check_servable(folder), "not servable")
    assert "--unit block" in message and "maps" not in message
