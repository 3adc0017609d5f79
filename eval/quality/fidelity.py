"""Generation fidelity: what a slimmed model writes, judged against the original it was cut from.

Perplexity and multiple choice score the model on text someone else wrote; damage that shows only when the
model writes (a repeated phrase, a topic lost after ten tokens) hides there. This module lets the slim model
write and has the original judge it:

* ``nll``: the original's mean negative log-likelihood per token of the slim model's greedy continuation of
  held-out prompts. The original's own greedy continuation gives its floor (``Reference.own_nll``); a slim
  model that writes what the original would have written scores near it, one that rambles scores far above.
* ``kept``: the share of the original's greedy tokens the slim model reproduces before its first divergence,
  averaged over prompts (1.0: every continuation identical).

Both decode greedily for a fixed number of tokens with the KV cache (``eval.speed.timing.greedy_decode``, the
loop every engine's greedy check is compared with); the prompts are equal-length windows of token ids, so a
batch needs no padding and each row is what a batch of one would give.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from eval.speed.timing import greedy_decode, keep_logits
from prune.errors import LayercutError
from prune.model.adapters import input_device


@dataclass(frozen=True)
class FidelityOptions:
    """How fidelity is measured.

    Attributes:
        prompts: prompts in all, shared out evenly over the texts they are cut from.
        prompt_tokens: tokens of each prompt.
        new_tokens: greedy tokens each model writes after a prompt.
        batch_size: prompts decoded together (the default, 32, is every default prompt at once: a decode step
            reads every weight whatever its batch, so on a CPU 32 rows cost little more than 8; the figures move
            only by float rounding).
    """

    prompts: int = 32
    prompt_tokens: int = 64
    new_tokens: int = 32
    batch_size: int = 32

    def __post_init__(self):
        for name in ("prompts", "prompt_tokens", "new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise LayercutError(f"fidelity {name} must be at least 1, got {getattr(self, name)}")

    def describe(self) -> dict:
        """The settings a figure was measured with, for its row."""
        return {"prompts": self.prompts, "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens}


def prompts_from_streams(streams: list[torch.Tensor], options: FidelityOptions) -> torch.Tensor:
    """``[options.prompts, prompt_tokens]`` windows cut evenly through each 1-D token stream in turn.

    Each stream gives its share of the prompts (the first ones one more when they do not divide), from windows
    spread over the whole text rather than its opening: a novel's first page is not the novel.
    """
    if not streams:
        raise LayercutError("generation fidelity needs held-out text to cut prompts from; none was given")
    shares = [options.prompts // len(streams) + (index < options.prompts % len(streams))
              for index in range(len(streams))]
    windows = []
    for stream, share in zip(streams, shares, strict=True):
        if share == 0:
            continue
        stream = stream.reshape(-1)
        room = stream.numel() - options.prompt_tokens
        if room < 0:
            raise LayercutError(f"a held-out text has {stream.numel()} tokens, fewer than the fidelity prompts' "
                                f"{options.prompt_tokens}: give a longer text or shorter prompts")
        starts = torch.linspace(0, room, share).round().long().tolist() if share > 1 else [0]
        windows += [stream[start:start + options.prompt_tokens] for start in starts]
    return torch.stack(windows)


@torch.inference_mode()
def greedy_continuations(model, prompts: torch.Tensor, options: FidelityOptions, desc: str = "greedy") -> torch.Tensor:
    """``[prompts, new_tokens]`` greedy ids ``model`` writes after each prompt (batched, KV cache, no padding)."""
    rows = []
    for start in tqdm(range(0, len(prompts), options.batch_size), desc=desc, unit="batch", leave=False):
        ids, _ = greedy_decode(model, prompts[start:start + options.batch_size], options.new_tokens)
        rows.append(ids.cpu())
    return torch.cat(rows)


@torch.inference_mode()
def continuation_nll(model, prompts: torch.Tensor, continuations: torch.Tensor,
                     options: FidelityOptions) -> torch.Tensor:
    """``[prompts]`` mean negative log-likelihood per token that ``model`` gives each continuation after its prompt."""
    device = input_device(model)
    out = []
    for start in range(0, len(prompts), options.batch_size):
        prompt, written = prompts[start:start + options.batch_size], continuations[start:start + options.batch_size]
        ids = torch.cat([prompt, written], dim=1).to(device)
        # only the continuation's positions reach the head (a batch of vocabulary-wide rows is the pass's largest
        # tensor); a model without logits_to_keep returns them all, and the slice keeps the same ones
        logits = model(input_ids=ids[:, :-1], use_cache=False,
                       **keep_logits(model, written.shape[1])).logits[:, -written.shape[1]:]
        # float32 log-softmax: a bf16 model's half-precision logits would round the loss at the third digit
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        picked = logprobs.gather(-1, written.to(device).unsqueeze(-1)).squeeze(-1)
        out.append(-picked.mean(dim=1).cpu())
    return torch.cat(out)


def kept_prefix(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """``[rows]`` share of each reference row that ``candidate`` reproduces before their first different token."""
    same = (reference == candidate).long()
    return same.cumprod(dim=1).sum(dim=1).float() / reference.shape[1]


class Reference:
    """The original model's side of fidelity: its prompts, its own greedy continuations and their NLL.

    Built once and shared by every model measured against it: the original decodes each prompt at most once per
    run (not at all when its side is given, as a cache keeps it).
    """

    def __init__(self, original, prompts: torch.Tensor, options: FidelityOptions | None = None, *,
                 greedy: torch.Tensor | None = None, own_nll: torch.Tensor | None = None):
        """``greedy`` and ``own_nll``: the original's side measured before on these prompts (a cache), or None."""
        self.original = original
        self.prompts = prompts
        self.options = options or FidelityOptions()
        if greedy is not None and tuple(greedy.shape) != (len(prompts), self.options.new_tokens):
            raise ValueError(f"a kept greedy continuation of shape {tuple(greedy.shape)} for {len(prompts)} prompts "
                             f"of {self.options.new_tokens} new tokens")
        self._greedy: torch.Tensor | None = greedy
        self._own_nll: torch.Tensor | None = own_nll if greedy is not None else None

    @property
    def greedy(self) -> torch.Tensor:
        """The original's greedy continuation of every prompt."""
        if self._greedy is None:
            self._greedy = greedy_continuations(self.original, self.prompts, self.options, desc="original greedy")
        return self._greedy

    @property
    def own_nll(self) -> torch.Tensor:
        """The original's NLL per token of its own greedy continuations: the floor ``nll`` is read against."""
        if self._own_nll is None:
            self._own_nll = continuation_nll(self.original, self.prompts, self.greedy, self.options)
        return self._own_nll

    def measure(self, model) -> dict:
        """``model``'s fidelity to the original: ``{"kept", "nll", "own_nll", ...settings}``, means over prompts.

        The original measured against itself gives ``kept`` 1.0 and ``nll`` equal to ``own_nll`` without
        decoding again.
        """
        if model is self.original:
            written, nll = self.greedy, self.own_nll
        else:
            written = greedy_continuations(model, self.prompts, self.options, desc="slim greedy")
            nll = continuation_nll(self.original, self.prompts, written, self.options)
        kept = kept_prefix(self.greedy, written)
        result = {"kept": float(kept.mean()), "nll": float(nll.mean()), "own_nll": float(self.own_nll.mean()),
                  # per prompt, in prompt order: two models measured on the same prompts compare row by row (paired
                  # gaps), far less noisy than their separate standard errors suggest
                  "kept_rows": [round(float(v), 6) for v in kept], "nll_rows": [round(float(v), 6) for v in nll],
                  "nll_stderr": _stderr(nll), "kept_stderr": _stderr(kept)}
        if not math.isfinite(result["nll"]):
            raise LayercutError("the original gives a non-finite likelihood to the continuations: its logits "
                                "overflow in this dtype; measure fidelity in float32 or bfloat16")
        return {**result, **self.options.describe()}


def _stderr(values: torch.Tensor) -> float:
    """Standard error of the mean of ``values`` (0 for a single value)."""
    return float(values.double().std() / math.sqrt(len(values))) if len(values) > 1 else 0.0
