"""Sub-layer units (``--unit attention,mlp``): their states, their removal, the export and the refusals."""

import json

import pytest
import torch
import transformers.dynamic_module_utils
from transformers import AutoModelForCausalLM

import prune
from prune.errors import LayercutError
from prune.loading.loader import load_model
from prune.model.adapters import get_blocks
from prune.model.capture import residual_states
from prune.model.remote_code import SUBLAYERS_KEY, ZeroSublayer
from prune.model.surgery import drop_blocks_
from prune.replace import parameter_count
from prune.selection.sublayers import (
    Unit,
    candidate_units,
    check_units_supported,
    contribution_path,
    parse_units,
    remove_units_,
    sublayer_path,
)
from tests.helpers import assert_cache_and_generate, make_tiny_model, run_prune_cli

# llama: sequential pre-norm; gemma2: norms on both sub-layer outputs and sliding-window layers;
# gpt2: Conv1D layers; gpt_neox: attention and MLP in parallel on one input
MODEL_TYPES = ["llama", "gemma2", "gpt2", "gpt_neox"]


def ids(samples=2, seq=24, seed=0):
    return torch.randint(3, 320, (samples, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(autouse=True)
def _no_remote_code_prompt(monkeypatch):
    monkeypatch.setattr(transformers.dynamic_module_utils, "TIME_OUT_REMOTE_CODE", 0)


@pytest.mark.parametrize("text,expected", [("block", ("block",)), ("attention", ("attention",)),
                                           ("mlp,attention", ("attention", "mlp")),
                                           ("block,attention,mlp", ("attention", "mlp"))])
def test_parse_units(text, expected):
    assert parse_units(text) == expected


@pytest.mark.parametrize("text", ["heads", "", "attention,ffn"])
def test_parse_units_refuses_unknown_units(text):
    with pytest.raises(LayercutError, match="--unit takes block, attention, mlp"):
        parse_units(text)


def _zeroing_hooks(model, units):
    """The reference removal: forward hooks that zero each sub-module's output, nothing replaced."""
    _, blocks = get_blocks(model)
    handles = []
    for unit in units:
        module = blocks[unit.block].get_submodule(sublayer_path(model, unit.kind))

        def zero(_m, _a, output):
            if isinstance(output, tuple):
                return (torch.zeros_like(output[0]), *output[1:])
            return torch.zeros_like(output)

        handles.append(module.register_forward_hook(zero))
    return handles


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_middle_state_is_the_block_output_without_its_mlp(model_type, one_thread):
    model = make_tiny_model(model_type)
    states = {}
    with torch.no_grad(), residual_states(model, lambda i, h: states.__setitem__(i, h.clone()),
                                          contribution_path(model)):
        model(ids())
    assert sorted(states) == list(range(9))  # 4 blocks: inputs, middles and the last output
    block_states = {}
    with torch.no_grad(), residual_states(model, lambda i, h: block_states.__setitem__(i, h.clone())):
        model(ids())
    for i in range(5):
        torch.testing.assert_close(states[2 * i], block_states[i], rtol=0, atol=0)
    # block 2's output with its MLP zeroed (and block 3 never mattering) is the middle state 2 * 2 + 1
    handles = _zeroing_hooks(model, [Unit(2, "mlp")])
    zeroed = {}
    try:
        with torch.no_grad(), residual_states(model, lambda i, h: zeroed.__setitem__(i, h.clone())):
            model(ids())
    finally:
        for handle in handles:
            handle.remove()
    torch.testing.assert_close(zeroed[3], states[5], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(states[5], states[6], atol=1e-3)  # the MLP does add something


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_removal_matches_zeroed_outputs_and_keeps_the_cache_right(model_type, one_thread):
    # block 2's attention: not the first of its kind on gemma2 either (blocks 0 and 1 are those)
    units = [Unit(1, "mlp"), Unit(2, "attention"), Unit(3, "attention"), Unit(3, "mlp")]
    reference = make_tiny_model(model_type)
    _zeroing_hooks(reference, units[:2])  # on for good
    drop_blocks_(reference, [3])  # both halves of block 3 go: it is removed whole
    model = make_tiny_model(model_type)
    before = parameter_count(model)
    record = remove_units_(model, units, ids(1, 16))
    assert record["blocks_removed_whole"] == [3] and record["num_blocks_after"] == 3
    _, blocks = get_blocks(model)
    assert isinstance(blocks[1].get_submodule(sublayer_path(model, "mlp")), ZeroSublayer)
    assert isinstance(blocks[2].get_submodule(sublayer_path(model, "attention")), ZeroSublayer)
    assert [(r["block"], r["kind"]) for r in getattr(model.config, SUBLAYERS_KEY)] == [(1, "mlp"), (2, "attention")]
    with torch.no_grad():
        torch.testing.assert_close(model(ids()).logits, reference(ids()).logits, rtol=1e-5, atol=1e-5)
    fresh = get_blocks(make_tiny_model(model_type))[1]
    expected = parameter_count(fresh[3]) + sum(parameter_count(fresh[u.block].get_submodule(
        sublayer_path(model, u.kind))) for u in units[:2])
    assert before - parameter_count(model) == expected
    assert_cache_and_generate(model, ids(2, 16))


def test_the_first_attention_of_each_kind_stays(monkeypatch, one_thread):
    import prune.selection.sublayers

    gemma = make_tiny_model("gemma2")  # sliding, full, sliding, full
    assert prune.selection.sublayers.anchor_attentions(gemma) == {0, 1}
    assert Unit(1, "attention") not in candidate_units(gemma, ("attention",), [])
    with pytest.raises(LayercutError, match="1.attention is the first attention of its kind"):
        remove_units_(gemma, [Unit(1, "attention")], ids(1, 16))
    # without that rule the cache check catches it: the full-attention mask is sized at block 1's empty cache
    monkeypatch.setattr(prune.selection.sublayers, "anchor_attentions", lambda model: {0})
    with pytest.raises(LayercutError, match="decoding through the KV cache no longer matches"):
        remove_units_(make_tiny_model("gemma2"), [Unit(1, "attention")], ids(1, 16))


def test_falcon_adds_into_the_mlp_output_in_place_and_the_middle_state_is_still_right(one_thread):
    from prune.model.tiny import build_tiny

    model = build_tiny("falcon").eval()
    states = {}
    with torch.no_grad(), residual_states(model, lambda i, h: states.__setitem__(i, h.clone()),
                                          contribution_path(model)):
        model(ids())
    _zeroing_hooks(model, [Unit(1, "mlp")])
    zeroed = {}
    with torch.no_grad(), residual_states(model, lambda i, h: zeroed.__setitem__(i, h.clone())):
        model(ids())
    torch.testing.assert_close(zeroed[2], states[3], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(states[3], states[2], atol=1e-4)  # the attention does add something


def test_candidates_keep_the_first_attention_and_protected_blocks():
    model = make_tiny_model("llama")
    units = candidate_units(model, ("attention", "mlp"), protected=[3])
    assert Unit(0, "attention") not in units and Unit(0, "mlp") in units
    assert not any(u.block == 3 for u in units) and len(units) == 5


def test_opt_removes_attention_but_refuses_mlp(one_thread):
    model = make_tiny_model("opt")
    check_units_supported(model, ("attention",))
    reference = make_tiny_model("opt")
    _zeroing_hooks(reference, [Unit(2, "attention")])
    remove_units_(model, [Unit(2, "attention")], ids(1, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(ids()).logits, reference(ids()).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(LayercutError, match=r"--unit attention,mlp: opt blocks have no mlp module to remove "
                       r"alone \(its feed-forward is bare"):
        check_units_supported(model, ("attention", "mlp"))


def test_a_block_that_adds_more_than_its_other_sublayer_is_refused(one_thread):
    model = make_tiny_model("llama")
    _, blocks = get_blocks(model)
    # as a biased norm on the attention output would: the block adds a constant of its own
    blocks[2].register_forward_hook(lambda _m, _a, output: (output[0] + 0.5, *output[1:])
                                    if isinstance(output, tuple) else output + 0.5)
    with pytest.raises(LayercutError, match="block 2 still adds something without its attention"):
        remove_units_(model, [Unit(2, "attention")], ids(1, 16))


def test_cli_exports_a_checkpoint_that_only_loads_with_its_removals(tiny_folder, tmp_path, capsys, one_thread):
    out = tmp_path / "units"
    code, stdout, _ = run_prune_cli(capsys, "--model", tiny_folder, "--unit", "attention,mlp", "--drop", 3,
                                    "--samples", 16, "--seq-len", 32, "--heldout-samples", 2, "--out", out)
    assert code == 0, stdout
    assert "removed 3 sub-layer(s) by linearity" in stdout and "| unit |" in stdout
    report = json.loads((out / "layercut.json").read_text())
    assert len(report["sublayers"]["units"]) == 3 and report["unit"] == ["attention", "mlp"]
    assert (out / "scores.md").is_file() and (out / "linearity_profile.png").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "layercut"
    assert len(config["base_config"][SUBLAYERS_KEY]) == len(report["sublayers"]["sublayers"])

    loaded = prune.load(out)
    assert sum(isinstance(m, ZeroSublayer) for m in loaded.model.modules()) == len(report["sublayers"]["sublayers"])
    assert parameter_count(loaded.model) < parameter_count(make_tiny_model("llama"))
    remote = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    with torch.no_grad():
        torch.testing.assert_close(remote(ids()).logits, loaded.model(ids()).logits, rtol=0, atol=1e-5)
    # the held-out figure is the exported model's: reloaded, it scores the same
    heldout = report["heldout"]
    assert heldout["pruned"] != heldout["original"]
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        AutoModelForCausalLM.from_pretrained(out)
    with pytest.raises(LayercutError, match="prune.load"):
        load_model(str(out))


def test_a_sublayer_checkpoint_is_not_pruned_again_and_says_what_it_is(tiny_folder, tmp_path, capsys, one_thread):
    out = tmp_path / "once"
    code, stdout, _ = run_prune_cli(capsys, "--model", tiny_folder, "--unit", "attention", "--drop", 1,
                                    "--samples", 16, "--seq-len", 32, "--heldout-samples", 0, "--out", out)
    assert code == 0, stdout
    assert "1 attention/MLP sub-layers removed" in (out / "README.md").read_text()
    with pytest.raises(LayercutError, match="removed attention/MLP sub-layers: load it with prune.load"):
        load_model(str(out))
    code, _, err = run_prune_cli(capsys, "--model", out, "--drop", 1, "--samples", 16, "--seq-len", 32,
                                 "--out", tmp_path / "twice")
    assert code == 2 and "already has attention/MLP sub-layers removed" in err, err


def test_target_params_removes_the_fewest_sublayers_that_meet_it(tiny_folder, tmp_path, capsys, one_thread):
    total = parameter_count(make_tiny_model("llama"))
    target = total - parameter_count(make_tiny_model("llama").model.layers[1].self_attn) - 1
    code, stdout, _ = run_prune_cli(capsys, "--model", tiny_folder, "--unit", "attention", "--target-params", target,
                                    "--samples", 16, "--seq-len", 32, "--heldout-samples", 0, "--out",
                                    tmp_path / "budget")
    assert code == 0, stdout
    report = json.loads((tmp_path / "budget" / "layercut.json").read_text())
    assert report["budget"]["drop"] == 2  # one attention does not reach it; two (blocks 1 and 2) do
    assert report["budget"]["params_after"] <= target


@pytest.mark.parametrize("args,message", [
    (["--unit", "attention", "--select", "span"], "--select with --unit attention: sub-layer removal ranks"),
    (["--unit", "mlp", "--replace", "linear"], "--replace with --unit mlp"),
    (["--unit", "attention", "--target-speedup", "1.2"], "--target-speedup with --unit attention"),
    (["--unit", "heads"], "--unit takes block, attention, mlp"),
    (["--unit", "attention", "--drop", "7"], "cannot remove 7 sub-layers: only 2 can go"),
    (["--unit", "attention", "--oracle"], "--oracle with --unit attention"),
])
def test_bad_unit_input_is_one_line_and_exit_2(tiny_folder, tmp_path, capsys, args, message):
    extra = [] if "--target-speedup" in args or "--drop" in args else ["--drop", "2"]
    assert run_prune_cli(capsys, "--model", tiny_folder, "--unit", "mlp")[2].strip().endswith(
        "--unit mlp needs an amount: pass --drop N (sub-layers) or --target-params")
    code, _, err = run_prune_cli(capsys, "--model", tiny_folder, *args, *extra, "--samples", 16, "--seq-len", 32,
                                 "--out", tmp_path / "bad")
    errors = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("error")]
    assert code == 2 and len(errors) == 1 and message in errors[0] and "Traceback" not in err, err
    assert not (tmp_path / "bad").exists()


def test_unit_on_opt_mlp_is_refused_from_the_cli(tmp_path, capsys):
    from tests.helpers import make_tiny_tokenizer

    folder = tmp_path / "opt"
    make_tiny_model("opt").save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    code, _, err = run_prune_cli(capsys, "--model", folder, "--unit", "mlp", "--drop", "1", "--samples", 16,
                                 "--seq-len", 32, "--out", tmp_path / "x")
    errors = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("error")]
    assert code == 2 and len(errors) == 1 and "opt blocks have no mlp module" in errors[0], err


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_skipped_units_give_the_removed_model_and_measured_costs_are_its_perplexity(model_type, one_thread):
    from prune.measure.heldout import packed_perplexity
    from prune.selection.sublayers import MEASURE_SEQUENCES, measured_costs, units_skipped

    units = [Unit(1, "mlp"), Unit(2, "attention")]
    model = make_tiny_model(model_type)
    removed = make_tiny_model(model_type)
    remove_units_(removed, units, ids(1, 16))
    with torch.no_grad():
        dense = model(ids()).logits
        with units_skipped(model, units):
            skipped = model(ids()).logits
        torch.testing.assert_close(skipped, removed(ids()).logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(ids()).logits, dense, rtol=0, atol=0)  # hooks gone on exit
    calibration = ids(MEASURE_SEQUENCES + 2, 16, seed=5)
    cache = measured_costs(model, calibration, units)
    alone = make_tiny_model(model_type)
    remove_units_(alone, units[1:], ids(1, 16))
    # the later sequences are not read: the cost is the perplexity of the first ones
    assert cache[units[1].label()] == pytest.approx(packed_perplexity(alone, calibration[:MEASURE_SEQUENCES],
                                                                      progress=False), rel=1e-5)
    assert cache["dense"] == pytest.approx(packed_perplexity(model, calibration[:MEASURE_SEQUENCES],
                                                             progress=False), rel=1e-6)
    assert cache[units[0].label()] != cache["dense"]


def test_measured_ranking_is_cost_per_parameter():
    from prune.selection.sublayers import rank_measured

    attention, mlp, helps = Unit(1, "attention"), Unit(1, "mlp"), Unit(2, "attention")
    costs = {"dense": 10.0, attention.label(): 11.0, mlp.label(): 12.0, helps.label(): 9.5}
    sizes = {attention: 100, mlp: 300, helps: 100}
    # log(1.2) / 300 = 6.1e-4 per parameter beats log(1.1) / 100 = 9.5e-4; a removal that lowers it leads
    assert rank_measured(costs, sizes, [attention, mlp, helps]) == [helps, mlp, attention]


def test_cli_measured_removes_the_cheapest_per_parameter(tiny_folder, tmp_path, capsys, one_thread):
    out = tmp_path / "measured"
    code, stdout, _ = run_prune_cli(capsys, "--model", tiny_folder, "--unit", "attention,mlp", "--select", "measured",
                                    "--drop", 2, "--samples", 16, "--seq-len", 32, "--heldout-samples", 0,
                                    "--out", out)
    assert code == 0, stdout
    assert "by measured cost per parameter (8 sequences)" in stdout
    report = json.loads((out / "layercut.json").read_text())
    measured = report["sublayer_measured"]
    assert set(report["sublayers"]["units"]) == set(measured["ranked"][:2])
    assert len(measured["perplexity"]) == len(measured["ranked"]) + 1  # every candidate and the dense model
