"""The ``vllm`` engine: vLLM's offline ``vllm.LLM``, prefix caching off so that a repeated prompt is computed again.

Prefill is one ``LLM.generate`` of the prompt(s) with ``max_tokens=1``; decode is the time of
``max_tokens = new_tokens + 1`` minus the time of ``max_tokens=1``, measured back to back: the
``new_tokens`` decode steps, the request overhead of both calls cancelling. Greedy (``temperature=0``),
``ignore_eos``, no detokenisation. A batch is ``--batch-size`` concurrent requests. The models of one
comparison are loaded together, each taking ``--gpu-memory`` divided by their number.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from eval.speed.engines.base import (
    Engine,
    EngineModel,
    EngineOptions,
    EngineSettings,
    checkpoint_bytes,
    export_path,
    prompt_rows,
    setting,
    token_list,
)
from prune.errors import LayercutError
from prune.model.adapters import max_positions
from prune.model.layouts import DECILM, VANILLA
from prune.replace import parameter_count

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmOptions(EngineOptions):
    """vLLM's own settings.

    Attributes:
        gpu_memory: Share of the GPU's memory (on a CPU, of the host's) vLLM may take for all the models
            loaded together; each gets ``gpu_memory / sharing`` (``gpu_memory_utilization``).
        eager: ``enforce_eager`` (no CUDA graphs: faster start, slower decode).
    """

    gpu_memory: float = setting(0.85, "share of the GPU's memory (on a CPU, of the host's) all the models loaded "
                                "together may take", flag="--gpu-memory", type=float,
                                check=lambda v: 0 < v <= 1, expect="is a share of the GPU's memory in (0, 1]")
    eager: bool = setting(False, "no CUDA graphs (enforce_eager; faster start, slower decode)", flag="--eager")


def decilm_folder(source: str) -> str:
    """``source``, or for a sub-layer checkpoint in the DeciLM layout its vLLM folder (``prune.checkpoint.decilm``).

    The folder is written once, cached beside the GGUF exports.
    """
    from prune.checkpoint.serving import layout_of_folder

    folder = Path(source)
    if not folder.is_dir() or layout_of_folder(folder) != DECILM:
        return source
    from prune.checkpoint.decilm import write_decilm
    from prune.checkpoint.gguf import is_decilm_folder

    if is_decilm_folder(folder):  # already written by prune.checkpoint.decilm
        return source

    out = export_path(folder, ".decilm")
    if not (out / "config.json").is_file():
        logger.info("writing %s in the DeciLM layout to %s (once)", folder, out)
        write_decilm(folder, out, overwrite=True)
    return str(out)


def _meta_model(source: str):
    """The model's architecture on the meta device (no weights): its parameter count and positions."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _params_and_positions(source: str) -> tuple[int, int | None]:
    """Parameter count and positions: from the architecture on the meta device, else the weight files' headers."""
    try:
        meta = _meta_model(source)
        return parameter_count(meta), max_positions(meta)
    except (ValueError, KeyError, OSError):  # a config transformers builds no model for (the DeciLM layout)
        from safetensors import safe_open

        params = 0
        for file in Path(source).glob("*.safetensors"):
            with safe_open(str(file), "pt") as handle:
                params += sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys())
        config = json.loads((Path(source) / "config.json").read_text(encoding="utf-8"))
        return params, config.get("max_position_embeddings")


def _refuse_wrapped(folder: str, engine: str) -> None:
    """A layercut checkpoint with maps or removed sub-layers runs in no serving engine: one line."""
    from prune.model import remote_code as hf_remote_code

    config = Path(folder) / "config.json"
    if config.is_file() and hf_remote_code.is_wrapped(json.loads(config.read_text(encoding="utf-8"))):
        raise LayercutError(f"--engine {engine} cannot run {folder}: it carries layercut's own modules; "
                            f"{hf_remote_code.SERVABLE}")


def _vllm_model_config(llm):
    """The ``ModelConfig`` of a ``vllm.LLM`` (its place moved between releases)."""
    engine = llm.llm_engine
    for owner in (engine, getattr(engine, "vllm_config", None), llm):
        config = getattr(owner, "model_config", None)
        if config is not None:
            return config
    raise LayercutError("this vLLM exposes no model_config on LLM.llm_engine: report the vLLM version")


def _vllm_device(vllm) -> str:
    """The device vLLM runs on (its platform: cuda, cpu, ...)."""
    try:
        return str(importlib.import_module("vllm.platforms").current_platform.device_type)
    except (ImportError, AttributeError):
        return "unknown"


class VllmEngine(Engine):
    """vLLM's offline ``LLM``, on a checkpoint folder or hub id; prefix caching off."""

    name, display, module, distribution, extra = "vllm", "vLLM", "vllm", "vllm", "vllm"
    summary = "vLLM's offline LLM, prefix caching off"
    layouts, options = (VANILLA, DECILM), VllmOptions

    @staticmethod
    def dtype(settings: EngineSettings) -> str:
        """``--dtype``, float32 for auto (vLLM's own auto turns a float32 checkpoint into float16)."""
        return "float32" if settings.load.dtype == "auto" else settings.load.dtype

    def memory_share(self, settings: EngineSettings) -> float:
        """Each model's ``gpu_memory_utilization``: ``--gpu-memory`` divided by the models loaded together."""
        return settings.of(self).gpu_memory / settings.sharing

    def describe(self, settings: EngineSettings) -> dict:
        """dtype, context, each model's GPU memory share and CUDA graphs."""
        return {"dtype": self.dtype(settings), "max_model_len": settings.context,
                "gpu_memory_utilization": round(self.memory_share(settings), 4),
                "enforce_eager": settings.of(self).eager}  # fmt: skip

    def load(self, path: str, settings: EngineSettings | None = None) -> EngineModel:
        """A ``vllm.LLM`` of ``max_model_len = settings.context``; params counted on the meta device."""
        from prune.loading.loader import hf_checkpoint

        settings = settings or EngineSettings()
        vllm = self.import_module()
        source = decilm_folder(hf_checkpoint(path))
        _refuse_wrapped(source, self.name)
        params, positions = _params_and_positions(source)
        # one token past the context: generate() always makes one, also when nll scores a whole window
        max_model_len = settings.context + 1 if positions is None else min(settings.context + 1, positions)
        # a DeciLM-layout folder (prune.checkpoint.decilm) names its config class by auto_map: remote code to vLLM
        remote = "auto_map" in json.loads((Path(source) / "config.json").read_text(encoding="utf-8")) \
            if (Path(source) / "config.json").is_file() else False
        try:
            llm = vllm.LLM(model=source, tokenizer=settings.load.tokenizer or source, dtype=self.dtype(settings),
                           max_model_len=max_model_len, gpu_memory_utilization=self.memory_share(settings),
                           enforce_eager=settings.of(self).eager, enable_prefix_caching=False, seed=0,
                           trust_remote_code=remote)  # fmt: skip
        except (RuntimeError, ValueError) as err:  # vLLM's engine did not start: its reason is in its log
            raise LayercutError(f"vLLM could not start on {source} ({' '.join(str(err).split())[:300]}); its log "
                                "above says why (on a CPU, --gpu-memory is the share of host memory it reserves)") \
                from None
        text_config = _vllm_model_config(llm).hf_text_config
        return EngineModel(
            model=llm, source=source, blocks=int(text_config.num_hidden_layers), params=params,
            weights_bytes=params * torch.empty((), dtype=getattr(torch, self.dtype(settings))).element_size(),
            checkpoint_bytes=checkpoint_bytes(source), vocab_size=int(text_config.vocab_size),
            max_positions=positions, device=_vllm_device(vllm), settings=settings, context=max_model_len,
        )  # fmt: skip

    def _generate(self, handle: EngineModel, rows: list[list[int]], **sampling) -> list:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, ignore_eos=True, detokenize=False, **sampling)
        return handle.model.generate([{"prompt_token_ids": row} for row in rows], params, use_tqdm=False)

    def _seconds(self, handle: EngineModel, rows: list[list[int]], max_tokens: int) -> float:
        start = time.perf_counter()
        self._generate(handle, rows, max_tokens=max_tokens)
        return time.perf_counter() - start

    def prefill_seconds(self, handle: EngineModel, prompt_ids) -> float:
        """One ``LLM.generate`` of ``max_tokens=1`` (each prompt row a request)."""
        return self._seconds(handle, prompt_rows(prompt_ids), 1)

    def decode_seconds(self, handle: EngineModel, prompt_ids, new_tokens: int) -> float:
        """``generate(max_tokens=new_tokens + 1)`` minus ``generate(max_tokens=1)``, back to back."""
        rows = prompt_rows(prompt_ids)
        first = self._seconds(handle, rows, 1)  # prefill + request overhead
        whole = self._seconds(handle, rows, new_tokens + 1)  # the same + new_tokens decode steps
        if whole <= first:
            raise LayercutError(f"vLLM's {new_tokens} decode steps took no measurable time ({whole:.4f} s with them, "
                                f"{first:.4f} s without): raise --new-tokens")
        return whole - first

    def greedy(self, handle: EngineModel, prompt_ids, new_tokens: int) -> list[int]:
        """``generate`` at temperature 0: the ids of its one completion."""
        (output,) = self._generate(handle, prompt_rows(prompt_ids), max_tokens=new_tokens)
        return list(output.outputs[0].token_ids)

    def nll(self, handle: EngineModel, token_ids) -> tuple[float, int]:
        """The ``prompt_logprobs`` vLLM gives the tokens (each position's own token is always among them)."""
        ids = token_list(token_ids)
        if len(ids) + 1 > handle.context:
            raise LayercutError(f"{len(ids)} tokens and the one vLLM generates exceed its max_model_len of "
                                f"{handle.context}: score shorter windows, or load with a larger context")
        (output,) = self._generate(handle, [ids], max_tokens=1, prompt_logprobs=1)
        entries = output.prompt_logprobs  # entry i: {token id: Logprob} for position i; entry 0 is None
        # each entry holds the prompt's own token besides the top prompt_logprobs ones
        total = math.fsum(-float(entries[i][token].logprob) for i, token in enumerate(ids) if i > 0)
        return total, len(ids) - 1

    def close(self, handle: EngineModel) -> None:
        """Stop the engine-core process (vLLM V1) and free the GPU memory."""
        llm = handle.model
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        with contextlib.suppress(Exception):  # the engine-core process of vLLM's V1; absent elsewhere
            core.shutdown()
        super().close(handle)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


ENGINE = VllmEngine()
