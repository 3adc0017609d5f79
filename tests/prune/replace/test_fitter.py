"""The fitters' shared base: where a span's replacement sits, weight patches, the Adam cache and its loss."""

import pytest
import torch
from torch import nn

from prune.model.adapters import get_blocks
from prune.replace.capture import SpanBatch
from prune.replace.config import ReplaceConfig
from prune.replace.fitter import CachingFitter, SpanFitter, WeightPatch, relative_mse
from tests.helpers import HIDDEN, make_tiny_model


def test_relative_mse_is_one_for_removal_and_zero_for_the_target():
    x, y = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    assert float(relative_mse(x, y, x)) == 1.0
    assert float(relative_mse(y, y, x)) == 0.0
    assert float(relative_mse((x + y) / 2, y, x)) == pytest.approx(0.25, rel=1e-5)  # half way: a quarter of the MSE


def test_a_span_is_carried_by_the_kept_block_beside_it():
    model = make_tiny_model("llama")
    blocks = get_blocks(model)[1]
    config = ReplaceConfig(method="linear", progress=False)
    first, later = SpanFitter(model, blocks, (0, 1), config), SpanFitter(model, blocks, (2, 3), config)
    assert (first.where, first.host) == ("before", 2)  # nothing before block 0: the map goes before block 2
    assert (later.where, later.host) == ("after", 1)
    assert later.dim == HIDDEN and later.dtype == torch.float32 and not later.needs_call


def test_a_weight_patch_applies_and_undoes():
    layer = nn.Linear(3, 2)
    old_weight, old_bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    undo = WeightPatch(layer, torch.ones(2, 3), torch.zeros(2)).apply()
    assert torch.equal(layer.weight, torch.ones(2, 3)) and torch.equal(layer.bias, torch.zeros(2))
    undo()
    assert torch.equal(layer.weight, old_weight) and torch.equal(layer.bias, old_bias)


def test_the_cache_keeps_batches_up_to_its_bytes_and_training_lowers_the_loss():
    model = make_tiny_model("llama")
    blocks = get_blocks(model)[1]
    generator = torch.Generator().manual_seed(0)
    target = torch.eye(HIDDEN) + 0.3 * torch.randn(HIDDEN, HIDDEN, generator=generator)
    batches = [SpanBatch(x, x @ target) for x in torch.randn(4, 2, 6, HIDDEN, generator=generator)]
    size = 2 * batches[0].x.numel() * 4  # x and y, float32
    untrained = CachingFitter(model, blocks, (1, 2), ReplaceConfig(method="block", progress=False), steps=0, lr=1e-3)
    for batch in batches:
        untrained.remember(batch)
    assert untrained.cache == []  # no Adam steps: nothing kept
    fitter = CachingFitter(model, blocks, (1, 2), ReplaceConfig(method="block", cache_bytes=3 * size, progress=False),
                           steps=60, lr=3e-2)
    for batch in batches:
        fitter.remember(batch)
    assert (len(fitter.cache), fitter.cached_bytes, fitter.dropped_batches) == (3, 3 * size, 1)
    module = nn.Linear(HIDDEN, HIDDEN, bias=False)
    with torch.no_grad():
        module.weight.copy_(torch.eye(HIDDEN))  # starts as removal: relative loss 1
    record = fitter.train(module, lambda m, batch: m(batch.x))
    assert record["steps"] == 60 and record["train_loss_start"] == pytest.approx(1.0, rel=1e-6)
    assert record["train_loss_end"] < 0.5 * record["train_loss_start"]
    assert all(p.requires_grad for p in module.parameters())  # the flags are restored as they were
