"""Serving engines that time and score a model: transformers, llama.cpp and vLLM, one registry.

    python -m eval.bench speed --engine llamacpp --baseline dense/ --model slim/ --threads 2
    python -m eval.bench speed --engine vllm --baseline dense/ --model slim/

Each :class:`Engine` loads a checkpoint into an :class:`EngineModel` and answers four questions about it:
the seconds of a prefill, the seconds of a greedy decode with the KV cache, its block count as the
engine itself reads it (so the ideal ``L / (L - k)`` is the engine's), and the summed negative
log-likelihood of given token ids (perplexity in that engine). How each engine is timed:

* ``transformers``: ``eval.speed.timing``'s workloads as they are (a forward over the prompt with the last
  logits only; a manual greedy loop of ``new_tokens`` single-token forwards on the KV cache, after an
  untimed prefill).
* ``llamacpp`` (llama-cpp-python, a GGUF file; a folder is exported first by ``prune.checkpoint.gguf``,
  float32, cached): prefill is ``Llama.eval`` of the prompt on an emptied KV cache, one
  ``llama_decode`` call of ``n_batch = n_ctx``, synchronised by reading its last logits. Decode is an
  untimed prefill, then ``new_tokens`` timed ``Llama.eval`` calls of one token each, the next token the
  argmax of the last logits (llama.cpp's own sampler chain is not used: it is the same work for every
  model). One sequence only (``--batch-size 1``).
* ``vllm`` (``vllm.LLM``, prefix caching off so that a repeated prompt is computed again): prefill is
  one ``LLM.generate`` of the prompt(s) with ``max_tokens=1``; decode is the time of ``max_tokens =
  new_tokens + 1`` minus the time of ``max_tokens=1``, measured back to back: the ``new_tokens`` decode
  steps, the request overhead of both calls cancelling. Greedy (``temperature=0``), ``ignore_eos``, no
  detokenisation. A batch is ``--batch-size`` concurrent requests.

The models of one comparison are loaded together (vLLM: each takes ``--gpu-memory`` divided by their
number). Peak memory is measured for transformers only. An engine's package is an extra: a missing
one is a one-line error naming it (``pip install 'layercut[llamacpp]'``).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eval.speed.peak_memory import weights_bytes
from eval.speed.timing import greedy_decode, time_decode, time_prefill
from prune.checkpoint.gguf import gguf_field
from prune.checkpoint.load_config import LoadConfig
from prune.errors import LayercutError
from prune.measure.perplexity import Window, stream_nll, token_nll
from prune.model.adapters import input_device, max_positions, num_blocks
from prune.registry import Registry
from prune.replace import parameter_count

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
GGUF_EXPORT_FOLDER = "gguf-export"  # under prune.loading.gguf.cache_dir(): float32 GGUF copies of checkpoint folders


def checkpoint_bytes(folder: str | Path | None) -> int | None:
    """Total size of the weight files in a checkpoint folder, None when it is not a folder."""
    if folder is None or not Path(folder).is_dir():
        return None
    files = [p for p in Path(folder).rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)]
    if any(p.suffix != ".gguf" for p in files):  # a GGUF written beside the weights (--export gguf) is a copy
        files = [p for p in files if p.suffix != ".gguf"]
    return sum(p.stat().st_size for p in files) or None


def checkpoint_folder(name: str) -> str | None:
    """The folder whose weight files give the checkpoint size (a GGUF alias: its converted safetensors copy)."""
    from prune.loading.loader import hf_checkpoint

    try:
        folder = hf_checkpoint(name)
    except LayercutError:
        return None
    return folder if Path(folder).is_dir() else None


def block_count(model: torch.nn.Module) -> int:
    """Return the number of decoder blocks; read the config for architectures without an adapter."""
    try:
        return num_blocks(model)
    except LayercutError:
        value = getattr(model.config, "num_hidden_layers", None)
        if value is None:
            raise
        return int(value)


@dataclass(frozen=True)
class EngineSettings:
    """How an engine loads a model.

    Attributes:
        load: transformers' loading (dtype, device, tokenizer); vLLM takes its dtype and tokenizer.
        threads: llama.cpp's ``n_threads`` and ``n_threads_batch`` (None: torch's thread count).
        context: Tokens one sequence may hold (llama.cpp ``n_ctx``, vLLM ``max_model_len``).
        gpu_layers: llama.cpp's ``n_gpu_layers`` (0: CPU only, -1: all).
        converter: llama.cpp's ``convert_hf_to_gguf.py`` for folders (None: ``$LLAMA_CPP_CONVERTER``).
        gpu_memory: Share of the GPU's memory vLLM may take for all the models loaded together.
        sharing: How many models are loaded together: each vLLM model gets ``gpu_memory / sharing``
            (``gpu_memory_utilization``).
        eager: vLLM's ``enforce_eager`` (no CUDA graphs: faster start, slower decode).
    """

    load: LoadConfig = field(default_factory=LoadConfig)
    threads: int | None = None
    context: int = 2048
    gpu_layers: int = 0
    converter: str | None = None
    gpu_memory: float = 0.85
    sharing: int = 1
    eager: bool = False

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise LayercutError(f"--threads must be a positive integer, got {self.threads}")
        if self.context < 2:
            raise LayercutError(f"an engine context of {self.context} tokens holds no prediction: use 2 or more")
        if not 0 < self.gpu_memory <= 1:
            raise LayercutError(f"--gpu-memory is a share of the GPU's memory in (0, 1], got {self.gpu_memory}")
        if self.sharing < 1:
            raise LayercutError(f"sharing counts the models loaded together: at least 1, got {self.sharing}")

    def thread_count(self) -> int:
        """The threads llama.cpp runs on: ``threads``, else torch's (``--threads`` or the free cores)."""
        return self.threads or torch.get_num_threads()


@dataclass
class EngineModel:
    """A model one engine has loaded, with what a speed report says of it.

    Attributes:
        model: The engine's own object (a ``PreTrainedModel``, a ``llama_cpp.Llama``, a ``vllm.LLM``).
        source: What was loaded: a folder, hub id or GGUF file.
        blocks: Decoder blocks, as the engine reads them.
        params: Parameter count.
        weights_bytes: Bytes of the weights the engine holds.
        checkpoint_bytes: Bytes of the weight files on disk, None when unknown.
        vocab_size: Rows of the embedding (prompt ids stay below it).
        max_positions: Positions the model was trained for, None when unknown.
        device: Where it runs, in words.
        settings: The settings it was loaded with.
        context: Tokens one request may hold in the engine, None for no fixed limit.
    """

    model: Any
    source: str
    blocks: int
    params: int
    weights_bytes: int
    checkpoint_bytes: int | None
    vocab_size: int
    max_positions: int | None
    device: str
    settings: EngineSettings
    context: int | None = None


class Engine:
    """One serving engine: its package, how it loads a model and times and scores it.

    Attributes:
        name: The ``--engine`` value.
        module: The package's import name.
        distribution: The package's name on PyPI.
        extra: layercut's extra that installs it, None for a core dependency.
        max_batch: Sequences one timing may hold, None for any.
    """

    name = ""
    module = ""
    distribution = ""
    extra: str | None = None
    max_batch: int | None = None

    def available(self) -> bool:
        """Whether the package is installed (without importing it)."""
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules (tests)
            return False

    def missing_message(self) -> str:
        """The one line for a missing package."""
        install = f"pip install 'layercut[{self.extra}]'" if self.extra else f"pip install {self.distribution}"
        return f"--engine {self.name} needs {self.distribution}: {install}"

    def check(self) -> None:
        """Raise the one-line error when the package is missing.

        Raises:
            LayercutError: the package is not installed; the message names the extra.
        """
        if not self.available():
            raise LayercutError(self.missing_message())

    def import_module(self):
        """The engine's package, imported; a missing or broken install is one line."""
        self.check()
        try:
            return importlib.import_module(self.module)
        except ImportError as err:
            detail = " ".join(str(err).split())
            raise LayercutError(f"{self.missing_message()} ({self.distribution} fails to import: {detail})") from None

    def version(self) -> str | None:
        """The installed package's version, None when it is not installed."""
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            module = importlib.import_module(self.module) if self.available() else None
            return getattr(module, "__version__", None)

    def describe(self, settings: EngineSettings) -> dict:
        """The settings that matter to this engine, as a speed report records them (JSON-ready)."""
        return {"dtype": settings.load.dtype, "device": settings.load.device, "threads": torch.get_num_threads()}

    def check_batch(self, batch_size: int) -> None:
        """Refuse a batch the engine's timing cannot hold, in one line."""
        if self.max_batch is not None and batch_size > self.max_batch:
            raise LayercutError(f"--engine {self.name} times {self.max_batch} sequence(s) at a time: "
                                f"use --batch-size {self.max_batch}")

    def load(self, path: str, settings: EngineSettings | None = None) -> EngineModel:
        """Load ``path`` (alias, folder, hub id or, for llama.cpp, a GGUF file)."""
        raise NotImplementedError

    def prefill_seconds(self, handle: EngineModel, prompt_ids: torch.Tensor) -> float:
        """Seconds of one prefill over ``prompt_ids`` ``[batch, prompt_len]``."""
        raise NotImplementedError

    def decode_seconds(self, handle: EngineModel, prompt_ids: torch.Tensor, new_tokens: int) -> float:
        """Seconds of ``new_tokens`` greedy decode steps with the KV cache, after the prompt's prefill."""
        raise NotImplementedError

    def block_count(self, handle: EngineModel) -> int:
        """Decoder blocks of the loaded model, as the engine reads them."""
        return handle.blocks

    def nll(self, handle: EngineModel, token_ids) -> tuple[float, int]:
        """``(sum of -log p(token[i] | tokens[:i]) for i in 1..n-1, n - 1)``, the sum in float64."""
        raise NotImplementedError

    def greedy(self, handle: EngineModel, prompt_ids, new_tokens: int) -> list[int]:
        """The ``new_tokens`` ids greedy decoding gives after the prompt (one sequence), as the engine serves them."""
        raise NotImplementedError

    def close(self, handle: EngineModel) -> None:
        """Free what the engine holds for ``handle``."""
        handle.model = None
        gc.collect()


ENGINES: Registry[Engine] = Registry("engine", flag="--engine")


def register_engine(engine: Engine) -> Engine:
    """Add an engine under its name."""
    return ENGINES.register(engine.name, engine)


def get_engine(name: str) -> Engine:
    """The engine registered as ``name`` (one line listing the known ones otherwise)."""
    return ENGINES.get(name)


def _token_list(token_ids) -> list[int]:
    """Token ids as a flat list of ints; refuses fewer than two (nothing to predict)."""
    ids = token_ids.reshape(-1).tolist() if isinstance(token_ids, torch.Tensor) else [int(t) for t in token_ids]
    if len(ids) < 2:
        raise LayercutError(f"perplexity needs at least 2 tokens, got {len(ids)}")
    return ids


def _prompt_rows(prompt_ids) -> list[list[int]]:
    """``[batch, prompt_len]`` ids as lists of ints."""
    if isinstance(prompt_ids, torch.Tensor):
        return prompt_ids.reshape(-1, prompt_ids.shape[-1]).tolist()
    rows = list(prompt_ids)
    return [list(map(int, row)) for row in rows] if rows and not isinstance(rows[0], int) else [list(map(int, rows))]


# ---- transformers ----


class TransformersEngine(Engine):
    """transformers in this process, loaded by ``prune.load`` (replacement maps attached)."""

    name, module, distribution = "transformers", "transformers", "transformers"

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
        """``eval.speed.timing.greedy_decode``'s ids: argmax steps on the KV cache."""
        (ids,) = _prompt_rows(prompt_ids)
        return greedy_decode(handle.model, torch.tensor([ids]), new_tokens)[0][0].tolist()

    def nll(self, handle: EngineModel, token_ids) -> tuple[float, int]:
        """``prune.measure.perplexity.stream_nll`` over one window of all the tokens."""
        ids = torch.tensor(_token_list(token_ids))  # [n]
        return stream_nll(handle.model, ids, [Window(0, len(ids), 1)], 1), len(ids) - 1


# ---- llama.cpp ----


def gguf_block_count(path: str | Path) -> int:
    """``{arch}.block_count`` of a GGUF file, ``arch`` from ``general.architecture``.

    Raises:
        LayercutError: the file has no such key.
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = gguf_field(reader, "general.architecture")
    count = gguf_field(reader, f"{arch}.block_count") if arch else None
    if count is None:
        raise LayercutError(f"{path} has no {arch or 'general.architecture'}.block_count: "
                            "is it a llama.cpp GGUF model?")
    return int(count)


def gguf_export_path(folder: Path, outtype: str = "f32") -> Path:
    """Where the GGUF copy of a checkpoint folder is cached: keyed by its path and its files' sizes and times."""
    from prune.loading.gguf import cache_dir

    # every file the converter may read (tokenizer files too), not the GGUFs written beside them
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix != ".gguf")
    stamp = [str(folder.resolve())] + [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
    digest = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:16]
    return cache_dir() / GGUF_EXPORT_FOLDER / f"{folder.name}-{digest}.{outtype}.gguf"


def gguf_file(path: str, converter: str | None = None) -> Path:
    """The GGUF file llama.cpp runs for ``path``: the file itself, or a folder's float32 export (made once).

    Args:
        path: a ``.gguf`` file, a checkpoint folder or an alias / hub id resolving to a local folder.
        converter: llama.cpp's ``convert_hf_to_gguf.py`` (None: ``$LLAMA_CPP_CONVERTER``).
    """
    given = Path(path).expanduser()
    if given.is_file() and given.suffix == ".gguf":
        return given.resolve()
    folder = given if given.is_dir() else Path(checkpoint_folder(path) or path)
    if not folder.is_dir():
        raise LayercutError(f"--engine llamacpp runs a .gguf file or a local checkpoint folder; {path} is neither")
    out = gguf_export_path(folder)
    if out.is_file():
        return out
    from prune.checkpoint.gguf import export_gguf  # written by the export side; imported when a folder needs it

    out.parent.mkdir(parents=True, exist_ok=True)
    logger.info("exporting %s to %s for llama.cpp (float32, once)", folder, out)
    return Path(export_gguf(folder, out=out, outtype="f32", converter=converter))


def decilm_folder(source: str) -> str:
    """``source``, or for a sub-layer checkpoint in the DeciLM layout its vLLM folder (``prune.checkpoint.decilm``, made once)."""
    from prune.checkpoint.serving import layout_of_folder
    from prune.model.layouts import DECILM

    folder = Path(source)
    if not folder.is_dir() or layout_of_folder(folder) != DECILM:
        return source
    from prune.checkpoint.decilm import write_decilm
    from prune.checkpoint.gguf import is_decilm_folder

    if is_decilm_folder(folder):  # already written by prune.checkpoint.decilm
        return source

    out = gguf_export_path(folder).with_suffix("").with_suffix(".decilm")
    if not (out / "config.json").is_file():
        logger.info("writing %s in the DeciLM layout to %s (once)", folder, out)
        write_decilm(folder, out, overwrite=True)
    return str(out)


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


class LlamaCppEngine(Engine):
    """llama.cpp through llama-cpp-python, on a GGUF file (a folder is exported to float32 GGUF once)."""

    name, module, distribution, extra, max_batch = "llamacpp", "llama_cpp", "llama-cpp-python", "llamacpp", 1

    def describe(self, settings: EngineSettings) -> dict:
        """Threads, context and GPU layers (the GGUF's own types are the dtype)."""
        return {"threads": settings.thread_count(), "n_ctx": settings.context, "gpu_layers": settings.gpu_layers}

    def _open(self, gguf: Path, settings: EngineSettings, n_ctx: int, logits_all: bool):
        llama_cpp = self.import_module()
        threads = settings.thread_count()
        try:
            return llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=n_ctx, logits_all=logits_all,
                                   n_threads=threads, n_threads_batch=threads, n_gpu_layers=settings.gpu_layers,
                                   seed=0, verbose=False)  # fmt: skip
        except ValueError as err:  # llama.cpp could not load the file: its message, in one line
            raise LayercutError(f"llama.cpp cannot load {gguf}: {' '.join(str(err).split())}") from None

    def load(self, path: str, settings: EngineSettings | None = None) -> EngineModel:
        """A ``llama_cpp.Llama`` of ``n_ctx = settings.context``, the last position's logits only."""
        settings = settings or EngineSettings()
        llama_cpp = self.import_module()
        gguf = gguf_file(path, settings.converter)
        llm = self._open(gguf, settings, settings.context, logits_all=False)
        return EngineModel(
            model=llm, source=str(gguf), blocks=gguf_block_count(gguf),
            params=int(llama_cpp.llama_model_n_params(llm.model)),
            weights_bytes=int(llama_cpp.llama_model_size(llm.model)),
            checkpoint_bytes=gguf.stat().st_size, vocab_size=llm.n_vocab(),
            max_positions=int(llama_cpp.llama_model_n_ctx_train(llm.model)) or None,
            device="cpu" if settings.gpu_layers == 0 else f"gpu ({settings.gpu_layers} layers offloaded)",
            settings=settings, context=llm.n_ctx(),
        )  # fmt: skip

    @staticmethod
    def _logits_reader(llm):
        """A function of no arguments giving the last position's logits ``[vocab]``, its look-ups done here.

        Reading the logits waits for the computation to finish (llama.cpp's GPU backends return early).
        """
        import numpy as np
        from llama_cpp import llama_get_logits_ith

        ctx, vocab = llm.ctx, llm.n_vocab()
        return lambda: np.ctypeslib.as_array(llama_get_logits_ith(ctx, -1), shape=(vocab,))

    @staticmethod
    def _prefill(llm, ids: list[int], last_logits) -> None:
        llm.reset()  # n_tokens = 0: eval drops the KV cache from there on and computes the prompt again
        llm.eval(ids)
        last_logits()

    def prefill_seconds(self, handle: EngineModel, prompt_ids) -> float:
        """``Llama.eval`` of the prompt on an emptied KV cache, until its last logits are there."""
        (ids,) = _prompt_rows(prompt_ids)
        last_logits = self._logits_reader(handle.model)
        start = time.perf_counter()
        self._prefill(handle.model, ids, last_logits)
        return time.perf_counter() - start

    def greedy(self, handle: EngineModel, prompt_ids, new_tokens: int) -> list[int]:
        """The argmax tokens of :meth:`decode_seconds`'s loop, kept."""
        (ids,) = _prompt_rows(prompt_ids)
        llm = handle.model
        last_logits = self._logits_reader(llm)
        self._prefill(llm, ids, last_logits)
        tokens = [int(last_logits().argmax())]
        while len(tokens) < new_tokens:
            llm.eval([tokens[-1]])
            tokens.append(int(last_logits().argmax()))
        return tokens

    def decode_seconds(self, handle: EngineModel, prompt_ids, new_tokens: int) -> float:
        """An untimed prefill, then ``new_tokens`` one-token ``Llama.eval`` calls, each next token the argmax."""
        (ids,) = _prompt_rows(prompt_ids)
        llm = handle.model
        last_logits = self._logits_reader(llm)
        self._prefill(llm, ids, last_logits)  # untimed
        token = int(last_logits().argmax())
        start = time.perf_counter()
        for _ in range(new_tokens):  # new_tokens forwards, as eval.speed.timing times them
            llm.eval([token])
            token = int(last_logits().argmax())
        return time.perf_counter() - start

    def nll(self, handle: EngineModel, token_ids) -> tuple[float, int]:
        """One ``Llama.eval`` with ``logits_all``: log-softmax of positions 0..n-2 at tokens 1..n-1."""
        ids = _token_list(token_ids)
        if handle.max_positions is not None and len(ids) > handle.max_positions:
            raise LayercutError(f"{len(ids)} tokens exceed the {handle.max_positions} positions of {handle.source}: "
                                "score shorter windows")
        # its own context: every position's logits (logits_all), which the timed one does not copy out
        llm = self._open(Path(handle.source), handle.settings, len(ids), logits_all=True)
        try:
            llm.eval(ids)
            logits = torch.from_numpy(llm.scores[: len(ids) - 1].copy())  # [n - 1, vocab] float32
        finally:
            llm.close()
        targets = torch.tensor(ids[1:])  # [n - 1]
        return float(token_nll(logits[None], targets[None])[0]), len(ids) - 1

    def close(self, handle: EngineModel) -> None:
        """Free the model and its context."""
        if handle.model is not None:
            handle.model.close()
        super().close(handle)


# ---- vLLM ----


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


def _meta_model(source: str):
    """The model's architecture on the meta device (no weights): its parameter count and positions."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _vllm_device(vllm) -> str:
    """The device vLLM runs on (its platform: cuda, cpu, ...)."""
    try:
        return str(importlib.import_module("vllm.platforms").current_platform.device_type)
    except (ImportError, AttributeError):
        return "unknown"


class VllmEngine(Engine):
    """vLLM's offline ``LLM``, on a checkpoint folder or hub id; prefix caching off."""

    name, module, distribution, extra = "vllm", "vllm", "vllm", "vllm"

    @staticmethod
    def dtype(settings: EngineSettings) -> str:
        """``--dtype``, float32 for auto (vLLM's own auto turns a float32 checkpoint into float16)."""
        return "float32" if settings.load.dtype == "auto" else settings.load.dtype

    def describe(self, settings: EngineSettings) -> dict:
        """dtype, context, each model's GPU memory share and CUDA graphs."""
        return {"dtype": self.dtype(settings), "max_model_len": settings.context,
                "gpu_memory_utilization": round(settings.gpu_memory / settings.sharing, 4),
                "enforce_eager": settings.eager}  # fmt: skip

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
        # a DeciLM-layout folder (prune.checkpoint.decilm) names its config class by auto_map: vLLM reads it as remote code
        remote = "auto_map" in json.loads((Path(source) / "config.json").read_text(encoding="utf-8")) \
            if (Path(source) / "config.json").is_file() else False
        try:
            llm = vllm.LLM(model=source, tokenizer=settings.load.tokenizer or source, dtype=self.dtype(settings),
                           max_model_len=max_model_len, gpu_memory_utilization=settings.gpu_memory / settings.sharing,
                           enforce_eager=settings.eager, enable_prefix_caching=False, seed=0,
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
        return self._seconds(handle, _prompt_rows(prompt_ids), 1)

    def decode_seconds(self, handle: EngineModel, prompt_ids, new_tokens: int) -> float:
        """``generate(max_tokens=new_tokens + 1)`` minus ``generate(max_tokens=1)``, back to back."""
        rows = _prompt_rows(prompt_ids)
        first = self._seconds(handle, rows, 1)  # prefill + request overhead
        whole = self._seconds(handle, rows, new_tokens + 1)  # the same + new_tokens decode steps
        if whole <= first:
            raise LayercutError(f"vLLM's {new_tokens} decode steps took no measurable time ({whole:.4f} s with them, "
                                f"{first:.4f} s without): raise --new-tokens")
        return whole - first

    def greedy(self, handle: EngineModel, prompt_ids, new_tokens: int) -> list[int]:
        """``generate`` at temperature 0: the ids of its one completion."""
        (output,) = self._generate(handle, _prompt_rows(prompt_ids), max_tokens=new_tokens)
        return list(output.outputs[0].token_ids)

    def nll(self, handle: EngineModel, token_ids) -> tuple[float, int]:
        """The ``prompt_logprobs`` vLLM gives the tokens (each position's own token is always among them)."""
        ids = _token_list(token_ids)
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


for _engine in (TransformersEngine(), LlamaCppEngine(), VllmEngine()):
    register_engine(_engine)
