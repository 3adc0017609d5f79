"""Every registered replacement method, through one path: fit, export, reload, same logits.

Parametrised over the registry itself, so a method is tested the day it registers. A toy method
registered here shows that a new method needs no other file.
"""

from dataclasses import dataclass

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import prune
from eval.bench.replace import VARIANTS, Variant, parse_variants
from prune.checkpoint.save_load import REPLACEMENTS_FILE
from prune.errors import LayercutError
from prune.model.adapters import get_blocks
from prune.model.surgery import drop_blocks_, host_position
from prune.replace import (
    METHODS,
    Method,
    MethodOptions,
    ReplaceConfig,
    SpanFitter,
    block_layout,
    check_replacement_supported,
    describe_replacement,
    fit_replacements,
    get_method,
    parameter_count,
    register_method,
    replace_blocks_,
    replacement_modules,
    unregister_method,
)
from prune.replace.modules import map_on_block
from tests.helpers import make_tiny_model

DROPPED = [1, 2]  # one span, not at block 0: every built-in method can take it


def calibration(samples=8, seq=24, seed=0):
    return torch.randint(3, 320, (samples, seq), generator=torch.Generator().manual_seed(seed))


def logits(model):
    with torch.no_grad():
        return model(calibration(2, 16, seed=11)).logits


def quick(name):
    """Defaults, except few Adam steps for the methods that train."""
    steps = {"steps": 3} if "steps" in get_method(name).options.specs() else {}
    return ReplaceConfig(method=name, progress=False, **steps)


def assert_layout(model, records):
    """Blocks, config and layout agree; the layout covers the kept blocks and every replaced one once."""
    layout = block_layout(model)
    blocks = get_blocks(model)[1]
    added = sum(r["where"] == "block" for r in records)  # a method that puts a new block in the span's place
    assert len(blocks) == model.config.num_hidden_layers == len(layout) == 4 - len(DROPPED) + added
    covered = sorted(i for entry in layout for i in entry)
    assert covered == ([0, 1, 2, 3] if records else [0, 3])
    assert all(host_position(layout, r["replaces"]) is not None for r in records)


@pytest.mark.parametrize("name", list(METHODS))
def test_method_fits_exports_and_reloads_with_equal_logits(name, tmp_path, tiny_tokenizer, one_thread):
    method = get_method(name)
    model = make_tiny_model("llama")
    removed = make_tiny_model("llama")
    drop_blocks_(removed, DROPPED)
    check_replacement_supported(model, name)
    records = replace_blocks_(model, DROPPED, calibration(), quick(name))
    assert len(records) == (1 if method.fitter else 0)
    assert all(r["method"] == name and r["replaces"] == DROPPED for r in records)
    assert_layout(model, records)
    expected = logits(model)
    if records:  # the fit changed something: not the same as only removing the blocks
        assert (expected - logits(removed)).abs().max() > 1e-4
    out = prune.save(model, tiny_tokenizer, tmp_path / name, {"dropped": DROPPED})
    assert (out / REPLACEMENTS_FILE).is_file() == (not method.servable)
    loaded = prune.load(out).model
    torch.testing.assert_close(logits(loaded), expected, rtol=0, atol=1e-5)
    assert block_layout(loaded) == block_layout(model)
    assert_layout(loaded, records)
    assert loaded.config.layercut_replacements == records
    assert len(replacement_modules(loaded)) == len(records)  # --train replacements finds them after a reload
    if method.servable:  # plain transformers reads the same model
        plain = AutoModelForCausalLM.from_pretrained(out).eval()
        torch.testing.assert_close(logits(plain), expected, rtol=0, atol=1e-5)
    for record in records:
        line = describe_replacement(record)
        assert line.startswith(f"replaced blocks {DROPPED} by {name} (") and ", independent fit, " in line


def test_unknown_method_lists_the_known_ones():
    known = ", ".join(METHODS)
    assert known.startswith("none, linear, lowrank, fold, block")
    for call in (lambda: ReplaceConfig(method="squash"), lambda: get_method("squash"),
                 lambda: check_replacement_supported(make_tiny_model("llama"), "squash")):
        with pytest.raises(LayercutError, match=f"unknown replacement 'squash': choose one of {known}$"):
            call()


def test_describe_replacement_is_the_cli_line():
    assert describe_replacement({"method": "linear", "replaces": [1, 2], "params": 1056, "fit": "independent",
                                 "fit_seconds": 0.04}) == (
        "replaced blocks [1, 2] by linear (1056 parameters, independent fit, 0.0s)")
    # a share of the update other than the whole least-squares fit is named: the default is 0.7
    assert describe_replacement({"method": "linear", "replaces": [1, 2], "params": 1056, "fit": "independent",
                                 "fit_seconds": 0.04, "update_scale": 0.7}) == (
        "replaced blocks [1, 2] by linear (1056 parameters, 0.7 of the fitted update, independent fit, 0.0s)")
    whole = describe_replacement({"method": "linear", "replaces": [1, 2], "params": 1056, "fit": "independent",
                                  "fit_seconds": 0.04, "update_scale": 1.0})
    assert whole.endswith("(1056 parameters, independent fit, 0.0s)")
    assert describe_replacement({"method": "fold", "replaces": [2], "params": 0, "rewrites": "mlp.down_proj",
                                 "fit": "sequential", "fit_seconds": 1.26}) == (
        "replaced blocks [2] by fold (folded into the previous block's mlp.down_proj, sequential fit, 1.3s)")
    assert describe_replacement({"method": "lowrank", "replaces": [3], "params": 160, "linear_params": 1056,
                                 "fit": "independent", "fit_seconds": 2.0}) == (
        "replaced blocks [3] by lowrank (160 parameters, 15.2% of a linear map's 1056, independent fit, 2.0s)")


# A toy method: a learnable per-channel scale after the host block, started at 1 (so it equals removal).


class ScaleMap(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, hidden):
        return hidden * self.scale


@dataclass
class ScaleOptions(MethodOptions):
    pass


class ScaleFitter(SpanFitter):
    def __init__(self, *args):
        super().__init__(*args)
        self.tokens = 0

    def observe(self, batch):
        self.tokens += batch.x.shape[0] * batch.x.shape[1]

    def finish(self):
        module = ScaleMap(self.dim).to(device=self.device, dtype=self.dtype)
        return self._replacement(module, params=parameter_count(module), tokens=self.tokens)


@pytest.fixture
def toy_method():
    method = register_method(Method(
        "scale", "per-channel scale (test only)", serving="layercut", options=ScaleOptions, fitter=ScaleFitter,
        module=ScaleMap, spec=lambda m: {"dim": m.scale.numel()}, build=lambda spec: ScaleMap(spec["dim"]),
        trained_module=map_on_block,
    ))
    try:
        yield method
    finally:
        unregister_method("scale")


def test_a_registered_method_is_available_everywhere(toy_method, tmp_path, tiny_tokenizer):
    assert ReplaceConfig(method="scale").method == "scale" and "scale" in ", ".join(METHODS)
    with pytest.raises(LayercutError, match="--rank applies to --replace lowrank only \\(got --replace scale\\)"):
        ReplaceConfig(method="scale", rank=2)
    model, removed = make_tiny_model("llama"), make_tiny_model("llama")
    drop_blocks_(removed, DROPPED)
    records = replace_blocks_(model, DROPPED, calibration(), ReplaceConfig(method="scale", progress=False))
    assert records[0]["method"] == "scale" and records[0]["params"] == 32 and records[0]["tokens"] == 8 * 24
    torch.testing.assert_close(logits(model), logits(removed), rtol=0, atol=1e-6)  # scale 1 = removal
    with torch.no_grad():
        replacement_modules(model)[0].scale.mul_(0.5)
    expected = logits(model)
    out = prune.save(model, tiny_tokenizer, tmp_path / "scaled", {})
    loaded = prune.load(out).model
    torch.testing.assert_close(logits(loaded), expected, rtol=0, atol=1e-6)
    maps = replacement_modules(loaded)
    assert [type(m) for m in maps] == [ScaleMap] and torch.equal(maps[0].scale, torch.full((32,), 0.5))
    assert describe_replacement(records[0]).startswith("replaced blocks [1, 2] by scale (32 parameters, ")
    assert parse_variants("scale,scale+sequential+distill") and VARIANTS["scale+distill"] == Variant("scale",
                                                                                                   distill=True)
    assert list(VARIANTS)[-1] == "scale"  # compared by default too


def test_a_shared_check_names_the_method_that_registered_it():
    # fold, fold-rotate and ReplaceMe's cosine register the same checks; each refusal names the --replace given
    from prune.replace.fold import FoldFitter, FoldOptions, check_fold_architecture, check_foldable

    register_method(Method("fold-twin", "fold under another name (test only)", serving="vanilla", options=FoldOptions,
                           fitter=FoldFitter, check_model=check_fold_architecture, check_spans=check_foldable))
    try:
        with pytest.raises(LayercutError, match="^--replace fold-twin: 'gemma3_text' normalises the MLP output"):
            check_replacement_supported(make_tiny_model("gemma3_text"), "fold-twin")
        with pytest.raises(LayercutError, match=r"^--replace fold-twin cannot replace blocks \[0, 1\]"):
            fit_replacements(make_tiny_model("llama"), [0, 1], calibration(), ReplaceConfig(method="fold-twin"))
    finally:
        unregister_method("fold-twin")


def test_unregistered_method_is_gone(toy_method):
    unregister_method("scale")
    with pytest.raises(LayercutError, match="unknown replacement 'scale'"):
        ReplaceConfig(method="scale")


def test_a_method_registers_once_and_saves_what_it_installs():
    with pytest.raises(ValueError, match="already registered"):
        register_method(get_method("linear"))
    with pytest.raises(ValueError, match="needs module, spec and build"):
        Method("broken", "no way to save it", serving="layercut", fitter=ScaleFitter)


def test_capabilities_are_declared_where_each_method_registers():
    from prune.model.layouts import LAYERCUT, VANILLA
    from prune.replace.registry import closed_form_methods, offloadable_methods

    # the lists --plan and --offload sequential used to keep by hand, now read from the registrations
    assert set(closed_form_methods()) == {"linear", "fold", "fold-rotate", "cosine", "linearpatch", "magcomp"}
    assert set(offloadable_methods()) == set(METHODS) - {"block"}
    assert {name for name, method in METHODS.items() if method.serving == LAYERCUT} == {"linear", "lowrank",
                                                                                      "linearpatch"}
    for method in METHODS.values():
        assert method.servable == (method.serving == VANILLA), method.name
    with pytest.raises(ValueError, match="serving must be 'vanilla' or 'layercut'"):
        Method("odd", "test only", serving="decilm")


@pytest.mark.parametrize(("model_type", "overrides", "chosen"), [
    ("llama", {"tie_word_embeddings": False}, "fold-rotate"),  # rotation costs nothing with an untied head
    ("llama", {"tie_word_embeddings": True}, "fold"),  # it would untie the head: fold
    ("opt", {}, "fold"),  # a LayerNorm takes no rotation, the fold still applies
    ("gemma3_text", {}, "none"),  # sandwich norms: no closed-form repair folds, removal
])
def test_the_default_repair_is_the_best_servable_one_the_layout_takes(model_type, overrides, chosen):
    from prune.replace.registry import default_method

    assert default_method(make_tiny_model(model_type, **overrides)) == chosen


def test_a_skeleton_defaults_to_the_best_repair_it_can_run_block_by_block():
    from prune.replace.registry import default_method
    from prune.replace.rotate import RotateFitter, RotateOptions

    untied = make_tiny_model("llama", tie_word_embeddings=False)
    assert default_method(untied) == default_method(untied, offloaded=True) == "fold-rotate"  # both ways
    # a method that cannot run block by block does not compete there, however it ranks in memory
    register_method(Method("rotate-in-memory-only", "test only", serving="vanilla", options=RotateOptions,
                           fitter=RotateFitter, default_for=lambda _model: 9, blockwise_refusal="is a test"))
    try:
        assert default_method(untied) == "rotate-in-memory-only"
        assert default_method(untied, offloaded=True) == "fold-rotate"
    finally:
        unregister_method("rotate-in-memory-only")
