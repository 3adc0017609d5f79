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

Other serving engines (``--engine llamacpp|vllm``, :func:`benchmark_engine_speed`) run the same
interleaved rounds on their own timings (``eval.speed.engines`` says how each one times), with the engine's
own block count for the ideal and no memory measurement.

This module runs the comparison; the timed workloads are ``eval.speed.timing``'s, the memory measurements
``eval.speed.peak_memory``'s and the figures and ratios ``eval.speed.results``'s.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm

from eval.speed.engines import (
    WEIGHT_SUFFIXES,
    Engine,
    EngineModel,
    EngineSettings,
    block_count,
    checkpoint_bytes,
    checkpoint_folder,
)
from eval.speed.peak_memory import peak_memory_inprocess, peak_memory_subprocess, run_once, weights_bytes
from eval.speed.results import (
    NOISY_RATIO_SPREAD,
    NOISY_RUN_SPREAD,
    ModelSpeed,
    SpeedComparison,
    SpeedRatio,
    Spread,
    attach_memory,
    ideal_speedup,
    noise_warnings,
    speed_ratio,
)
from eval.speed.timing import SpeedOptions, greedy_decode, make_prompt, time_decode, time_prefill
from prune.errors import LayercutError
from prune.loading.loader import check_tokenizer
from prune.model.adapters import input_device, max_positions
from prune.replace import parameter_count

# the names callers import from here, though most live in the modules above
__all__ = ["NOISY_RATIO_SPREAD", "NOISY_RUN_SPREAD", "WEIGHT_SUFFIXES", "ModelSpeed", "SpeedComparison", "SpeedOptions",
           "SpeedRatio", "Spread", "attach_memory", "benchmark_engine_speed", "benchmark_speed", "block_count",
           "checkpoint_bytes", "checkpoint_folder", "greedy_decode", "ideal_speedup", "interleaved_timings",
           "make_prompt", "measure_engine_speed", "measure_speed", "memory_mode", "noise_warnings",
           "peak_memory_inprocess", "peak_memory_subprocess", "run_once", "speed_ratio", "time_decode", "time_prefill",
           "unique_labels", "weights_bytes"]

logger = logging.getLogger(__name__)

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

    def time_one(name: str) -> tuple[float, float]:
        # Decode first: its untimed prefill warms this model up after the switch from the previous
        # one, so the timed prefill that follows is not charged a cold start (SmolLM2-135M: +7% at 30 blocks).
        decode_s = time_decode(models[name], prompt, options.new_tokens)
        return time_prefill(models[name], prompt), decode_s

    samples = interleaved_timings(names, time_one, options, progress)
    speeds = {n: _model_speed(n, models[n], *samples[n], options, (folders or {}).get(n)) for n in names}
    device = input_device(models[baseline])
    return SpeedComparison(
        baseline=speeds[baseline],
        candidates=[speeds[n] for n in names[1:]],
        ratios=[speed_ratio(speeds[baseline], speeds[n]) for n in names[1:]],
        options=options,
        device=str(device),
        torch_threads=torch.get_num_threads(),
        engine="transformers",
        engine_version=_transformers_version(),
    )


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def interleaved_timings(names: list[str], time_one, options: SpeedOptions,
                        progress: bool = True) -> dict[str, tuple[list[float], list[float]]]:
    """Time each model in turn (A B C, A B C, ...): ``options.warmup`` untimed rounds, then ``options.repeats``.

    Args:
        names: Labels, the baseline first.
        time_one: ``label -> (prefill seconds, decode seconds)`` of one turn.
        options: Rounds.
        progress: Show a tqdm bar.

    Returns:
        Label -> (prefill seconds, decode seconds) of the timed rounds.
    """
    samples = {name: ([], []) for name in names}
    for step in tqdm(range(options.warmup + options.repeats), desc="speed", unit="round", disable=not progress):
        for name in names:
            prefill_s, decode_s = time_one(name)
            if step >= options.warmup:
                samples[name][0].append(prefill_s)
                samples[name][1].append(decode_s)
    return samples


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


def benchmark_speed(baseline: str, models: list[str], load, options: SpeedOptions,
                    memory: str = "subprocess") -> SpeedComparison:
    """Load the baseline and the models (``prune.load``), time them interleaved, and measure peak memory.

    Args:
        baseline: the original model.
        models: the candidates.
        load: a ``prune.checkpoint.load_config.LoadConfig`` giving dtype, device, quantization and tokenizer.
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


def memory_mode(engine: str, requested: str | None) -> str:
    """``--memory`` for an engine: transformers measures it (default "subprocess"); the others do not ("off")."""
    if engine == "transformers":
        return requested or "subprocess"
    if requested not in (None, "off"):
        raise LayercutError(f"--memory {requested} measures transformers models only: drop it for --engine {engine}")
    return "off"


def measure_engine_speed(engine: Engine, handles: dict[str, EngineModel], baseline: str,
                         options: SpeedOptions | None = None, *, progress: bool = True) -> SpeedComparison:
    """Time the baseline and each candidate in ``engine``, interleaved, ``options.repeats`` times.

    The same rounds, warm-up, turn order (decode, then prefill) and figures as :func:`measure_speed`; the
    block counts, hence the ideal ``L / (L - k)``, are the engine's. Peak memory is not measured.

    Args:
        engine: The engine that loaded ``handles``.
        handles: Label -> loaded model; must include ``baseline``.
        baseline: Label of the original model.
        options: Sizes and repeats.
        progress: Show a tqdm bar.
    """
    options = options or SpeedOptions()
    if baseline not in handles:
        raise LayercutError(f"baseline '{baseline}' is not among the models {list(handles)}")
    engine.check_batch(options.batch_size)
    needed = options.prompt_len + options.new_tokens
    for label, handle in handles.items():
        if handle.max_positions is not None and needed > handle.max_positions:
            raise LayercutError(f"prompt_len + new_tokens = {needed} exceeds the {handle.max_positions} positions of "
                                f"{label}; lower --prompt-len")
    prompt = make_prompt(min(h.vocab_size for h in handles.values()), options)  # [batch, prompt_len]
    names = [baseline] + [n for n in handles if n != baseline]

    def time_one(name: str) -> tuple[float, float]:
        decode_s = engine.decode_seconds(handles[name], prompt, options.new_tokens)  # first, as measure_speed
        return engine.prefill_seconds(handles[name], prompt), decode_s

    samples = interleaved_timings(names, time_one, options, progress)
    speeds = {n: _engine_model_speed(engine, n, handles[n], *samples[n], options) for n in names}
    return SpeedComparison(
        baseline=speeds[baseline],
        candidates=[speeds[n] for n in names[1:]],
        ratios=[speed_ratio(speeds[baseline], speeds[n]) for n in names[1:]],
        options=options,
        device=handles[baseline].device,
        torch_threads=torch.get_num_threads(),
        engine=engine.name,
        engine_version=engine.version(),
        engine_settings=engine.describe(handles[baseline].settings),
    )


def _engine_model_speed(engine: Engine, name: str, handle: EngineModel, prefill_s, decode_s,
                        options: SpeedOptions) -> ModelSpeed:
    return ModelSpeed(
        name=name,
        num_blocks=engine.block_count(handle),
        params=handle.params,
        weights_bytes=handle.weights_bytes,
        checkpoint_bytes=handle.checkpoint_bytes,
        prefill_tokens_per_s=Spread.of([options.batch_size * options.prompt_len / s for s in prefill_s]),
        decode_tokens_per_s=Spread.of([options.batch_size * options.new_tokens / s for s in decode_s]),
        prefill_s=list(prefill_s),
        decode_s=list(decode_s),
        memory_method=f"off: not measured for --engine {engine.name}",
    )


def benchmark_engine_speed(engine: Engine, baseline: str, models: list[str], settings: EngineSettings,
                           options: SpeedOptions, *, progress: bool = True) -> SpeedComparison:
    """Load the baseline and the models in ``engine``, time them interleaved, and free them.

    Args:
        engine: A registered engine (``eval.speed.engines.ENGINES``), its package installed.
        baseline: The original model.
        models: The candidates.
        settings: How the engine loads them; its ``context`` must hold ``prompt_len + new_tokens`` tokens.
        options: What to time.
        progress: Show a tqdm bar.
    """
    engine.check()
    engine.check_batch(options.batch_size)
    names = [baseline, *models]
    labels = unique_labels(names)
    handles: dict[str, EngineModel] = {}
    try:
        for label, name in zip(labels, names, strict=True):
            handles[label] = engine.load(name, settings)
        return measure_engine_speed(engine, handles, labels[0], options, progress=progress)
    finally:
        for handle in handles.values():
            engine.close(handle)
