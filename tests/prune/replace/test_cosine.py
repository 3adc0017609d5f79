"""``cosine`` (ReplaceMe): a map ``T`` on the previous block's MLP output, folded into its output projection."""

import pytest
import torch

from prune.model.adapters import block_part, get_blocks
from prune.replace import ReplaceConfig
from prune.replace.capture import SpanBatch
from prune.replace.cosine import CosineFitter, CosineOptions, cosine_distance
from tests.helpers import HIDDEN, make_tiny_model


def test_cosine_distance_is_zero_for_the_same_direction_and_two_for_the_opposite():
    x = torch.randn(3, 5, 8)
    assert float(cosine_distance(2 * x, x)) == pytest.approx(0.0, abs=1e-6)
    assert float(cosine_distance(-x, x)) == pytest.approx(2.0, abs=1e-6)
    assert (CosineOptions().steps, CosineOptions().lr, CosineOptions().ridge) == (100, 1e-4, 0.0)


def test_least_squares_recovers_an_exact_map_and_folds_it_into_the_projection():
    model = make_tiny_model("llama")
    blocks = get_blocks(model)[1]
    fitter = CosineFitter(model, blocks, (2, 3), ReplaceConfig(method="cosine", steps=0, progress=False))
    assert fitter.host == 1 and fitter.projection is block_part(blocks[1], model, "mlp_out")
    generator = torch.Generator().manual_seed(0)
    transform = torch.eye(HIDDEN) + 0.1 * torch.randn(HIDDEN, HIDDEN, generator=generator)
    for _ in range(3):
        x, m = torch.randn(2, 8, HIDDEN, generator=generator), torch.randn(2, 8, HIDDEN, generator=generator)
        fitter.observe(SpanBatch(x, x - m + m @ transform, m=m))  # y = r + m T, r = x - m
    torch.testing.assert_close(fitter.least_squares().float(), transform, rtol=1e-4, atol=1e-4)
    old = fitter.projection.weight.detach().double().clone()
    replacement = fitter.finish()
    assert replacement.where == "fold" and replacement.record["objective"] == "least-squares"
    # nn.Linear stores [out, in]: m' = z W^T T, stored as T^T W
    torch.testing.assert_close(replacement.patch.weight.double(), transform.double().T @ old, rtol=1e-4, atol=1e-5)
