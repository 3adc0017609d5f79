"""Replacements of removed blocks: closed-form maps, low-rank maps, trained blocks, layout, KV cache."""

import pytest
import torch
from torch import nn

from prune.errors import LayercutError
from prune.measure.least_squares import fit_linear_map
from prune.measure.moments import span_pairs
from prune.model.adapters import arch_spec, get_blocks
from prune.model.capture import residual_states
from prune.model.surgery import blocks_removed, drop_blocks_
from prune.replace import (
    LinearMap,
    LowRankMap,
    PairAccumulator,
    ReplaceConfig,
    ReplacedBlock,
    SpanBatch,
    block_layout,
    fit_replacements,
    get_method,
    replace_blocks_,
    replacement_modules,
    replacement_records,
)
from prune.replace.linear import LinearFitter
from prune.replace.lowrank import reduced_rank_fit
from tests.helpers import TINY_TYPES, assert_cache_and_generate, make_tiny_model

HIDDEN = 32


def calibration(samples=16, seq=32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 320, (samples, seq), generator=generator)


def quick(method, steps=10, **kw):
    """A quiet config; ``steps`` only for the methods that train."""
    if "steps" in get_method(method).options.specs():
        kw["steps"] = steps
    return ReplaceConfig(method=method, progress=False, **kw)


def final_state(model, ids):
    states = {}
    last = len(get_blocks(model)[1])
    with torch.no_grad(), residual_states(model, lambda i, h: states.__setitem__(i, h)):
        model.base_model(input_ids=ids, use_cache=False)
    return states[last]


class AffineBlock(nn.Module):
    """A stand-in decoder block that is exactly h -> h A + b."""

    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = nn.Parameter(a), nn.Parameter(b)

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states @ self.a + self.b


@pytest.mark.parametrize("precision,rtol", [("float64", 1e-9), ("float32", 1e-5)])
def test_pair_accumulator_matches_explicit_moments(precision, rtol):
    torch.manual_seed(0)
    x = torch.randn(3, 50, 6) * 5 + 1000  # massive mean, small spread: the shift keeps the spread's digits
    y = torch.randn(3, 50, 4)
    acc = PairAccumulator(precision)
    for k in range(3):
        acc.update(x[k], y[k])
    m = acc.moments()
    fx, fy = x.reshape(-1, 6).double(), y.reshape(-1, 4).double()
    cx, cy = fx - fx.mean(0), fy - fy.mean(0)
    assert m.n == 150
    torch.testing.assert_close(m.mean_x, fx.mean(0))
    scale = float((cx.T @ cx).abs().max())
    torch.testing.assert_close(m.cxx, cx.T @ cx, rtol=rtol, atol=rtol * scale)
    torch.testing.assert_close(m.cxy, cx.T @ cy, rtol=rtol, atol=rtol * scale)


def test_linear_fitter_recovers_an_exact_map():
    torch.manual_seed(0)
    a, b = torch.randn(HIDDEN, HIDDEN), torch.randn(HIDDEN)
    model = make_tiny_model("llama")
    fitter = LinearFitter(model, list(get_blocks(model)[1]), (1, 2), quick("linear", update_scale=1))
    for _ in range(4):
        x = torch.randn(2, 64, HIDDEN, dtype=torch.float64)
        fitter.observe(SpanBatch(x, x @ a.double() + b.double()))
    result = fitter.finish()
    assert isinstance(result.module, LinearMap) and result.where == "after" and result.host == 0
    torch.testing.assert_close(result.module.proj.weight.T, a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(result.module.proj.bias, b, rtol=1e-5, atol=1e-5)
    assert result.record["params"] == HIDDEN * HIDDEN + HIDDEN


def test_linear_replacement_of_an_exactly_linear_block_is_exact():
    torch.manual_seed(0)
    model = make_tiny_model("llama")
    blocks = get_blocks(model)[1]
    blocks[2] = AffineBlock(torch.eye(HIDDEN) + 0.1 * torch.randn(HIDDEN, HIDDEN), 0.1 * torch.randn(HIDDEN))
    ids = calibration(4, 24, seed=1)
    with torch.no_grad():
        expected = model(ids).logits
    records = replace_blocks_(model, [2], calibration(), quick("linear", update_scale=1))
    assert records[0]["replaces"] == [2] and records[0]["method"] == "linear" and records[0]["fit"] == "independent"
    assert records[0]["params"] == HIDDEN * HIDDEN + HIDDEN and records[0]["fit_seconds"] >= 0
    assert model.config.num_hidden_layers == 3 and block_layout(model) == [[0], [1, 2], [3]]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)


def test_fit_short_adds_the_calibration_cut_into_short_sequences():
    """``short``: the least squares over the long sequences and the same tokens cut short, pooled."""
    model = make_tiny_model("llama")
    ids = calibration(8, 32)
    captured = {"x": [], "y": []}

    def keep(index, state):
        if index in (1, 3):
            captured["x" if index == 1 else "y"].append(state.detach().reshape(-1, HIDDEN))

    with torch.no_grad(), residual_states(model, keep):
        model.base_model(input_ids=ids, use_cache=False)
        model.base_model(input_ids=ids.reshape(-1, 8), use_cache=False)  # the 8-token cut: other states
    acc = PairAccumulator()
    acc.update(torch.cat(captured["x"]), torch.cat(captured["y"]))
    expected = fit_linear_map(acc.moments())
    short = fit_replacements(model, [1, 2], ids, quick("linear", short=8, update_scale=1))[0].module
    long = fit_replacements(model, [1, 2], ids, quick("linear", update_scale=1))[0].module
    torch.testing.assert_close(short.proj.weight.T.double(), expected.weight, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(long.proj.weight, short.proj.weight, atol=1e-3)
    # as long as the calibration sequences or longer, there is nothing to cut
    same = fit_replacements(model, [1, 2], ids, quick("linear", short=32, update_scale=1))[0].module
    torch.testing.assert_close(same.proj.weight, long.proj.weight)
    with pytest.raises(LayercutError, match="--fit-short takes a sequence length of at least 2"):
        quick("linear", short=1)
    # linear is fitted on 64-token sequences too unless told otherwise; the other methods are not
    assert quick("linear").short == 64 and quick("linear", short=0).short == 0
    assert quick("lowrank").short == 0 and quick("block").short == 0 and quick("none").short == 0


@pytest.mark.parametrize("method", ["linear", "fold"])
def test_update_scale_applies_that_share_of_the_fitted_update(method):
    """A share s of the update: the state handed on is h + s (f(h) - h), h the span's input (the removal's)."""
    ids, heldout = calibration(), calibration(4, 24, seed=3)
    whole, half, default, removed = (make_tiny_model("llama") for _ in range(4))

    def handed_on(model):  # block 1's input: the span's input before surgery, the state after it once the span is gone
        states = {}
        with torch.no_grad(), residual_states(model, lambda i, h: states.__setitem__(i, h)):
            model.base_model(input_ids=heldout, use_cache=False)
        return states[1]

    h = handed_on(whole)
    replace_blocks_(whole, [1, 2], ids, quick(method, update_scale=1))
    replace_blocks_(half, [1, 2], ids, quick(method, update_scale=0.5))
    replace_blocks_(default, [1, 2], ids, quick(method))
    drop_blocks_(removed, [1, 2])
    fitted = handed_on(whole)
    assert float((fitted - h).abs().max()) > 1e-2  # the map does move the state
    torch.testing.assert_close(handed_on(half), h + 0.5 * (fitted - h), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(handed_on(default), h + 0.7 * (fitted - h), rtol=1e-4, atol=1e-4)
    assert replacement_records(default)[0]["update_scale"] == 0.7
    torch.testing.assert_close(handed_on(removed), h)
    record = replacement_records(half)[0]
    assert record["update_scale"] == 0.5
    if method == "linear":  # the same map module, so the checkpoint layout does not change
        assert isinstance(replacement_modules(half)[0], LinearMap)


@pytest.mark.parametrize("model_type", sorted(TINY_TYPES))
def test_linear_beats_removal_on_the_final_state(model_type):
    ids, heldout = calibration(), calibration(4, 32, seed=7)
    reference = final_state(make_tiny_model(model_type), heldout)
    removed, linear = make_tiny_model(model_type), make_tiny_model(model_type)
    drop_blocks_(removed, [1, 2])
    replace_blocks_(linear, [1, 2], ids, quick("linear"))
    err_removed = ((final_state(removed, heldout) - reference) ** 2).mean()
    err_linear = ((final_state(linear, heldout) - reference) ** 2).mean()
    assert err_linear < err_removed, (float(err_linear), float(err_removed))


@pytest.mark.parametrize(
    "method,dropped,layout",
    [
        ("none", [1, 2], [[0], [3]]),
        ("linear", [1, 2], [[0, 1, 2], [3]]),
        ("linear", [0], [[0, 1], [2], [3]]),
        ("linear", [0, 2], [[0, 1, 2], [3]]),
        ("lowrank", [2, 3], [[0], [1, 2, 3]]),
        ("fold", [2], [[0], [1, 2], [3]]),
        ("block", [1, 2], [[0], [1, 2], [3]]),
    ],
)
def test_layout_is_recorded(method, dropped, layout):
    model = make_tiny_model("llama")
    replace_blocks_(model, dropped, calibration(), quick(method))
    assert block_layout(model) == layout == model.config.layercut_layout
    assert model.config.num_hidden_layers == len(layout) == len(get_blocks(model)[1])
    records = replacement_records(model)
    assert len(records) == (0 if method == "none" else len(span_pairs(dropped)))
    if method == "linear" and dropped == [0, 2]:
        block = get_blocks(model)[1][0]  # one kept block carries the map before it and the map after it
        assert isinstance(block, ReplacedBlock) and block.before is not None and block.after is not None
        assert [r["where"] for r in records] == ["before", "after"]


def test_layout_composes_and_temporary_removal_restores_it():
    model = make_tiny_model("llama")
    assert block_layout(model) == [[0], [1], [2], [3]] and not hasattr(model.config, "layercut_layout")
    with blocks_removed(model, [1]):
        assert block_layout(model) == [[0], [2], [3]]
    assert not hasattr(model.config, "layercut_layout")
    replace_blocks_(model, [1], calibration(), quick("linear"))
    assert block_layout(model) == [[0, 1], [2], [3]]
    drop_blocks_(model, [1])
    assert block_layout(model) == [[0, 1], [3]] and len(replacement_records(model)) == 1
    drop_blocks_(model, [0])  # the block carrying the map goes, and its record with it
    assert block_layout(model) == [[3]] and replacement_records(model) == []


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "opt", "gpt2", "gpt_neox"])
@pytest.mark.parametrize("method", ["linear", "lowrank", "fold", "block"])
def test_generation_with_kv_cache_after_each_method(model_type, method):
    if method == "fold" and model_type == "gemma2":
        pytest.skip("gemma2 cannot fold (normed MLP output)")
    model = make_tiny_model(model_type)
    replace_blocks_(model, [1, 2], calibration(8, 32), quick(method, steps=3))
    expected = 3 if method == "block" else 2
    assert len(get_blocks(model)[1]) == getattr(model.config, arch_spec(model).layer_count) == expected
    assert_cache_and_generate(model, calibration(2, 12, seed=3))


def test_sequential_fit_uses_the_surgered_inputs():
    model = make_tiny_model("llama")
    ids = calibration()
    independent = fit_replacements(model, [1, 3], ids, quick("linear"))
    sequential = fit_replacements(model, [1, 3], ids, quick("linear", fit="sequential"))
    first = [r.module.proj.weight for r in (independent[0], sequential[0])]
    second = [r.module.proj.weight for r in (independent[1], sequential[1])]
    torch.testing.assert_close(first[0], first[1])  # nothing replaced before the first span
    assert not torch.allclose(second[0], second[1], atol=1e-4)
    # the model is untouched by fitting
    assert len(get_blocks(model)[1]) == 4 and not hasattr(model.config, "layercut_layout")
    # sequential inputs are exactly what the model with the first span replaced feeds span 2
    linear = make_tiny_model("llama")
    replace_blocks_(linear, [1, 3], ids, quick("linear", fit="sequential"))
    heldout = calibration(4, 32, seed=9)
    reference = final_state(make_tiny_model("llama"), heldout)
    independent_model = make_tiny_model("llama")
    replace_blocks_(independent_model, [1, 3], ids, quick("linear"))
    err_seq = ((final_state(linear, heldout) - reference) ** 2).mean()
    err_ind = ((final_state(independent_model, heldout) - reference) ** 2).mean()
    assert err_seq < 1.05 * err_ind


def reference_reduced_rank(x, y, rank):
    """Reduced-rank regression with explicit data: OLS, then project on the top right singular vectors of the fit."""
    xc, yc = x - x.mean(0), y - y.mean(0)
    b = torch.linalg.lstsq(xc, yc).solution
    _, _, vh = torch.linalg.svd(xc @ b, full_matrices=False)
    return b @ vh[:rank].T @ vh[:rank]


def test_reduced_rank_fit_matches_explicit_reference():
    torch.manual_seed(0)
    x = torch.randn(400, 12, dtype=torch.float64)
    y = x @ torch.randn(12, 12, dtype=torch.float64) + 0.1 * torch.randn(400, 12, dtype=torch.float64)
    acc = PairAccumulator()
    acc.update(x, y)
    down, up = reduced_rank_fit(acc.moments(), 3)
    torch.testing.assert_close(down @ up.T, reference_reduced_rank(x, y, 3), rtol=1e-8, atol=1e-8)


def test_lowrank_map_parameters_and_full_rank_equals_linear():
    ids = calibration()
    lowrank, linear = make_tiny_model("llama"), make_tiny_model("llama")
    records = replace_blocks_(lowrank, [1, 2], ids, quick("lowrank", steps=0, rank=HIDDEN))
    replace_blocks_(linear, [1, 2], ids, quick("linear", update_scale=1))  # lowrank starts from least squares
    rank = HIDDEN
    assert records[0]["params"] == 2 * rank * HIDDEN + 3 * HIDDEN and records[0]["rank"] == rank
    assert records[0]["linear_params"] == HIDDEN * HIDDEN + HIDDEN
    heldout = calibration(2, 16, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(lowrank(heldout).logits, linear(heldout).logits, rtol=1e-3, atol=1e-3)
    default = make_tiny_model("llama")
    records = replace_blocks_(default, [1, 2], ids, quick("lowrank", steps=5))
    assert records[0]["rank"] == 1 and records[0]["params"] == 2 * HIDDEN + 3 * HIDDEN  # max(1, 32 // 100)
    assert isinstance(replacement_modules(default)[0], LowRankMap)


def test_lowrank_training_does_not_lose_the_closed_form_start():
    model = make_tiny_model("llama")
    records = replace_blocks_(model, [1, 2], calibration(), quick("lowrank", rank=4, steps=30))
    record = records[0]
    assert record["steps"] == 30 and record["train_loss_end"] <= record["train_loss_start"] * 1.05
    assert record["train_loss_start"] < 1.0  # the closed-form start already beats removal (1.0)


def test_block_replacement_trains_and_stays_vanilla():
    model = make_tiny_model("llama")
    original = get_blocks(model)[1]
    one_block = sum(p.numel() for p in original[1].parameters())
    records = replace_blocks_(model, [1, 2], calibration(), quick("block", steps=40, lr=3e-3))
    record = records[0]
    assert record["params"] == one_block and record["train_loss_end"] < record["train_loss_start"]
    blocks = get_blocks(model)[1]
    assert type(blocks[1]) is type(blocks[0]) and len(blocks) == 3
    assert replacement_modules(model) == [blocks[1]]


def test_block_replacement_refuses_a_block_standing_alone():
    # a span of one would be replaced by a copy of itself: training starts at zero loss and nothing shrinks
    with pytest.raises(LayercutError, match=r"span of 2 or more blocks, and the selection left \[\[1\], \[3\]\] sh"):
        replace_blocks_(make_tiny_model("llama"), [1, 3], calibration(), quick("block"))
    model = make_tiny_model("llama")
    assert len(replace_blocks_(model, [1, 2], calibration(), quick("block", steps=1))) == 1
    assert len(get_blocks(model)[1]) == 3


def test_replacement_modules_for_each_method():
    ids = calibration()
    model = make_tiny_model("llama")
    replace_blocks_(model, [0, 2], ids, quick("linear"))
    maps = replacement_modules(model)
    assert len(maps) == 2 and all(isinstance(m, LinearMap) for m in maps)
    model = make_tiny_model("gpt2")
    replace_blocks_(model, [2], ids, quick("fold"))
    assert replacement_modules(model) == [get_blocks(model)[1][1].mlp.c_proj]
    assert replacement_modules(make_tiny_model("llama")) == []


def test_wrapper_exposes_the_block_parts():
    model = make_tiny_model("qwen2")
    replace_blocks_(model, [2], calibration(), quick("linear"))
    wrapper = get_blocks(model)[1][1]
    assert isinstance(wrapper, ReplacedBlock)
    assert wrapper.self_attn is wrapper.block.self_attn and wrapper.get_submodule("mlp.down_proj") is not None
    assert wrapper.self_attn.layer_idx == 1


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(method="squash"), "unknown replacement 'squash': choose one of none, linear, lowrank, fold, block"),
        (dict(method="lowrank", rank=0), "--rank must be a positive integer, got 0"),
        (dict(method="lowrank", rank=-3), "--rank must be a positive integer"),
        (dict(method="linear", rank=4), "--rank applies to --replace lowrank only (got --replace linear); drop --rank"),
        (dict(method="none", rank=4), "--rank applies to --replace lowrank only (got --replace none)"),
        (dict(method="linear", fit="greedy"), "unknown --fit 'greedy'"),
        (dict(method="none", fit="sequential"),
         "--fit sequential applies to replacements: pass --replace linear|lowrank|fold|block"),
        (dict(method="linear", ridge=-1.0), "--ridge must be a finite number >= 0"),
        (dict(method="block", ridge=0.1),
         "--ridge applies to --replace linear, lowrank, fold, cosine, local, fold-rotate only"),
        (dict(method="block", steps=-1), "--replace-steps must be a whole number >= 0"),
        (dict(method="linear", steps=5), "--replace-steps applies to --replace lowrank, block, cosine, local only"),
        (dict(method="fold", lr=1e-3), "replacement lr applies to --replace lowrank, block, cosine, local only"),
        (dict(method="block", lr=0.0), "replacement lr must be a positive number, got 0.0"),
        (dict(method="linear", batch_size=0), "--batch-size must be positive, got 0"),
        (dict(method="linear", update_scale=0.0), "--update-scale takes a share in (0, 1]"),
        (dict(method="fold", update_scale=1.5), "--update-scale takes a share in (0, 1]"),
        (dict(method="block", update_scale=0.5),
         "--update-scale applies to --replace linear, fold, local, fold-rotate only"),
        (dict(method="none", update_scale=1.0),
         "--update-scale applies to --replace linear, fold, local, fold-rotate only"),
    ],
)
def test_bad_options(options, message):
    with pytest.raises(LayercutError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ReplaceConfig(**options)


def test_fold_on_an_architecture_without_an_mlp_output_projection(monkeypatch):
    import dataclasses

    from prune.model import adapters

    llama = adapters.ARCHITECTURES["llama"]
    monkeypatch.setitem(adapters.ARCHITECTURES, "llama", dataclasses.replace(llama, mlp_out=""))
    model = make_tiny_model("llama")
    with pytest.raises(LayercutError, match="MLP output projection, which is unknown for 'llama'"):
        replace_blocks_(model, [2], calibration(), quick("fold"))
    monkeypatch.setitem(adapters.ARCHITECTURES, "llama", dataclasses.replace(llama, mlp_out="mlp.no_such_proj"))
    with pytest.raises(LayercutError, match="blocks have no 'mlp.no_such_proj'"):
        replace_blocks_(model, [2], calibration(), quick("fold"))
    assert len(get_blocks(model)[1]) == 4  # nothing changed


def test_fold_errors_for_block_zero_and_normed_mlp_output():
    with pytest.raises(LayercutError, match="span starting at block 0 has no previous block.*--protect"):
        replace_blocks_(make_tiny_model("llama"), [0, 1], calibration(), quick("fold"))
    with pytest.raises(LayercutError, match="^--replace fold: 'gemma2' normalises the MLP output"):
        replace_blocks_(make_tiny_model("gemma2"), [2], calibration(), quick("fold"))
    with pytest.raises(LayercutError, match="^--replace cosine: 'gemma2' normalises the MLP output"):
        replace_blocks_(make_tiny_model("gemma2"), [2], calibration(), quick("cosine"))


def test_method_defaults_and_a_resolved_config_validates_again():
    import dataclasses

    resolved = {m: ReplaceConfig(method=m) for m in ("none", "linear", "lowrank", "fold", "block")}
    flat = [c.to_dict() for c in resolved.values()]  # unset (None) where the method takes no Adam steps
    assert [(f["steps"], f["lr"]) for f in flat] == [(None, None), (None, None), (100, 1e-3), (None, None), (200, 1e-4)]
    assert ReplaceConfig(method="block", steps=0, lr=3e-3).options.steps == 0
    for config in resolved.values():  # a resolved config (e.g. read back from layercut.json) is accepted as it is
        again = dataclasses.replace(config, seed=1)
        assert again.options == config.options and again.to_dict() == {**config.to_dict(), "seed": 1}


def test_capture_pass_stops_after_the_last_hooked_block():
    from prune.replace.capture import record

    model = make_tiny_model("llama")
    blocks = get_blocks(model)[1]
    calls = []
    handles = [b.register_forward_pre_hook(lambda _m, _a, i=i: calls.append(i)) for i, b in enumerate(blocks)]
    values = record(model, calibration(2, 8), lambda r: r.output_of(blocks[1], "y"))
    assert calls == [0, 1] and values["y"].shape == (2, 8, HIDDEN)  # blocks 2 and 3 never ran
    calls.clear()
    record(model, calibration(2, 8), lambda r: r.output_of(blocks[1], "y"), stop_early=False)
    assert calls == [0, 1, 2, 3]
    for handle in handles:
        handle.remove()


def test_single_block_spans_fit_from_the_scoring_pass_without_a_capture_pass(monkeypatch):
    from prune.measure.moments import stream_moments
    from prune.replace import driver

    ids = calibration()
    captured, given = make_tiny_model("llama"), make_tiny_model("llama")
    replace_blocks_(captured, [1, 3], ids, quick("linear"))
    moments = stream_moments(given, ids, batch_size=4, progress=False)
    passes = []
    monkeypatch.setattr(driver, "record", lambda *a, **k: passes.append(1))  # any capture pass would fail here
    records = replace_blocks_(given, [1, 3], ids, quick("linear"), moments)
    assert passes == [] and all(r["from_scoring_pass"] for r in records)
    assert [r["tokens"] for r in records] == [ids.numel()] * 2
    heldout = calibration(2, 16, seed=5)
    with torch.no_grad():  # the same least squares from the same tokens: equal up to float32 products
        torch.testing.assert_close(given(heldout).logits, captured(heldout).logits, rtol=1e-4, atol=1e-4)


def test_a_multi_block_span_still_gets_its_capture_pass():
    from prune.measure.moments import stream_moments

    ids = calibration()
    model = make_tiny_model("llama")
    moments = stream_moments(model, ids, batch_size=4, progress=False)  # adjacent pairs only
    records = replace_blocks_(model, [1, 2], ids, quick("linear"), moments)
    assert records[0]["replaces"] == [1, 2] and not records[0]["from_scoring_pass"]
