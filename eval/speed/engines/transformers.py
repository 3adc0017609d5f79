"""The ``transformers`` engine: the model in this process, loaded by ``prune.load`` (replacement maps attached).

Timed by ``eval.speed.timing``'s workloads as they are: a forward over the prompt with the last logits only;
a manual greedy loop of ``new_tokens`` single-token forwards on the KV cache, after an untimed prefill.
It runs every layout (``prune.load`` attaches layercut's own modules), and is the reference the other
engines' perplexity is compared with.
"""

from __future__ import annotations

import torch

from eval.speed.engines.base import (
    REFERENCE,
    Engine,
    EngineModel,
    EngineSettings,
    block_count,
    checkpoint_bytes,
    checkpoint_folder,
    prompt_rows,
    token_list,
)
from eval.speed.peak_memory import weights_bytes
from eval.speed.timing import greedy_decode, time_decode, time_prefill
from prune.loading.offload import streamed
from prune.measure.perplexity import Window, stream_nll
from prune.model.adapters import input_device, max_positions
from prune.model.layouts import VANILLA
from prune.replace import parameter_count


class TransformersEngine(Engine):
    """transformers in this process, loaded by ``prune.load`` (replacement maps attached)."""

    name, display, module, distribution = REFERENCE, "transformers", "transformers", "transformers"
    summary = "in this process, with its peak memory"
    layouts = (VANILLA,)  # as it ships; sub-layer removals and maps need layercut or trust_remote_code

    def refusal(self, serving: dict) -> str | None:
        """None: ``prune.load`` opens every layout in this process (the reference of every comparison)."""
        return None

    def load(self, path: str, settings: EngineSettings | None = None) -> EngineModel:
        """``prune.load`` with ``settings.load``'s dtype, device and tokenizer."""
        settings = settings or EngineSettings()
        loaded = settings.load.load(path)
        model = loaded.model.eval()
        return EngineModel(
            model=model, source=str(loaded.source), blocks=block_count(model), params=parameter_count(model),
            weights_bytes=weights_bytes(model), checkpoint_bytes=checkpoint_bytes(checkpoint_folder(path)),
            vocab_size=model.get_input_embeddings().weight.shape[0], max_positions=max_positions(model),
            device=str(input_device(model)), settings=settings,
        )  # fmt: skip

    def prefill_seconds(self, handle: EngineModel, prompt_ids: torch.Tensor) -> float:
        """``eval.speed.timing.time_prefill``: one forward, the last position's logits only."""
        return time_prefill(handle.model, torch.as_tensor(prompt_ids).reshape(-1, prompt_ids.shape[-1]))

    def decode_seconds(self, handle: EngineModel, prompt_ids: torch.Tensor, new_tokens: int) -> float:
        """``eval.speed.timing.time_decode``: ``new_tokens`` single-token forwards on the KV cache."""
        return time_decode(handle.model, torch.as_tensor(prompt_ids).reshape(-1, prompt_ids.shape[-1]), new_tokens)

    def greedy(self, handle: EngineModel, prompt_ids, new_tokens: int) -> list[int]:
        """``eval.speed.timing.greedy_decode``'s ids: argmax steps on the KV cache (a skeleton's blocks streamed)."""
        (ids,) = prompt_rows(prompt_ids)
        with streamed(handle.model):
            return greedy_decode(handle.model, torch.tensor([ids]), new_tokens)[0][0].tolist()

    def nll(self, handle: EngineModel, token_ids) -> tuple[float, int]:
        """``prune.measure.perplexity.stream_nll`` over one window of all the tokens.

        A skeleton (``--offload sequential``) streams its blocks, one in memory at a time.
        """
        ids = torch.tensor(token_list(token_ids))  # [n]
        with streamed(handle.model):
            return stream_nll(handle.model, ids, [Window(0, len(ids), 1)], 1), len(ids) - 1


ENGINE = TransformersEngine()
