"""Streamed scores against direct computations on stacked hidden states."""

import pytest
import torch

from prune.errors import LayercutError
from prune.measure.least_squares import fit_linear_map, r_squared
from prune.measure.moments import StateMoments, span_pairs, stream_moments
from prune.measure.scores import SCORES, block_scores, get_score
from prune.model.capture import residual_states
from tests.helpers import make_tiny_model


def stacked_states(model, ids, batch_size):
    """Every residual state for every token, the memory-hungry way (the reference)."""
    states: dict[int, list[torch.Tensor]] = {}
    with residual_states(model, lambda i, h: states.setdefault(i, []).append(h.reshape(-1, h.shape[-1]).double())):
        with torch.no_grad():
            for start in range(0, ids.shape[0], batch_size):
                model.base_model(input_ids=ids[start : start + batch_size], use_cache=False)
    return {i: torch.cat(v) for i, v in states.items()}


def lstsq_linearity(x, y, driver="gelsd"):
    """1 - min_A ||X~ A - Y~||^2 by torch.linalg.lstsq on centred, Frobenius-normalised states."""
    x = x - x.mean(0)
    y = y - y.mean(0)
    x, y = x / x.norm(), y / y.norm()
    solution = torch.linalg.lstsq(x, y, driver=driver).solution
    return 1 - float(((x @ solution - y) ** 2).sum())


# float64 products are the exact reference; float32 ones (the default) round once per batch, ~1e-7 relative
# per Gram entry, which moves a score (a ratio of traces near 1) by a few 1e-8 on these blocks.
TOLERANCE = {"float64": 1e-10, "float32": 1e-6}


@pytest.mark.parametrize("precision", sorted(TOLERANCE))
@pytest.mark.parametrize("model_type", ["llama", "gpt2", "opt", "gemma2"])
def test_linearity_equals_direct_least_squares(model_type, precision):
    model = make_tiny_model(model_type)
    ids = torch.randint(3, 320, (10, 24))
    moments = stream_moments(model, ids, batch_size=3, progress=False, precision=precision)
    scores = block_scores(moments)
    states = stacked_states(model, ids, batch_size=4)
    tol = TOLERANCE[precision]
    for block in range(4):
        x, y = states[block], states[block + 1]
        assert scores["linearity"][block] == pytest.approx(lstsq_linearity(x, y), abs=tol)
        assert scores["linearity-nores"][block] == pytest.approx(lstsq_linearity(x, y - x), abs=tol)
        cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
        assert scores["cosine"][block] == pytest.approx(float(cos.mean()), abs=1e-6)
        assert scores["bi"][block] == pytest.approx(1 - float(cos.mean()), abs=1e-6)
        angular = torch.arccos(cos.clamp(-1, 1)) / torch.pi
        assert scores["angular"][block] == pytest.approx(float(angular.mean()), abs=1e-6)
    # The no-residual score is a different quantity: on random blocks it is far from the residual one.
    assert max(abs(a - b) for a, b in zip(scores["linearity"], scores["linearity-nores"], strict=True)) > 0.05


def test_statistics_do_not_depend_on_batching_and_respect_the_mask():
    model = make_tiny_model("llama")
    ids = torch.randint(3, 320, (6, 16))
    a = stream_moments(model, ids, batch_size=1, progress=False, precision="float64")
    b = stream_moments(model, ids, batch_size=6, progress=False, precision="float64")
    assert a.n == b.n == 96
    torch.testing.assert_close(a.pair(1, 2).cxy, b.pair(1, 2).cxy, rtol=1e-9, atol=1e-9)
    # float32 products round per batch: agreement to ~1e-6 of the Gram's scale, whatever the batching
    c = stream_moments(model, ids, batch_size=1, progress=False)
    scale = float(a.pair(1, 2).cxy.abs().max())
    torch.testing.assert_close(c.pair(1, 2).cxy, a.pair(1, 2).cxy, rtol=0, atol=1e-6 * scale)
    assert float((c.pair(1, 2).cxy - a.pair(1, 2).cxy).abs().max()) > 0  # float32 was used: not bit-equal

    # Masked tokens must not count: feeding the same batch twice with half masked equals the unmasked half.
    moments = StateMoments(2, [(0, 1)], precision="float64")
    states = torch.randn(2, 2, 8, 5)  # [state, batch, seq, d]
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    moments.begin_batch(mask)
    moments.observe(0, states[0])
    moments.observe(1, states[1])
    kept0 = states[0].reshape(-1, 5)[mask.reshape(-1).bool()].double()
    kept1 = states[1].reshape(-1, 5)[mask.reshape(-1).bool()].double()
    assert moments.n == 12
    expected = (kept0 - kept0.mean(0)).T @ (kept1 - kept1.mean(0))
    torch.testing.assert_close(moments.pair(0, 1).cxy, expected)


def test_least_squares_map_and_r_squared_match_direct_fit():
    model = make_tiny_model("gpt_neox")
    ids = torch.randint(3, 320, (12, 16))
    moments = stream_moments(model, ids, pairs=span_pairs([1, 2]), progress=False)
    states = stacked_states(model, ids, batch_size=12)
    x, y = states[1], states[3]
    fit = fit_linear_map(moments.pair(1, 3))
    design = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
    direct = torch.linalg.lstsq(design, y, driver="gelsd").solution
    torch.testing.assert_close(fit(x), design @ direct, rtol=1e-7, atol=1e-7)
    residual = y - fit(x)
    direct_r2 = float((1 - (residual**2).sum(0) / ((y - y.mean(0)) ** 2).sum(0)).mean())
    # the moment form subtracts sums of squares (float32 batch products): a few 1e-8 of cancellation
    assert r_squared(fit, moments.pair(1, 3)) == pytest.approx(direct_r2, abs=1e-7)
    ridge = fit_linear_map(moments.pair(1, 3), ridge=10.0)
    assert r_squared(ridge, moments.pair(1, 3)) < r_squared(fit, moments.pair(1, 3))


def test_all_pairs_cosines_for_span_scores():
    model = make_tiny_model("qwen2")
    ids = torch.randint(3, 320, (4, 16))
    moments = stream_moments(model, ids, cosine_pairs="all", progress=False)
    states = stacked_states(model, ids, batch_size=4)
    cos = torch.nn.functional.cosine_similarity(states[0], states[3], dim=-1)
    assert moments.mean_cosine(0, 3) == pytest.approx(float(cos.mean()), abs=1e-6)


def test_unknown_score_lists_the_known_ones():
    with pytest.raises(LayercutError, match="unknown score 'foo'.*linearity"):
        get_score("foo")
    assert {"linearity", "linearity-nores", "cosine", "angular", "bi"} <= set(SCORES)


@pytest.mark.slow
def test_linearity_equals_least_squares_on_real_smollm2_states():
    from prune.data.calibration import DataConfig, calibration_data
    from prune.loading.loader import load_model

    loaded = load_model("smollm2-135m")
    ids = calibration_data(loaded.tokenizer, DataConfig("builtin", samples=5, seq_len=512)).token_ids  # 2560 > 4 x 576
    moments = stream_moments(loaded.model, ids, batch_size=5, progress=False)
    scores = block_scores(moments, ["linearity", "linearity-nores"])
    states = stacked_states(loaded.model, ids, batch_size=5)
    # First and last blocks, the jump at 12 (massive activations), and the no-residual peaks at 0, 11, 28.
    for block in (0, 1, 11, 12, 15, 28, 29):
        x, y = states[block], states[block + 1]
        # n = 2560 > d = 576 tokens: X has full column rank and QR (gelsy) solves it exactly and fast.
        assert scores["linearity"][block] == pytest.approx(lstsq_linearity(x, y, "gelsy"), abs=1e-6)
        assert scores["linearity-nores"][block] == pytest.approx(lstsq_linearity(x, y - x, "gelsy"), abs=1e-6)
    # The shape the Secretly Linear paper reports: middle blocks ~0.9996 with the residual, much lower without.
    assert min(scores["linearity"][12:19]) > 0.999
    assert max(scores["linearity-nores"][12:19]) < 0.8


def test_every_score_of_a_block_shares_one_eigendecomposition(monkeypatch):
    model = make_tiny_model("llama")
    moments = stream_moments(model, torch.randint(3, 320, (6, 24)), progress=False)
    calls = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda a: calls.append(1) or eigh(a))
    first = block_scores(moments, ["linearity", "linearity-nores"])
    assert len(calls) == 4  # one per block's input state, not one per score
    assert block_scores(moments, ["linearity", "linearity-nores"]) == first and len(calls) == 4
