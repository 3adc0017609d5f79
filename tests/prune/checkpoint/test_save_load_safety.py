"""A checkpoint with maps never loads as another model, and every refusal says what to do instead.

transformers' concrete classes (``LlamaForCausalLM.from_pretrained``) adopt a nested config whose ``model_type``
matches theirs; a checkpoint with maps keeps its base config where none does, so they refuse it, while
``prune.load`` and ``trust_remote_code=True`` load it with its maps, in the new layout and the old one.
"""

import json

import pytest
import torch
import transformers.dynamic_module_utils
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, LlamaForCausalLM

import prune
from prune.checkpoint.save_load import SERVING
from prune.model import remote_code as hf_remote_code
from prune.replace import ReplaceConfig, replace_blocks_
from tests.helpers import make_tiny_model, make_tiny_tokenizer

SERVABLE = ("--replace fold", "--replace none", "magcomp")


@pytest.fixture(autouse=True)
def _no_remote_code_prompt(monkeypatch):
    """transformers asks on a terminal before running a checkpoint's code; here it refuses at once."""
    monkeypatch.setattr(transformers.dynamic_module_utils, "TIME_OUT_REMOTE_CODE", 0)


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture
def maps_checkpoint(tmp_path, one_thread):
    """A tiny Llama with block 1 replaced by a linear map, saved; and the in-memory model it came from."""
    model = make_tiny_model("llama")
    calibration = torch.randint(3, 320, (8, 32), generator=torch.Generator().manual_seed(0))
    replace_blocks_(model, [1], calibration, ReplaceConfig(method="linear", progress=False))
    return model, prune.save(model, make_tiny_tokenizer(), tmp_path / "linear", {"dropped": [1]})


IDS = torch.randint(3, 320, (2, 20), generator=torch.Generator().manual_seed(11))


def test_concrete_and_auto_classes_refuse_a_maps_checkpoint(maps_checkpoint):
    _, out = maps_checkpoint
    with pytest.raises(Exception, match="load it with prune.load") as caught:
        LlamaForCausalLM.from_pretrained(out)
    assert "trust_remote_code=True" in str(caught.value)
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        AutoModelForCausalLM.from_pretrained(out)


def assert_loads_with_maps(model, out):
    """prune.load gives the saved model's logits exactly; the remote code within float32 rounding."""
    expected = logits(model, IDS)
    torch.testing.assert_close(logits(prune.load(out).model, IDS), expected, rtol=0, atol=0)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    torch.testing.assert_close(logits(remote, IDS), expected, rtol=0, atol=1e-6)


def test_maps_checkpoint_loads_with_its_maps(maps_checkpoint):
    assert_loads_with_maps(*maps_checkpoint)


def test_no_config_class_adopts_the_base_config(maps_checkpoint):
    _, out = maps_checkpoint
    config = json.loads((out / "config.json").read_text())
    assert config["base_model_type"] == "llama" and "model_type" not in config["base_config"]
    assert not any(isinstance(v, dict) and v.get("model_type") == "llama" for v in config.values())


def test_old_layout_checkpoint_still_loads(maps_checkpoint):
    """Checkpoints written before: the base config nested with its model_type, no refusal field."""
    model, out = maps_checkpoint
    config = json.loads((out / "config.json").read_text())
    base = hf_remote_code.unwrap_config_dict(config)
    old = {key: value for key, value in config.items() if key not in (hf_remote_code.BASE_TYPE_KEY, "vocab_size")}
    old["base_config"] = base
    old["auto_map"] = {k: v for k, v in old["auto_map"].items() if k != "AutoModel"}
    (out / "config.json").write_text(json.dumps(old))
    assert_loads_with_maps(model, out)


def test_engines_building_from_the_config_are_told_what_serves(maps_checkpoint):
    """vLLM's Transformers backend builds AutoModel from the config: the refusal names the servable exports."""
    _, out = maps_checkpoint
    config = AutoConfig.from_pretrained(out, trust_remote_code=True)
    assert "AutoModel" in config.auto_map
    with pytest.raises(TypeError) as caught:
        AutoModel.from_config(config, trust_remote_code=True)
    message = str(caught.value)
    assert "\n" not in message and "vLLM" in message and all(way in message for way in SERVABLE)


def test_report_and_card_say_it_is_not_servable(maps_checkpoint):
    _, out = maps_checkpoint
    report = json.loads((out / "layercut.json").read_text())
    assert report["serving"] == SERVING and report["serving"]["layout"] == "layercut"
    card = (out / "README.md").read_text()
    assert "vLLM and llama.cpp cannot run it" in card and all(way in card for way in SERVABLE)


def test_tokenizer_files_point_to_no_custom_code(maps_checkpoint):
    _, out = maps_checkpoint
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert "auto_map" not in tokenizer_config
