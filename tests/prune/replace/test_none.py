"""``none``: the blocks are only removed; nothing is fitted and the checkpoint stays vanilla."""

import torch

from prune.model.layouts import VANILLA
from prune.model.surgery import block_layout, drop_blocks_
from prune.replace import ReplaceConfig, get_method, replace_blocks_, replacement_modules
from prune.replace.none import NoneOptions
from tests.helpers import make_tiny_model


def test_none_is_removal_and_takes_no_option():
    method = get_method("none")
    assert method.fitter is None and method.serving == VANILLA and method.fits == ("independent",)
    assert NoneOptions.specs() == {} and ReplaceConfig(method="none").options == NoneOptions()
    ids = torch.randint(3, 320, (4, 16), generator=torch.Generator().manual_seed(0))
    model, removed = make_tiny_model("llama"), make_tiny_model("llama")
    assert replace_blocks_(model, [1, 2], ids, ReplaceConfig(method="none", progress=False)) == []
    drop_blocks_(removed, [1, 2])
    assert block_layout(model) == [[0], [3]] and replacement_modules(model) == []
    with torch.no_grad():
        assert torch.equal(model(ids).logits, removed(ids).logits)
