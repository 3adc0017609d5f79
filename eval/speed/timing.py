"""What ``eval.speed.measure`` times: a prefill over a random prompt and a greedy decode with the KV cache.

* prefill: one forward pass over a ``[batch, prompt_len]`` prompt with ``logits_to_keep=1`` (the
  logits of the last position only, as a serving engine or ``generate`` does), no KV cache.
* decode: a manual greedy loop of ``new_tokens`` single-token steps that reuse the KV cache built
  by an untimed prefill. We do not call ``generate``: its per-step Python overhead (logits processors,
  stopping criteria) is the same for both models and only dilutes the ratio we want.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch

from prune.errors import LayercutError
from prune.model.adapters import cache_keyword, input_device


@dataclass
class SpeedOptions:
    """What to time.

    Attributes:
        prompt_len: Prompt tokens per sequence (prefill length).
        new_tokens: Decode steps with the KV cache.
        batch_size: Sequences per forward pass.
        repeats: Timed repetitions per model (interleaved).
        warmup: Untimed repetitions per model before timing.
        seed: Seed of the random prompt (same prompt for every model).
    """

    prompt_len: int = 256
    new_tokens: int = 64
    batch_size: int = 1
    repeats: int = 5
    warmup: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompt_len", "new_tokens", "batch_size", "repeats"):
            if getattr(self, name) < 1:
                raise LayercutError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise LayercutError(f"warmup must be 0 or more, got {self.warmup}")


def make_prompt(vocab_size: int, options: SpeedOptions) -> torch.Tensor:
    """Random prompt shared by all models; token ids avoid the first 16 (often special tokens)."""
    generator = torch.Generator().manual_seed(options.seed)
    low = 16 if vocab_size > 32 else 0
    return torch.randint(low, vocab_size, (options.batch_size, options.prompt_len), generator=generator)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def keep_logits(model: torch.nn.Module, count: int = 1) -> dict:
    """``forward``'s keyword computing only the last ``count`` positions' logits ({} for a model without it)."""
    return {"logits_to_keep": count} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


@torch.inference_mode()
def time_prefill(model: torch.nn.Module, prompt: torch.Tensor) -> float:
    """Seconds for one forward pass over ``prompt`` ``[batch, prompt_len]``."""
    device = input_device(model)
    prompt = prompt.to(device)
    _sync(device)
    start = time.perf_counter()
    model(input_ids=prompt, use_cache=False, **keep_logits(model))
    _sync(device)
    return time.perf_counter() - start


@torch.inference_mode()
def greedy_decode(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float]:
    """Greedy decoding with the KV cache: an untimed prefill, then ``new_tokens`` timed single-token steps.

    Returns:
        ``([batch, new_tokens]`` generated ids, seconds of the decode steps).
    """
    device = input_device(model)
    name = cache_keyword(model)  # read once, outside the timed loop
    out = model(input_ids=prompt.to(device), use_cache=True, **keep_logits(model))
    cache, token = getattr(out, name), out.logits[:, -1].argmax(-1, keepdim=True)  # token: [batch, 1]
    generated = [token]
    _sync(device)
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        out = model(input_ids=token.to(device), use_cache=True, **{name: cache})
        cache, token = getattr(out, name), out.logits[:, -1].argmax(-1, keepdim=True)
        generated.append(token)
    # The last step's forward also runs (a server computes the next token's logits): new_tokens forwards timed.
    model(input_ids=token.to(device), use_cache=True, **{name: cache})
    _sync(device)
    return torch.cat(generated, dim=1), time.perf_counter() - start


def time_decode(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> float:
    """Seconds for ``new_tokens`` single-token forward passes with the KV cache, after an untimed prefill."""
    return greedy_decode(model, prompt, new_tokens)[1]
