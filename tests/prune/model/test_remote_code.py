"""A checkpoint with replacement maps never loads silently as another model.

Plain transformers refuses it, ``trust_remote_code=True`` loads it with its maps (the ``modeling_layercut.py``
it carries), ``prune.load`` loads it without remote code, and ``prune.loading.loader.load_model`` refuses it.
"""

import ast
import json
import shutil

import pytest
import torch
import transformers.dynamic_module_utils
from transformers import AutoModelForCausalLM, AutoTokenizer

import prune
from prune.errors import LayercutError
from prune.loading.loader import load_config, load_model
from prune.model import remote_code as hf_remote_code
from prune.model.surgery import block_layout
from prune.replace import LinearMap, LowRankMap, ReplaceConfig, replace_blocks_, replacement_modules
from tests.helpers import assert_cache_and_generate, make_tiny_model, make_tiny_tokenizer


def calibration(samples=8, seq=32, seed=0):
    return torch.randint(3, 320, (samples, seq), generator=torch.Generator().manual_seed(seed))


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(autouse=True)
def _no_remote_code_prompt(monkeypatch):
    """transformers asks on a terminal before running a checkpoint's code; here it refuses at once."""
    monkeypatch.setattr(transformers.dynamic_module_utils, "TIME_OUT_REMOTE_CODE", 0)


def save_replaced(tmp_path, model_type, method, dropped=(1,)):
    model = make_tiny_model(model_type)
    options = {"steps": 3} if method == "lowrank" else {}
    replace_blocks_(model, list(dropped), calibration(), ReplaceConfig(method=method, progress=False, **options))
    out = prune.save(model, make_tiny_tokenizer(), tmp_path / f"{model_type}-{method}", {"dropped": list(dropped)})
    return model, out


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
@pytest.mark.parametrize("method", ["linear", "lowrank"])
def test_maps_checkpoint_loads_with_remote_code_and_refuses_without(tmp_path, one_thread, model_type, method):
    model, out = save_replaced(tmp_path, model_type, method)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "layercut" and config["base_model_type"] == model_type
    assert config["auto_map"] == hf_remote_code.AUTO_MAP
    assert (out / "modeling_layercut.py").read_text() == open(hf_remote_code.__file__).read()

    with pytest.raises(ValueError, match="trust_remote_code=True"):
        AutoModelForCausalLM.from_pretrained(out)

    ids = calibration(2, 20, seed=11)
    expected = logits(prune.load(out).model, ids)
    torch.testing.assert_close(expected, logits(model, ids), rtol=0, atol=1e-6)
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert not remote.training and remote.config.model_type == model_type
    torch.testing.assert_close(logits(remote, ids), expected, rtol=0, atol=1e-5)
    assert_cache_and_generate(remote, ids)

    with pytest.raises(LayercutError) as caught:
        load_model(str(out))
    message = str(caught.value)
    assert "\n" not in message and "is a checkpoint with replacement maps" in message and "prune.load(path)" in message


def test_remote_code_refuses_a_maps_checkpoint_without_its_maps_file(tmp_path, one_thread):
    _, out = save_replaced(tmp_path, "llama", "linear")
    (out / "replacements.safetensors").unlink()
    with pytest.raises(ValueError, match="records replacement maps but has no replacements.safetensors"):
        AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)


def test_remote_code_needs_no_layercut():
    """The template imports only torch, transformers, safetensors and the standard library."""
    tree = ast.parse(open(hf_remote_code.__file__).read())
    nodes = list(ast.walk(tree))
    roots = {alias.name.split(".")[0] for node in nodes if isinstance(node, ast.Import) for alias in node.names}
    roots |= {node.module.split(".")[0] for node in nodes if isinstance(node, ast.ImportFrom)}
    assert roots <= {"__future__", "json", "torch", "safetensors", "transformers"}, roots


def test_remote_code_knows_every_saved_map_type():
    """A new method that saves maps must teach the checkpoint's modeling code its module too."""
    from prune.replace import METHODS

    saved = {name for name, method in METHODS.items() if not method.servable}
    assert saved <= set(hf_remote_code.MAP_TYPES), f"add {saved - set(hf_remote_code.MAP_TYPES)} to MAP_TYPES"


def test_model_card_says_how_to_load(tmp_path, one_thread):
    _, out = save_replaced(tmp_path, "llama", "linear")
    card = (out / "README.md").read_text()
    assert 'prune.load("llama-linear")' in card
    assert 'AutoModelForCausalLM.from_pretrained("llama-linear", trust_remote_code=True)' in card
    assert "refuses it" in card and "It is a plain checkpoint" not in card
    tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=True)  # as the card says
    assert tokenizer("a truth")["input_ids"] == make_tiny_tokenizer()("a truth")["input_ids"]


@pytest.mark.parametrize("method", ["none", "fold"])
def test_vanilla_exports_stay_plain(tmp_path, one_thread, method):
    model = make_tiny_model("llama")
    replace_blocks_(model, [1, 2], calibration(), ReplaceConfig(method=method, progress=False))
    out = prune.save(model, make_tiny_tokenizer(), tmp_path / method, {"dropped": [1, 2]})
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and "auto_map" not in config
    assert not (out / "modeling_layercut.py").exists() and not (out / "replacements.safetensors").exists()
    ids = calibration(2, 20, seed=11)
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(logits(plain, ids), logits(model, ids), rtol=0, atol=1e-5)
    assert load_model(str(out)).model.config.num_hidden_layers == 2


def test_old_unwrapped_checkpoint_still_loads_and_is_refused_by_the_plain_loader(tmp_path, one_thread):
    """Checkpoints written before the wrapping: base config.json, maps next to it, no modeling file."""
    model, out = save_replaced(tmp_path, "llama", "linear", dropped=(1, 2))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(hf_remote_code.unwrap_config_dict(config)))
    (out / "modeling_layercut.py").unlink()
    ids = calibration(2, 20, seed=11)
    loaded = prune.load(out).model
    torch.testing.assert_close(logits(loaded, ids), logits(model, ids), rtol=0, atol=1e-6)
    assert [type(m) for m in replacement_modules(loaded)] == [LinearMap]
    with pytest.raises(LayercutError, match="is a checkpoint with replacement maps"):
        load_model(str(out))


def test_reloaded_checkpoint_saves_wrapped_again(tmp_path, one_thread):
    """prune.load gives the base architecture with layercut's own map modules; saving it wraps it again."""
    model, out = save_replaced(tmp_path, "llama", "lowrank")
    loaded = prune.load(out)
    assert loaded.model.config.model_type == "llama" and not hasattr(loaded.model.config, "auto_map")
    assert [type(m) for m in replacement_modules(loaded.model)] == [LowRankMap]
    again = prune.save(loaded.model, loaded.tokenizer, tmp_path / "again", {})
    assert json.loads((again / "config.json").read_text())["model_type"] == "layercut"
    ids = calibration(2, 20, seed=11)
    reloaded = prune.load(again).model
    torch.testing.assert_close(logits(reloaded, ids), logits(model, ids), rtol=0, atol=1e-6)
    assert block_layout(reloaded) == block_layout(model)


def test_load_config_of_a_maps_checkpoint_is_the_base_config(tmp_path, one_thread):
    model, out = save_replaced(tmp_path, "llama", "linear", dropped=(1, 2))
    config = load_config(str(out))
    assert type(config) is type(model.config) and config.model_type == "llama"
    assert config.num_hidden_layers == 2 and config.layercut_layout == block_layout(model)


def test_a_folder_moved_elsewhere_keeps_loading(tmp_path, one_thread):
    """The remote code reads only the folder it is in (no absolute paths recorded)."""
    model, out = save_replaced(tmp_path, "gpt2", "linear")
    moved = shutil.move(str(out), str(tmp_path / "elsewhere"))
    ids = calibration(2, 20, seed=11)
    remote = AutoModelForCausalLM.from_pretrained(moved, trust_remote_code=True)
    torch.testing.assert_close(logits(remote, ids), logits(model, ids), rtol=0, atol=1e-5)
