"""Speed and memory of a pruned model against its original, measured in the same run.

What is timed and why:

* prefill: one forward pass over a ``[batch, prompt_len]`` prompt with ``logits_to_keep=1`` (the
  logits of the last position only, as a serving engine or ``generate`` does), no KV cache.
* decode: a manual greedy loop of ``new_tokens`` single-token steps that reuse the KV cache built
  by an untimed prefill. We do not call ``generate``: its per-step Python overhead (logits processors,
  stopping criteria) is the same for both models and only dilutes the ratio we want.
* Baseline and candidates are measured interleaved (A B C A B C ...) after a warm-up, ``repeats``
  times. Within a turn the decode runs first, so its untimed prefill warms the model up and neither
  timing pays the cold start that follows a switch between models (it costs a large model more than
  a small one, which inflated prefill speed-ups past the ideal). We report median, min, max and
  quartiles, and speed-up ratios both as the ratio of medians and as the spread of per-repeat
  (paired) ratios, which cancels slow drifts of a shared machine.
* peak memory: on CUDA ``torch.cuda.max_memory_allocated``; on CPU the peak RSS of a fresh child
  process that loads the model and runs one prefill + decode (:func:`peak_memory_subprocess`), minus
  the RSS of that child before loading (Python, torch, transformers). For a model that exists only in
  memory, :func:`peak_memory_inprocess` gives weights + the RSS growth during a run (sampled).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from prune.adapters import input_device, max_positions, num_blocks
from prune.errors import LayercutError
from prune.loading import check_tokenizer
from prune.memory import vm_hwm_bytes
from prune.replace import parameter_count

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_REPO_ROOT = Path(__file__).resolve().parents[1]


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


@dataclass
class Spread:
    """Median and spread of repeated measurements (float64)."""

    median: float
    min: float
    max: float
    q1: float
    q3: float

    @classmethod
    def of(cls, samples: list[float]) -> Spread:
        """Summarise samples; quartiles by the inclusive method (exact for 1 or 2 samples too)."""
        values = sorted(float(v) for v in samples)
        if len(values) == 1:
            return cls(values[0], values[0], values[0], values[0], values[0])
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(statistics.median(values), values[0], values[-1], q1, q3)


@dataclass
class ModelSpeed:
    """Measurements of one model.

    Attributes:
        name: Label (model name or folder).
        num_blocks: Decoder blocks in the model.
        params: Parameter count.
        weights_bytes: Bytes of parameters and buffers in memory.
        checkpoint_bytes: Bytes of weight files on disk, None for a model without a folder.
        prefill_tokens_per_s: Spread of prefill throughput.
        decode_tokens_per_s: Spread of decode throughput.
        prefill_s: Raw prefill seconds per repeat.
        decode_s: Raw decode seconds per repeat.
        peak_memory_bytes: Peak memory attributable to the model (see ``memory_method``), or None.
        memory_method: How the peak was measured.
    """

    name: str
    num_blocks: int
    params: int
    weights_bytes: int
    checkpoint_bytes: int | None
    prefill_tokens_per_s: Spread
    decode_tokens_per_s: Spread
    prefill_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    peak_memory_bytes: int | None = None
    memory_method: str | None = None


@dataclass
class SpeedRatio:
    """Candidate speed / baseline speed; ``ideal`` is ``L / (L - k)`` from the block counts."""

    name: str
    ideal: float
    prefill: float
    decode: float
    prefill_paired: Spread
    decode_paired: Spread
    params: float
    peak_memory: float | None


@dataclass
class SpeedComparison:
    """A baseline, its candidates and their ratios, with the settings used."""

    baseline: ModelSpeed
    candidates: list[ModelSpeed]
    ratios: list[SpeedRatio]
    options: SpeedOptions
    device: str
    torch_threads: int

    def to_dict(self) -> dict:
        """Return a JSON-ready dict."""
        return asdict(self)


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters and buffers (tied weights counted once)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def checkpoint_bytes(folder: str | Path | None) -> int | None:
    """Total size of the weight files in a checkpoint folder, None when it is not a folder."""
    if folder is None or not Path(folder).is_dir():
        return None
    files = [p for p in Path(folder).rglob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)]
    return sum(p.stat().st_size for p in files) or None


def block_count(model: torch.nn.Module) -> int:
    """Return the number of decoder blocks; read the config for architectures without an adapter."""
    try:
        return num_blocks(model)
    except LayercutError:
        value = getattr(model.config, "num_hidden_layers", None)
        if value is None:
            raise
        return int(value)


def make_prompt(vocab_size: int, options: SpeedOptions) -> torch.Tensor:
    """Random prompt shared by all models; token ids avoid the first 16 (often special tokens)."""
    generator = torch.Generator().manual_seed(options.seed)
    low = 16 if vocab_size > 32 else 0
    return torch.randint(low, vocab_size, (options.batch_size, options.prompt_len), generator=generator)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _keeps_last_logits_only(model: torch.nn.Module) -> dict:
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


@torch.inference_mode()
def time_prefill(model: torch.nn.Module, prompt: torch.Tensor) -> float:
    """Seconds for one forward pass over ``prompt`` ``[batch, prompt_len]``."""
    device = input_device(model)
    prompt = prompt.to(device)
    _sync(device)
    start = time.perf_counter()
    model(input_ids=prompt, use_cache=False, **_keeps_last_logits_only(model))
    _sync(device)
    return time.perf_counter() - start


@torch.inference_mode()
def greedy_decode(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float]:
    """Greedy decoding with the KV cache: an untimed prefill, then ``new_tokens`` timed single-token steps.

    Returns:
        ``([batch, new_tokens]`` generated ids, seconds of the decode steps).
    """
    device = input_device(model)
    out = model(input_ids=prompt.to(device), use_cache=True, **_keeps_last_logits_only(model))
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)  # token: [batch, 1]
    generated = [token]
    _sync(device)
    start = time.perf_counter()
    for _ in range(new_tokens - 1):
        out = model(input_ids=token.to(device), past_key_values=cache, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        generated.append(token)
    # The last step's forward also runs (a server computes the next token's logits): new_tokens forwards timed.
    model(input_ids=token.to(device), past_key_values=cache, use_cache=True)
    _sync(device)
    return torch.cat(generated, dim=1), time.perf_counter() - start


def time_decode(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> float:
    """Seconds for ``new_tokens`` single-token forward passes with the KV cache, after an untimed prefill."""
    return greedy_decode(model, prompt, new_tokens)[1]


def _check_context(model: torch.nn.Module, options: SpeedOptions) -> None:
    limit = max_positions(model)
    needed = options.prompt_len + options.new_tokens
    if limit is not None and needed > limit:
        raise LayercutError(
            f"prompt_len + new_tokens = {needed} exceeds the model's {limit} positions; lower --prompt-len"
        )


def measure_speed(
    models: dict[str, torch.nn.Module],
    baseline: str,
    options: SpeedOptions | None = None,
    *,
    folders: dict[str, str | Path] | None = None,
    progress: bool = True,
) -> SpeedComparison:
    """Time the baseline and each candidate interleaved, ``options.repeats`` times.

    Args:
        models: Label -> model, all loaded; must include ``baseline``.
        baseline: Label of the original model.
        options: Sizes and repeats.
        folders: Label -> checkpoint folder, for checkpoint sizes.
        progress: Show a tqdm bar.

    Returns:
        Per-model measurements (memory not filled in: see :func:`attach_memory`) and ratios.
    """
    options = options or SpeedOptions()
    if baseline not in models:
        raise LayercutError(f"baseline '{baseline}' is not among the models {list(models)}")
    for model in models.values():
        model.eval()
        _check_context(model, options)
    vocab = min(m.get_input_embeddings().weight.shape[0] for m in models.values())
    prompt = make_prompt(vocab, options)  # [batch, prompt_len]
    names = [baseline] + [n for n in models if n != baseline]
    samples = {name: ([], []) for name in names}  # name -> (prefill seconds, decode seconds)
    rounds = options.warmup + options.repeats
    for step in tqdm(range(rounds), desc="speed", unit="round", disable=not progress):
        for name in names:  # interleaved: A B C, A B C, ...
            # Decode first: its untimed prefill warms this model up after the switch from the previous
            # one, so the timed prefill that follows is not charged a cold start (SmolLM2-135M: +7% at 30 blocks).
            decode_s = time_decode(models[name], prompt, options.new_tokens)
            prefill_s = time_prefill(models[name], prompt)
            if step >= options.warmup:
                samples[name][0].append(prefill_s)
                samples[name][1].append(decode_s)
    speeds = {n: _model_speed(n, models[n], *samples[n], options, (folders or {}).get(n)) for n in names}
    device = input_device(models[baseline])
    return SpeedComparison(
        baseline=speeds[baseline],
        candidates=[speeds[n] for n in names[1:]],
        ratios=[speed_ratio(speeds[baseline], speeds[n]) for n in names[1:]],
        options=options,
        device=str(device),
        torch_threads=torch.get_num_threads(),
    )


def _model_speed(name, model, prefill_s, decode_s, options, folder) -> ModelSpeed:
    prefill_tokens = options.batch_size * options.prompt_len
    decode_tokens = options.batch_size * options.new_tokens
    return ModelSpeed(
        name=name,
        num_blocks=block_count(model),
        params=parameter_count(model),
        weights_bytes=weights_bytes(model),
        checkpoint_bytes=checkpoint_bytes(folder),
        prefill_tokens_per_s=Spread.of([prefill_tokens / s for s in prefill_s]),
        decode_tokens_per_s=Spread.of([decode_tokens / s for s in decode_s]),
        prefill_s=list(prefill_s),
        decode_s=list(decode_s),
    )


def ideal_speedup(baseline_blocks: int, candidate_blocks: int) -> float:
    """``L / (L - k)``: the speed-up if all time were spent in the blocks."""
    if candidate_blocks < 1:
        raise LayercutError(f"a candidate with {candidate_blocks} blocks has no ideal speed-up; keep at least one")
    return baseline_blocks / candidate_blocks


def speed_ratio(base: ModelSpeed, cand: ModelSpeed) -> SpeedRatio:
    """Candidate / baseline throughput: ratio of medians, and the spread of per-repeat ratios."""
    paired_prefill = [b / c for b, c in zip(base.prefill_s, cand.prefill_s, strict=True)]
    paired_decode = [b / c for b, c in zip(base.decode_s, cand.decode_s, strict=True)]
    memory = None
    if base.peak_memory_bytes and cand.peak_memory_bytes:
        memory = cand.peak_memory_bytes / base.peak_memory_bytes
    return SpeedRatio(
        name=cand.name,
        ideal=ideal_speedup(base.num_blocks, cand.num_blocks),
        prefill=cand.prefill_tokens_per_s.median / base.prefill_tokens_per_s.median,
        decode=cand.decode_tokens_per_s.median / base.decode_tokens_per_s.median,
        prefill_paired=Spread.of(paired_prefill),
        decode_paired=Spread.of(paired_decode),
        params=cand.params / base.params,
        peak_memory=memory,
    )


# Spreads past these (max / min over the repeats) mean the machine, not the model, set the timing.
NOISY_RUN_SPREAD = 1.5
NOISY_RATIO_SPREAD = 1.25


def noise_warnings(comparison: SpeedComparison) -> list[str]:
    """One line per timing too noisy to trust: a model's throughput or a paired ratio that varied too much."""
    lines = []
    for model in [comparison.baseline, *comparison.candidates]:
        for phase, spread in (("prefill", model.prefill_tokens_per_s), ("decode", model.decode_tokens_per_s)):
            if spread.min > 0 and spread.max / spread.min > NOISY_RUN_SPREAD:
                lines.append(f"{model.name} {phase}: {spread.min:.1f}-{spread.max:.1f} tokens/s over the repeats "
                             f"(x{spread.max / spread.min:.2f}); the machine was busy, the figure is noise")
    for ratio in comparison.ratios:
        for phase, spread in (("prefill", ratio.prefill_paired), ("decode", ratio.decode_paired)):
            if spread.min > 0 and spread.max / spread.min > NOISY_RATIO_SPREAD:
                lines.append(f"{ratio.name} {phase} speed-up ranges x{spread.min:.3f}-x{spread.max:.3f} between "
                             "repeats: not a measurement; rerun on an idle machine, with --threads 1 or more --repeats")
    return lines


def attach_memory(comparison: SpeedComparison, peaks: dict[str, tuple[int | None, str]]) -> None:
    """Fill in peak memory (label -> (bytes, method)) and recompute the ratios."""
    for speed in [comparison.baseline, *comparison.candidates]:
        if speed.name in peaks:
            speed.peak_memory_bytes, speed.memory_method = peaks[speed.name]
    comparison.ratios = [speed_ratio(comparison.baseline, c) for c in comparison.candidates]


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
    code = "import sys; from eval.speed import _peak_memory_child; _peak_memory_child(sys.argv[1])"
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

    from prune.checkpoint import load  # imported before the baseline RSS: its libraries are not the model's cost

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


def unique_labels(names: list[str]) -> list[str]:
    """Labels for ``names``, unique: a model given twice (e.g. the baseline against itself) gets ``#2``, ``#3``."""
    labels: list[str] = []
    for name in names:
        label, n = name, 1
        while label in labels:
            n += 1
            label = f"{name}#{n}"
        labels.append(label)
    return labels


def checkpoint_folder(name: str) -> str | None:
    """The folder whose weight files give the checkpoint size (a GGUF alias: its converted safetensors copy)."""
    from prune.loading import hf_checkpoint

    try:
        folder = hf_checkpoint(name)
    except LayercutError:
        return None
    return folder if Path(folder).is_dir() else None


def benchmark_speed(baseline: str, models: list[str], load, options: SpeedOptions,
                    memory: str = "subprocess") -> SpeedComparison:
    """Load the baseline and the models (``prune.load``), time them interleaved, and measure peak memory.

    Args:
        baseline: the original model.
        models: the candidates.
        load: a ``prune.options.LoadConfig`` giving dtype, device, quantization and tokenizer.
        options: what to time.
        memory: "subprocess" (each model in a fresh process), "inprocess" (approximate) or "off".
    """
    names = [baseline, *models]
    for name in names:
        check_tokenizer(name, load.tokenizer)
    labels = unique_labels(names)
    loaded = {label: load.load(name) for label, name in zip(labels, names, strict=True)}
    folders = {label: checkpoint_folder(name) for label, name in zip(labels, names, strict=True)}
    comparison = measure_speed({label: lm.model for label, lm in loaded.items()}, labels[0], options, folders=folders)
    if memory == "inprocess":
        attach_memory(comparison, {label: peak_memory_inprocess(lm.model, options) for label, lm in loaded.items()})
    loaded.clear()  # free the models before the memory children load their own copies
    if memory == "subprocess":
        attach_memory(comparison, {
            label: peak_memory_subprocess(name, options, device=load.device, dtype=load.dtype, tokenizer=load.tokenizer)
            for label, name in zip(labels, names, strict=True)
        })  # fmt: skip
    return comparison
