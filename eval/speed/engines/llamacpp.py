"""The ``llamacpp`` engine: llama.cpp through llama-cpp-python, on a GGUF file.

A folder is exported first by ``prune.checkpoint.gguf`` (float32 unless ``--gguf-type``, cached). Prefill is
``Llama.eval`` of the prompt on an emptied KV cache, one ``llama_decode`` call of ``n_batch = n_ctx``, synchronised by
reading its last logits. Decode is an untimed prefill, then ``new_tokens`` timed ``Llama.eval`` calls of
one token each, the next token the argmax of the last logits (llama.cpp's own sampler chain is not used:
it is the same work for every model). One sequence only (``--batch-size 1``).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from eval.speed.engines.base import (
    Engine,
    EngineModel,
    EngineOptions,
    EngineSettings,
    checkpoint_folder,
    export_path,
    prompt_rows,
    setting,
    token_list,
)
from prune.checkpoint.gguf import OUTTYPES, gguf_field
from prune.errors import LayercutError
from prune.measure.perplexity import token_nll
from prune.model.layouts import DECILM, VANILLA

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LlamaCppOptions(EngineOptions):
    """llama.cpp's own settings.

    Attributes:
        gpu_layers: ``n_gpu_layers`` (0: CPU only, -1: all).
        converter: llama.cpp's ``convert_hf_to_gguf.py`` for folders (None: ``$LLAMA_CPP_CONVERTER``).
        gguf_type: the type a folder is converted to (a ``.gguf`` file runs as it is): a quantized file is timed
            against its original quantized the same way, so the ratio is the depth's alone.
        no_repack: load with llama.cpp's extra buffer types off (``use_extra_bufts``, its ``--no-repack``): some
            builds crash (SIGSEGV) loading any model on some CPUs unless they are; the weights then stay as stored.
    """

    gpu_layers: int = setting(0, "layers offloaded to the GPU", flag="--gpu-layers", type=int,
                              default_help="0, CPU only; -1: all")
    converter: str | None = setting(None, "llama.cpp's convert_hf_to_gguf.py, for folders", flag="--converter",
                                    type=str, default_help="$LLAMA_CPP_CONVERTER")
    gguf_type: str = setting("f32", "the GGUF type a checkpoint folder is converted to (a .gguf file runs as it is)",
                             flag="--gguf-type", type=str, check=lambda value: value in OUTTYPES,
                             expect=f"is one of {', '.join(OUTTYPES)}")
    no_repack: bool = setting(False, "load with llama.cpp's extra buffer types off (its own --no-repack), for a "
                              "build that crashes loading models on this CPU", flag="--no-repack")


# loads that turn llama.cpp's defaults wait for each other: each gives back the function it found
_DEFAULTS_TURNED = threading.Lock()


@contextmanager
def _extra_buffer_types(llama_cpp, on: bool):
    """While open, ``Llama`` loads models with llama.cpp's extra buffer types ``on`` (its default) or off.

    ``llama_cpp.Llama`` takes no argument for ``llama_model_params.use_extra_bufts``: it starts from
    ``llama_model_default_params()``, looked up on ``llama_cpp.llama_cpp`` as it loads, so that function is
    wrapped here for the load alone (one load at a time).
    """
    if on:
        yield
        return
    with _DEFAULTS_TURNED:
        bindings = llama_cpp.llama_cpp
        default = bindings.llama_model_default_params
        if "use_extra_bufts" not in dict(getattr(default().__class__, "_fields_", ())):
            # a ctypes structure takes an unknown attribute without a word: the setting would do nothing
            raise LayercutError("llama.cpp's extra buffer types cannot be turned off (--no-repack): this "
                                "llama-cpp-python has no use_extra_bufts setting: pip install -U 'layercut[llamacpp]'")

        def without_extra_buffers():
            params = default()
            params.use_extra_bufts = False
            return params

        bindings.llama_model_default_params = without_extra_buffers
        try:
            yield
        finally:
            bindings.llama_model_default_params = default


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
    """Where the GGUF copy of a checkpoint folder is cached: keyed by its path, its files' sizes and times, its type."""
    return export_path(folder, f".{outtype}.gguf")


def gguf_file(path: str, converter: str | None = None, outtype: str = "f32") -> Path:
    """The GGUF file llama.cpp runs for ``path``: the file itself, or a folder's export of ``outtype`` (made once).

    Args:
        path: a ``.gguf`` file, a checkpoint folder or an alias / hub id resolving to a local folder.
        converter: llama.cpp's ``convert_hf_to_gguf.py`` (None: ``$LLAMA_CPP_CONVERTER``).
        outtype: the folder's GGUF type (``prune.checkpoint.gguf.OUTTYPES``; the quantized ones need
            llama-cpp-python's quantizer, which this engine has).
    """
    given = Path(path).expanduser()
    if given.is_file() and given.suffix == ".gguf":
        return given.resolve()
    folder = given if given.is_dir() else Path(checkpoint_folder(path) or path)
    if not folder.is_dir():
        raise LayercutError(f"--engine llamacpp runs a .gguf file or a local checkpoint folder; {path} is neither")
    out = gguf_export_path(folder, outtype)
    if out.is_file():
        return out
    from prune.checkpoint.gguf import export_gguf  # written by the export side; imported when a folder needs it

    out.parent.mkdir(parents=True, exist_ok=True)
    logger.info("exporting %s to %s for llama.cpp (%s, once)", folder, out, outtype)
    return Path(export_gguf(folder, out=out, outtype=outtype, converter=converter))


class LlamaCppEngine(Engine):
    """llama.cpp through llama-cpp-python, on a GGUF file (a folder is exported to GGUF once: ``--gguf-type``)."""

    name, display, module, distribution, extra = "llamacpp", "llama.cpp", "llama_cpp", "llama-cpp-python", "llamacpp"
    summary = ("llama.cpp through llama-cpp-python; a folder is exported to GGUF once (float32 unless --gguf-type); "
               "--threads sets its threads")
    layouts, options, max_batch = (VANILLA, DECILM), LlamaCppOptions, 1
    # PyPI has no binary wheel of llama-cpp-python: pip compiles llama.cpp (measured on 2 cores: 20-26 minutes
    # until 2026-12-02, 8-9 minutes on 2026-12-03 beside other jobs, 5.8 and 6.1 minutes on 2026-12-04, idle)
    install_note = "pip compiles llama.cpp from source: 6-26 minutes on 2 CPU cores, once"

    def describe(self, settings: EngineSettings) -> dict:
        """Threads, context, GPU layers and ``no_repack`` when on (the GGUF's own types are the dtype)."""
        own = settings.of(self)
        return {"threads": settings.thread_count(), "n_ctx": settings.context, "gpu_layers": own.gpu_layers,
                **({"no_repack": True} if own.no_repack else {})}  # fmt: skip

    def _open(self, gguf: Path, settings: EngineSettings, n_ctx: int, logits_all: bool):
        llama_cpp = self.import_module()
        threads = settings.thread_count()
        own = settings.of(self)
        with _extra_buffer_types(llama_cpp, on=not own.no_repack):
            try:
                return llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=n_ctx, logits_all=logits_all,
                                       n_threads=threads, n_threads_batch=threads,
                                       n_gpu_layers=own.gpu_layers, seed=0, verbose=False)  # fmt: skip
            except ValueError as err:  # llama.cpp could not load the file: its message, in one line
                raise LayercutError(f"llama.cpp cannot load {gguf}: {' '.join(str(err).split())}") from None

    def load(self, path: str, settings: EngineSettings | None = None) -> EngineModel:
        """A ``llama_cpp.Llama`` of ``n_ctx = settings.context``, the last position's logits only."""
        settings = settings or EngineSettings()
        own = settings.of(self)
        llama_cpp = self.import_module()
        gguf = gguf_file(path, own.converter, own.gguf_type)
        llm = self._open(gguf, settings, settings.context, logits_all=False)
        return EngineModel(
            model=llm, source=str(gguf), blocks=gguf_block_count(gguf),
            params=int(llama_cpp.llama_model_n_params(llm.model)),
            weights_bytes=int(llama_cpp.llama_model_size(llm.model)),
            checkpoint_bytes=gguf.stat().st_size, vocab_size=llm.n_vocab(),
            max_positions=int(llama_cpp.llama_model_n_ctx_train(llm.model)) or None,
            device="cpu" if own.gpu_layers == 0 else f"gpu ({own.gpu_layers} layers offloaded)",
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
        (ids,) = prompt_rows(prompt_ids)
        last_logits = self._logits_reader(handle.model)
        start = time.perf_counter()
        self._prefill(handle.model, ids, last_logits)
        return time.perf_counter() - start

    def greedy(self, handle: EngineModel, prompt_ids, new_tokens: int) -> list[int]:
        """The argmax tokens of :meth:`decode_seconds`'s loop, kept."""
        (ids,) = prompt_rows(prompt_ids)
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
        (ids,) = prompt_rows(prompt_ids)
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
        ids = token_list(token_ids)
        if handle.max_positions is not None and len(ids) > handle.max_positions:
            raise LayercutError(f"{len(ids)} tokens exceed the {handle.max_positions} positions of {handle.source}: "
                                "score shorter windows")
        # a context of its own that keeps every position's logits (the timed one does not copy them out), opened
        # once: reopening it per window read the whole file again each time
        llm = handle.scorer
        if llm is None or llm.n_ctx() < len(ids):
            if llm is not None:
                llm.close()
            llm = handle.scorer = self._open(Path(handle.source), handle.settings, max(len(ids), handle.context or 0),
                                             logits_all=True)
        llm.reset()  # n_tokens = 0: the window is computed from an empty KV cache
        llm.eval(ids)
        logits = torch.from_numpy(llm.scores[: len(ids) - 1].copy())  # [n - 1, vocab] float32
        targets = torch.tensor(ids[1:])  # [n - 1]
        return float(token_nll(logits[None], targets[None])[0]), len(ids) - 1

    def close(self, handle: EngineModel) -> None:
        """Free the model and its context."""
        for llm in (handle.model, handle.scorer):
            if llm is not None:
                llm.close()
        handle.scorer = None
        super().close(handle)


ENGINE = LlamaCppEngine()
