"""What block-local distillation saves against global healing, at the quality local distillation reaches.

``python -m eval.bench heal-cost`` chooses the blocks once (``--score``, ``--select``, ``--drop``), then:

1. **local**: ``--replace local`` on a fresh copy of the model (each kept block before a span trained alone,
   on its own recorded inputs, to give the span's closed-form map's output): its wall time, its peak memory
   (the process's resident high-water mark from the stage's start; on a GPU also torch's allocated peak) and
   the held-out perplexity it leaves, the quality to reach;
2. **global**: ``--start`` (removal by default) on another fresh copy, then distillation of the whole model
   towards the original (``distill``'s defaults: KL of the next-token distributions, ``--train``), once for
   each step count of ``--steps`` in turn, each run from the start with its own schedule, until one reaches
   the local row's held-out perplexity. Each run's time, peak memory and perplexity are a row.

The table says which global run first matched local, and the ratios of its time and memory to local's; where
none did, it says so and the best global run's figures stand beside local's.

    python -m eval.bench heal-cost --model smollm2-135m --drop 8 --heldout emma.txt --out bench-heal-cost/
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from eval.bench.output import finish_figure, pyplot, report_results, steps_line
from eval.bench.registry import bench_option, data_option, register_subcommand, threads_option
from eval.quality.perplexity import perplexity, tokenize_text
from prune.data.calibration import DataConfig, calibration_data, load_documents
from prune.errors import LayercutError
from prune.memory import measured_stage
from prune.options import apply_threads
from prune.pipeline.config import PruneConfig
from prune.pipeline.runner import blocks_to_drop, score_model
from prune.replace import METHODS, ReplaceConfig, check_span_lengths, replace_blocks_, spans_of

logger = logging.getLogger(__name__)

HEAL_COST_HELP = "block-local distillation against global healing at the quality local reaches: time, peak memory"
DEFAULT_STEPS = (25, 50, 100, 200)


@dataclass
class HealCostOptions:
    """One heal-cost benchmark.

    Attributes:
        prune: model, calibration, score, selection, ``drop`` and batch size (its ``replace`` is unused).
        heldout: text the calibration and the distillation never saw (a file or datasets spec).
        heldout_chars: score only its first this many characters (None: all).
        steps: the global runs' step counts, tried in this order until one reaches local's perplexity.
        start: the repair the global runs start from (a training-free method; ``none``: removal).
        train: what the global runs train (``distill``'s ``--train``: lora, all, replacements).
        distill: further ``DistillConfig`` keys for the global runs (their text, batch, learning rate).
    """

    prune: PruneConfig
    heldout: str
    heldout_chars: int | None = None
    steps: tuple[int, ...] = DEFAULT_STEPS
    start: str = "none"
    train: str = "lora"
    distill: dict | None = None

    def __post_init__(self):
        if not self.steps or any(not isinstance(s, int) or s <= 0 for s in self.steps):
            raise LayercutError(f"--steps takes positive step counts like 25,50,100, got {self.steps}")
        if self.start not in METHODS or self.start == "local":
            raise LayercutError(f"--start {self.start}: a training-free repair the global runs start from, one of "
                                f"{', '.join(m for m in METHODS if m != 'local')}")


def heal_cost(loaded, calibration, heldout_ids: torch.Tensor, options: HealCostOptions) -> dict:
    """The local row, the global rows and which global run first matched local (see the module's docstring)."""
    from distill.config import DistillConfig  # the global runs' trainer (eval may use distill; prune may not)
    from distill.train import distill

    model, seq_len = loaded.model, options.prune.data.seq_len
    model.eval()
    score = lambda m: perplexity(m, heldout_ids, seq_len=seq_len, progress=False).perplexity  # noqa: E731
    dense = score(model)
    moments, scores = score_model(model, calibration, options.prune)
    dropped = blocks_to_drop(model, calibration, moments, scores, options.prune)
    for method in ("local", options.start):
        check_span_lengths(method, spans_of(dropped), fix=f"--replace {method} cannot take them: pass other --drop")
    batch = options.prune.batch_size

    def local_run():
        student = copy.deepcopy(model)
        replace_blocks_(student, dropped, calibration.token_ids, ReplaceConfig(method="local", batch_size=batch))
        return student

    student, cost = measured_stage(local_run)
    local = {"repair": "local", "steps": 0, **cost, "perplexity": score(student)}
    del student
    logger.info("local: %.2f held-out perplexity in %.1f s", local["perplexity"], local["seconds"])
    rows, matched = [], None
    for steps in options.steps:
        config = DistillConfig(**{**(options.distill or {}), "steps": steps, "train": options.train})

        def global_run(config=config):
            student = copy.deepcopy(model)
            replace_blocks_(student, dropped, calibration.token_ids,
                            ReplaceConfig(method=options.start, batch_size=batch))
            result = distill(student, model, loaded.tokenizer, config)
            return student, result

        (student, result), cost = measured_stage(global_run)
        rows.append({"repair": f"{options.start} + {steps} steps ({options.train})", "steps": steps, **cost,
                     "final_loss": result.final_loss, "perplexity": score(student)})
        del student
        logger.info("global %d steps: %.2f held-out perplexity in %.1f s", steps, rows[-1]["perplexity"],
                    rows[-1]["seconds"])
        if rows[-1]["perplexity"] <= local["perplexity"]:
            matched = rows[-1]
            break
    return {"model": loaded.name, "dropped": dropped, "dense": {"perplexity": dense},
            "heldout_tokens": int(heldout_ids.numel()), "calibration": calibration.describe(),
            "score": options.prune.score, "select": options.prune.select, "start": options.start,
            "train": options.train, "local": local, "global": rows,
            "matched_steps": None if matched is None else matched["steps"],
            "ratios": _ratios(local, matched or min(rows, key=lambda r: r["perplexity"]))}


def _ratios(local: dict, other: dict) -> dict:
    """The global run's time and peak memory over local's."""
    ratio = lambda key: (other[key] / local[key]) if local.get(key) and other.get(key) else None  # noqa: E731
    return {"seconds": ratio("seconds"), "peak_rss_bytes": ratio("peak_rss_bytes"),
            "peak_cuda_bytes": ratio("peak_cuda_bytes")}


def heal_cost_markdown(results: dict) -> str:
    """The rows as a markdown table, and the sentence saying which global run matched local."""
    mib = lambda b: "-" if b is None else f"{b / 2**20:,.0f}"  # noqa: E731
    lines = [f"{results['model']}, blocks {results['dropped']} ({results['select']} on {results['score']}); held-out "
             f"perplexity over {results['heldout_tokens']:,} tokens (dense {results['dense']['perplexity']:.2f}).", "",
             "| repair | steps | seconds | peak RSS (MiB) | peak CUDA (MiB) | held-out perplexity |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in [results["local"], *results["global"]]:
        lines.append(f"| {row['repair']} | {row['steps']} | {row['seconds']:,.1f} | {mib(row['peak_rss_bytes'])} | "
                     f"{mib(row.get('peak_cuda_bytes'))} | {row['perplexity']:.2f} |")
    ratios = results["ratios"]
    times = f"{ratios['seconds']:.2f}x local's time" if ratios["seconds"] else "time not compared"
    memory = f"{ratios['peak_rss_bytes']:.2f}x its peak RSS" if ratios["peak_rss_bytes"] else "memory not compared"
    if results["matched_steps"] is not None:
        verdict = (f"Global healing first reached local's perplexity at {results['matched_steps']} steps: "
                   f"{times}, {memory}.")
    else:
        verdict = (f"No global run reached local's perplexity ({results['local']['perplexity']:.2f}); the best "
                   f"global run took {times}, {memory}.")
    return "\n".join([*lines, "", verdict])


def plot_heal_cost(results: dict, path) -> Path:
    """PNG: held-out perplexity against wall seconds, the global runs as a line, local as a point, dense dashed."""
    local, rows = results["local"], results["global"]
    fig, ax = pyplot().subplots(figsize=(6, 4), dpi=120)
    steps_line(ax, [r["seconds"] for r in rows], [r["perplexity"] for r in rows], [r["steps"] for r in rows],
               f"{results['start']} + global healing ({results['train']})")
    ax.plot([local["seconds"]], [local["perplexity"]], "s", color="C3", label="local (block by block)")
    return finish_figure(fig, ax, path, reference=(results["dense"]["perplexity"], "dense"), xlabel="wall seconds",
                         ylabel="held-out perplexity",
                         title=f"{results['model']}, drop {len(results['dropped'])}: local against global healing")


# ---- eval.bench heal-cost ----


@dataclass(frozen=True)
class HealCostBenchOptions:
    """The options of ``eval.bench heal-cost``: its flags, in ``--help``'s order.

    Attributes:
        model: model name or folder.
        device: cpu, cuda, cuda:N or auto.
        drop: blocks to remove.
        heldout: text the calibration and distillation never saw (a file or datasets spec).
        heldout_chars: score only its first this many characters (None: all).
        score: ranking criterion, as ``prune.run``.
        select: selection, as ``prune.run``.
        steps: comma list of the global runs' step counts, tried in turn.
        start: the training-free repair global healing starts from.
        train: what global healing trains.
        data: the calibration text.
        batch_size: sequences per forward pass.
        out: folder for ``heal_cost.json``, ``heal_cost.md`` and ``heal_cost.png`` (None: print only).
        threads: CPU threads (None: the free cores).
    """

    model: str = bench_option("smollm2-135m", "model name or folder (default: smollm2-135m)")
    device: str = bench_option("cpu", "cpu, cuda, cuda:N or auto (default: cpu)")
    drop: int = bench_option(8, "blocks to remove (default: 8)", type=int)
    heldout: str | None = bench_option(
        None, "text the calibration and distillation never saw: a .txt/.jsonl/.parquet file or a datasets spec",
        required=True)
    heldout_chars: int | None = bench_option(None, "score only its first N characters", type=int)
    score: str = bench_option("linearity", "ranking criterion, as prune.run (default: linearity)")
    select: str = bench_option("topk", "a selection, as prune.run (default: topk)")
    steps: str = bench_option(",".join(map(str, DEFAULT_STEPS)),
                              "the global runs' step counts, tried in turn until one reaches local (default: "
                              f"{','.join(map(str, DEFAULT_STEPS))})")
    start: str = bench_option("none", "the training-free repair global healing starts from (default: none, removal)")
    train: str = bench_option("lora", "what global healing trains: lora, all, replacements (default: lora)")
    data: DataConfig = data_option(samples=32, seq_len=512, what="sequence and perplexity window")
    batch_size: int = bench_option(4, "sequences per forward pass (default: 4)", type=int)
    out: str | None = bench_option(None, "folder for heal_cost.json, heal_cost.md and heal_cost.png (default: print "
                                         "only)")
    threads: int | None = threads_option()


def run_heal_cost(command: HealCostBenchOptions) -> int:
    """Run the benchmark of ``command``, print its table and write it under ``--out``."""
    apply_threads(command)
    try:
        steps = tuple(int(s) for s in str(command.steps).split(",") if s.strip())
    except ValueError:
        raise LayercutError(f"--steps takes step counts like 25,50,100, got '{command.steps}'") from None
    prune = PruneConfig(load={"model": command.model, "device": command.device}, data=command.data,
                        batch_size=command.batch_size, score=command.score, select=command.select,
                        drop=command.drop)
    options = HealCostOptions(prune, command.heldout, command.heldout_chars, steps, command.start, command.train)
    documents, _ = load_documents(options.heldout, flag="--heldout")
    loaded = prune.load.load()
    heldout = tokenize_text(loaded.tokenizer, "\n\n".join(documents)[: options.heldout_chars])
    calibration = calibration_data(loaded.tokenizer, prune.data, model=loaded.model)
    results = heal_cost(loaded, calibration, heldout, options)
    report_results(command.out, "heal_cost", results, heal_cost_markdown(results), plot_heal_cost)
    return 0


register_subcommand("heal-cost", HEAL_COST_HELP, HealCostBenchOptions, run_heal_cost)
