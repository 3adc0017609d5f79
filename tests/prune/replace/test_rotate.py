"""``--replace fold-rotate``: a scale and rotation carried by a change of basis, the rest folded; exact and plain."""

import copy
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from prune.errors import LayercutError
from prune.measure.moments import PairMoments
from prune.model.adapters import block_part, get_blocks
from prune.replace import (
    METHODS,
    ReplaceConfig,
    fit_replacements,
    install_replacements_,
    replace_blocks_,
    surgered_view,
)
from prune.replace.rotate import _factor, check_rotatable, fit_rotation, share_of
from tests.helpers import make_tiny_model

LLAMA_FAMILY = ["llama", "mistral", "qwen2", "qwen3"]


def ids(samples=8, seq=32, seed=0):
    return torch.randint(3, 300, (samples, seq), generator=torch.Generator().manual_seed(seed))


def rotate_config(**kw):
    return ReplaceConfig(method="fold-rotate", progress=False, **{"update_scale": 1.0, **kw})


def model_with_maps(model, replacements):
    """The original model with each cut's restricted map ``s r Q + z W'`` put in by hooks, the span skipped."""
    reference = copy.deepcopy(model)
    blocks = get_blocks(reference)[1]
    for replacement in replacements:
        fit, host = replacement.patch.fit, blocks[replacement.host]
        seen = {}
        host.post_attention_layernorm.register_forward_pre_hook(lambda _m, a, seen=seen: seen.__setitem__("r", a[0]))
        block_part(host, reference, "mlp_out").register_forward_pre_hook(
            lambda _m, a, seen=seen: seen.__setitem__("z", a[0]))

        def mapped(_m, _a, out, seen=seen, fit=fit):
            state = out[0] if isinstance(out, tuple) else out
            new = (fit.scale * seen["r"].double() @ fit.rotation + seen["z"].double() @ fit.weight).to(state.dtype)
            return (new, *out[1:]) if isinstance(out, tuple) else new

        host.register_forward_hook(mapped)
        for position in replacement.span:
            blocks[position].forward = lambda hidden_states, *a, **k: hidden_states
    return reference


@pytest.mark.parametrize("model_type", LLAMA_FAMILY)
@pytest.mark.parametrize("tied", [True, False])
def test_folded_checkpoint_gives_the_logits_of_the_restricted_maps(model_type, tied, tmp_path):
    """Two cuts, composed: the plain model's logits are those of the model with the maps, to 1e-5 (epsilon 1e-12)."""
    model = make_tiny_model(model_type, tie_word_embeddings=tied, rms_norm_eps=1e-12, num_hidden_layers=6)
    replacements = fit_replacements(model, [2, 4], ids(), rotate_config())
    assert all(r.record["rotation_angle"] > 0.01 and r.record["fit_loss_vs_fold"] < 0.95 for r in replacements)
    reference = model_with_maps(model, replacements)
    test = ids(2, 16, seed=1)
    with torch.no_grad():
        want = reference(test).logits
    install_replacements_(model, replacements)
    with torch.no_grad():
        got = model(test).logits
    assert (got - want).abs().max() < 1e-5 * max(1.0, float(want.abs().max()))
    # a plain checkpoint: transformers alone reloads it, with an untied head where the model had a tied one
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not reloaded.config.tie_word_embeddings
    with torch.no_grad():
        assert torch.allclose(reloaded(test).logits, got, atol=1e-6)


def test_untying_costs_vocab_times_hidden_where_the_head_was_tied():
    """The parameter cost, both ways: fold keeps the tie, fold-rotate adds exactly one vocab x hidden matrix."""
    counts = {}
    declared = METHODS["fold-rotate"].adds_params  # what prune.ship reads before any fit
    assert declared(make_tiny_model("llama", tie_word_embeddings=False)) == 0
    for method in ("fold", "fold-rotate"):
        model = make_tiny_model("llama", tie_word_embeddings=True)
        if method == "fold-rotate":
            assert declared(model) == model.get_input_embeddings().weight.numel()
        records = replace_blocks_(model, [2], ids(), ReplaceConfig(method=method, progress=False))
        counts[method] = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    assert counts["fold-rotate"] - counts["fold"] == embedding.numel()
    assert records[0]["unties_head"] and records[0]["head_params_added"] == embedding.numel()
    untied = make_tiny_model("llama", tie_word_embeddings=False)
    before = sum(p.numel() for p in untied.parameters())
    record = replace_blocks_(untied, [2], ids(), rotate_config())[0]
    assert not record["unties_head"] and record["head_params_added"] == 0
    assert before - sum(p.numel() for p in untied.parameters()) == sum(
        p.numel() for p in make_tiny_model("llama").model.layers[2].parameters())


def test_a_view_with_the_cut_puts_every_weight_and_the_tie_back():
    """The selection loops apply and undo sets of cuts: the undo leaves the model as it was, tie included."""
    model = make_tiny_model("llama", tie_word_embeddings=True)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    replacements = fit_replacements(model, [2], ids(), rotate_config())
    with surgered_view(model, replacements):
        assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.config.tie_word_embeddings
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_the_hosted_view_is_the_folded_function_and_changes_the_host_alone():
    """What a repaired selection measures: two cuts as hooks on their hosts give the folded model's logits."""
    model = make_tiny_model("llama", tie_word_embeddings=True, rms_norm_eps=1e-12, num_hidden_layers=6)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    replacements = fit_replacements(model, [2, 4], ids(), rotate_config())
    test = ids(2, 16, seed=1)
    with torch.no_grad(), surgered_view(model, replacements):
        want = model(test).logits
    hosted = [dataclasses.replace(r, patch=r.patch.hosted()) for r in replacements]
    with torch.no_grad(), surgered_view(model, hosted):
        got = model(test).logits
        # upstream of the first cut nothing turns: the embedding and blocks 0 and 1 (the host) keep their weights,
        # but for the host's MLP write
        front = ("model.embed", "model.layers.0.", "model.layers.1.")
        upstream = [k for k in model.state_dict() if k.startswith(front)]
        changed = [k for k in upstream if not torch.equal(state[k], model.state_dict()[k])]
        assert len(upstream) > 10 and changed == ["model.layers.1.mlp.down_proj.weight"]
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert (got - want).abs().max() < 1e-5 * max(1.0, float(want.abs().max()))
    assert (got - model(test).logits).abs().max() > 1e-2  # the cuts did change the model
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_the_joint_fit_starts_at_fold_and_recovers_a_planted_rotation():
    """y = s r Q + z W exactly: the alternating fit finds s, Q and W; its first round is fold's least squares."""
    gen = torch.Generator().manual_seed(0)
    d, width, n = 6, 10, 4000
    r = torch.randn(n, d, generator=gen, dtype=torch.float64)
    z = torch.randn(n, width, generator=gen, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    w = torch.randn(width, d, generator=gen, dtype=torch.float64) * 0.3
    y = 1.3 * r @ q + z @ w
    x = torch.cat([r, z], 1)
    moments = PairMoments(n, torch.zeros(d + width, dtype=torch.float64), torch.zeros(d, dtype=torch.float64),
                          x.T @ x, x.T @ y, y.T @ y)
    fit = fit_rotation(moments, d, iterations=500)
    assert abs(fit.scale - 1.3) < 1e-4 and torch.allclose(fit.rotation, q, atol=1e-4)
    assert torch.allclose(fit.weight, w, atol=1e-4) and fit.loss < 1e-6 * fit.start_loss
    fold = torch.linalg.lstsq(z, y - r).solution  # Q = I, s = 1
    assert abs(fit.start_loss - float(((y - r - z @ fold) ** 2).sum())) < 1e-6 * fit.start_loss
    half = share_of(fit, torch.zeros(width, d, dtype=torch.float64), 0.5)
    assert torch.allclose(half.rotation @ half.rotation.T, torch.eye(d, dtype=torch.float64), atol=1e-10)
    assert abs(half.scale - 1.15) < 1e-4 and torch.allclose(half.weight, 0.5 * fit.weight)


@pytest.mark.parametrize(("model_type", "why"), [
    ("gemma3_text", "normalises the MLP output"),  # sandwich norms
    ("opt", "not an RMSNorm"),  # LayerNorm with a bias
    ("gemma", r"not gain \* x / rms\(x\)"),  # (1 + w) gain
])
def test_layouts_that_cannot_carry_a_rotation_are_refused_in_one_line(model_type, why):
    with pytest.raises(LayercutError, match=why) as error:
        check_rotatable(make_tiny_model(model_type))
    assert "\n" not in str(error.value) and str(error.value).startswith("--replace fold-rotate: ")
    with pytest.raises(LayercutError, match=f"^--replace rotate-twin: .*{why}"):  # the name it is registered as
        check_rotatable(make_tiny_model(model_type), "rotate-twin")


def test_the_fit_s_losses_read_from_its_solves_are_the_squared_errors_of_its_maps():
    """The rounds take the loss from the solve's own products; it must be the error of (s, Q, W') on the data."""
    gen = torch.Generator().manual_seed(1)
    d, width, n = 5, 9, 3000
    r = torch.randn(n, d, generator=gen, dtype=torch.float64)
    z = torch.randn(n, width, generator=gen, dtype=torch.float64)
    y = 0.8 * r + z @ torch.randn(width, d, generator=gen, dtype=torch.float64) + 0.5 * torch.randn(
        n, d, generator=gen, dtype=torch.float64)  # noise: no exact fit, the rounds stop on a small gain
    x = torch.cat([r, z], 1)
    moments = PairMoments(n, torch.zeros(d + width, dtype=torch.float64), torch.zeros(d, dtype=torch.float64),
                          x.T @ x, x.T @ y, y.T @ y)
    for ridge in (0.0, 0.1):
        fit = fit_rotation(moments, d, ridge=ridge, iterations=40)
        error = float(((y - fit.scale * r @ fit.rotation - z @ fit.weight) ** 2).sum())
        assert abs(fit.loss - error) < 1e-9 * error and fit.loss < fit.start_loss
        assert 1 <= fit.iterations < 40


def test_an_mlp_wider_than_its_tokens_is_fitted_with_the_least_ridge_that_factors_its_gram():
    """Fewer tokens than MLP inputs (Llama-3-8B's 14,336 on 28 rows of 512): the Gram is singular, and rounding left
    it short of positive definite; the fit raises its ridge until Cholesky goes through, and fits as well."""
    gen = torch.Generator().manual_seed(2)
    d, width, n = 4, 24, 16  # z's Gram has rank 16 of 24
    r = torch.randn(n, d, generator=gen, dtype=torch.float64)
    z = torch.randn(n, width, generator=gen, dtype=torch.float64)
    y = r + z @ torch.randn(width, d, generator=gen, dtype=torch.float64) * 0.1
    x = torch.cat([r, z], 1)
    gram = x.T @ x
    null = torch.linalg.svd(z).Vh[-1]  # a direction z never takes: nudged below zero, as rounding leaves it
    gram[d:, d:] -= 1e-6 * float(torch.diagonal(gram[d:, d:]).mean()) * torch.outer(null, null)
    assert torch.linalg.cholesky_ex(gram[d:, d:] + 1e-10 * float(torch.diagonal(gram[d:, d:]).mean())
                                    * torch.eye(width, dtype=torch.float64)).info > 0  # where it used to fail
    moments = PairMoments(n, torch.zeros(d + width, dtype=torch.float64), torch.zeros(d, dtype=torch.float64),
                          gram, x.T @ y, y.T @ y)
    fit = fit_rotation(moments, d, iterations=20)
    error = float(((y - fit.scale * r @ fit.rotation - z @ fit.weight) ** 2).sum())
    assert torch.isfinite(fit.weight).all() and error < 1e-3 * float((y ** 2).sum())
    # the ridge it took is the least tenfold step that factors: a tenth of it does not
    g_zz, eye = gram[d:, d:], torch.eye(width, dtype=torch.float64)
    _, lam = _factor(g_zz, 0.0, eye)
    mean = float(torch.diagonal(g_zz).mean())
    assert 1e-10 * mean < lam <= 1.0001e-5 * mean and torch.linalg.cholesky_ex(g_zz + lam / 10 * eye).info > 0
    # a Gram no ridge up to a tenth of its diagonal can factor, or one that overflowed: one line each
    with pytest.raises(LayercutError, match=r"^--replace fold-rotate: .*not positive definite.*--samples") as error:
        _factor(g_zz - mean * eye, 0.0, eye)
    assert "\n" not in str(error.value)
    with pytest.raises(LayercutError, match="not finite"):
        _factor(torch.full_like(g_zz, float("nan")), 0.0, eye)
