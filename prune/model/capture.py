"""Forward hooks that hand each residual-stream state to a callback while the model runs.

State ``i`` is the input of block ``i``; state ``L`` is the output of the last block (before the final
norm, which is why ``output_hidden_states`` is not used: its last entry is usually after the norm).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from prune.model.adapters import get_blocks

StateCallback = Callable[[int, torch.Tensor], None]


def block_output(output) -> torch.Tensor:
    """The hidden state a block returns: a tensor, or the first element of a tuple (older transformers)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def with_block_output(output, hidden: torch.Tensor):
    """``output`` with its hidden state (:func:`block_output`) swapped for ``hidden``, for a forward hook to return."""
    return (hidden, *output[1:]) if isinstance(output, (tuple, list)) else hidden


def block_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden state passed to a block, positionally or as ``hidden_states=``."""
    return args[0] if args else kwargs["hidden_states"]


@contextmanager
def hooks_held(handles: list) -> Iterator[None]:
    """The hooks behind ``handles`` stay registered inside the ``with`` and go on exit, even on error."""
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def residual_states(model: nn.Module, callback: StateCallback, contribution: str | None = None) -> Iterator[None]:
    """Call ``callback(i, h)`` for every residual state ``h`` [batch, seq, hidden] during forward passes.

    Blocks follow each other directly in every supported architecture, so block ``i``'s output is
    block ``i+1``'s input: hooking block 0's input and every block's output sees each state once.

    ``contribution``: the path, inside a block, of the module whose output is the MLP's contribution
    to the residual (``prune.selection.sublayers.contribution_path``). With it, states interleave with each
    block's middle state (output minus that contribution): 2i is block i's input, 2i+1 its middle.
    """
    _, blocks = get_blocks(model)
    handles = []
    try:
        handles.append(
            blocks[0].register_forward_pre_hook(
                lambda _m, args, kwargs: callback(0, block_input(args, kwargs)), with_kwargs=True
            )
        )
        for index, block in enumerate(blocks):
            if contribution is None:
                handles.append(block.register_forward_hook(_output_hook(callback, index + 1)))
                continue
            last: dict[str, torch.Tensor] = {}
            try:  # a block without an MLP (attention-only blocks of hybrids) has its output as middle state
                module = block.get_submodule(contribution)
            except AttributeError:
                module = None
            if module is not None:
                # a copy: a block may add into the MLP's output in place (Falcon)
                handles.append(module.register_forward_hook(
                    lambda _m, _a, output, last=last: last.__setitem__("mlp", block_output(output).clone())))
            handles.append(block.register_forward_hook(_split_hook(callback, 2 * index + 1, last)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _split_hook(callback: StateCallback, middle_index: int, last: dict):
    def hook(_module, _args, output):
        hidden = block_output(output)
        mlp = last.pop("mlp", None)
        callback(middle_index, hidden if mlp is None else hidden - mlp)
        callback(middle_index + 1, hidden)

    return hook


def _output_hook(callback: StateCallback, state_index: int):
    def hook(_module, _args, output):
        callback(state_index, block_output(output))

    return hook
