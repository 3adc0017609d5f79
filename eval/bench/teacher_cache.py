"""Online distillation against training from the teacher's top-K logits cache: memory, step time, final KL.

``python -m eval.bench teacher-cache`` prunes a model (``--drop`` blocks, closed-form linear maps), then runs
``distill.run`` twice with the same steps, batch, data and seed, each in a fresh process so its peak RSS is
its own: once with the teacher online, once with ``--teacher-cache topk=K``. The cache is written first by a
separate process (its time is the cache's cost), so the cached run reads it without ever loading the teacher.
Both distilled students are then scored on the same held-out sequences with the full-softmax KL to the
teacher (not the top-K form the cached run trains on).

K is chosen before any of this, on a selection split (calibration sequences, never the held-out ones the
table reports): the smallest candidate whose top-K KL of the pruned, untrained student is within
``--k-tolerance`` of its full KL, so the cache keeps what the loss sees.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from distill.teacher_cache import KEEP_ENV
from eval.bench.registry import bench_option, data_option, register_subcommand, threads_option
from prune.checkpoint.report import read_report
from prune.data.calibration import DataConfig
from prune.errors import LayercutError
from prune.options import apply_threads

logger = logging.getLogger(__name__)

_REPO_ROOT = Path(__file__).resolve().parents[2]
TEACHER_CACHE_HELP = "online distillation against training from the teacher's top-K logits cache: memory, step time, KL"
STEP_RATIO_TARGET = 0.6  # the target: cached step time at most 0.6x the online step
KL_GAP_TARGET = 0.05  # and a final KL within 5% of online KD's


@dataclass
class CacheBenchOptions:
    """One teacher-cache benchmark.

    Attributes:
        model: the teacher (alias, hub id or folder).
        drop: blocks removed (replaced by closed-form linear maps).
        student: an already pruned student folder (skips pruning).
        steps: optimizer steps of each distillation.
        train: what both runs train (``distill.run --train``): "replacements" (the maps), "lora" (``prune.ship``'s
            heal: LoRA on the kept blocks), ...
        batch_size: sequences per step.
        k: K of the cache, or "auto" (chosen on the selection split from ``k_candidates``).
        k_candidates: the K tried by "auto".
        k_tolerance: "auto" takes the smallest K whose top-K KL is within this share of the full KL.
        data: distillation text (``--data``).
        text_field: the field of a .jsonl/.parquet/datasets source that holds the text (``--text-field``).
        samples: training sequences.
        seq_len: tokens per sequence.
        heldout_samples: held-out sequences the final KL is measured on.
        selection_samples: calibration sequences K is chosen on.
        prune_samples: calibration sequences of the pruning (of ``prune.run``'s default length, 512 tokens).
        seed: data order and sampling.
        threads: torch threads of every child process (None: their default).
        work: folder for the students, caches and distilled models.
    """

    model: str = "smollm2-135m"
    drop: int = 4
    student: str | None = None
    steps: int = 100
    train: str = "replacements"
    batch_size: int = 4
    k: str = "auto"
    k_candidates: list[int] = field(default_factory=lambda: [16, 32, 64, 128, 256])
    k_tolerance: float = 0.01
    data: str = "builtin"
    text_field: str = "text"
    samples: int = 512
    seq_len: int = 128
    heldout_samples: int = 32
    selection_samples: int = 16
    prune_samples: int = 64
    seed: int = 0
    threads: int | None = None
    work: str = "bench-teacher-cache.work"

    def __post_init__(self):
        if self.k != "auto" and (not str(self.k).isdigit() or int(self.k) <= 0):
            raise LayercutError(f"--k must be a positive integer or auto, got {self.k!r}")
        if not self.k_candidates or any(k <= 0 for k in self.k_candidates):
            raise LayercutError(f"--k-candidates must be positive integers, got {self.k_candidates}")
        if self.heldout_samples <= 0 or self.selection_samples <= 0:
            raise LayercutError("--heldout-samples and --selection-samples must be positive: the KL is measured on "
                                "them")
        if self.selection_samples > self.samples:
            raise LayercutError(f"--selection-samples ({self.selection_samples}) cannot exceed --samples "
                                f"({self.samples})")


def _child(args: list[str], what: str, timeout_s: float = 6 * 3600) -> subprocess.CompletedProcess:
    """Run ``python args`` from the repository root; a failure is one line with the child's last error line."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO_ROOT), env.get("PYTHONPATH")) if p)
    env[KEEP_ENV] = "0"  # the teacher's pass is what this bench times: never a copy kept by an earlier run
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout_s)
    if done.returncode != 0:
        tail = [line for line in done.stderr.strip().splitlines() if line.strip()][-1:] or ["no output"]
        raise LayercutError(f"{what} failed in its child process (exit {done.returncode}): {tail[0]}")
    return done


def _threads(options: CacheBenchOptions) -> list[str]:
    return ["--threads", str(options.threads)] if options.threads else []


def _data_flags(options: CacheBenchOptions) -> list[str]:
    return ["--data", options.data, "--text-field", options.text_field, "--samples", str(options.samples),
            "--seq-len", str(options.seq_len), "--seed", str(options.seed), "--heldout-samples",
            str(options.heldout_samples)]


def prune_student(options: CacheBenchOptions, work: Path) -> Path:
    """The student: ``options.student``, else ``prune.run --drop`` with linear maps, in a child process."""
    if options.student:
        return Path(options.student)
    out = work / "student"
    if not (out / "layercut.json").is_file():
        _child(["-m", "prune.run", "--model", options.model, "--drop", str(options.drop), "--replace", "linear",
                "--data", options.data, "--text-field", options.text_field, "--samples", str(options.prune_samples),
                "--heldout-samples", "0",
                "--out", str(out), "--overwrite", *_threads(options)], "pruning")
    return out


def distill_config(options: CacheBenchOptions, k: int | None):
    """The ``DistillConfig`` ``distill.run`` builds from :func:`distill_flags` (the cache's request must match)."""
    from distill.config import DistillConfig
    from prune.data.calibration import DataConfig

    data = DataConfig(options.data, options.samples, options.seq_len, options.seed,
                      heldout_samples=options.heldout_samples, text_field=options.text_field)
    return DistillConfig(steps=options.steps, train=options.train, batch_size=options.batch_size, log_every=1,
                         save_every=0,
                         seed=options.seed, data=data, teacher_cache=None if k is None else f"topk={k}")


def distill_flags(options: CacheBenchOptions, student: Path, out: Path, k: int | None) -> list[str]:
    """``distill.run``'s arguments for one of the two runs (the cached one with ``--teacher-cache``)."""
    cache = ["--teacher-cache", f"topk={k}"] if k is not None else []
    return ["-m", "distill.run", "--student", str(student), "--teacher", options.model, "--out", str(out),
            "--steps", str(options.steps), "--train", options.train, "--batch-size", str(options.batch_size),
            "--log-every", "1",
            "--save-every", "0", "--overwrite", *_data_flags(options), *cache, *_threads(options)]


def _cache_child(spec_json: str) -> None:
    """Body of the cache-writing child: load, write the cache as ``distill.run`` would, print one JSON line."""
    from distill.job import DistillJob, open_teacher, work_folder
    from prune.checkpoint.load_config import LoadConfig
    from prune.checkpoint.save_load import load
    from prune.memory import peak_rss_bytes

    spec = json.loads(spec_json)
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    options = CacheBenchOptions(**spec["options"])
    started = time.perf_counter()
    job = DistillJob(student=spec["student"], teacher=LoadConfig(model=options.model, device="auto"),
                     config=distill_config(options, spec["k"]), out=spec["out"])
    student = load(job.student, dtype="float32")
    _, _, cache = open_teacher(job, student, read_report(job.student), work_folder(job.out, None))
    print(json.dumps({"seconds": round(time.perf_counter() - started, 2), "peak_memory_bytes": peak_rss_bytes(),
                      **cache.report()}))


def write_cache_child(options: CacheBenchOptions, student: Path, out: Path, k: int) -> dict:
    """Write the cached run's teacher cache in a fresh process; its report, wall time and peak RSS."""
    spec = {"options": asdict(options), "student": str(student), "out": str(out), "k": k, "threads": options.threads}
    code = "import sys; from eval.bench.teacher_cache import _cache_child; _cache_child(sys.argv[1])"
    done = _child(["-c", code, json.dumps(spec)], "writing the teacher cache")
    return json.loads(done.stdout.strip().splitlines()[-1])


def step_seconds(log_path: Path) -> list[float]:
    """Seconds of each step from a ``train_log.jsonl`` written with ``--log-every 1``."""
    rows = [json.loads(line) for line in log_path.read_text(encoding="utf-8").splitlines() if line.strip()]
    times = [0.0] + [float(row["seconds"]) for row in rows]
    return [after - before for before, after in zip(times[:-1], times[1:], strict=True)]


def run_distillation(options: CacheBenchOptions, student: Path, out: Path, k: int | None) -> dict:
    """One ``distill.run`` in a fresh process: its peak RSS, median step time and report section."""
    started = time.perf_counter()
    _child(distill_flags(options, student, out, k), "distillation" + (f" from the top-{k} cache" if k else ""))
    section = read_report(out)["distill"]
    steps = step_seconds(out / "train_log.jsonl")
    return {"peak_memory_bytes": section["peak_memory_bytes"],
            "peak_gpu_memory_bytes": section["peak_gpu_memory_bytes"],
            "steps": len(steps), "median_step_seconds": statistics.median(steps), "loop_seconds": section["seconds"],
            "wall_seconds": round(time.perf_counter() - started, 2), "final_loss": section["final_loss"],
            "teacher_cache": section.get("teacher_cache")}


def _kl_config(options: CacheBenchOptions):
    from distill.config import DistillConfig

    return DistillConfig(batch_size=options.batch_size, losses={"teacher_student_kl": 1.0})


def choose_k(options: CacheBenchOptions, teacher, student, selection: torch.Tensor) -> tuple[int, dict]:
    """K for the cache, and the KL of the untrained student at each candidate K on the selection split."""
    from distill.losses import LossInputs, teacher_student_kl, topk_kl, topk_targets

    if options.k != "auto":
        return int(options.k), {"rule": "given (--k)"}
    sums = {k: 0.0 for k in options.k_candidates}
    full = 0.0
    with torch.no_grad():
        for ids in torch.split(selection, options.batch_size):
            t_logits, s_logits = teacher(input_ids=ids).logits, student(input_ids=ids).logits  # [batch, seq, vocab]
            mask = torch.ones_like(ids)
            full += float(teacher_student_kl(LossInputs({}, {}, [], mask, s_logits, t_logits))) * ids.shape[0]
            for k in sums:
                sums[k] += float(topk_kl(s_logits, topk_targets(t_logits, k), mask)) * ids.shape[0]
    full /= selection.shape[0]
    gaps = {k: (full - total / selection.shape[0]) / full for k, total in sums.items()}
    within = [k for k in sorted(gaps) if gaps[k] <= options.k_tolerance]
    chosen = within[0] if within else max(gaps)
    rule = (f"smallest K whose top-K KL is within {options.k_tolerance:.0%} of the full KL" if within else
            f"the largest K tried: none came within {options.k_tolerance:.0%} of the full KL")
    return chosen, {"rule": rule,
                    "full_kl": full, "gap": {str(k): round(g, 5) for k, g in gaps.items()}}


def heldout_kl(options: CacheBenchOptions, teacher, students: dict[str, torch.nn.Module],
               heldout: torch.Tensor) -> dict[str, float]:
    """The full-softmax KL(teacher || student) of each student on the held-out sequences."""
    from distill.forward import evaluate_losses

    config = _kl_config(options)
    return {name: evaluate_losses(model, teacher, heldout, config)["teacher_student_kl"]
            for name, model in students.items()}


def _split(options: CacheBenchOptions, tokenizer, teacher) -> tuple[torch.Tensor, torch.Tensor]:
    """The selection split (the first training sequences) and the held-out sequences ``distill.run`` measures."""
    from prune.data.calibration import calibration_data

    data = calibration_data(tokenizer, distill_config(options, None).data, model=teacher)
    if data.heldout_ids is None:
        raise LayercutError("the distillation text gave no held-out sequences: give a longer --data")
    return data.token_ids[: options.selection_samples], data.heldout_ids


def benchmark_teacher_cache(options: CacheBenchOptions) -> dict:
    """Prune, choose K, run online and cached distillation, and score both; the JSON result."""
    from prune.checkpoint.save_load import load

    work = Path(options.work).expanduser()
    work.mkdir(parents=True, exist_ok=True)
    student_dir = prune_student(options, work)
    teacher = load(options.model, dtype="float32").model
    untrained = load(str(student_dir), dtype="float32")
    selection, heldout = _split(options, untrained.tokenizer, teacher)
    k, selection_report = choose_k(options, teacher, untrained.model, selection)
    before = heldout_kl(options, teacher, {"pruned": untrained.model}, heldout)["pruned"]
    del untrained, teacher  # the children's memory is measured on their own, but this process shares the machine
    online = run_distillation(options, student_dir, work / "online", None)
    cache_write = write_cache_child(options, student_dir, work / "cached", k)
    cached = run_distillation(options, student_dir, work / "cached", k)
    if cached["teacher_cache"] is None or cached["teacher_cache"]["written"]:
        raise LayercutError("the cached run wrote its cache again (another request than the writer's): its memory "
                            "would include the teacher; check that the options of both match")
    teacher = load(options.model, dtype="float32").model
    kls = heldout_kl(options, teacher, {name: load(str(work / name), dtype="float32").model
                                        for name in ("online", "cached")}, heldout)
    return {"model": options.model, "drop": options.drop, "k": k, "k_selection": selection_report,
            "options": asdict(options), "device": "cuda" if torch.cuda.is_available() else "cpu",
            "heldout_sequences": int(heldout.shape[0]), "kl_before": before,
            "online": {**online, "heldout_kl": kls["online"]},
            "cached": {**cached, "heldout_kl": kls["cached"], "cache_write": cache_write},
            **_verdict(online, cached, kls)}


def _verdict(online: dict, cached: dict, kls: dict[str, float]) -> dict:
    ratio = cached["median_step_seconds"] / online["median_step_seconds"]
    gap = (kls["cached"] - kls["online"]) / kls["online"]
    return {"step_ratio": round(ratio, 4), "kl_gap": round(gap, 4),
            "memory_ratio": round(cached["peak_memory_bytes"] / online["peak_memory_bytes"], 4),
            "meets": {"step_ratio": ratio <= STEP_RATIO_TARGET, "kl_gap": gap <= KL_GAP_TARGET}}


def cache_markdown(result: dict) -> str:
    """The result as a markdown table and the two verdict lines."""
    mib = 2**20
    rows = [("online KD", result["online"], "-"),
            (f"cached top-{result['k']}", result["cached"], f"{result['cached']['cache_write']['seconds']:.1f}")]
    student = result["options"].get("student")
    pruned = f"student {Path(student).name}" if student else f"at drop {result['drop']}"
    lines = [f"Teacher cache: {result['model']}, {pruned}, {result['options']['steps']} steps of "
             f"{result['options']['batch_size']} x {result['options']['seq_len']} tokens training "
             f"{result['options'].get('train', 'replacements')} ({result['device']}); KL "
             f"(full softmax) on {result['heldout_sequences']} held-out sequences, {result['kl_before']:.4f} before "
             "distillation", "",
             "| run | peak RSS (MiB) | median s/step | cache write (s) | held-out KL |", "|---|---:|---:|---:|---:|"]
    for name, row, write in rows:
        lines.append(f"| {name} | {row['peak_memory_bytes'] / mib:.0f} | {row['median_step_seconds']:.3f} | {write} | "
                     f"{row['heldout_kl']:.4f} |")
    meets = result["meets"]
    gap = result["k_selection"].get("gap")
    lines += ["", f"step time x{result['step_ratio']:.3f} of online (target <= {STEP_RATIO_TARGET}: "
              f"{'met' if meets['step_ratio'] else 'missed'}); KL {result['kl_gap']:+.1%} against online (target "
              f"<= {KL_GAP_TARGET:+.0%}: {'met' if meets['kl_gap'] else 'missed'}); "
              f"peak RSS x{result['memory_ratio']:.3f}",
              f"K = {result['k']}: {result['k_selection']['rule']}"
              + (f" (selection-split gap by K: {gap})" if gap else "")]
    return "\n".join(lines)


_D = CacheBenchOptions()  # the flags' defaults are the benchmark's


@dataclass(frozen=True)
class TeacherCacheBenchOptions:
    """The options of ``eval.bench teacher-cache``: its flags, in ``--help``'s order (see :class:`CacheBenchOptions`).

    ``k_candidates`` is the comma list the command line gives; ``data`` holds the distillation text, its sequences,
    seed and held-out sequences; ``out``: folder for ``teacher_cache.json`` and ``teacher_cache.md`` (None: print
    only).
    """

    model: str = bench_option(_D.model, f"teacher, pruned with linear maps (default: {_D.model})")
    drop: int = bench_option(_D.drop, f"blocks removed (default: {_D.drop})", type=int)
    student: str | None = bench_option(None, "an already pruned student folder (default: prune --model)")
    steps: int = bench_option(_D.steps, f"steps of each distillation (default: {_D.steps})", type=int)
    train: str = bench_option(_D.train, "what both distillations train, as distill.run --train (default: "
                              f"{_D.train}; lora: prune.ship's heal)")
    batch_size: int = bench_option(_D.batch_size, f"sequences per step (default: {_D.batch_size})", type=int)
    k: str = bench_option(_D.k, "K of the top-K cache, or auto: the smallest of --k-candidates whose top-K KL is "
                          "within --k-tolerance of the full KL on a selection split (default: auto)")
    k_candidates: str = bench_option(",".join(map(str, _D.k_candidates)),
                                     f"K tried by --k auto (default: {','.join(map(str, _D.k_candidates))})")
    k_tolerance: float = bench_option(_D.k_tolerance,
                                      f"share of the full KL a top-K KL may miss (default: {_D.k_tolerance})",
                                      type=float)
    data: DataConfig = data_option(samples=_D.samples, seq_len=_D.seq_len, heldout_samples=_D.heldout_samples,
                                          data=_D.data,
                                          data_help="builtin, the novel alone (no minutes of sampling on a CPU)",
                                          heldout_help="sequences the final KL is measured on")
    selection_samples: int = bench_option(_D.selection_samples, "training sequences --k auto chooses on (default: "
                                          f"{_D.selection_samples})", type=int)
    prune_samples: int = bench_option(_D.prune_samples,
                                      f"calibration sequences of the pruning (default: {_D.prune_samples})", type=int)
    work: str = bench_option(_D.work, f"students, caches and distilled models (default: {_D.work})")
    out: str | None = bench_option(None, "folder for teacher_cache.json and teacher_cache.md (default: print only)")
    threads: int | None = threads_option()


def run_teacher_cache(command: TeacherCacheBenchOptions) -> int:
    """Run the benchmark of ``command``, print its table and write it under ``--out``."""
    apply_threads(command)
    try:
        candidates = [int(k) for k in str(command.k_candidates).split(",")]
    except ValueError:
        raise LayercutError(f"--k-candidates takes comma-separated integers, got {command.k_candidates!r}") from None
    data = command.data
    options = CacheBenchOptions(
        model=command.model, drop=command.drop, student=command.student, steps=command.steps,
        train=command.train, batch_size=command.batch_size, k=command.k, k_candidates=candidates,
        k_tolerance=command.k_tolerance,
        data=data.data, text_field=data.text_field, samples=data.samples, seq_len=data.seq_len,
        heldout_samples=data.heldout_samples,
        selection_samples=command.selection_samples, prune_samples=command.prune_samples, seed=data.seed,
        threads=command.threads or torch.get_num_threads(), work=command.work)
    result = benchmark_teacher_cache(options)
    table = cache_markdown(result)
    print(table)
    if command.out:
        from prune.atomic import atomic_directory, write_json

        with atomic_directory(command.out, overwrite=True) as staging:
            write_json(staging / "teacher_cache.json", result)
            (staging / "teacher_cache.md").write_text(table + "\n", encoding="utf-8")
    return 0


register_subcommand("teacher-cache", TEACHER_CACHE_HELP, TeacherCacheBenchOptions, run_teacher_cache)
