"""What streamed scoring costs: time against a plain forward pass, memory against storing every state.

Four ways to get every block's linearity over N calibration tokens:
- ``plain``: the forward pass alone (no scores), the floor.
- ``streamed``: layercut's hooks folding each state into float64 moments (memory independent of N).
- ``sequential``: the same moments block by block from a skeleton (``--offload sequential``): one block's
  weights in memory, read from the checkpoint, and two state buffers of N tokens.
- ``stored``: keep every residual state of every token, then solve least squares per block (what
  tools that collect ``hidden_states`` first, such as LLM-Microscope, do; memory grows with N).

Time ratios are measured in one process, interleaved, several repeats. Peak memory of each method is
measured in a fresh child process each (peak RSS over the RSS after loading, or CUDA max allocated),
so one measurement cannot inherit another's high-water mark.

The end-to-end rows time whole prune runs (load, calibrate, score, select, surgery, export), plain removal
against ``--replace linear`` of the same blocks, interleaved: what a linear map costs a user on top.
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch
from tqdm.auto import tqdm

from eval.bench.registry import bench_option, data_option, register_subcommand, threads_option
from prune.checkpoint.load_config import LoadConfig
from prune.checkpoint.save_load import load
from prune.data.calibration import BUILTIN, DataConfig, calibration_data
from prune.errors import LayercutError
from prune.loading.offload import load_offloaded
from prune.measure.blockwise import stream_moments_blockwise
from prune.measure.moments import stream_moments
from prune.measure.scores import block_scores
from prune.memory import peak_rss_bytes, reset_peak_rss
from prune.model.adapters import get_blocks, hidden_size, num_blocks
from prune.model.capture import residual_states
from prune.options import apply_threads, parse_counts
from prune.pipeline.config import PruneConfig
from prune.pipeline.runner import run_prune

METHODS = ("plain", "streamed", "sequential", "stored")


@dataclass
class MemoryRow:
    """One method at one token count, measured in its own process."""

    method: str
    tokens: int
    seconds: float
    peak_mib: float  # above the memory held after loading the model and data


@torch.no_grad()
def run_method(method: str, model, token_ids: torch.Tensor, batch_size: int) -> list[float] | None:
    """Run one method over ``token_ids`` [samples, seq]; returns linearity scores (None for plain)."""
    if method == "plain":
        for start in range(0, token_ids.shape[0], batch_size):
            model.base_model(input_ids=token_ids[start : start + batch_size], use_cache=False)
        return None
    if method == "streamed":
        moments = stream_moments(model, token_ids, batch_size=batch_size, progress=False)
        return block_scores(moments, ["linearity"])["linearity"]
    if method == "sequential":  # what --offload sequential runs: each block scored, then its statistics freed
        moments = stream_moments_blockwise(model, token_ids, batch_size=batch_size, progress=False,
                                            scores=["linearity"])
        return block_scores(moments, ["linearity"])["linearity"]
    if method == "stored":
        return _stored_linearity(model, token_ids, batch_size)
    raise ValueError(f"unknown method {method!r}; known: {METHODS}")


def _stored_linearity(model, token_ids, batch_size) -> list[float]:
    states: dict[int, list[torch.Tensor]] = {}
    with residual_states(model, lambda i, h: states.setdefault(i, []).append(h.reshape(-1, h.shape[-1]).cpu())):
        for start in range(0, token_ids.shape[0], batch_size):
            model.base_model(input_ids=token_ids[start : start + batch_size], use_cache=False)
    stacked = [torch.cat(states.pop(i)) for i in range(len(states))]  # every state: [tokens, hidden]
    scores = []
    for x, y in itertools.pairwise(stacked):
        x, y = x.double(), y.double()
        x, y = x - x.mean(0), y - y.mean(0)
        x, y = x / x.norm(), y / y.norm()
        solution = torch.linalg.lstsq(x, y, driver="gelsd").solution
        scores.append(1 - float(((x @ solution - y) ** 2).sum()))
    return scores


def _tokens(loaded, tokens: int, seq_len: int, data: str | None) -> torch.Tensor:
    samples = max(1, tokens // seq_len)
    # which text is scored does not change what scoring it costs; sampling it would only lengthen the run
    config = DataConfig(data=data or BUILTIN, samples=samples, seq_len=seq_len)
    return calibration_data(loaded.tokenizer, config, model=loaded.model).token_ids


def _memory_worker(model_name, device, method, tokens, seq_len, batch_size, data, queue) -> None:
    loaded = load_offloaded(model_name, device=device) if method == "sequential" else load(model_name, device=device)
    ids = _tokens(loaded, tokens, seq_len, data).to(loaded.model.device)
    on_cuda = ids.device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        _page_in(loaded.model)
        reset_peak_rss()  # loading's transient peak is not the method's
        base = psutil.Process().memory_info().rss
    started = time.perf_counter()
    run_method(method, loaded.model, ids, batch_size)
    seconds = time.perf_counter() - started
    if on_cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = peak_rss_bytes()  # VmHWM: starts afresh in this child, unlike ru_maxrss
    queue.put(MemoryRow(method, ids.numel(), seconds, (peak - base) / 2**20))


@torch.no_grad()
def _page_in(model) -> None:
    """Read every weight in memory once: the loaded model's own pages count in the base, not in the pass.

    Safetensors are mapped from disk, so a weight's pages become resident when first read: the embedding
    table (113 MB on SmolLM2-135M) would otherwise count, a page at a time, as memory the pass took.
    """
    for tensor in [*model.parameters(), *model.buffers()]:
        if not tensor.is_meta:
            tensor.sum()


def measure_memory(model_name: str, device: str, method: str, tokens: int, seq_len: int, batch_size: int,
                   data: str | None = None) -> MemoryRow:
    """Peak memory and time of one method in a fresh child process."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(
        target=_memory_worker, args=(model_name, device, method, tokens, seq_len, batch_size, data, queue)
    )
    process.start()
    row = queue.get()
    process.join()
    return row


def measure_time_ratio(loaded, tokens: int, seq_len: int, batch_size: int, repeats: int,
                       data: str | None = None) -> dict:
    """Streamed-scoring time over plain-forward time, interleaved (plain, streamed, plain, ...)."""
    ids = _tokens(loaded, tokens, seq_len, data).to(loaded.model.device)
    for method in ("plain", "streamed"):  # warm-up, both alike: first calls allocate
        run_method(method, loaded.model, ids[:batch_size], batch_size)
    times: dict[str, list[float]] = {"plain": [], "streamed": []}
    for _ in tqdm(range(repeats), desc="timing plain vs streamed", unit="round"):
        for method in times:
            if ids.device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            run_method(method, loaded.model, ids, batch_size)
            if ids.device.type == "cuda":
                torch.cuda.synchronize()
            times[method].append(time.perf_counter() - started)
    ratios = [s / p for s, p in zip(times["streamed"], times["plain"], strict=True)]
    return {
        "tokens": ids.numel(),
        "plain_seconds": times["plain"],
        "streamed_seconds": times["streamed"],
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def measure_blockwise(model: str, device: str, tokens: int, seq_len: int, batch_size: int, repeats: int,
                       data: str | None = None) -> dict:
    """Block-by-block scoring from a skeleton against the in-memory pass: time (interleaved), equality, sizes.

    Both models are loaded in this process; the sizes are what the sequential pass must hold: one block,
    a state buffer [tokens, hidden] and the statistics it holds at a time (two float64 Grams and one cross
    Gram; the in-memory pass keeps 2L + 1 of them).
    """
    whole, skeleton = load(model, device=device), load_offloaded(model, device=device)
    ids = _tokens(whole, tokens, seq_len, data).to(whole.model.device)
    times: dict[str, list[float]] = {"streamed": [], "sequential": []}
    scores: dict[str, list[float]] = {}
    for _ in tqdm(range(repeats), desc="timing in-memory vs block by block", unit="round"):
        for method, loaded in (("streamed", whole), ("sequential", skeleton)):
            started = time.perf_counter()
            scores[method] = run_method(method, loaded.model, ids, batch_size)
            times[method].append(time.perf_counter() - started)
    ratios = [b / a for a, b in zip(times["streamed"], times["sequential"], strict=True)]
    block = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in get_blocks(whole.model)[1])
    d, states = hidden_size(whole.model), num_blocks(whole.model) + 1
    return {"tokens": ids.numel(), "streamed_seconds": times["streamed"], "sequential_seconds": times["sequential"],
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "max_score_difference": max(abs(a - b) for a, b in zip(scores["streamed"], scores["sequential"],
                                                                    strict=True)),
            "block_mib": block / 2**20, "buffer_mib": ids.numel() * d * whole.model.dtype.itemsize / 2**20,
            "statistics_mib": 3 * d * d * 8 / 2**20, "statistics_in_memory_mib": (2 * states - 1) * d * d * 8 / 2**20}


def measure_end_to_end(model: str, device: str, data: DataConfig, batch_size: int, drop: int,
                       repeats: int) -> dict:
    """Wall time of whole prune runs, ``--drop drop`` removed vs replaced by ``linear``, interleaved.

    No held-out perplexity (the same cost in both runs would only dilute the ratio); everything else is
    the run a user types, export included.
    """
    data = dataclasses.replace(data, heldout_samples=0)
    times: dict[str, list[float]] = {"none": [], "linear": []}
    fits: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="layercut-e2e-") as folder:
        for _ in tqdm(range(repeats), desc=f"end to end: drop {drop}, remove vs linear", unit="round"):
            for method in times:
                config = PruneConfig(load=LoadConfig(model=model, device=device), data=data, drop=drop,
                                     replace=method, batch_size=batch_size, out=str(Path(folder) / method),
                                     overwrite=True)
                started = time.perf_counter()
                result = run_prune(config)
                times[method].append(time.perf_counter() - started)
                if method == "linear":
                    fits.append({"dropped": result.dropped, "replacements": [
                        {k: r.get(k) for k in ("replaces", "fit_seconds", "from_scoring_pass")}
                        for r in result.report["replacements"]]})
    ratios = [b / a for a, b in zip(times["none"], times["linear"], strict=True)]
    return {"drop": drop, "tokens": data.num_tokens, "remove_seconds": times["none"],
            "linear_seconds": times["linear"], "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios), "linear_fits": fits}


def memory_rows_as_dicts(rows: list[MemoryRow]) -> list[dict]:
    """JSON-ready rows."""
    return [asdict(r) for r in rows]


def scoring_markdown(model: str, timing: dict, rows: list[MemoryRow], end_to_end: dict | None = None) -> str:
    """Markdown summary: the time ratios, then one memory row per (tokens, method) and the growth ratios."""
    e2e = []
    if end_to_end is not None:
        e = end_to_end
        e2e = [f"End to end, `--drop {e['drop']} --replace linear` / `--drop {e['drop']}` (plain removal of the same "
               f"blocks) over {e['tokens']} calibration tokens: median **{e['ratio_median']:.3f}x** (min "
               f"{e['ratio_min']:.3f}, max {e['ratio_max']:.3f}; {len(e['remove_seconds'])} interleaved rounds; "
               f"removal median {statistics.median(e['remove_seconds']):.1f} s, linear median "
               f"{statistics.median(e['linear_seconds']):.1f} s)", ""]
    sequential = []
    if timing.get("sequential") is not None:
        q = timing["sequential"]
        sequential = [f"Block by block from a skeleton (`--offload sequential`) / in memory over {q['tokens']} tokens: "
                      f"median **{q['ratio_median']:.3f}x** (min {q['ratio_min']:.3f}, max {q['ratio_max']:.3f}); "
                      f"largest linearity difference {q['max_score_difference']:.1e}. What it holds besides the "
                      f"skeleton: one block {q['block_mib']:.1f} MiB, two state buffers of {q['buffer_mib']:.1f} MiB, "
                      f"statistics {q['statistics_mib']:.1f} MiB at a time (the in-memory pass keeps "
                      f"{q['statistics_in_memory_mib']:.1f} MiB).", ""]
    lines = [
        f"## Scoring cost: {model}",
        "",
        f"Streamed scoring / plain forward over {timing['tokens']} tokens: median "
        f"**{timing['ratio_median']:.3f}x** (min {timing['ratio_min']:.3f}, max {timing['ratio_max']:.3f}; "
        f"{len(timing['plain_seconds'])} interleaved rounds; plain median "
        f"{statistics.median(timing['plain_seconds']):.1f} s, streamed median "
        f"{statistics.median(timing['streamed_seconds']):.1f} s)",
        "",
        *sequential,
        *e2e,
        "| method | tokens | seconds | peak memory above model (MiB) |",
        "|---|---:|---:|---:|",
        *(f"| {r.method} | {r.tokens} | {r.seconds:.1f} | {r.peak_mib:.0f} |" for r in rows),
        "",
    ]
    for method in sorted({r.method for r in rows}):
        mine = sorted((r for r in rows if r.method == method), key=lambda r: r.tokens)
        if len(mine) > 1 and mine[0].peak_mib > 0:
            lines.append(
                f"- {method}: peak memory at {mine[-1].tokens} tokens / at {mine[0].tokens} tokens = "
                f"{mine[-1].peak_mib / mine[0].peak_mib:.2f}x"
            )
    return "\n".join(lines)


def benchmark_scoring(model: str, device: str, data: DataConfig, batch_size: int, time_tokens: int, repeats: int,
                      token_counts: list[int], methods: list[str], end_to_end_drop: int = 0) -> dict:
    """The time ratio of streamed scoring to a plain forward pass, then each method's memory at each token count.

    Args:
        model: the model to score (``prune.load``).
        device: where to run it.
        data: calibration text; its ``data`` and ``seq_len`` are used, the token counts set the samples.
        batch_size: sequences per forward pass.
        time_tokens: tokens per timed pass.
        repeats: interleaved timed rounds.
        token_counts: token counts of the memory rows.
        methods: memory rows to run (``streamed``, ``sequential``, ``stored``, ``plain``), each in a fresh
            process; ``sequential`` also times the block-by-block pass against the in-memory one
            (:func:`measure_blockwise`, into ``timing["sequential"]``).
        end_to_end_drop: blocks removed in the end-to-end rows (:func:`measure_end_to_end`, ``repeats``
            rounds over ``data``); 0 skips them.

    Returns:
        ``{"model", "timing", "memory", "end_to_end"}`` (JSON-ready) and ``"rows"`` (the :class:`MemoryRow`
        objects).
    """
    loaded = load(model, device=device)
    timing = measure_time_ratio(loaded, time_tokens, data.seq_len, batch_size, repeats, data.data)
    del loaded
    if "sequential" in methods:
        timing["sequential"] = measure_blockwise(model, device, time_tokens, data.seq_len, batch_size, repeats,
                                                  data.data)
    cells = [(tokens, method) for tokens in token_counts for method in methods]
    rows = [measure_memory(model, device, method, tokens, data.seq_len, batch_size, data.data)
            for tokens, method in tqdm(cells, desc="peak memory, a fresh process each", unit="run")]
    end_to_end = (measure_end_to_end(model, device, data, batch_size, end_to_end_drop, repeats)
                  if end_to_end_drop else None)
    return {"model": model, "timing": timing, "memory": memory_rows_as_dicts(rows), "end_to_end": end_to_end,
            "rows": rows}


# ---- eval.bench scoring ----

SCORING_HELP = "streamed scoring time vs a plain forward pass; peak memory vs storing every hidden state"


@dataclass(frozen=True)
class ScoringBenchOptions:
    """The options of ``eval.bench scoring``: its flags, in ``--help``'s order.

    Attributes:
        model: model name or folder.
        device: cpu, cuda or cuda:N.
        data: the calibration text (its ``samples`` unused: the passes count tokens).
        threads: CPU threads (None: the free cores).
        tokens: comma list of token counts for the memory rows.
        time_tokens: tokens per timed pass.
        batch_size: sequences per forward pass.
        repeats: interleaved timed rounds.
        methods: comma list of memory rows.
        end_to_end: blocks the timed whole prune runs remove (0: skip them).
        out: folder for ``scoring.json`` and ``scoring.md`` (None: print only).
    """

    model: str = bench_option("smollm2-135m", "model name or folder (default: smollm2-135m)")
    device: str = bench_option("cpu", "cpu, cuda or cuda:N (default: cpu)")
    data: DataConfig = data_option(
        samples=None, seq_len=512, data=BUILTIN,
        data_help="builtin, the novel alone: the text does not change what scoring it costs")
    threads: int | None = threads_option()
    tokens: str = bench_option("8192,32768", "token counts for the memory rows (default: 8192,32768)")
    time_tokens: int = bench_option(8192, "tokens per timed pass (default: 8192)", type=int)
    batch_size: int = bench_option(4, "sequences per forward pass (default: 4)", type=int)
    repeats: int = bench_option(3, "interleaved timed rounds (default: 3)", type=int)
    methods: str = bench_option("streamed,stored", "memory rows (default: streamed,stored)")
    end_to_end: int = bench_option(4, "time whole prune runs removing DROP blocks against replacing them by linear "
                                      "maps (default calibration: 64 sequences of --seq-len; default: 4; 0 skips)",
                                   type=int, metavar="DROP")
    out: str | None = bench_option(None, "folder for scoring.json and scoring.md (default: print only)")


def run_scoring(options: ScoringBenchOptions) -> int:
    """Run the benchmark of ``options``, print its table and write it under ``--out``."""
    apply_threads(options)
    token_counts = parse_counts(options.tokens, "--tokens")
    if options.end_to_end < 0:
        raise LayercutError(f"--end-to-end must be a block count >= 0, got {options.end_to_end}")
    result = benchmark_scoring(options.model, options.device, options.data, options.batch_size,
                               options.time_tokens, options.repeats, token_counts, options.methods.split(","),
                               options.end_to_end)
    table = scoring_markdown(options.model, result["timing"], result["rows"], result["end_to_end"])
    print(table)
    if options.out:
        from prune.atomic import atomic_directory, write_json

        with atomic_directory(options.out, overwrite=True) as staging:
            write_json(staging / "scoring.json", {k: v for k, v in result.items() if k != "rows"})
            (staging / "scoring.md").write_text(table + "\n", encoding="utf-8")
    return 0


register_subcommand("scoring", SCORING_HELP, ScoringBenchOptions, run_scoring)
