"""``--replace fold``: exact least squares into the MLP output projection; a vanilla checkpoint."""

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

import prune
from prune.errors import LayercutError
from prune.model.adapters import block_part, get_blocks
from prune.model.capture import block_output
from prune.replace import ReplaceConfig, replace_blocks_
from prune.replace.fold import FoldOptions, check_foldable, mlp_output_projection
from tests.helpers import make_tiny_model, make_tiny_tokenizer

FOLDABLE = ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "opt", "gpt2", "gpt_neox"]


def calibration(samples=16, seq=32, seed=0):
    return torch.randint(3, 320, (samples, seq), generator=torch.Generator().manual_seed(seed))


def fold(model, dropped, ids, **kw):
    return replace_blocks_(model, dropped, ids, ReplaceConfig(method="fold", progress=False, **kw))


@torch.no_grad()
def explicit_fold_target(model, host, span_end, ids):
    """z (MLP hidden of the host), and t = y - r with every activation kept in memory (the plain reference)."""
    blocks = get_blocks(model)[1]
    proj = block_part(blocks[host], model, "mlp_out")
    seen = {}
    handles = [
        proj.register_forward_pre_hook(lambda _m, args: seen.__setitem__("z", args[0])),
        proj.register_forward_hook(lambda _m, _a, out: seen.__setitem__("m", out)),
        blocks[host].register_forward_hook(lambda _m, _a, out: seen.__setitem__("h", block_output(out))),
        blocks[span_end].register_forward_hook(lambda _m, _a, out: seen.__setitem__("y", block_output(out))),
    ]
    zs, ts = [], []
    try:
        for start in range(0, ids.shape[0], 4):
            model.base_model(input_ids=ids[start : start + 4], use_cache=False)
            d = seen["h"].shape[-1]
            r = seen["h"].reshape(-1, d) - seen["m"].reshape(-1, d)
            zs.append(seen["z"].reshape(-1, seen["z"].shape[-1]).double())
            ts.append((seen["y"].reshape(-1, d) - r).double())
    finally:
        for h in handles:
            h.remove()
    return torch.cat(zs), torch.cat(ts)


@pytest.mark.parametrize("model_type", ["llama", "opt", "gpt2", "gpt_neox"])
def test_fold_is_the_least_squares_solution(model_type):
    """Streamed float64 moments give the same weights as lstsq on the explicit activations."""
    ids = calibration()
    model = make_tiny_model(model_type)
    z, t = explicit_fold_target(model, 1, 3, ids)  # span = blocks 2, 3; host = block 1
    proj = block_part(get_blocks(model)[1][1], model, "mlp_out")
    with_bias = proj.bias is not None
    design = torch.cat([z, torch.ones(len(z), 1, dtype=z.dtype)], 1) if with_bias else z
    solution = torch.linalg.lstsq(design, t, driver="gelsd").solution  # [intermediate (+1), d]
    records = fold(model, [2, 3], ids, update_scale=1)  # the whole update: least squares itself
    assert records[0]["params"] == 0 and records[0]["intercept"] == with_bias
    weight = proj.weight if isinstance(proj, Conv1D) else proj.weight.T  # [intermediate, d]
    assert block_part(get_blocks(model)[1][1], model, "mlp_out") is proj
    fitted = z @ weight.double() + (proj.bias.double() if with_bias else 0)
    best = design @ solution
    # same predictions (weights may differ along near-null directions of z's Gram)
    torch.testing.assert_close(fitted, best, rtol=1e-4, atol=1e-4 * float(t.abs().max()))


@pytest.mark.parametrize("model_type", FOLDABLE)
def test_fold_export_loads_in_plain_transformers(model_type, tmp_path):
    ids = calibration()
    model = make_tiny_model(model_type)
    fold(model, [2], ids)
    out = prune.save(model, make_tiny_tokenizer(), tmp_path / "folded", {"note": "test"})
    assert not (out / "replacements.safetensors").exists()
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    heldout = calibration(2, 20, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(plain(heldout).logits, model(heldout).logits, rtol=0, atol=1e-5)
    assert plain.config.layercut_layout == [[0], [1, 2], [3]]
    assert plain.config.layercut_replacements[0]["method"] == "fold"


def test_fold_beats_removal():
    ids, heldout = calibration(), calibration(4, 32, seed=7)
    reference = make_tiny_model("gpt2")
    folded, removed = make_tiny_model("gpt2"), make_tiny_model("gpt2")
    fold(folded, [1, 2], ids)
    from prune.model.surgery import drop_blocks_

    drop_blocks_(removed, [1, 2])
    with torch.no_grad():
        target = reference.base_model(heldout).last_hidden_state
        err_fold = ((folded.base_model(heldout).last_hidden_state - target) ** 2).mean()
        err_removed = ((removed.base_model(heldout).last_hidden_state - target) ** 2).mean()
    assert err_fold < err_removed


def test_sequential_fold_only_changes_later_spans():
    ids = calibration()
    independent, sequential = make_tiny_model("opt"), make_tiny_model("opt")
    fold(independent, [1, 3], ids)  # hosts: block 0 (span [1]) and block 2 (span [3])
    fold(sequential, [1, 3], ids, fit="sequential")
    weights = [[block_part(b, m, "mlp_out").weight for b in get_blocks(m)[1]] for m in (independent, sequential)]
    torch.testing.assert_close(weights[0][0], weights[1][0])  # the first span sees the original inputs
    assert not torch.allclose(weights[0][1], weights[1][1], atol=1e-5)  # the second sees the folded block 0


def test_the_projection_a_fold_writes_and_the_spans_it_refuses():
    llama, gpt2 = make_tiny_model("llama"), make_tiny_model("gpt2")
    assert mlp_output_projection(llama, get_blocks(llama)[1][1]) is get_blocks(llama)[1][1].mlp.down_proj
    assert isinstance(mlp_output_projection(gpt2, get_blocks(gpt2)[1][2]), Conv1D)  # GPT-2's c_proj
    check_foldable(llama, [(2, 3)])
    with pytest.raises(LayercutError, match="span starting at block 0 has no previous block"):
        check_foldable(llama, [(2,), (0, 1)])
    assert (FoldOptions().update_scale, FoldOptions().ridge) == (0.7, 0.0)
