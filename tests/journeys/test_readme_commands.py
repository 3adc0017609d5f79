"""The README's big-model command, typed as written, plans on this machine from the model's config.json alone."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from transformers import LlamaConfig

from tests.helpers import run_prune_cli

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_offload_command_plans_from_a_config_json(tmp_path, capsys, monkeypatch):
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```$", text, re.S | re.M)
    command = next(block for block in blocks if "--offload sequential" in block)
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[:3] == ["python", "-m", "prune.run"]
    argv = argv[3:]
    hub_id = argv[argv.index("--model") + 1]
    # the config.json of meta-llama/Meta-Llama-3-70B (its shape), as `hf download ... config.json` leaves it
    folder = tmp_path / hub_id.split("/")[-1]
    LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                tie_word_embeddings=False).save_pretrained(folder)
    argv[argv.index("--model") + 1] = str(folder / "config.json")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_prune_cli(capsys, *argv, "--plan", "--plan-gpus", "1", "--plan-gpu-memory", "24GB")
    assert code == 0, err
    assert "70.55B parameters, 80 blocks" in out and "offload sequential" in out and "(fits)" in out
