"""The wrapper that carries replacement maps on a kept block, and what methods share about modules."""

from __future__ import annotations

from torch import nn

from prune.capture import block_input


class ReplacedBlock(nn.Module):
    """A kept block with replacement maps for the removed spans next to it.

    ``before`` runs on the block's input (a span that started at block 0), ``after`` on its output.
    Attribute lookups it does not know fall through to the wrapped block, so code that reaches into
    blocks by name (``self_attn``, ``mlp.down_proj``, ``attention_type``) sees the same parts.
    """

    def __init__(self, block: nn.Module, before: nn.Module | None = None, after: nn.Module | None = None):
        super().__init__()
        self.block = block
        self.before = before
        self.after = after

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            block = self.__dict__["_modules"].get("block")
            if block is None:
                raise
            return getattr(block, name)

    def maps(self) -> list[nn.Module]:
        """The replacement maps (before, after) present."""
        return [m for m in (self.before, self.after) if m is not None]

    def forward(self, *args, **kwargs):
        """Run ``before``, the block, then ``after``; returns what the block returns (tensor or tuple)."""
        hidden = block_input(args, kwargs)
        if self.before is not None:
            hidden = self.before(hidden)
        if args:
            output = self.block(hidden, *args[1:], **kwargs)
        else:
            output = self.block(**{**kwargs, "hidden_states": hidden})
        if self.after is None:
            return output
        if isinstance(output, (tuple, list)):
            return (self.after(output[0]), *output[1:])
        return self.after(output)


def parameter_count(module: nn.Module) -> int:
    """Number of trainable-or-not parameters (buffers excluded)."""
    return sum(p.numel() for p in module.parameters())


def map_on_block(_model: nn.Module, block: nn.Module, record: dict) -> nn.Module | None:
    """The map a record's replacement put on ``block`` (its ``before`` or ``after``); None if it carries none."""
    if not isinstance(block, ReplacedBlock):
        return None
    return block.before if record["where"] == "before" else block.after
