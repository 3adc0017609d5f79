"""``layercut.json``'s format (``prune.checkpoint.report``): every earlier format loads, a newer one is refused."""

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import prune
from prune.checkpoint.decilm import write_decilm
from prune.checkpoint.report import FORMAT, REPORT_FILE, migrate, read_report, upgrade_records
from prune.checkpoint.serving import folder_serving
from prune.errors import LayercutError
from prune.model.layouts import DECILM, LAYERCUT, VANILLA, serving_entry
from prune.model.surgery import drop_blocks_
from prune.replace import LinearMap, ReplaceConfig, replace_blocks_, replacement_modules
from prune.selection.sublayers import Unit, remove_units_
from tests.helpers import make_tiny_model, make_tiny_tokenizer


def ids(samples=16, seq=32):
    return torch.randint(3, 320, (samples, seq), generator=torch.Generator().manual_seed(0))


def logits(model):
    with torch.no_grad():
        return model(ids(2, 20)).logits


def read(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text(encoding="utf-8"))


def write(folder: Path, name: str, data: dict) -> None:
    (folder / name).write_text(json.dumps(data), encoding="utf-8")


def unnumbered(report: dict, serving: bool = False) -> dict:
    """``report`` as the oldest unnumbered reports were: records under ``kind`` without ``maps``, no ``serving``."""
    old = {key: value for key, value in report.items() if key not in ("format", *(() if serving else ("serving",)))}
    old["replacements"] = [{("kind" if key == "method" else key): value for key, value in record.items()
                            if key != "maps"} for record in report.get("replacements", [])]
    return old


@pytest.fixture(scope="module")
def maps_model():
    model = make_tiny_model("llama")
    replace_blocks_(model, [1, 2], ids(), ReplaceConfig(method="linear", progress=False))
    return model


def test_every_writer_stamps_the_format(tmp_path, maps_model):
    out = prune.save(maps_model, make_tiny_tokenizer(), tmp_path / "maps", {"dropped": [1, 2]})
    assert read(out, REPORT_FILE)["format"] == FORMAT
    assert read_report(out)["format"] == FORMAT


def test_a_report_of_the_current_format_is_read_as_written(tmp_path, maps_model):
    out = prune.save(maps_model, make_tiny_tokenizer(), tmp_path / "maps", {"dropped": [1, 2]})
    written = read(out, REPORT_FILE)
    assert migrate(written) == written
    assert read_report(out) == written


def test_unnumbered_records_name_their_method_and_flag_their_maps():
    records = [{"kind": "linear", "replaces": [1, 2]}, {"kind": "fold", "replaces": [3]},
               {"method": "lowrank", "replaces": [4]}]
    assert upgrade_records(records) == [{"method": "linear", "replaces": [1, 2], "maps": True},
                                        {"method": "fold", "replaces": [3]},
                                        {"method": "lowrank", "replaces": [4], "maps": True}]
    assert records[0] == {"kind": "linear", "replaces": [1, 2]}, "the records read are not changed"


def test_an_unnumbered_report_gets_its_serving_entry_from_its_records_without_a_folder():
    maps = migrate({"replacements": [{"kind": "linear", "replaces": [1]}]})
    assert maps["format"] == FORMAT and maps["serving"] == serving_entry(LAYERCUT)
    assert maps["replacements"] == [{"method": "linear", "replaces": [1], "maps": True}]
    fold = migrate({"replacements": [{"kind": "fold", "replaces": [1]}]})
    assert fold["serving"] == serving_entry(VANILLA)
    written = {**serving_entry(VANILLA), "note": "as written"}
    assert migrate({"serving": written})["serving"] == written, "a serving entry written before the format stays"


def test_an_unnumbered_distillation_names_its_losses():
    old = {"distill": {"steps": 5, "config": {"lr": 1e-4, "kl_weight": 1.0, "mse_weight": 0.5, "cosine_reg": 0.0}}}
    distill = migrate(old)["distill"]
    assert distill == {"steps": 5, "config": {"lr": 1e-4, "losses": {"teacher_student_kl": 1.0, "layerwise_mse": 0.5}}}
    assert "kl_weight" in old["distill"]["config"], "the report read is not changed"


def test_a_maps_checkpoint_of_the_unnumbered_format_loads(tmp_path, maps_model):
    """The oldest layout: no format, records under "kind" without "maps" (report and config), no serving entry."""
    out = prune.save(maps_model, make_tiny_tokenizer(), tmp_path / "old", {"dropped": [1, 2]})
    current = read(out, REPORT_FILE)
    write(out, REPORT_FILE, unnumbered(current))
    config = read(out, "config.json")
    base = config["base_config"]
    base["layercut_replacements"] = unnumbered({"replacements": base["layercut_replacements"]})["replacements"]
    write(out, "config.json", config)

    assert read_report(out) == current
    assert folder_serving(out) == serving_entry(LAYERCUT)
    loaded = prune.load(out)
    torch.testing.assert_close(logits(loaded.model), logits(maps_model), rtol=0, atol=1e-6)
    assert [type(m) for m in replacement_modules(loaded.model)] == [LinearMap]
    assert loaded.model.config.layercut_replacements == current["replacements"]


def test_a_plain_checkpoint_of_the_unnumbered_format_loads(tmp_path):
    """A report written with its serving entry but before the format number."""
    model = make_tiny_model("qwen2")
    drop_blocks_(model, [1, 2])
    out = prune.save(model, make_tiny_tokenizer(), tmp_path / "plain", {"dropped": [1, 2]})
    current = read(out, REPORT_FILE)
    write(out, REPORT_FILE, unnumbered(current, serving=True))
    assert read_report(out) == current
    loaded = prune.load(out)
    torch.testing.assert_close(logits(loaded.model), logits(model), rtol=0, atol=1e-6)


def test_a_sublayer_checkpoint_of_the_unnumbered_format_is_read_in_the_decilm_layout(tmp_path):
    """Sub-layer removals written before the serving entry: the wrapped config shows they fit the DeciLM layout."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=256, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                                         max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                                         eos_token_id=2)).eval()
    remove_units_(model, [Unit(1, "attention"), Unit(2, "mlp")], ids(1, 16))
    out = prune.save(model, make_tiny_tokenizer(), tmp_path / "units", {"source_model": "tiny"})
    write(out, REPORT_FILE, unnumbered(read(out, REPORT_FILE)))
    report = read_report(out)
    assert report["format"] == FORMAT and report["serving"]["layout"] == DECILM
    torch.testing.assert_close(logits(prune.load(out).model), logits(model), rtol=0, atol=1e-6)
    decilm = write_decilm(out, tmp_path / "units-decilm")
    assert read(decilm, REPORT_FILE)["format"] == FORMAT


def test_a_format_2_serving_entry_names_no_engine():
    """Format 2 listed the engines in the entry; their registry says it now (eval.speed.engines)."""
    old = {"format": 2, "serving": {"layout": "decilm", "engines": ["vllm"], "vllm": True, "llama_cpp": False,
                                    "llama_cpp_why_not": "a no-op FFN", "why": "no-op entries", "serve": "vllm serve"}}
    assert migrate(old)["serving"] == {"layout": "decilm", "why": "no-op entries", "serve": "vllm serve",
                                       "why_not": {"llamacpp": "a no-op FFN"}}
    plain = {"format": 2, "serving": {"layout": "vanilla", "engines": ["transformers", "vllm", "llama.cpp"],
                                      "vllm": True, "llama_cpp": True, "why": "a plain checkpoint"}}
    assert migrate(plain)["serving"] == {"layout": "vanilla", "why": "a plain checkpoint"}


def test_a_plain_checkpoint_of_format_2_loads(tmp_path):
    model = make_tiny_model("llama")
    drop_blocks_(model, [1])
    out = prune.save(model, make_tiny_tokenizer(), tmp_path / "plain", {"dropped": [1]})
    current = read(out, REPORT_FILE)
    serving = {**current["serving"], "engines": ["transformers", "vllm", "llama.cpp"], "vllm": True,
               "llama_cpp": True}
    write(out, REPORT_FILE, {**current, "format": 2, "serving": serving})
    assert read_report(out) == current and folder_serving(out) == serving_entry(VANILLA)
    torch.testing.assert_close(logits(prune.load(out).model), logits(model), rtol=0, atol=1e-6)


def test_a_report_of_a_newer_format_is_refused_in_one_line(tmp_path):
    model = make_tiny_model("llama")
    out = prune.save(model, make_tiny_tokenizer(), tmp_path / "new", {})
    write(out, REPORT_FILE, {**read(out, REPORT_FILE), "format": FORMAT + 1})
    for call in (lambda: read_report(out), lambda: prune.load(out), lambda: folder_serving(out)):
        with pytest.raises(LayercutError, match="written by a newer layercut.*upgrade with pip install -U layercut"
                           ) as err:
            call()
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("version", ["2", 0, True, None])
def test_a_format_that_is_no_number_is_a_damaged_report(version):
    with pytest.raises(LayercutError, match="is damaged"):
        migrate({"format": version})
