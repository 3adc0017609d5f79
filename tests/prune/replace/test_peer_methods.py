"""The peer methods registered as replacements: Prune&Comp's magnitude compensation, LinearPatch, ReplaceMe."""

import copy

import pytest
import torch

from prune.errors import LayercutError
from prune.model.adapters import get_blocks
from prune.model.surgery import drop_blocks_
from prune.replace import ReplaceConfig, check_replacement_supported, replace_blocks_
from prune.replace.linearpatch import orthonormal_hadamard
from prune.replace.magcomp import attention_output_projection
from tests.helpers import make_tiny_model

SPAN = [1, 2]


def tokens(samples=8, seq=24, seed=0):
    return torch.randint(3, 320, (samples, seq), generator=torch.Generator().manual_seed(seed))


def states(model, ids):
    """Residual states 0..L-1 (embeddings, then each block's output but the last, which HF normalises)."""
    with torch.no_grad():
        return model(ids, output_hidden_states=True).hidden_states


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def without_norm_eps(model):
    """The norms' epsilon is the one thing that is not scale-invariant: make it negligible."""
    for module in model.modules():
        for name in ("eps", "variance_epsilon"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 1e-12)
    return model


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "gpt_neox"])
def test_magcomp_acts_as_feeding_the_scaled_state(model_type, one_thread):
    ids = tokens()
    original = without_norm_eps(make_tiny_model(model_type))
    hidden = states(original, ids)
    x, y = hidden[1], hidden[3]  # input and output of blocks 1-2
    factor = float(y.double().norm(dim=-1).mean() / x.double().norm(dim=-1).mean())
    compensated = without_norm_eps(make_tiny_model(model_type))
    records = replace_blocks_(compensated, SPAN, ids, ReplaceConfig(method="magcomp", progress=False))
    assert records[0]["factor"] == pytest.approx(factor, rel=1e-6) and abs(factor - 1) > 0.01
    assert records[0]["scaled_blocks"] == 1 and records[0]["params"] == 0
    # the same thing done the obvious way: drop the blocks, multiply block 0's output by the factor
    reference = without_norm_eps(make_tiny_model(model_type))
    drop_blocks_(reference, SPAN)
    hook = get_blocks(reference)[1][0].register_forward_hook(
        lambda _m, _a, out: (out[0] * factor, *out[1:]) if isinstance(out, tuple) else out * factor)
    expected = logits(reference, ids[:2])
    hook.remove()
    removed = logits(reference, ids[:2])
    got = logits(compensated, ids[:2])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert float((got - removed).abs().max()) > 1e-3  # and it is not plain removal


def test_magcomp_refuses_post_norm_architectures():
    with pytest.raises(LayercutError, match="magcomp: 'gemma2' normalises each sub-layer's output"):
        check_replacement_supported(make_tiny_model("gemma2"), "magcomp")
    opt = make_tiny_model("opt")
    assert attention_output_projection(opt, get_blocks(opt)[1][0]) is get_blocks(opt)[1][0].self_attn.out_proj


@pytest.mark.parametrize("dim", [32, 576, 12])
def test_hadamard_rotation_is_orthonormal_and_spreads_a_spike(dim):
    rotation = orthonormal_hadamard(dim)
    torch.testing.assert_close(rotation @ rotation.T, torch.eye(dim, dtype=torch.float64), rtol=0, atol=1e-10)
    spike = torch.zeros(dim, dtype=torch.float64)
    spike[3] = 1.0
    if dim == 32:  # a pure Hadamard spreads one channel evenly over all
        torch.testing.assert_close((spike @ rotation).abs(), torch.full((dim,), dim ** -0.5, dtype=torch.float64))
    assert float((spike @ rotation).abs().max()) < 0.6


def test_linearpatch_matches_rotated_channel_magnitudes(one_thread):
    ids = tokens()
    model = make_tiny_model("llama")
    hidden = states(model, ids)
    x, y = hidden[1].reshape(-1, 32).double(), hidden[3].reshape(-1, 32).double()
    records = replace_blocks_(model, SPAN, ids, ReplaceConfig(method="linearpatch", progress=False))
    patch = get_blocks(model)[1][0].after.proj
    weight = patch.weight.double()
    torch.testing.assert_close(weight, weight.T, rtol=0, atol=1e-6)  # H D H^T is symmetric
    assert float(patch.bias.detach().abs().max()) == 0.0 and records[0]["params"] == 32 * 32 + 32
    rotation = orthonormal_hadamard(32)
    patched = x @ weight.T  # nn.Linear: h W^T
    # after the patch, every rotated channel has the span output's mean magnitude
    torch.testing.assert_close((patched @ rotation).abs().mean(0), (y @ rotation).abs().mean(0), rtol=1e-4, atol=0)
    assert records[0]["scale_min"] < records[0]["scale_max"]


def test_replaceme_least_squares_and_cosine_objectives(one_thread):
    ids = tokens(16, 24)
    original = make_tiny_model("llama")
    y = states(original, ids)[3].double()
    x = states(original, ids)[1].double()
    results = {}
    for name, steps in (("ls", 0), ("cos", 60)):
        model = copy.deepcopy(original)
        records = replace_blocks_(model, SPAN, ids, ReplaceConfig(method="cosine", steps=steps, lr=1e-2,
                                                                  progress=False))
        assert records[0]["objective"] == ("least-squares" if steps == 0 else "cosine")
        h = states(model, ids)[1].double()  # what block 3 now reads
        results[name] = (float(((h - y) ** 2).mean()), float(torch.nn.functional.cosine_similarity(h, y, -1).mean()))
        if steps:
            assert records[0]["cosine_distance_end"] < records[0]["cosine_distance_start"]
    removal = (float(((x - y) ** 2).mean()), float(torch.nn.functional.cosine_similarity(x, y, -1).mean()))
    assert results["ls"][0] < removal[0]  # least squares beats removal on the MSE ...
    assert results["ls"][0] <= results["cos"][0] + 1e-9  # ... and is the MSE optimum of this family
    assert results["cos"][1] > results["ls"][1]  # the cosine objective buys cosine
