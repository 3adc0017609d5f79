"""``--replace local``: the block before a cut retrained block-locally towards the span's map; a plain checkpoint."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from prune.errors import LayercutError
from prune.replace import ReplaceConfig, fit_replacements, replace_blocks_, surgered_view
from tests.helpers import make_tiny_model


def ids(samples=8, seq=32, seed=0):
    return torch.randint(3, 300, (samples, seq), generator=torch.Generator().manual_seed(seed))


def local(**kw):
    return ReplaceConfig(method="local", progress=False, **{"steps": 60, "lr": 1e-3, **kw})


@pytest.mark.parametrize(("model_type", "folds"), [("llama", True), ("gemma3_text", False)])
def test_the_host_learns_the_maps_output_and_the_checkpoint_stays_plain(model_type, folds, tmp_path):
    """Only the block before the cut changes; its error to the map's output falls; transformers reloads it alone."""
    model = make_tiny_model(model_type, num_hidden_layers=6)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    record = replace_blocks_(model, [2, 3], ids(), local())[0]
    assert record["fold_init"] is folds  # sandwich norms: no fold, the block itself is the start
    if folds:  # the fold towards the map's outputs starts below removal's error
        assert record["relative_error_start"] < 0.9
    else:
        assert record["relative_error_start"] == pytest.approx(1.0, abs=1e-4)
    assert record["train_loss_end"] < 0.6 * record["train_loss_start"]
    after = model.state_dict()
    source = {0: 0, 1: 1, 2: 4, 3: 5}  # blocks 4, 5 now sit at 2, 3

    def original(key):
        parts = key.split(".")
        if not key.startswith("model.layers."):
            return key
        return ".".join([*parts[:2], str(source[int(parts[2])]), *parts[3:]])

    changed = {k.split(".")[2] for k in after if not torch.equal(after[k], before[original(k)])}
    assert changed == {"1"}  # only the host, block 1
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    test = ids(2, 16, seed=1)
    with torch.no_grad():
        assert torch.allclose(reloaded(test).logits, model(test).logits, atol=1e-5)
    assert reloaded.config.num_hidden_layers == 4


def test_a_view_puts_the_hosts_weights_back():
    model = make_tiny_model("llama", num_hidden_layers=6)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    replacements = fit_replacements(model, [3], ids(), local(steps=5))
    with surgered_view(model, replacements):
        assert not torch.equal(model.model.layers[2].mlp.down_proj.weight, state["model.layers.2.mlp.down_proj.weight"])
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_a_span_from_block_0_is_refused_in_one_line():
    with pytest.raises(LayercutError, match=r"retrains the block before the span.*protect block 0") as error:
        fit_replacements(make_tiny_model("llama"), [0, 1], ids(), local())
    assert "\n" not in str(error.value)
