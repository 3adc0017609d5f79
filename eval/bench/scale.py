"""What a block-by-block prune of a real model's shape costs, on a random-weight checkpoint of that shape.

    python -m eval.bench scale --shape llama-3-8b --dtype float32 [--drop 8] [--replace fold] [--out bench-scale/]
    python -m eval.bench scale --shape qwen2.5-7b --dtype bfloat16 --write-only --checkpoint /data/qwen2.5-7b-bf16/

Four stages, each timed: (a) write the checkpoint of ``--shape`` (``prune.model.shaped``; one already complete
is reused), in this process; (b) ``python -m prune.run --offload sequential ... --plan``, the planner's estimate
of the run's peak memory and time, read from its ``--plan-json``; (c) the same run for real, exported to
``OUT/slim``; (d) the export check: the slim checkpoint's config loads with its layer count, and every tensor it
kept equals the source tensor it came from, bit for bit, except those a repair declares it rewrites (the fold's
``mlp.down_proj`` of the block before each removed span), listed. (b) and (c) run as child processes, whose peak
resident memory is read inside each as it ends (``VmHWM``, which starts afresh in a new process).

The weights are random: the scores the run prints are meaningless; its time and memory are what the real model
costs. ``OUT/scale.json`` and ``OUT/scale.md`` say so.
"""

from __future__ import annotations

import codecs
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import MISSING, asdict, dataclass
from pathlib import Path

import torch

from eval.bench.registry import bench_option, register_subcommand, threads_option
from prune.atomic import write_file_atomic, write_json
from prune.checkpoint.report import read_report
from prune.errors import LayercutError
from prune.loading.offload import weight_files
from prune.measure.scores import MIN_TOKENS_PER_DIM
from prune.memory import measured_stage
from prune.model.shaped import (
    DTYPES,
    RANDOM_WEIGHTS,
    shape_bytes,
    shape_config,
    shape_names,
    shaped_record,
    write_shaped,
)
from prune.options import apply_threads

SCALE_HELP = ("write a random-weight checkpoint of a real model's shape (llama-3-8b, ...), then plan, run and check "
              "a block-by-block prune of it: real time and memory, meaningless scores")
TOKENIZER = "smollm2-135m"  # embedded, offline; its 49,152 ids are valid in every registered shape's vocabulary
RANDOM_NOTE = ("The weights are random: every score and perplexity measured on them is meaningless; the time and "
               "memory are what a checkpoint of this shape costs.")
# calibration of the default run: at least this many sequences, more where the scores need 4 tokens per dimension
DEFAULT_SAMPLES = 8
DEFAULT_SEQ_LEN = 512
RUN_GROUP = "the run (python -m prune.run --offload sequential --data builtin)"  # --help's group of its flags
CHECK_CHUNK_ELEMENTS = 2**24  # the export check compares row slices of at most this many values at a time

# prune.run in a child process that records its own peak memory as it ends, whatever it ends with
_CHILD = """\
import json, os, runpy, sys
from prune.memory import peak_rss_bytes
sys.argv = ["prune.run", *sys.argv[1:]]
try:
    runpy.run_module("prune.run", run_name="__main__", alter_sys=True)
finally:
    torch = sys.modules.get("torch")
    cuda = torch.cuda.max_memory_allocated() if torch is not None and torch.cuda.is_initialized() else None
    with open(os.environ["LAYERCUT_PEAK_FILE"], "w", encoding="utf-8") as file:
        json.dump({"rss": peak_rss_bytes(), "cuda": cuda}, file)
"""


@dataclass
class ScaleOptions:
    """What ``eval.bench scale`` writes and runs.

    Attributes:
        shape: a registered shape (``prune.model.shaped.shape_names``).
        dtype: the checkpoint's dtype, and the run's.
        out: folder for ``scale.json``, ``scale.md`` and the slim checkpoint (``OUT/slim``).
        checkpoint: where the shaped checkpoint goes (None: ``OUT/<shape>-<dtype>``).
        write_only: stop after writing the checkpoint.
        seed: the checkpoint's seed.
        drop: blocks the run removes.
        samples: calibration sequences (None: enough for the scores, at least :data:`DEFAULT_SAMPLES`).
        seq_len: tokens per sequence.
        replace: the run's ``--replace``.
        heldout_samples: the run's ``--heldout-samples`` (0: no held-out perplexity, meaningless here anyway).
        device: the run's ``--device``.
        in_memory: also run the same prune with the whole model in memory and compare (scores, fitted
            tensors, time, peak memory): for shapes that fit.
        threads: torch's CPU threads here and in each run (None: prune.run's default).
    """

    # each field is its flag of eval.bench scale, in --help's order
    shape: str = bench_option(MISSING, "the real model whose shape is written", choices=shape_names,
                              required=True)
    dtype: str = bench_option("float32", "the checkpoint's dtype (default: float32)", choices=DTYPES)
    out: str = bench_option("bench-scale", "folder for scale.json, scale.md, logs/ and the slim checkpoint slim/ "
                            "(default: bench-scale/)")
    checkpoint: str | None = bench_option(None, "where the shaped checkpoint goes, reused when complete (default: "
                                          "OUT/<shape>-<dtype>)", metavar="DIR")
    write_only: bool = bench_option(False, "write the checkpoint and stop", action="store_true")
    seed: int = bench_option(0, "the checkpoint's random seed (default: 0)", type=int)
    drop: int = bench_option(8, "blocks removed (default: 8)", type=int, group=RUN_GROUP)
    samples: int | None = bench_option(
        None, f"calibration sequences (default: {DEFAULT_SAMPLES}, more where the shape's width needs "
              f"{MIN_TOKENS_PER_DIM} tokens per dimension: 32 for a width of 4096 at 512 tokens)",
        type=int, group=RUN_GROUP)
    seq_len: int = bench_option(DEFAULT_SEQ_LEN, f"tokens per sequence (default: {DEFAULT_SEQ_LEN})", type=int,
                                group=RUN_GROUP)
    replace: str = bench_option("fold", "the repair (prune.run --replace; default: fold)", group=RUN_GROUP)
    heldout_samples: int = bench_option(0, "held-out sequences whose perplexity ends the run (meaningless on random "
                                        "weights; default: 0 = skipped)", type=int, group=RUN_GROUP)
    device: str = bench_option("cpu", "cpu, cuda or cuda:N (default: cpu)", group=RUN_GROUP)
    in_memory: bool = bench_option(False, "also run the same prune with the whole model in memory and compare "
                                   "scores, exported tensors, time and peak memory (for a shape that fits)",
                                   action="store_true", group=RUN_GROUP)
    threads: int | None = threads_option()

    def __post_init__(self):
        if self.shape not in shape_names():
            raise LayercutError(f"unknown shape '{self.shape}' (--shape): choose one of {', '.join(shape_names())}")
        if self.dtype not in DTYPES:
            raise LayercutError(f"--dtype {self.dtype}: choose one of {', '.join(DTYPES)}")
        layers = shape_config(self.shape).num_hidden_layers
        if not self.write_only and not 0 < self.drop < layers - 1:
            raise LayercutError(f"--drop {self.drop}: {self.shape} has {layers} blocks, the first and last kept; "
                                f"choose 1 to {layers - 2}")
        for name in ("samples", "seq_len", "threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise LayercutError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
        if self.heldout_samples < 0:
            raise LayercutError(f"--heldout-samples must be 0 or more, got {self.heldout_samples}")

    @property
    def checkpoint_dir(self) -> Path:
        """Where the shaped checkpoint goes."""
        return Path(self.checkpoint or Path(self.out) / f"{self.shape}-{self.dtype}")

    @property
    def slim_dir(self) -> Path:
        """Where the run exports its checkpoint."""
        return Path(self.out) / "slim"

    def calibration_samples(self) -> int:
        """``samples``, or the fewest sequences the scores accept (4 tokens per dimension), at least 8."""
        if self.samples is not None:
            return self.samples
        hidden = shape_config(self.shape).hidden_size
        return max(DEFAULT_SAMPLES, math.ceil(MIN_TOKENS_PER_DIM * hidden / self.seq_len))


def prune_argv(options: ScaleOptions, offload: str = "sequential") -> list[str]:
    """``prune.run``'s arguments for the run on the shaped checkpoint (``--plan`` and ``--out`` added by the caller)."""
    argv = ["--model", str(options.checkpoint_dir), "--offload", offload, "--dtype", options.dtype,
            "--device", options.device, "--drop", str(options.drop), "--replace", options.replace,
            "--data", "builtin", "--samples", str(options.calibration_samples()), "--seq-len", str(options.seq_len),
            "--heldout-samples", str(options.heldout_samples)]
    return argv + (["--threads", str(options.threads)] if options.threads else [])


@dataclass
class ChildRun:
    """One ``prune.run`` child process: its wall time, its own peak memory and how it ended."""

    argv: list[str]
    seconds: float
    peak_rss: int | None
    peak_cuda: int | None
    returncode: int
    last_line: str


def _tee(process: subprocess.Popen, log: Path) -> str:
    """Copy the child's output to this process's stderr and to ``log``; its last non-empty line."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    last = ""
    with log.open("wb") as handle:
        while chunk := os.read(process.stdout.fileno(), 65536):
            handle.write(chunk)
            text = decoder.decode(chunk)
            sys.stderr.write(text)
            sys.stderr.flush()
            # progress bars rewrite their line with carriage returns: the last line is the last one drawn
            lines = [line for line in text.replace("\r", "\n").split("\n") if line.strip()]
            last = lines[-1].strip() if lines else last
    return last


def run_prune_child(argv: list[str], log: Path) -> ChildRun:
    """``python -m prune.run ARGV`` in a child process, timed, its output shown and kept in ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="layercut-scale-") as folder:
        peak_file = Path(folder) / "peak.json"
        started = time.perf_counter()
        process = subprocess.Popen([sys.executable, "-c", _CHILD, *argv], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, env={**os.environ, "LAYERCUT_PEAK_FILE": str(peak_file)})
        try:
            last = _tee(process, log)
            returncode = process.wait()
        except BaseException:  # Ctrl-C or SIGTERM here: the run must not outlive the bench (its lock, its memory)
            process.terminate()
            process.wait()
            raise
        seconds = time.perf_counter() - started
        peak = json.loads(peak_file.read_text(encoding="utf-8")) if peak_file.is_file() else {}
    return ChildRun(argv, seconds, peak.get("rss"), peak.get("cuda"), returncode, last)


def _checked(child: ChildRun, what: str, log: Path) -> ChildRun:
    if child.returncode != 0:
        raise LayercutError(f"{what} failed (exit {child.returncode}): {child.last_line or 'no output'} "
                            f"(its log: {log})")
    return child


# ---- the export check ----


def _rewritten(config, prefix: str, layout: list[list[int]]) -> list[str]:
    """Name prefixes of the tensors the run's repairs declare they rewrite (``rewrites`` of each record)."""
    from prune.model.surgery import host_position

    found = []
    for record in getattr(config, "layercut_replacements", None) or []:
        rewrites = record.get("rewrites") or []
        paths = [rewrites] if isinstance(rewrites, str) else rewrites
        position = host_position(layout, record["replaces"])
        if position is not None:
            found += [f"{prefix}.{position}.{path}." for path in paths]
    return found


def _source_names(names: list[str], prefix: str, layout: list[list[int]]) -> dict[str, str]:
    """Each slim tensor's source name: a block's tensor comes from the first original block its position covers."""
    found = {}
    for name in names:
        if name.startswith(prefix + "."):
            position, rest = name[len(prefix) + 1:].split(".", 1)
            found[name] = f"{prefix}.{min(layout[int(position)])}.{rest}"
        else:
            found[name] = name
    return found


def _same_tensor(slim, slim_name: str, source, source_name: str) -> bool:
    """Whether two stored tensors are equal bit for bit, read in row slices (never two whole tensors)."""
    a, b = slim.get_slice(slim_name), source.get_slice(source_name)
    if a.get_dtype() != b.get_dtype() or a.get_shape() != b.get_shape():
        return False
    shape = a.get_shape()
    if len(shape) < 2:
        return torch.equal(slim.get_tensor(slim_name), source.get_tensor(source_name))
    step = max(1, CHECK_CHUNK_ELEMENTS // math.prod(shape[1:]))
    return all(torch.equal(a[start:start + step], b[start:start + step]) for start in range(0, shape[0], step))


def check_export(source: str | Path, slim: str | Path, expected_layers: int | None = None) -> dict:
    """Check a slim checkpoint against the checkpoint it was cut from, one tensor at a time.

    Its config must load, hold ``expected_layers`` blocks, and name every tensor a model of that config has; each
    of its tensors must equal, bit for bit, the source tensor it came from (a block's: the first original block
    its position covers in ``layercut_layout``), except the tensors a repair declares it rewrites (the
    ``rewrites`` of ``layercut_replacements``: a fold's ``mlp.down_proj`` of the block before the span).

    Args:
        source: the checkpoint the run read.
        slim: the checkpoint it exported.
        expected_layers: the block count the slim must have (None: not checked).

    Returns:
        ``passed``, ``layers``, ``expected_layers``, ``layout``, ``tensors`` (compared), ``equal`` (their count),
        ``changed`` (rewritten by a repair and different), ``mismatched`` (different, or another dtype or shape,
        though nothing rewrote them), ``missing`` (a model of the config has them, the files do not) and
        ``unexpected`` (in the files with no place in the model, or no source tensor), ``seconds``.
    """
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from prune.loading.loader import load_config
    from prune.model.adapters import arch_spec
    from prune.model.tiny import quiet

    started = time.perf_counter()
    source, slim = Path(source), Path(slim)
    config = load_config(str(slim))  # a checkpoint with maps gives the config of the model it wraps
    spec = arch_spec(config.model_type)
    layers = getattr(config, spec.layer_count)
    layout = [list(entry) for entry in getattr(config, "layercut_layout", None) or [[i] for i in range(layers)]]
    with quiet(), init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    tied = set(getattr(model, "_tied_weights_keys", None) or ()) if config.tie_word_embeddings else set()
    wanted = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items() if name not in tied}
    slim_files, source_files = weight_files(slim), weight_files(source)
    sources = _source_names(sorted(slim_files), spec.blocks, layout)
    rewritten = _rewritten(config, spec.blocks, layout)
    result = {"layers": layers, "expected_layers": expected_layers, "layout": layout, "tensors": 0, "equal": 0,
              "changed": [], "mismatched": [], "missing": sorted(set(wanted) - set(slim_files)),
              "unexpected": sorted(n for n in slim_files if n not in wanted or sources[n] not in source_files)}
    with contextlib.ExitStack() as stack:
        opened: dict[Path, object] = {}

        def handle(path: Path):
            if path not in opened:
                opened[path] = stack.enter_context(safe_open(path, framework="pt"))
            return opened[path]

        for name in sorted(set(slim_files) - set(result["unexpected"])):
            result["tensors"] += 1
            same = _same_tensor(handle(slim / slim_files[name]), name, handle(source / source_files[sources[name]]),
                                sources[name])
            if same:
                result["equal"] += 1
            else:
                result["changed" if any(name.startswith(p) for p in rewritten) else "mismatched"].append(name)
    result["passed"] = (not result["mismatched"] and not result["missing"] and not result["unexpected"]
                        and (expected_layers is None or layers == expected_layers))
    result["seconds"] = time.perf_counter() - started
    return result


# ---- the benchmark ----


def _measured_in_process(fn):
    """``fn()``'s result, wall seconds and this process's peak resident bytes while it ran."""
    value, cost = measured_stage(fn)
    return value, cost["seconds"], cost["peak_rss_bytes"]


def write_stage(options: ScaleOptions) -> dict:
    """Write (or reuse) the shaped checkpoint; its time, peak memory and size."""
    from prune.loading.loader import load_tokenizer

    folder = options.checkpoint_dir
    reused = (shaped_record(folder) or {}).get("shape") == options.shape  # write_shaped refuses any other
    tokenizer = load_tokenizer(TOKENIZER)
    _, seconds, peak = _measured_in_process(lambda: write_shaped(
        options.shape, folder, tokenizer=tokenizer, dtype=options.dtype, seed=options.seed))
    size = shape_bytes(options.shape, options.dtype)
    return {"seconds": seconds, "peak_rss": peak, "bytes": size, "reused": reused, "checkpoint": str(folder),
            "shards": len(list(folder.glob("*.safetensors")))}


def plan_stage(options: ScaleOptions, logs: Path) -> dict:
    """``prune.run ... --plan --plan-json``: the planner's estimate, and what planning itself cost."""
    with tempfile.TemporaryDirectory(prefix="layercut-scale-plan-") as folder:
        plan_file = Path(folder) / "plan.json"
        log = logs / "plan.txt"
        child = _checked(run_prune_child([*prune_argv(options), "--plan", "--plan-json", str(plan_file)], log),
                         "prune.run --plan", log)
        plan = json.loads(plan_file.read_text(encoding="utf-8"))
    return {**_child_dict(child), "plan": plan}


def run_stage(options: ScaleOptions, logs: Path) -> dict:
    """The run for real, exported to ``OUT/slim``: time, peak memory, and its own time from ``layercut.json``."""
    log = logs / "run.txt"
    child = _checked(run_prune_child([*prune_argv(options), "--out", str(options.slim_dir), "--overwrite"], log),
                     "prune.run", log)
    report = read_report(options.slim_dir)
    return {**_child_dict(child), "run_seconds": report.get("seconds"), "dropped": report.get("dropped"),
            "replace": report.get("replace")}


def in_memory_stage(options: ScaleOptions, logs: Path) -> dict:
    """The same prune with the whole model in memory, exported to ``OUT/slim-in-memory``."""
    log = logs / "run-in-memory.txt"
    out = Path(options.out) / "slim-in-memory"
    child = _checked(run_prune_child([*prune_argv(options, "none"), "--out", str(out), "--overwrite"], log),
                     "prune.run --offload none", log)
    report = read_report(out)
    return {**_child_dict(child), "run_seconds": report.get("seconds"), "dropped": report.get("dropped")}


def compare_runs(block_by_block: str | Path, in_memory: str | Path) -> dict:
    """How far two exports of the same prune are apart: their scores and every tensor (largest differences).

    Returns:
        ``dropped_equal``, ``score_difference`` (largest absolute, over every score of every block),
        ``tensor_difference`` (largest absolute over every tensor, read one at a time) and the tensor it is in.
    """
    from safetensors import safe_open

    reports = [read_report(f) for f in (block_by_block, in_memory)]
    scores = [reports[0]["scores"], reports[1]["scores"]]
    score_difference = max((abs(a - b) for name in scores[0] for a, b in zip(scores[0][name], scores[1][name],
                                                                            strict=True)), default=0.0)
    maps = [weight_files(Path(f)) for f in (block_by_block, in_memory)]
    largest, where = 0.0, None
    with contextlib.ExitStack() as stack:
        opened: dict[Path, object] = {}

        def tensor(folder, files, name):
            path = Path(folder) / files[name]
            if path not in opened:
                opened[path] = stack.enter_context(safe_open(path, framework="pt"))
            return opened[path].get_tensor(name).double()

        for name in sorted(maps[0]):
            if name not in maps[1]:
                return {"dropped_equal": False, "score_difference": score_difference, "tensor_difference": None,
                        "tensor": name}
            gap = float((tensor(block_by_block, maps[0], name) - tensor(in_memory, maps[1], name)).abs().max())
            if where is None or gap > largest:
                largest, where = gap, name
    return {"dropped_equal": reports[0]["dropped"] == reports[1]["dropped"], "score_difference": score_difference,
            "tensor_difference": largest, "tensor": where}


def _child_dict(child: ChildRun) -> dict:
    return {key: value for key, value in asdict(child).items() if key not in ("returncode", "last_line")}


def _planned(plan: dict, device: str) -> tuple[float | None, float]:
    """The planner's peak on ``device`` (``cpu`` for host memory) and its time."""
    return plan.get("peak", {}).get(device), plan.get("seconds", 0.0)


def ratios(result: dict) -> dict:
    """The run's measured peak memory and time over the planner's (time: prune.run's own, Python's start excluded)."""
    if "run" not in result:
        return {}
    plan, run = result["plan"]["plan"], result["run"]
    found = {}
    cpu, seconds = _planned(plan, "cpu")
    if cpu and run.get("peak_rss"):
        found["peak_rss"] = run["peak_rss"] / cpu
    gpu = next((value for device, value in plan.get("peak", {}).items() if device.startswith("cuda")), None)
    if gpu and run.get("peak_cuda"):
        found["peak_cuda"] = run["peak_cuda"] / gpu
    if seconds and run.get("run_seconds"):
        found["seconds"] = run["run_seconds"] / seconds
    return found


def benchmark_scale(options: ScaleOptions) -> dict:
    """Write the shaped checkpoint, then plan, run and check the prune of it (unless ``write_only``).

    Returns:
        JSON-ready: ``shape``, ``dtype``, ``parameters``, ``random_weights`` (what the figures mean), ``options``,
        and per stage (``write``, ``plan``, ``run``, ``check``) its seconds, peak memory and findings, with
        ``ratios`` (measured over planned).
    """
    itemsize = getattr(torch, options.dtype).itemsize
    result = {"shape": options.shape, "dtype": options.dtype,
              "parameters": shape_bytes(options.shape, options.dtype) // itemsize,
              "random_weights": RANDOM_WEIGHTS, "options": asdict(options), "write": write_stage(options)}
    if options.write_only:
        return result
    logs = Path(options.out) / "logs"
    result["plan"] = plan_stage(options, logs)
    result["run"] = run_stage(options, logs)
    layers = shape_config(options.shape).num_hidden_layers - options.drop
    check, seconds, peak = _measured_in_process(lambda: check_export(options.checkpoint_dir, options.slim_dir,
                                                                     layers))
    result["check"] = {**check, "seconds": seconds, "peak_rss": peak}
    result["ratios"] = ratios(result)
    if options.in_memory:
        result["in_memory"] = in_memory_stage(options, logs)
        result["in_memory"]["compare"] = compare_runs(options.slim_dir, Path(options.out) / "slim-in-memory")
        for key in ("seconds", "peak_rss"):
            if result["run"].get(key) and result["in_memory"].get(key):
                result["in_memory"][f"{key}_ratio"] = result["run"][key] / result["in_memory"][key]
    return result


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def _s(value: float) -> str:
    return f"{value:.1f}" if value >= 1 else f"{value:.2g}"


def scale_markdown(result: dict) -> str:
    """The table of stages (wall seconds, peak memory, the planner's estimate, measured over planned) and the note."""
    options, write = result["options"], result["write"]
    lines = [f"## Scale: {result['shape']} ({result['dtype']}, {result['parameters']:,} parameters)", "",
             f"**{RANDOM_NOTE}**", "",
             "| stage | wall s | peak RSS GB | planner's estimate | measured / planned |", "|---|---:|---:|---|---|",
             f"| write the checkpoint ({write['bytes'] / 1e9:.2f} GB, {write['shards']} shard(s)"
             f"{', reused' if write['reused'] else ''}) | {_s(write['seconds'])} | {_gb(write['peak_rss'])} | - | - |"]
    if "run" not in result:
        return "\n".join(lines) + "\n"
    plan, run, check, ratio = result["plan"], result["run"], result["check"], result["ratios"]
    cpu, seconds = _planned(plan["plan"], "cpu")
    measured = ", ".join(f"{ratio[k]:.2f}x {label}" for k, label in
                         (("peak_rss", "memory"), ("peak_cuda", "GPU memory"), ("seconds", "time")) if k in ratio)
    gpu = f"; GPU peak {_gb(run['peak_cuda'])} GB" if run.get("peak_cuda") else ""
    lines += [
        f"| plan (`prune.run --plan`) | {_s(plan['seconds'])} | {_gb(plan['peak_rss'])} | - | - |",
        f"| prune.run: drop {options['drop']}, `--replace {options['replace']}`, `--offload sequential`, "
        f"{options['device']} (its own time {_s(run['run_seconds'] or 0)} s{gpu}) | {_s(run['seconds'])} | "
        f"{_gb(run['peak_rss'])} | {_gb(cpu)} GB, {_s(seconds)} s | {measured or '-'} |",
        f"| export check ({check['tensors']} tensors, one at a time) | {_s(check['seconds'])} | "
        f"{_gb(check['peak_rss'])} | - | - |", "",
        _check_line(check), "",
        "Peak RSS is each stage's whole resident set, the interpreter's included (the child's own high-water mark "
        "for the plan and the run); the time ratio sets prune.run's own time (Python's start excluded) against the "
        "planner's.", "",
        "The run: `python -m prune.run " + " ".join(run["argv"]) + "`"]
    if "in_memory" in result:
        memory, compare = result["in_memory"], result["in_memory"]["compare"]
        lines += ["", "### Block by block against in memory", "",
                  "| run | wall s | its own s | peak RSS GB |", "|---|---:|---:|---:|",
                  f"| in memory (`--offload none`) | {_s(memory['seconds'])} | {_s(memory['run_seconds'] or 0)} | "
                  f"{_gb(memory['peak_rss'])} |",
                  f"| block by block (`--offload sequential`) | {_s(run['seconds'])} | {_s(run['run_seconds'] or 0)} | "
                  f"{_gb(run['peak_rss'])} |", "",
                  f"Block by block / in memory: time {memory.get('seconds_ratio', float('nan')):.2f}x, peak memory "
                  f"{memory.get('peak_rss_ratio', float('nan')):.2f}x. The same blocks dropped: "
                  f"{'yes' if compare['dropped_equal'] else 'NO'}; largest score difference "
                  f"{compare['score_difference']:.1e}; largest difference of any exported tensor "
                  f"{compare['tensor_difference']:.1e} (in {compare['tensor']})."]
    return "\n".join(lines) + "\n"


def _check_line(check: dict) -> str:
    verdict = "passed" if check["passed"] else "FAILED"
    parts = [f"Export check {verdict}: {check['layers']} blocks (expected {check['expected_layers']}), "
             f"{check['equal']} of {check['tensors']} tensors equal to their source bit for bit"]
    if check["changed"]:
        parts.append(f"rewritten by the repair: {', '.join(check['changed'])}")
    for key in ("mismatched", "missing", "unexpected"):
        if check[key]:
            parts.append(f"{key}: {', '.join(check[key])}")
    return "; ".join(parts) + "."


# ---- eval.bench scale ----


def run_scale(options: ScaleOptions) -> int:
    """Run the benchmark of ``options``, print its table and write ``scale.json`` and ``scale.md`` under ``--out``.

    Returns:
        0, or 1 when the export check failed.
    """
    apply_threads(options)
    result = benchmark_scale(options)
    table = scale_markdown(result)
    print(table)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    write_file_atomic(out / "scale.json", lambda path: write_json(path, result))
    write_file_atomic(out / "scale.md", lambda path: path.write_text(table, encoding="utf-8"))
    return 0 if result.get("check", {}).get("passed", True) else 1


register_subcommand("scale", SCALE_HELP, ScaleOptions, run_scale)
