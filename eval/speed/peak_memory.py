"""Peak memory of one prefill + decode, for ``eval.speed.measure``'s comparison.

On CUDA ``torch.cuda.max_memory_allocated``; on CPU the peak RSS of a fresh child process that loads
the model and runs one prefill + decode (:func:`peak_memory_subprocess`), minus the RSS of that child
before loading (Python, torch, transformers). For a model that exists only in memory,
:func:`peak_memory_inprocess` gives weights + the RSS growth during a run (sampled).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from eval.speed.timing import SpeedOptions, make_prompt, time_decode
from prune.errors import LayercutError
from prune.memory import vm_hwm_bytes
from prune.model.adapters import input_device

_REPO_ROOT = Path(__file__).resolve().parents[2]


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters and buffers (tied weights counted once)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


@torch.inference_mode()
def run_once(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> None:
    """One prefill + decode, the workload whose peak memory we report."""
    time_decode(model, prompt, new_tokens)


def peak_memory_inprocess(model: torch.nn.Module, options: SpeedOptions | None = None) -> tuple[int, str]:
    """Peak memory of one prefill + decode of an in-memory model.

    Returns:
        ``(bytes, method)``: on CUDA the weights plus the growth of ``max_memory_allocated`` over the
        run; on CPU the weights plus the peak RSS growth sampled every millisecond.
    """
    options = options or SpeedOptions()
    prompt = make_prompt(model.get_input_embeddings().weight.shape[0], options)
    device = input_device(model)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run_once(model, prompt, options.new_tokens)
        growth = torch.cuda.max_memory_allocated(device) - before
        return weights_bytes(model) + growth, "cuda: weights + max_memory_allocated growth (in process)"
    growth = _sampled_rss_growth(lambda: run_once(model, prompt, options.new_tokens))
    return weights_bytes(model) + growth, "cpu: weights + sampled RSS growth (in process)"


def _sampled_rss_growth(work: Callable[[], None], interval_s: float = 0.001) -> int:
    import psutil

    process = psutil.Process()
    before = peak = process.memory_info().rss
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, process.memory_info().rss)
            time.sleep(interval_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        work()
    finally:
        done.set()
        sampler.join()
    return max(0, max(peak, process.memory_info().rss) - before)


def peak_memory_subprocess(
    model_ref: str,
    options: SpeedOptions | None = None,
    *,
    device: str = "cpu",
    dtype: str = "auto",
    tokenizer: str | None = None,
    timeout_s: float = 1800,
) -> tuple[int, str]:
    """Peak memory of loading ``model_ref`` and running one prefill + decode, in a fresh process.

    On CPU: the child's peak RSS (``VmHWM`` on Linux, else sampled) minus its RSS after importing
    torch and transformers; on CUDA: the child's ``torch.cuda.max_memory_allocated``.

    Args:
        model_ref: Name or folder that ``prune.load`` loads (replacement maps attached).
        options: Prompt and decode sizes of the run.
        device: Device to load on.
        dtype: Dtype to load in.
        tokenizer: Tokenizer name for a folder saved without one.
        timeout_s: Give up after this many seconds.

    Returns:
        ``(bytes, method)``.
    """
    options = options or SpeedOptions()
    spec = {"model": model_ref, "tokenizer": tokenizer, "device": device, "dtype": dtype, "options": asdict(options),
            "threads": torch.get_num_threads()}  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO_ROOT), env.get("PYTHONPATH")) if p)
    code = "import sys; from eval.speed.peak_memory import _peak_memory_child; _peak_memory_child(sys.argv[1])"
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True, env=env, timeout=timeout_s
    )
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise LayercutError(f"memory measurement of {model_ref} failed in its child process: {tail[0]}")
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return int(report["bytes"]), report["method"]


def _peak_memory_child(spec_json: str) -> None:
    """Body of the child process of :func:`peak_memory_subprocess`; prints one JSON line."""
    import psutil

    from prune.checkpoint.save_load import (
        load,  # imported before the baseline RSS: its libraries are not the model's cost
    )

    spec = json.loads(spec_json)
    options = SpeedOptions(**spec["options"])
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    base_rss = psutil.Process().memory_info().rss
    kept = []

    def load_and_run() -> None:
        loaded = load(spec["model"], tokenizer=spec["tokenizer"], dtype=spec["dtype"], device=spec["device"])
        model = loaded.model.eval()
        run_once(model, make_prompt(model.get_input_embeddings().weight.shape[0], options), options.new_tokens)
        kept.append(model)  # keep the weights resident until the peak is read

    growth = _sampled_rss_growth(load_and_run, interval_s=0.005)
    if input_device(kept[0]).type == "cuda":
        report = {"bytes": torch.cuda.max_memory_allocated(), "method": "cuda: max_memory_allocated (fresh process)"}
    else:
        peak = max(base_rss + growth, vm_hwm_bytes() or 0)
        report = {"bytes": peak - base_rss, "method": "cpu: peak RSS of a fresh process minus its RSS after imports"}
    print(json.dumps(report))
