"""``block``: one block of the architecture per span, a copy of the span's first block, trained to its output."""

import pytest
import torch

from prune.errors import LayercutError
from prune.model.adapters import get_blocks
from prune.model.layouts import VANILLA
from prune.replace import ReplaceConfig, get_method
from prune.replace.block import BlockFitter, BlockOptions
from tests.helpers import make_tiny_model


def test_block_defaults_and_capabilities():
    assert (BlockOptions().steps, BlockOptions().lr) == (200, 1e-4)
    method = get_method("block")
    assert method.fitter is BlockFitter and method.serving == VANILLA and method.min_span == 2


def test_untrained_the_new_block_is_a_copy_of_the_spans_first_block():
    model = make_tiny_model("llama")
    blocks = get_blocks(model)[1]
    fitter = BlockFitter(model, blocks, (1, 2), ReplaceConfig(method="block", steps=0, progress=False))
    assert fitter.needs_call and fitter.where == "block" and fitter.host is None
    replacement = fitter.finish()
    assert replacement.where == "block" and replacement.module is not blocks[1]
    assert replacement.record == {"params": sum(p.numel() for p in blocks[1].parameters()),
                                  "init_block_position": 1, "steps": 0}
    copied, original = replacement.module.state_dict(), blocks[1].state_dict()
    assert copied.keys() == original.keys() and all(torch.equal(copied[k], original[k]) for k in original)


def test_negative_steps_are_refused():
    with pytest.raises(LayercutError, match="--replace-steps must be a whole number >= 0"):
        BlockOptions(steps=-1)
