"""``prune.save`` / ``prune.load``: vanilla and replacement checkpoints round-trip with equal logits."""

import json

import pytest
import torch

import prune
from prune.checkpoint import save_load as checkpoint
from prune.errors import LayercutError
from prune.loading.loader import LoadedModel
from prune.model.adapters import get_blocks
from prune.model.surgery import block_layout, drop_blocks_
from prune.replace import LinearMap, LowRankMap, ReplaceConfig, ReplacedBlock, replace_blocks_, replacement_modules
from tests.helpers import make_tiny_model, make_tiny_tokenizer


def calibration(samples=16, seq=32, seed=0):
    return torch.randint(3, 320, (samples, seq), generator=torch.Generator().manual_seed(seed))


def logits(model, seed=11):
    with torch.no_grad():
        return model(calibration(2, 20, seed=seed)).logits


@pytest.mark.parametrize(
    "model_type,method,dropped",
    [
        ("llama", "linear", [1, 2]),
        ("llama", "linear", [0, 2]),  # a map before block 0's successor and one after it
        ("gpt2", "lowrank", [2]),
        ("opt", "linear", [3]),
        ("gpt_neox", "lowrank", [0]),
    ],
)
def test_replacement_checkpoint_round_trip(tmp_path, model_type, method, dropped):
    model = make_tiny_model(model_type)
    records = replace_blocks_(model, dropped, calibration(),
                              ReplaceConfig(method=method, progress=False, steps=5 if method == "lowrank" else None))
    expected = logits(model)
    out = prune.save(model, make_tiny_tokenizer(), tmp_path / "ckpt", {"dropped": dropped})
    assert (out / "replacements.safetensors").is_file()
    assert "prune.load" in (out / "README.md").read_text()
    report = json.loads((out / "layercut.json").read_text())
    assert report["replacements"] == records and report["layout"] == block_layout(model)
    assert any(isinstance(b, ReplacedBlock) for b in get_blocks(model)[1]), "saving keeps the wrappers in memory"

    loaded = prune.load(out)
    torch.testing.assert_close(logits(loaded.model), expected, rtol=0, atol=1e-6)
    assert block_layout(loaded.model) == block_layout(model)
    assert loaded.model.config.layercut_replacements == records
    cls = LinearMap if method == "linear" else LowRankMap
    assert [type(m) for m in replacement_modules(loaded.model)] == [cls] * len(records)
    # plain transformers must not read the folder as the kept blocks without the maps (model/test_remote_code.py)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "layercut" and config["base_model_type"] == model_type
    assert (out / "modeling_layercut.py").is_file()


def test_vanilla_round_trip_and_layout(tmp_path):
    model = make_tiny_model("qwen2")
    drop_blocks_(model, [1, 2])
    out = prune.save(model, make_tiny_tokenizer(), tmp_path / "slim", {"dropped": [1, 2]})
    assert not (out / "replacements.safetensors").exists()
    loaded = prune.load(str(out))
    torch.testing.assert_close(logits(loaded.model), logits(model), rtol=0, atol=1e-6)
    assert block_layout(loaded.model) == [[0], [3]]


def test_load_without_the_maps_file_is_a_clear_error(tmp_path):
    model = make_tiny_model("llama")
    replace_blocks_(model, [2], calibration(), ReplaceConfig(method="linear", progress=False))
    out = prune.save(model, make_tiny_tokenizer(), tmp_path / "lin", {})
    (out / "replacements.safetensors").unlink()
    with pytest.raises(LayercutError, match="records linear replacements but has no replacements.safetensors"):
        prune.load(out)


def test_load_delegates_names_to_load_model(monkeypatch):
    calls = []
    loaded = LoadedModel(make_tiny_model("llama"), make_tiny_tokenizer(), "smollm2-135m", "hub")

    def fake_load_model(name, **kwargs):
        calls.append((name, kwargs))
        return loaded

    monkeypatch.setattr(checkpoint, "load_model", fake_load_model)
    assert prune.load("smollm2-135m", dtype="bfloat16") is loaded
    assert calls == [("smollm2-135m", {"dtype": "bfloat16", "allow_maps": True})]


def test_vanilla_blocks_restores_wrappers_on_error():
    model = make_tiny_model("llama")
    replace_blocks_(model, [2], calibration(), ReplaceConfig(method="linear", progress=False))
    with pytest.raises(RuntimeError), checkpoint.vanilla_blocks(model) as maps:
        assert list(maps) == ["1.after"] and not isinstance(get_blocks(model)[1][1], ReplacedBlock)
        raise RuntimeError("boom")
    assert isinstance(get_blocks(model)[1][1], ReplacedBlock)


def maps_metadata(folder):
    from safetensors import safe_open

    with safe_open(str(folder / "replacements.safetensors"), framework="pt") as handle:
        return json.loads(handle.metadata()["layercut_maps"])


def test_maps_file_metadata_keeps_its_format(tmp_path):
    """The saved map specs stay what earlier checkpoints hold, so those keep loading."""
    model = make_tiny_model("llama")
    replace_blocks_(model, [0, 2], calibration(), ReplaceConfig(method="linear", progress=False))
    out = prune.save(model, make_tiny_tokenizer(), tmp_path / "lin", {})
    assert maps_metadata(out) == {"0.before": {"type": "linear", "dim": 32}, "0.after": {"type": "linear", "dim": 32}}
    model = make_tiny_model("llama")
    replace_blocks_(model, [2], calibration(), ReplaceConfig(method="lowrank", rank=3, steps=0, progress=False))
    out = prune.save(model, make_tiny_tokenizer(), tmp_path / "low", {})
    assert maps_metadata(out) == {"1.after": {"type": "lowrank", "dim": 32, "rank": 3, "residual": True}}


def test_checkpoint_with_legacy_kind_records_loads(tmp_path):
    """Checkpoints written before the rename name the method under "kind"."""
    model = make_tiny_model("llama")
    replace_blocks_(model, [1, 2], calibration(), ReplaceConfig(method="linear", progress=False))
    out = prune.save(model, make_tiny_tokenizer(), tmp_path / "old", {})
    config = json.loads((out / "config.json").read_text())
    base = config["base_config"]  # the records live in the wrapped model's config
    base["layercut_replacements"] = [{("kind" if k == "method" else k): v for k, v in r.items()}
                                     for r in base["layercut_replacements"]]
    (out / "config.json").write_text(json.dumps(config))
    loaded = prune.load(out)
    torch.testing.assert_close(logits(loaded.model), logits(model), rtol=0, atol=1e-6)
    assert [type(m) for m in replacement_modules(loaded.model)] == [LinearMap]
    (out / "replacements.safetensors").unlink()
    with pytest.raises(LayercutError, match="records linear replacements but has no replacements.safetensors"):
        prune.load(out)


def test_unknown_map_type_is_a_clear_error():
    with pytest.raises(LayercutError, match="holds a map of unknown type 'squash': update layercut"):
        checkpoint._build_map({"type": "squash", "dim": 4})
    with pytest.raises(TypeError, match="cannot save a replacement map of type Linear"):
        checkpoint._map_spec(torch.nn.Linear(2, 2))


def test_load_passes_every_keyword_to_load_model(monkeypatch):
    seen = {}
    loaded = LoadedModel(make_tiny_model("llama"), make_tiny_tokenizer(), "x", "hub")
    monkeypatch.setattr(checkpoint, "load_model", lambda name, **kwargs: seen.update(kwargs) or loaded)
    prune.load("x", dtype="float32", device="cpu", load_in_4bit=False, load_in_8bit=False, tokenizer="gpt2")
    assert seen == {"dtype": "float32", "device": "cpu", "load_in_4bit": False, "load_in_8bit": False,
                    "tokenizer": "gpt2", "allow_maps": True}


def test_load_fetches_the_maps_of_a_hub_checkpoint(tmp_path, monkeypatch):
    """A hub id whose records need maps gets its replacements.safetensors from the hub (the cache here)."""
    import transformers.utils

    from prune.loading.loader import load_model

    model = make_tiny_model("llama")
    replace_blocks_(model, [2], calibration(), ReplaceConfig(method="linear", progress=False))
    out = prune.save(model, make_tiny_tokenizer(), tmp_path / "lin", {})
    base = load_model(str(out), allow_maps=True)
    monkeypatch.setattr(checkpoint, "load_model", lambda name, **kwargs: LoadedModel(base.model, base.tokenizer,
                                                                                     name, "org/lin"))
    asked = []
    monkeypatch.setattr(transformers.utils, "cached_file",
                        lambda repo, file: asked.append((repo, file)) or str(out / file))
    loaded = prune.load("org/lin")
    assert asked == [("org/lin", "replacements.safetensors")]
    torch.testing.assert_close(logits(loaded.model), logits(model), rtol=0, atol=1e-6)
