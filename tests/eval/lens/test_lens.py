"""Lens library: shortcuts, R^2, Precision@k / surprisal, early exit, heatmap, stand-ins, save/reload."""

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import eval.lens
from eval.lens.metrics import (
    PRECISION_KS,
    early_exit_sweep,
    evaluate_shortcuts,
    fixed_exit,
    heatmap_pairs,
    heatmap_states,
    identity_r2,
    layers_at_precision,
    mat_r2_per_layer,
    r2_heatmap,
)
from eval.lens.shortcuts import (
    LowRankBank,
    LowRankConfig,
    ShortcutSet,
    batch_states,
    build_shortcuts,
    load_shortcuts,
    mat_pairs,
    parse_shortcuts,
    train_low_rank,
)
from eval.lens.standins import final_predictions, fit_stand_ins, parse_blocks, stand_in
from prune.errors import LayercutError
from prune.measure.moments import stream_moments
from prune.model.adapters import final_norm, get_blocks, hidden_size, lm_head, num_blocks
from tests.helpers import make_tiny_model

SEQ = 32


pytestmark = pytest.mark.usefixtures("one_thread")


def token_ids(samples: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 320, (samples, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def llama():
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def splits():
    return token_ids(8, 0), token_ids(4, 1)  # 256 fit tokens (>= 4 x 32), 128 held out


def stacked(model, ids) -> list[torch.Tensor]:
    """Every residual state of every token, [n, d] float64 (the plain reference the streamed code must match)."""
    return [s.double() for s in batch_states(model, ids, num_blocks(model))]


def direct_r2(x_fit, y_fit, x_eval, y_eval, ridge: float) -> float:
    """Least squares with a bias on stacked states, then coordinate-averaged held-out R^2."""
    if ridge == 0:
        design = torch.cat([x_fit, torch.ones(len(x_fit), 1, dtype=x_fit.dtype)], 1)
        solution = torch.linalg.lstsq(design, y_fit).solution
        weight, bias = solution[:-1], solution[-1]
    else:
        xc, yc = x_fit - x_fit.mean(0), y_fit - y_fit.mean(0)
        gram = xc.T @ xc
        lam = ridge * torch.diagonal(gram).mean()
        weight = torch.linalg.solve(gram + lam * torch.eye(len(gram), dtype=gram.dtype), xc.T @ yc)
        bias = y_fit.mean(0) - x_fit.mean(0) @ weight
    residual = y_eval - (x_eval @ weight + bias)
    sst = ((y_eval - y_eval.mean(0)) ** 2).sum(0)
    return float((1 - (residual**2).sum(0) / sst).mean())


@pytest.mark.parametrize("ridge", [0.0, 1e-3])
def test_mat_r2_equals_direct_least_squares(llama, splits, ridge):
    fit, held = splits
    count = num_blocks(llama)
    fit_moments = stream_moments(llama, fit, pairs=mat_pairs(count), progress=False)
    eval_moments = stream_moments(llama, held, pairs=mat_pairs(count), progress=False)
    streamed = mat_r2_per_layer(fit_moments, eval_moments, count, ridge)
    xs, ys = stacked(llama, fit), stacked(llama, held)
    for layer in range(count):
        assert streamed[layer] == pytest.approx(direct_r2(xs[layer], xs[count], ys[layer], ys[count], ridge), abs=1e-6)
        y = ys[count]
        expected_id = float((1 - ((y - ys[layer]) ** 2).sum(0) / ((y - y.mean(0)) ** 2).sum(0)).mean())
        assert identity_r2(eval_moments, layer, count) == pytest.approx(expected_id, abs=1e-6)
    assert streamed[-1] > 0.5  # the last block is close to linear even in a random model


def fitted_set(model, fit, names=("id", "mat", "njtc", "n-njtc"), steps=6) -> ShortcutSet:
    count, dim = num_blocks(model), hidden_size(model)
    moments = stream_moments(model, fit, pairs=mat_pairs(count), progress=False)
    config = LowRankConfig(rank=2, steps=steps, epochs=1, token_batch=64)
    maps, _ = train_low_rank(model, fit, names, config, batch_size=4, progress=False)
    return build_shortcuts(list(names), count, dim, moments=moments, ridge=1e-3, low_rank=maps,
                           settings={"rank": 2, "residual": True})  # fmt: skip


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "opt"])
def test_precision_and_surprisal_equal_per_token_recomputation(model_type, splits):
    model = make_tiny_model(model_type)
    fit, held = splits
    shortcuts = fitted_set(model, fit)
    lens = evaluate_shortcuts(model, shortcuts, held, batch_size=3, progress=False)
    count = num_blocks(model)
    with torch.no_grad():
        states = batch_states(model, held, count)
        full_logits = model(held).logits.reshape(-1, 320).float()  # the model's own forward, not our lens path
        reference = full_logits.argmax(-1)
        assert torch.equal(lens.reference.reshape(-1), reference)
        for name in shortcuts.names:
            for layer in range(count + 1):
                logits = lm_head(model)(final_norm(model)(shortcuts.apply(name, layer, states[layer]))).float()
                target = logits.gather(1, reference[:, None])
                rank = (logits > target).sum(1)  # tokens scored above the reference
                for k in PRECISION_KS:
                    expected = (rank < k).double().mean()
                    assert lens.precision[name][k][layer] == pytest.approx(float(expected), abs=1e-9)
                surprisal = (torch.logsumexp(logits, 1) - target.squeeze(1)).double().mean()
                assert lens.surprisal[name][layer] == pytest.approx(float(surprisal), rel=1e-5)
                top1 = torch.softmax(logits, 1).max(1).values
                assert torch.allclose(lens.confidence[name][:, layer], top1, atol=1e-6)
    assert lens.precision["id"][1][count] == 1.0


def test_token_level_r2_agrees_with_moments(llama, splits):
    fit, held = splits
    count = num_blocks(llama)
    shortcuts = fitted_set(llama, fit, names=("id", "mat"))
    lens = evaluate_shortcuts(llama, shortcuts, held, batch_size=4, progress=False)
    eval_moments = stream_moments(llama, held, pairs=mat_pairs(count), progress=False)
    fit_moments = stream_moments(llama, fit, pairs=mat_pairs(count), progress=False)
    moment_r2 = mat_r2_per_layer(fit_moments, eval_moments, count, 1e-3)
    for layer in range(count):
        assert lens.r2["mat"][layer] == pytest.approx(moment_r2[layer], abs=1e-4)
        assert lens.r2["id"][layer] == pytest.approx(identity_r2(eval_moments, layer, count), abs=1e-4)


def brute_force_exit(confidence, correct, lam):
    tokens, width = confidence.shape
    count = width - 1
    hits, layers = 0, 0
    for t in range(tokens):
        exit_layer = count
        for layer in range(1, count):
            if confidence[t, layer] > lam:
                exit_layer = layer
                break
        layers += exit_layer
        hits += 1 if exit_layer == count else int(correct[t, exit_layer])
    return hits / tokens, layers / tokens


def test_early_exit_sweep_equals_brute_force():
    generator = torch.Generator().manual_seed(0)
    confidence = torch.rand(60, 7, generator=generator)
    correct = torch.rand(60, 7, generator=generator) < confidence  # confident layers tend to be right
    correct[:, -1] = True
    thresholds = [0.0, 0.1, 0.35, 0.5, 0.8, 0.95, 1.0]
    points = early_exit_sweep(confidence, correct, thresholds)
    for point, lam in zip(points, thresholds, strict=True):
        precision, layers = brute_force_exit(confidence, correct, lam)
        assert point.threshold == lam
        assert point.precision == pytest.approx(precision, abs=1e-12)
        assert point.layers == pytest.approx(layers, abs=1e-12)
    assert points[-1].layers == 6 and points[-1].precision == 1.0  # lambda = 1: nobody exits
    assert points[0].layers == 1  # lambda = 0: everyone exits at layer 1
    assert layers_at_precision(points, 0.0) == 1
    assert layers_at_precision(points, 1.0) == min(p.layers for p in points if p.precision >= 1.0)
    assert fixed_exit(correct) == pytest.approx(correct.double().mean(0).tolist())


def test_heatmap_shape_and_diagonal(llama, splits):
    fit, held = splits
    count = num_blocks(llama)
    states = heatmap_states(count)
    assert states == list(range(count + 1))
    assert heatmap_states(30, 4) == [0, 4, 8, 12, 16, 20, 24, 28, 30]
    pairs = sorted(set(heatmap_pairs(states)) | set(mat_pairs(count)))
    fit_moments = stream_moments(llama, fit, pairs=pairs, progress=False)
    eval_moments = stream_moments(llama, held, pairs=pairs, progress=False)
    grids = r2_heatmap(fit_moments, eval_moments, states, 1e-3, progress=False)
    per_layer = mat_r2_per_layer(fit_moments, eval_moments, count, 1e-3)
    for name in ("id", "mat"):
        grid = grids[name]
        assert len(grid) == count + 1 and all(len(row) == count + 1 for row in grid)
        for i in range(count + 1):
            assert grid[i][i] == 1.0
            assert all(grid[i][j] is None for j in range(i))
    for layer in range(count):
        assert grids["mat"][layer][count] == pytest.approx(per_layer[layer], abs=1e-12)
        assert grids["id"][layer][count] == pytest.approx(identity_r2(eval_moments, layer, count), abs=1e-12)
        assert grids["mat"][layer][layer + 1] >= grids["mat"][layer][count] - 0.2  # neighbours are easier


def test_shortcuts_save_and_reload(llama, splits, tmp_path):
    shortcuts = fitted_set(llama, splits[0])
    shortcuts.save(tmp_path)
    loaded = load_shortcuts(tmp_path)
    assert loaded.names == shortcuts.names and loaded.target == shortcuts.target and loaded.dim == shortcuts.dim
    assert loaded.settings == shortcuts.settings
    states = torch.randn(2, 5, hidden_size(llama))
    for name in shortcuts.names:
        assert loaded.parameters_per_layer(name) == shortcuts.parameters_per_layer(name)
        for layer in range(shortcuts.target):
            assert torch.equal(loaded.apply(name, layer, states), shortcuts.apply(name, layer, states))
    with pytest.raises(LayercutError, match="no shortcuts.safetensors"):
        load_shortcuts(tmp_path / "missing")


def test_parameter_counts(llama, splits):
    shortcuts = fitted_set(llama, splits[0], steps=1)
    d, r = 32, 2
    assert shortcuts.parameters_per_layer("id") == 0
    assert shortcuts.parameters_per_layer("mat") == d * d + d
    assert shortcuts.parameters_per_layer("njtc") == 2 * r * d
    assert shortcuts.parameters_per_layer("n-njtc") == 2 * r * d + 2 * d  # BN running stats not counted


@pytest.mark.parametrize("residual", [True, False])
def test_low_rank_training_lowers_the_mse(llama, splits, residual):
    fit, _ = splits
    count = num_blocks(llama)
    states = stacked(llama, fit)
    config = LowRankConfig(rank=4, steps=60, epochs=2, lr=3e-2, token_batch=128, residual=residual)
    maps, losses = train_low_rank(llama, fit, ["n-njtc"], config, batch_size=8, progress=False)
    target = states[count].float()
    with torch.no_grad():
        for layer in (0, count - 1):
            trained = torch.nn.functional.mse_loss(maps["n-njtc"](layer, states[layer].float()), target)
            start = torch.nn.functional.mse_loss(states[layer].float() if residual else 0 * target, target)
            assert trained < 0.9 * start
    assert len(losses["n-njtc"]) == count


def test_parse_shortcuts_and_blocks():
    assert parse_shortcuts("n-njtc, id") == ["id", "n-njtc"]
    with pytest.raises(LayercutError, match="unknown shortcut 'lens'.*id, mat, njtc, n-njtc"):
        parse_shortcuts("id,lens")
    assert parse_blocks(None, 6) == list(range(6))
    assert parse_blocks("0,2-3,-1", 6) == [0, 2, 3, 5]
    with pytest.raises(LayercutError, match="blocks 0..5"):
        parse_blocks("9", 6)
    with pytest.raises(LayercutError, match="list like"):
        parse_blocks("a-b", 6)


def manual_predictions(model, ids, reference):
    with torch.no_grad():
        logits = model(ids).logits.reshape(-1, 320).float()
    ref = reference.reshape(-1)
    precision = float((logits.argmax(-1) == ref).double().mean())
    surprisal = float((torch.logsumexp(logits, 1) - logits.gather(1, ref[:, None]).squeeze(1)).double().mean())
    return precision, surprisal


def test_stand_in_matches_manual_replacement(llama, splits):
    fit, held = splits
    fits = fit_stand_ins(llama, [1, 2], fit, ridge=1e-3, batch_size=4, progress=False)
    assert sorted(fits) == [(b, p) for b in (1, 2) for p in ("attention", "mlp", "norms")]
    assert len(fits[(1, "norms")]) == 2
    with torch.no_grad():
        original = llama(held).logits
    reference = original.argmax(-1)
    with stand_in(llama, 1, "mlp", fits[(1, "mlp")]):
        precision, surprisal = final_predictions(llama, held, reference, batch_size=3)
    mlp = get_blocks(llama)[1][1].mlp
    saved_forward = mlp.forward
    mlp.forward = lambda x: fits[(1, "mlp")][0](x)  # the plain replacement the hooks must reproduce
    try:
        expected = manual_predictions(llama, held, reference)
    finally:
        mlp.forward = saved_forward
    assert precision == pytest.approx(expected[0], abs=1e-9)
    assert surprisal == pytest.approx(expected[1], rel=1e-5)
    assert precision < 1.0
    with torch.no_grad():
        assert torch.equal(llama(held).logits, original)  # hooks removed
    assert final_predictions(llama, held, reference) == pytest.approx((1.0, manual_predictions(llama, held,
                                                                                               reference)[1]))


def test_opt_feed_forward_stand_in_spans_fc1_to_fc2(splits):
    model = make_tiny_model("opt")
    fit, held = splits
    fits = fit_stand_ins(model, [0], fit, ridge=0.0, batch_size=4, progress=False)
    with torch.no_grad():
        original = model(held).logits
    block = get_blocks(model)[1][0]
    hidden = {}
    handle = block.fc1.register_forward_pre_hook(lambda _m, args: hidden.setdefault("x", args[0]))
    try:
        with torch.no_grad(), stand_in(model, 0, "mlp", fits[(0, "mlp")]):
            changed = model(held).logits
    finally:
        handle.remove()
    assert hidden["x"].shape[-1] == 32 and not torch.equal(changed, original)
    random.seed(0)
    with torch.no_grad():
        assert torch.equal(model(held).logits, original)


@pytest.mark.parametrize("residual", [True, False])
def test_low_rank_bank_equals_per_layer_batchnorm_reference(residual):
    torch.manual_seed(0)
    layers, dim, rank = 3, 16, 2
    bank = LowRankBank(layers, dim, rank, batch_norm=True, residual=residual)
    with torch.no_grad():
        bank.v.normal_()
        bank.norm_weight.uniform_(0.5, 1.5)
        bank.norm_bias.normal_()
    norms = [torch.nn.BatchNorm1d(dim) for _ in range(layers)]
    for layer, norm in enumerate(norms):
        norm.weight.data.copy_(bank.norm_weight[layer])
        norm.bias.data.copy_(bank.norm_bias[layer])
    x = torch.randn(layers, 40, dim) * 3 + 1

    def reference(layer, states):
        y = norms[layer](states) @ bank.u[layer] @ bank.v[layer]
        return y + states if residual else y

    batched = bank.train().forward_all(x)  # training mode: batch statistics, running stats updated
    for layer in range(layers):
        expected = reference(layer, x[layer])  # nn.BatchNorm1d in training mode updates its running stats too
        assert torch.allclose(batched[layer], expected, atol=1e-5)
        assert torch.allclose(bank.running_mean[layer], norms[layer].running_mean, atol=1e-6)
        assert torch.allclose(bank.running_var[layer], norms[layer].running_var, atol=1e-6)
    bank.eval()
    for norm in norms:
        norm.eval()
    with torch.no_grad():
        for layer in range(layers):
            assert torch.allclose(bank(layer, x[layer]), reference(layer, x[layer]), atol=1e-5)


def test_import_eval_lens_is_light_and_its_docstring_names_every_module():
    code = ("import json, sys\nimport eval.lens\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('eval', 'torch'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["eval", "eval.lens"]  # nothing imported until a module is used
    named = set(re.findall(r":mod:`~eval\.lens\.(\w+)`", eval.lens.__doc__))
    modules = {path.stem for path in Path(eval.lens.__file__).parent.glob("*.py")} - {"__init__", "__main__"}
    assert named == modules
