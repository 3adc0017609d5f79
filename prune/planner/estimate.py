r"""A run's peak memory per device and its time, per stage, from the model's config alone (``--plan``).

    python -m prune.run --model smollm2-135m --drop 4 --replace linear --plan
    python -m prune.run --model meta-llama/Meta-Llama-3-70B --drop 20 --replace linear --distill-steps 2000 \\
        --dtype bfloat16 --plan --plan-gpus 8 --plan-gpu-memory 80GB --plan-host-memory 2TB

No weight is read: :mod:`prune.planner.shape` counts the parameters of the model built from its config on
the meta device, :mod:`prune.planner.stages` turns them and the options into bytes per device and seconds
per stage (load, scoring, a selection that measures the model, fitting, distillation, evaluation). A run whose
stage needs clearly more than a device holds is refused before anything loads (:func:`check_plan`), in one
line naming the options that make it fit (:func:`fixes`); ``--no-plan-check`` skips the check.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prune.errors import LayercutError
from prune.planner.inputs import DistillSpec, Hardware, PlanInput, lora_targets_spec
from prune.planner.machine import machine_speed
from prune.planner.memory import add
from prune.planner.rates import CPU_SOURCE, GPU_SOURCE
from prune.planner.shape import ModelShape, build_on_meta, read_config, shape_of_model, shape_of_name
from prune.planner.stages import (
    Stage,
    stage_distillation,
    stage_evaluation,
    stage_fitting,
    stage_load,
    stage_scoring,
    stage_selection,
    stage_teacher_cache,
)
from prune.selection.strategies import measured_selections, parse_protect

logger = logging.getLogger(__name__)

__all__ = ["DistillSpec", "Hardware", "PlanInput", "RunPlan", "check_plan", "fixes", "format_plan", "plan_run"]

# An estimate is within ~20 % of a measured peak: refuse only what needs more than this times a device's memory.
REFUSE_MARGIN = 1.2
_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9, "T": 1e12, "TB": 1e12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
@dataclass
class RunPlan:
    """A plan: the model, its inputs, every stage, and each device's limit."""

    shape: ModelShape
    inp: PlanInput
    stages: list[Stage]
    limits: dict[str, float]

    def peak(self, device: str) -> float:
        """The most any stage holds on ``device``."""
        return max((stage.peak(device) for stage in self.stages), default=0.0)

    def worst(self) -> tuple[str, str, float]:
        """(stage, device, bytes) of the largest share of a device's memory."""
        return max(((s.name, d, s.peak(d)) for s in self.stages for d in self.limits),
                   key=lambda item: item[2] / self.limits[item[1]])

    def fits(self, margin: float = 1.0) -> bool:
        """Whether every stage fits every device (``margin`` x its memory)."""
        return all(s.peak(d) <= margin * self.limits[d] for s in self.stages for d in self.limits)

    @property
    def seconds(self) -> float:
        """Estimated wall time of all stages."""
        return sum(stage.seconds for stage in self.stages)

    def to_dict(self) -> dict:
        """JSON-ready: inputs, shape, per stage per device bytes (and parts), seconds, limits, fit."""
        return {
            "model": self.inp.model, "shape": self.shape.to_dict(), "inputs": dataclasses.asdict(self.inp),
            "limits": self.limits, "fits": self.fits(), "peak": {d: self.peak(d) for d in self.limits},
            "seconds": self.seconds,
            "stages": [{"name": s.name, "seconds": s.seconds, "note": s.note,
                        "peak": {d: s.peak(d) for d in s.devices},
                        "parts": {d: dict(p) for d, p in s.devices.items()}} for s in self.stages],
            "throughput": throughput_source(self.inp),
        }


def throughput_source(inp: PlanInput) -> str:
    """Where the plan's rate comes from: the GPU's assumption, or the CPU's measurement at this CPU's speed now."""
    if inp.on_gpu:
        return GPU_SOURCE
    return f"{CPU_SOURCE}; this CPU now x{machine_speed():.2f} of it"


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """``--plan``, its what-ifs (``--plan-gpus``, ``--plan-gpu-memory``, ...) and ``--no-plan-check``."""
    group = parser.add_argument_group("plan (memory and time from the model's config; no weights read)")
    group.add_argument("--plan", action="store_true",
                       help="print each stage's peak memory per device and its time for these options, and which "
                       "options make it fit, then exit")
    group.add_argument("--plan-json", default=None, metavar="FILE", help="with --plan, also write the plan as JSON")
    group.add_argument("--plan-gpus", type=int, default=None, metavar="N",
                       help="plan for N GPUs instead of this machine's --device (0: the CPU)")
    group.add_argument("--plan-gpu-memory", default=None, metavar="SIZE",
                       help="memory of one planned GPU (80GB, 24GiB; default: this machine's)")
    group.add_argument("--plan-host-memory", default=None, metavar="SIZE",
                       help="RAM of the planned machine (default: this machine's)")
    group.add_argument("--plan-fsdp", action="store_true",
                       help="plan distillation sharded over the GPUs with FSDP (accelerate launch), not a device map")
    group.add_argument("--no-plan-check", action="store_true",
                       help="run even when the plan says a stage needs clearly more memory than a device has")


PLAN_FLAGS = {"plan", "plan_json", "plan_gpus", "plan_gpu_memory", "plan_host_memory", "plan_fsdp", "no_plan_check"}


def hardware_from_args(args: argparse.Namespace, device: str) -> Hardware:
    """The :class:`Hardware` of the flags :func:`add_plan_arguments` added, for a run on ``device``."""
    return hardware_for(device, args.plan_gpus, args.plan_gpu_memory, args.plan_host_memory, args.plan_fsdp)


def write_plan_json(plan: RunPlan, path: str | None) -> None:
    """Write ``plan.to_dict()`` to ``path`` (nothing without one), its folder made if missing.

    Raises:
        LayercutError: ``path`` is a folder, or nothing can be written there (one line naming ``--plan-json``).
    """
    if not path:
        return
    target = Path(path).expanduser()
    if target.is_dir():
        raise LayercutError(f"--plan-json {path} is a folder: pass a file path such as plan.json")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(plan.to_dict(), indent=2) + "\n", encoding="utf-8")
    except OSError as err:
        raise LayercutError(f"--plan-json {path} cannot be written ({err.strerror}): pass a path in a writable "
                            "folder") from None


def plan_run(shape: ModelShape, inp: PlanInput, moments_alive: bool = True) -> RunPlan:
    """Every stage of a prune run (those its options switch on) and each device's memory."""
    stages = [stage_load(shape, inp), stage_scoring(shape, inp),
              stage_selection(shape, inp, inp.select in measured_selections()), stage_fitting(shape, inp),
              stage_teacher_cache(shape, inp), stage_distillation(shape, inp, moments_alive),
              stage_evaluation(shape, inp)]
    limits = {"cpu": inp.hardware.host_memory}
    limits.update({f"cuda:{i}": inp.hardware.gpu_memory for i in range(inp.hardware.gpus)})
    return RunPlan(shape, inp, [stage for stage in stages if stage is not None], limits)


def parse_bytes(text: str, flag: str) -> float:
    """``"80GB"`` -> 8e10, ``"24GiB"`` -> 24 x 2^30 (decimal units, binary with i)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise LayercutError(f"{flag} takes a size above 0 like 80GB or 24GiB, got {text!r}")
    return float(match.group(1)) * _UNITS[unit]


def machine_memory() -> float:
    """RAM of this machine in bytes (``MemTotal``; psutil elsewhere)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024.0
    except OSError:
        pass
    import psutil

    return float(psutil.virtual_memory().total)


def local_gpus(device: str) -> tuple[int, float]:
    """(GPUs, bytes of the first) that ``--device`` would use here: none for cpu or without CUDA."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return 0, 0.0
    count = torch.cuda.device_count() if device == "auto" else 1
    index = int(device.partition(":")[2] or 0) if device.startswith("cuda") else 0
    return count, float(torch.cuda.get_device_properties(index).total_memory)


def hardware_for(device: str, gpus: int | None = None, gpu_memory: str | None = None,
                 host_memory: str | None = None, fsdp: bool = False) -> Hardware:
    """The devices of a plan: this machine's (``--device``), or the what-if ``--plan-gpus`` / ``--plan-*-memory``."""
    count, size = local_gpus(device) if gpus is None else (gpus, 0.0)
    if gpu_memory is not None:
        size = parse_bytes(gpu_memory, "--plan-gpu-memory")
    if count and not size:
        raise LayercutError("--plan-gpus needs --plan-gpu-memory (80GB): the memory of one GPU")
    if gpus is not None and gpus < 0:
        raise LayercutError(f"--plan-gpus must be 0 (the CPU) or more, got {gpus}")
    host = parse_bytes(host_memory, "--plan-host-memory") if host_memory is not None else machine_memory()
    return Hardware(gpus=count, gpu_memory=size, host_memory=host, fsdp=fsdp)


def _drop_count(config, shape: ModelShape) -> int:
    """Blocks the run removes: ``drop``, or the count a parameter or speed-up target works out to."""
    from prune.selection.budget import blocks_for_params, blocks_for_speedup, parse_param_target
    from prune.selection.strategies import parse_drop

    if config.drop is not None:
        return parse_drop(config.drop, shape.layers)
    if config.target_speedup is not None:
        return blocks_for_speedup(config.target_speedup, shape.layers)
    if config.target_params is not None:
        target = parse_param_target(config.target_params, shape.total)
        protected = set(parse_protect(config.protect, shape.layers))
        free = [block for block in range(shape.layers) if block not in protected]
        # a plan's blocks are all one size, so which free blocks the run's selection picks does not change the count
        return blocks_for_params(target, shape.total, [shape.block_params] * shape.layers, lambda k: free[:k],
                                 len(free))
    return 0


def distill_spec(options: dict, fallback_seq_len: int = 128) -> DistillSpec:
    """A :class:`DistillSpec` from a run's ``distill`` section (``DistillConfig`` keys; absent ones: its defaults)."""
    defaults = DistillSpec()
    data = options.get("data") or {}
    losses = options.get("losses") or {"teacher_student_kl": 1.0}
    kl = losses.get("teacher_student_kl", 0) > 0 if options.get("kl_weight") is None else options["kl_weight"] > 0
    cache = options.get("teacher_cache") or 0
    if isinstance(cache, str):  # "topk=64", as distill.run's --teacher-cache spells it
        match = re.fullmatch(r"(?:topk=)?(\d+)", cache.strip())
        if match is None:
            raise LayercutError(f"teacher_cache takes topk=K (topk=64), got {cache!r}")
        cache = int(match.group(1))
    # a cache holds each sequence once, however many times the steps read it (prune.ship's heal reads its few
    # calibration rows many times)
    sequences = int(data.get("samples", 0) or 0) + int(data.get("heldout_samples", 0) or 0)
    return DistillSpec(steps=int(options.get("steps", 0)), batch_size=options.get("batch_size", defaults.batch_size),
                       seq_len=data.get("seq_len", fallback_seq_len), grad_accum=options.get("grad_accum", 1),
                       train=options.get("train", defaults.train), lora_r=options.get("lora_r", defaults.lora_r),
                       lora_targets=lora_targets_spec(options.get("lora_targets", defaults.lora_targets)), kl=kl,
                       teacher_cache=int(cache), cache_sequences=sequences)


def plan_input(config, shape: ModelShape, hardware: Hardware) -> PlanInput:
    """The :class:`PlanInput` of a :class:`prune.pipeline.config.PruneConfig` on ``hardware``."""
    load = config.load
    return PlanInput(
        model=load.model, drop=_drop_count(config, shape), replace=config.replace.method, dtype=load.dtype,
        quant_bits=4 if load.load_in_4bit else 8 if load.load_in_8bit else 16,
        offload=getattr(load, "offload", "none"), samples=config.data.samples, seq_len=config.data.seq_len,
        heldout_samples=config.data.heldout_samples, batch_size=config.batch_size,
        fit_short=config.replace.short or 0, select=config.select,
        protected=len(parse_protect(config.protect, shape.layers)), checkpoint_dtype=shape.dtype,
        distill=distill_spec(config.distill, DistillSpec().seq_len), hardware=hardware,
        # the config's own check: the data it names is the fix's to change (the fix's words say so)
        offloadable=all(flag == "--data" for flag, _ in config.offload_refusals()),
        shape_speed=_shape_speed(shape, hardware, config))


def _shape_speed(shape: ModelShape, hardware: Hardware, config) -> float:
    """:func:`prune.planner.machine.shape_speed` of the model's widths on the run's batch (a CPU run's only).

    Block by block a block runs one sequence at a time; sequences longer than 512 tokens are timed at 512, which
    bounds the probe's cost.
    """
    if hardware.gpus:
        return 1.0
    from prune.planner.machine import shape_speed

    offloaded = getattr(config.load, "offload", "none") == "sequential"
    return shape_speed(shape.hidden, shape.intermediate, shape.heads, 1 if offloaded else config.batch_size,
                       min(config.data.seq_len, 512))


def plan_config(config, hardware: Hardware, shape: ModelShape | None = None, keeps_original: bool = False) -> RunPlan:
    """The plan of a :class:`prune.pipeline.config.PruneConfig`, its model read from its config alone.

    ``keeps_original``: the caller holds the original model beside the run's copy (``eval.compare`` prunes
    a copy of it in each cell), so every stage after loading also holds its weights.
    """
    built = None
    if getattr(config, "auto_replace", False) and config.replace.method == "none":
        # --replace auto: the run chooses once the model is loaded (PruneConfig.with_default_repair); the plan
        # reads the same choice from the model built on the meta device, so it sizes that fit, not a removal
        built = build_on_meta(read_config(config.load.model))
        config = config.with_default_repair(built)
    shape = shape or (shape_of_model(built) if built is not None else shape_of_name(config.load.model))
    plan = plan_run(shape, plan_input(config, shape, hardware))
    if keeps_original:
        original = plan_run(shape, dataclasses.replace(plan.inp, offload="none")).stages[0]
        for stage in plan.stages[1:]:
            for device, parts in original.devices.items():
                add(stage.devices.setdefault(device, {}), "original (kept)", parts.get("weights", 0.0))
    return plan


# What may make a plan fit, most preferred first: (the words of the fix, whether it applies, the changed input).
_Fix = tuple[str, Callable[[PlanInput], bool], Callable[[PlanInput], PlanInput]]


def _with(inp: PlanInput, **changes) -> PlanInput:
    return dataclasses.replace(inp, **changes)


def _candidate_fixes(inp: PlanInput) -> list[_Fix]:
    """The option changes :func:`fixes` tries, each with when it applies."""
    spec, hw = inp.distill, inp.hardware
    more = [n for n in (2, 4, 8) if n > hw.gpus]
    return [
        # a skeleton cannot sample the default calibration's self half: the fix names the data too
        ("--offload sequential (with --data builtin, a file or a dataset)", _offload_applies,
         lambda i: _with(i, offload="sequential")),
        ("--dtype bfloat16", lambda i: i.dtype_bytes == 4 and i.quant_bits == 16,
         lambda i: _with(i, dtype="bfloat16")),
        ("--load-in-8bit", lambda i: i.on_gpu and i.quant_bits == 16, lambda i: _with(i, quant_bits=8)),
        ("--load-in-4bit", lambda i: i.on_gpu and i.quant_bits > 4, lambda i: _with(i, quant_bits=4)),
        ("a teacher cache (distill.run --teacher-cache topk=64)",
         lambda i: i.distill.steps > 0 and not i.distill.teacher_cache,
         lambda i: _with(i, distill=dataclasses.replace(i.distill, teacher_cache=64))),
        (f"FSDP over the {hw.gpus} GPUs (--plan-fsdp)", lambda i: i.hardware.gpus > 1 and not i.hardware.fsdp
         and spec.steps > 0, lambda i: _with(i, hardware=dataclasses.replace(i.hardware, fsdp=True))),
        *[(f"{n} x {hw.gpu_memory / 1e9:.0f} GB GPUs (--device auto)", lambda i: i.on_gpu,
           lambda i, n=n: _with(i, hardware=dataclasses.replace(i.hardware, gpus=n))) for n in more],
    ]


def _offload_applies(inp: PlanInput) -> bool:
    """Whether ``--offload sequential`` is a fix: not on already, and the run's options allow it (``offloadable``)."""
    return inp.offload != "sequential" and inp.offloadable


def fixes(plan: RunPlan, most: int = 3) -> list[str]:
    """The fewest option changes (up to ``most`` together) that make ``plan`` fit, best first; [] if none."""
    candidates = [fix for fix in _candidate_fixes(plan.inp) if fix[1](plan.inp)]
    for size in range(1, most + 1):
        found = []
        for combo in itertools.combinations(candidates, size):
            inp = plan.inp
            for _, _, change in combo:
                inp = change(inp)
            if plan_run(plan.shape, inp, _moments_alive(plan)).fits():
                found.append(" ".join(words for words, _, _ in combo))
        if found:
            # the fewest GPUs that fit is the fix to name; more of them fit too, and say nothing new
            gpus = [f for f in found if "GPUs (--device auto)" in f]
            return [f for f in found if f not in gpus[1:]][:3]
    return []


def _moments_alive(plan: RunPlan) -> bool:
    distill = next((s for s in plan.stages if s.name == "distillation"), None)
    return distill is None or any("moments (float64)" in parts for parts in distill.devices.values())


def refusal(plan: RunPlan) -> str | None:
    """The one-line refusal of a plan clearly above a device's memory (``REFUSE_MARGIN``), else None."""
    if plan.fits(REFUSE_MARGIN):
        return None
    stage, device, need = plan.worst()
    found = fixes(plan)
    fix = ("fits with " + ", or ".join(found)) if found else "no option tried makes it fit: use more or larger devices"
    return (f"the {stage} stage needs {_gb(need)} on {device} ({_gb(plan.limits[device])}): {fix} "
            "(estimate: python -m prune.run ... --plan; skip the check: --no-plan-check)")


def check_plan(plan: RunPlan) -> None:
    """Raise :class:`LayercutError` (one line, with the fix) when ``plan`` clearly does not fit."""
    message = refusal(plan)
    if message is not None:
        raise LayercutError(message)


def refuse_if_too_big(config, make_plan: Callable[[], RunPlan]) -> None:
    """Refuse ``config`` up front when its plan clearly does not fit (:func:`check_plan`).

    The plan is advice: a model whose config it cannot read or build on the meta device is left to the run,
    which gives its own one-line error for a bad name.
    """
    try:
        plan = make_plan()
    except Exception as err:  # noqa: BLE001 - any failure to plan must not stop a run that may work
        logger.info("no memory plan for %s (%s): running without the check", config.load.model, err)
        return
    check_plan(plan)


def _gb(value: float) -> str:
    return f"{value / 1e9:.1f} GB" if value < 1e11 else f"{value / 1e9:.0f} GB"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _top_parts(parts: dict[str, float], count: int = 4) -> str:
    ranked = sorted(parts.items(), key=lambda item: -item[1])[:count]
    return ", ".join(f"{name} {_gb(value)}" for name, value in ranked)


def _stage_line(stage: Stage, plan: RunPlan) -> str:
    """One stage: the fullest device, its share of memory, what fills it, the time."""
    device = max(stage.devices, key=lambda d: stage.peak(d) / plan.limits[d])
    others = [d for d in stage.devices if d != device and stage.peak(d) > 0]
    also = f"; {others[0]} {_gb(stage.peak(others[0]))}" if others else ""
    return (f"  {stage.name:<13} {_gb(stage.peak(device)):>9} on {device:<7} "
            f"({100 * stage.peak(device) / plan.limits[device]:3.0f} %)  {_duration(stage.seconds):>7}  "
            f"[{_top_parts(stage.devices[device])}{also}]" + (f"  {stage.note}" if stage.note else ""))


def format_plan(plan: RunPlan) -> str:
    """The printed plan: devices, one line per stage, the verdict and the fixes."""
    inp, shape = plan.inp, plan.shape
    devices = ", ".join(f"{d} {_gb(v)}" for d, v in plan.limits.items())
    quant = {4: ", 4-bit", 8: ", 8-bit"}.get(inp.quant_bits, "")
    lines = [f"plan: {inp.model} ({shape.model_type}, {shape.total / 1e9:.2f}B parameters, {shape.layers} blocks, "
             f"d={shape.hidden}), drop {inp.drop}, replace {inp.replace}, {inp.dtype_bytes * 8}-bit weights{quant}, "
             f"offload {inp.offload}",
             f"devices: {devices}" + (" (FSDP for distillation)" if inp.hardware.fsdp else ""),
             "  stage          peak     device     share     time   what fills it"]
    lines += [_stage_line(stage, plan) for stage in plan.stages]
    stage, device, need = plan.worst()
    verdict = ("fits" if plan.fits() else "tight: within the estimate's 20 %" if plan.fits(REFUSE_MARGIN)
               else "does not fit")
    lines.append(f"peak {_gb(need)} on {device} in {stage} ({verdict}); time about {_duration(plan.seconds)} "
                 f"({throughput_source(inp)})")
    if not plan.fits():
        found = fixes(plan)
        lines.append("makes it fit: " + (", or ".join(found) if found else "no option tried; more devices"))
    return "\n".join(lines)
