"""Every causal-LM architecture of the installed transformers: pruned through the CLI, or refused with a reason.

Each supported architecture is built tiny from its own default config, saved with a tiny tokenizer,
pruned by ``python -m prune.run --drop 1``, reloaded with plain transformers and compared with the
original model whose dropped block is skipped by a forward hook.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from prune.errors import LayercutError
from prune.model.adapters import arch_spec, get_blocks, layer_count_attribute, text_config
from prune.model.architectures import (
    TINY_VOCAB,
    architecture_markdown,
    architecture_status,
    architecture_table,
    build_tiny,
    causal_lm_types,
)
from tests.helpers import make_tiny_tokenizer
from tests.helpers import run_prune_cli as run

TYPES = list(causal_lm_types())
# The decoder-only share the issue targets: of the architectures that build tiny and are decoders.
TARGET_SHARE = 0.9


@cache
def status(model_type):
    return architecture_status(model_type)


def skip_block(model, index):
    """A forward hook that makes block ``index`` return its input: the reference for dropping it."""
    block = get_blocks(model)[1][index]

    def hook(module, args, kwargs, output):
        hidden = args[0] if args else kwargs["hidden_states"]
        return type(output)([hidden, *output[1:]]) if isinstance(output, (tuple, list)) else hidden

    return block.register_forward_hook(hook, with_kwargs=True)


def prune_through_cli(model_type, tmp_path, capsys):
    """(original model, reloaded export, dropped index) for a tiny ``model_type``."""
    model = build_tiny(model_type)
    folder, out = tmp_path / "tiny", tmp_path / "out"
    model.save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    # the novel alone: text sampled from a random tiny model would move the block chosen on a hybrid to
    # one its config cannot describe without it (a refusal tested elsewhere)
    code, stdout, err = run(capsys, "--model", folder, "--data", "builtin", "--samples", "8", "--seq-len", "32",
                            "--batch-size", "4", "--drop", "1", "--protect", "none", "--heldout-samples", "2",
                            "--out", out)
    assert code == 0, err[-2000:]
    import json

    dropped = json.loads((out / "layercut.json").read_text())["dropped"]
    assert len(dropped) == 1
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    return model, reloaded, dropped[0]


@pytest.mark.slow
@pytest.mark.parametrize("model_type", TYPES)
def test_architecture_prunes_or_refuses(model_type, tmp_path, capsys, one_thread):
    row = status(model_type)
    if not row.checked:
        pytest.skip(f"not buildable tiny: {row.reason}")
    if not row.supported:
        assert row.reason and "\n" not in row.reason
        return
    model, reloaded, dropped = prune_through_cli(model_type, tmp_path, capsys)
    blocks = len(get_blocks(model)[1])
    config = text_config(reloaded)
    assert getattr(config, layer_count_attribute(config)) == blocks - 1 == len(get_blocks(reloaded)[1])
    layer_types = getattr(text_config(model), "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) == blocks:
        assert config.layer_types == layer_types[:dropped] + layer_types[dropped + 1:]
    ids = torch.randint(3, TINY_VOCAB, (2, 12))
    handle = skip_block(model, dropped)
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        handle.remove()
        got = reloaded(ids, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_coverage_of_buildable_decoders(capsys):
    rows = architecture_table()
    checked = [r for r in rows if r.checked and not r.family]
    supported = [r for r in checked if r.supported]
    with capsys.disabled():
        print(f"\nlayercut architecture coverage: {len(supported)} of {len(checked)} buildable decoder-only "
              f"causal-LM architectures supported ({len(rows)} in transformers)")
    assert len(supported) >= TARGET_SHARE * len(checked)
    names = {r.model_type for r in supported}
    assert {"llama", "qwen3_moe", "mixtral", "gemma3_text", "olmo2", "granite", "jamba", "qwen3_next"} <= names
    assert all(r.reason and "\n" not in r.reason for r in rows if not r.supported)
    table = architecture_markdown(rows)
    assert table.count("| supported |") == sum(r.supported for r in rows)


@pytest.mark.parametrize("model_type,reason", [
    ("bert", "an encoder (bidirectional) model"),
    ("bart", "an encoder-decoder model"),
    ("mamba", "a pure recurrent / state-space stack"),
    ("xlm", "its blocks are split across parallel lists"),
])
def test_refused_with_one_line_reason(model_type, reason):
    row = status(model_type)
    assert not row.supported and reason in row.reason


def test_arch_spec_refuses_an_encoder_by_name():
    with pytest.raises(LayercutError, match="unsupported architecture 'bert': an encoder.*--list-architectures"):
        arch_spec("bert")


def test_quick_representatives_prune_through_cli(tmp_path, capsys, one_thread):
    """Three shapes in the quick suite: dense with sliding layers, mixture-of-experts, attention/mamba hybrid."""
    for model_type in ("gemma3_text", "qwen3_moe", "jamba"):
        model, reloaded, dropped = prune_through_cli(model_type, tmp_path / model_type, capsys)
        ids = torch.randint(3, TINY_VOCAB, (1, 10))
        skip_block(model, dropped)
        with torch.no_grad():
            torch.testing.assert_close(reloaded(ids, use_cache=False).logits, model(ids, use_cache=False).logits,
                                       rtol=1e-4, atol=1e-4)
        assert AutoConfig.from_pretrained(tmp_path / model_type / "out").get_text_config().num_hidden_layers == 3
