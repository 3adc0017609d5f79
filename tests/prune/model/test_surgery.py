import pytest
import torch

from prune.errors import LayercutError
from prune.model.adapters import arch_spec, get_blocks
from prune.model.surgery import blocks_removed, drop_blocks_
from tests.helpers import TINY_TYPES, assert_cache_and_generate, make_tiny_model


def attention_indices(model):
    blocks = get_blocks(model)[1]
    return [m.layer_idx for b in blocks for m in b.modules() if hasattr(m, "layer_idx")]


@pytest.mark.parametrize("model_type", sorted(TINY_TYPES))
def test_drop_blocks_renumbers_and_generates_with_cache(model_type):
    model = make_tiny_model(model_type)
    ids = torch.randint(3, 320, (2, 12))
    kept_blocks = [get_blocks(model)[1][i] for i in (0, 3)]
    layer_types = getattr(model.config, "layer_types", None)
    kept = drop_blocks_(model, [1, 2])
    assert kept == [0, 3]
    spec = arch_spec(model)
    assert getattr(model.config, spec.layer_count) == 2
    assert list(get_blocks(model)[1]) == kept_blocks
    assert sorted(set(attention_indices(model))) == [0, 1]
    if layer_types is not None:
        assert model.config.layer_types == [layer_types[0], layer_types[3]]
    assert_cache_and_generate(model, ids)


def test_blocks_removed_restores_everything():
    model = make_tiny_model("gemma2")
    ids = torch.randint(3, 320, (1, 10))
    with torch.no_grad():
        before = model(ids).logits
        types = list(model.config.layer_types)
        with blocks_removed(model, [0, 2]):
            assert model.config.num_hidden_layers == 2
            during = model(ids).logits
        after = model(ids).logits
    assert not torch.allclose(before, during)
    torch.testing.assert_close(before, after)
    assert model.config.num_hidden_layers == 4 and model.config.layer_types == types
    assert attention_indices(model) == [0, 1, 2, 3]


def test_removed_block_is_really_skipped():
    """Dropping block 1 equals running the blocks 0, 2, 3 by hand."""
    model = make_tiny_model("gpt2")
    ids = torch.randint(3, 320, (1, 6))
    with torch.no_grad():
        h = model.transformer.wte(ids) + model.transformer.wpe(torch.arange(6))[None]
        blocks = list(model.transformer.h)
        for i in (0, 2, 3):
            out = blocks[i](h)
            h = out[0] if isinstance(out, tuple) else out
        expected = model.lm_head(model.transformer.ln_f(h))
        drop_blocks_(model, [1])
        torch.testing.assert_close(model(ids, use_cache=False).logits, expected, rtol=1e-5, atol=1e-5)
    assert model.config.n_layer == 3


def test_bad_block_indices():
    model = make_tiny_model("llama")
    with pytest.raises(LayercutError, match="out of range"):
        drop_blocks_(model, [7])
    with pytest.raises(LayercutError, match="at least one must stay"):
        drop_blocks_(model, [0, 1, 2, 3])


def _tiny(model_type, **overrides):
    from prune.model.architectures import build_tiny

    return build_tiny(model_type, **overrides)


def test_sparse_step_becomes_an_explicit_dense_list():
    """Qwen2-MoE with every 2nd layer sparse: after dropping block 1 the step no longer holds, mlp_only_layers does."""
    model = _tiny("qwen2_moe", decoder_sparse_step=2, mlp_only_layers=[])
    kinds = [type(b.mlp).__name__ for b in get_blocks(model)[1]]
    drop_blocks_(model, [1])
    assert model.config.decoder_sparse_step == 1 and model.config.mlp_only_layers == [0, 1]
    assert [type(b.mlp).__name__ for b in get_blocks(model)[1]] == [kinds[0], kinds[2], kinds[3]]
    rebuilt = type(model)(model.config)
    assert [type(b.mlp).__name__ for b in rebuilt.model.layers] == [kinds[0], kinds[2], kinds[3]]


def test_first_dense_layers_and_index_lists_are_renumbered():
    model = _tiny("deepseek_v3", first_k_dense_replace=2)
    drop_blocks_(model, [0])
    assert model.config.first_k_dense_replace == 1
    model = _tiny("lfm2", full_attn_idxs=[1, 3])
    assert model.config.layer_types == ["conv", "full_attention", "conv", "full_attention"]
    drop_blocks_(model, [1])
    assert model.config.layer_types == ["conv", "conv", "full_attention"]
    assert model.config.full_attn_idxs == [2]


def test_jamba_period_is_resolved_or_refused():
    model = _tiny("jamba")  # attention every 2nd layer from 1, experts every 2nd from 1
    drop_blocks_(model, [2, 3])
    assert (model.config.attn_layer_period, model.config.attn_layer_offset) == (2, 1)
    model = _tiny("jamba", num_hidden_layers=8)
    drop_blocks_(model, [0])  # attention at 1, 3, 5, 7 -> now at 0, 2, 4, 6: period 2, offset 0
    assert (model.config.attn_layer_period, model.config.attn_layer_offset) == (2, 0)
    with pytest.raises(LayercutError, match="attn_layer_period/attn_layer_offset .* cannot describe the kept blocks"):
        drop_blocks_(model, [1])  # attention would sit at 0, 1, 3, 5: no period fits
    assert len(get_blocks(model)[1]) == 7, "a refused removal changes nothing"


def test_cyclic_block_pattern_is_written_out():
    model = _tiny("recurrent_gemma")
    before = list(model.config.layers_block_type)
    drop_blocks_(model, [1])
    assert list(model.config.layers_block_type) == [before[0], before[2], before[3]]


def test_an_unknown_layer_counter_is_caught_by_rebuilding(monkeypatch):
    """If no rule knew decoder_sparse_step, the rebuilt model would put an MoE block where a dense one is kept."""
    from prune.model import surgery

    model = _tiny("qwen2_moe", decoder_sparse_step=2, mlp_only_layers=[])
    real = surgery.remapped_config_entries

    def without_step_rule(config, sources, count):
        step, config.decoder_sparse_step = config.decoder_sparse_step, 1  # hide the counter from the rules
        try:
            entries = real(config, sources, count)
        finally:
            config.decoder_sparse_step = step
        entries.pop("mlp_only_layers", None)
        return entries

    monkeypatch.setattr(surgery, "remapped_config_entries", without_step_rule)
    with pytest.raises(LayercutError, match="block 2 would reload as a different block.*choose other blocks"):
        drop_blocks_(model, [1])
    assert len(get_blocks(model)[1]) == 4


RULE = "n_input_layers + n_recurrent_layers + n_output_layers must equal num_hidden_layers"


@pytest.fixture
def layer_count_tied(monkeypatch):
    """A config whose own rules refuse any layer count but its original one (as transformers 5.24's dory does)."""
    from huggingface_hub.errors import StrictDataclassClassValidationError
    from transformers import LlamaConfig

    real = LlamaConfig.validate

    def validate(self):
        if self.num_hidden_layers != 4:
            cause = ValueError(RULE)
            raise StrictDataclassClassValidationError(validator="validate_architecture", cause=cause) from cause
        return real(self)

    monkeypatch.setattr(LlamaConfig, "validate", validate)


def test_a_layer_count_the_config_rules_refuse_is_one_line_before_anything_changes(layer_count_tied):
    from prune.model.surgery import check_removable

    model = make_tiny_model("llama")
    assert model.config.num_hidden_layers == 4
    for attempt in (lambda: drop_blocks_(model, [1]), lambda: check_removable(model, [1]),
                    lambda: blocks_removed(model, [1]).__enter__()):
        with pytest.raises(LayercutError) as err:
            attempt()
        assert "\n" not in str(err.value) and RULE in str(err.value) and "llama config with 3 blocks" in str(err.value)
        assert len(get_blocks(model)[1]) == 4 and model.config.num_hidden_layers == 4


def test_prune_run_refuses_such_a_model_with_exit_2_and_writes_nothing(layer_count_tied, tiny_folder, tmp_path,
                                                                       capsys):
    from prune.errors import EXIT_BAD_INPUT
    from tests.helpers import run_prune_cli

    out = tmp_path / "slim"
    code, _, err = run_prune_cli(capsys, "--model", tiny_folder, "--drop", "1", "--samples", "8", "--seq-len", "32",
                                 "--threads", "1", "--out", out)
    assert code == EXIT_BAD_INPUT and RULE in err.strip().splitlines()[-1] and "Traceback" not in err
    assert not out.exists()
