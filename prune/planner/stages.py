"""The stages of a plan (``prune.planner.estimate``): what each holds on each device, and how long it takes.

:class:`PlanInput` is a run's options as plain numbers; each ``stage_*`` function returns a :class:`Stage`
with the bytes per device (by what fills them, from :mod:`prune.planner.memory`) and its seconds.
Times divide each stage's arithmetic (2 x parameters a token passes through for a forward, x2 again for a
backward through frozen weights, x3 with gradients for every weight) by a throughput: measured on this
machine's CPU, and an assumed share of an H100's bf16 peak on a GPU; the plan names which one gave each time.
The distillation part takes plain numbers (:class:`DistillSpec`): prune never imports ``distill``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prune.planner.inputs import DTYPE_BYTES, PlanInput
from prune.planner.machine import machine_speed
from prune.planner.memory import (
    CPU_BASELINE_BYTES,
    CUDA_CONTEXT_BYTES,
    Parts,
    add,
    decomposition_bytes,
    divergence_logit_bytes,
    fit_bytes,
    fitted_map_bytes,
    forward_bytes,
    kl_logit_bytes,
    lora_params,
    map_params,
    measuring_logit_bytes,
    measuring_state_bytes,
    moment_bytes,
    perplexity_logit_bytes,
    placed,
    solve_bytes,
    train_activation_bytes,
    weight_bytes,
)
from prune.planner.shape import ModelShape
from prune.replace.registry import METHODS, closed_form_methods
from prune.selection.repaired import MEASURE_EVERY

# Throughput. CPU: SmolLM2-135M's scoring pass ran 482 tokens/s on 2 threads of this 2-core machine
# (2026-12-02, prune.run --drop 4 --samples 32, idle: the machine prune.planner.machine's probe is the reference
# of), 253 MFLOP a token (2 x 106 M block parameters + the float32 moment products): 1.22e11 FLOP/s in
# float32, multiplied by this CPU's speed now against that machine (prune.planner.machine). GPU: an assumption,
# 40 % of an H100 SXM's 989 TFLOP/s dense bf16 (NVIDIA H100 datasheet); bitsandbytes 4/8-bit weights at half
# that (they are dequantized per call).
CPU_FLOPS = 1.22e11
GPU_FLOPS = 0.4 * 989e12
QUANTIZED_SPEED = 0.5
DISK_BYTES_PER_S = 1.0e9  # assumption: a local NVMe read with a cold page cache
CPU_SOURCE = "CPU: 1.22e11 FLOP/s measured (SmolLM2-135M scoring, 482 tokens/s, 2 threads)"
# What distillation reaches of CPU_FLOPS on the CPU: eval.bench teacher-cache --train lora on SmolLM2-135M at drop 8
# (prune.ship's heal; 4 x 128 tokens a step, 2 threads, idle, the reference machine's speed, 2026-12-02): the
# student's forward and backward 2.718 s a step (the cached run: 217.5 GFLOP planned), the teacher's forward 0.776 s
# more (the online run, 3.494 s: 137.7 GFLOP). The teacher's forward outruns the scoring pass, which also
# multiplies every state's float32 moments; the student's backward through LoRA's many small products does not.
TRAIN_SHARE = 0.656
TEACHER_SHARE = 1.455
# float64 on a GPU: 40 % of an H100 SXM's 67 TFLOP/s FP64 Tensor Core peak (NVIDIA H100 datasheet), the closed-form
# fits' arithmetic (prune.measure.least_squares, prune.replace.rotate)
GPU_FP64_FLOPS = 0.4 * 67e12
GPU_SOURCE = "GPU: 40 % of H100 bf16 peak (989 TFLOP/s, NVIDIA datasheet) = 4.0e14 FLOP/s per GPU"
# The closed-form work in float64, at the reference machine's speed (fitted on prune.ship's SmolLM2-135M runs,
# ship.costs): a fit's sums (its regressor's Gram and the cross with its target) and the eigendecompositions that
# the scores and the least-squares solves go through (prune.measure.least_squares).
FIT_FLOPS = 3.88e10
# torch.linalg.eigh of an n x n float64 matrix, in FIT_FLOPS' operations per n^3: 0.13-0.15 ns per n^3 at n = 576 to
# 4,096 on 2 threads of this machine (2026-12-03, its probe at 0.98-1.02x), 0.19 ns at n = 8,192 (a Llama-3.2-1B
# shape's fold, 105 s of a 430 s prune.run). Counted as n^3 until then, the fold's solve at the MLP width was most
# of what the planner missed on the 1B and 8B shapes. EIGH_FLOPS up to EIGH_NARROW, EIGH_WIDE_FLOPS (0.19 ns) from
# EIGH_WIDE on (wider ones unmeasured: the same), between them in proportion to log n (eigh_flops): counted at 6
# throughout, the 1B shape's two folds at 8,192 took 101 s of its shortlist where 84 were planned (2026-12-05,
# reports/planner-probe).
EIGH_FLOPS = 6.0
EIGH_WIDE_FLOPS = 7.4
EIGH_NARROW, EIGH_WIDE = 4096, 8192
# On a GPU, models of this project's sizes leave it idle: a pass costs its kernel launches and Python, not its
# arithmetic. Both floors were read off one H200 (2026-12-04, reports/gpu-ship/h200-2026-12-04: bfloat16, torch 2.11,
# transformers 5.17) and hold for the host's Python as much as for the GPU.
# A block's forward call at a decode step: SmolLM2-135M decoded 60.4 tokens/s through 30 blocks (0.55 ms a block),
# the Llama-3.2-1B shape 69.4 through 16 (0.90 ms: its 128k-wide head).
GPU_BLOCK_CALL_SECONDS = 5.5e-4
# A LoRA distillation step of 4 x 128 tokens (forward, backward, the optimizer): 100 steps took 17.8 s on SmolLM2-135M
# at drop 8 (22 blocks), 18.2 s on the 1B shape at drop 4 (12 blocks), 23.9 s on Gemma-3-270M's shape (14 blocks)
GPU_STEP_SECONDS = 0.18
# float32 arithmetic on a GPU against its bfloat16 tensor cores: an H100 SXM's 67 TFLOP/s FP32 against 989 (NVIDIA
# datasheet); the heal block by block trains its pair in float32
FP32_SHARE = 67 / 989








@dataclass
class Stage:
    """One stage of a plan: bytes per device (by what fills them) and its time."""

    name: str
    devices: dict[str, Parts]
    seconds: float
    note: str = ""

    def peak(self, device: str) -> float:
        """Bytes on ``device`` in this stage."""
        return sum(self.devices.get(device, {}).values())


def compute_devices(inp: PlanInput) -> list[str]:
    """The devices that hold weights: the GPUs, or the CPU."""
    return [f"cuda:{i}" for i in range(inp.hardware.gpus)] or ["cpu"]


def _new_devices(inp: PlanInput) -> dict[str, Parts]:
    """Each device's fixed cost: the process on the host, a CUDA context per GPU."""
    devices: dict[str, Parts] = {"cpu": {"python + torch": CPU_BASELINE_BYTES}}
    for name in compute_devices(inp):
        if name != "cpu":
            devices[name] = {"CUDA context": CUDA_CONTEXT_BYTES}
    return devices


def _weights(devices: dict[str, Parts], shape: ModelShape, inp: PlanInput, blocks: int, label: str) -> None:
    """``blocks`` blocks with embedding and head, spread over the compute devices."""
    names = compute_devices(inp)
    for name, value in zip(names, placed(shape, inp, blocks, len(names)), strict=True):
        add(devices[name], label, value)


def _moments(devices: dict[str, Parts], shape: ModelShape, inp: PlanInput, extra: float = 0.0) -> None:
    """The scoring moments (and ``extra`` fit sums), shared over the devices that make the states.

    Under offload sequential each block's scores are taken as soon as its statistics are complete and the
    statistics freed (``prune.measure.blockwise``): three [d, d] matrices instead of 2L + 1.
    """
    names = compute_devices(inp)
    moments = 3 * shape.hidden ** 2 * 8 if inp.offload == "sequential" else moment_bytes(shape)
    for name in names[:1] if inp.offload == "sequential" else names:
        share = 1 if inp.offload == "sequential" else 1 / len(names)
        add(devices[name], "moments (float64)", moments * share)
        add(devices[name], "fit sums (float64)", extra * share)


def _streamed(devices: dict[str, Parts], shape: ModelShape, inp: PlanInput, tokens: int) -> None:
    """Offload sequential: one block, the embedding and two [tokens, d] state buffers on the compute device."""
    first = compute_devices(inp)[0]
    add(devices[first], "one block + embedding", weight_bytes(shape, inp, 1, head=False))
    add(devices[first], "2 state buffers", 2 * tokens * shape.hidden * inp.act_bytes)


def _flops(shape: ModelShape, blocks: int, head: bool = False) -> float:
    """FLOP of a forward per token through ``blocks`` blocks (and the head)."""
    return 2 * (blocks * shape.block_active_params + (shape.vocab * shape.hidden if head else 0))


def _rate(inp: PlanInput, quantized: bool | None = None, parallel: int = 1) -> float:
    """FLOP/s: the CPU's measured (at this CPU's speed now), or ``parallel`` GPUs' assumed (half for bitsandbytes)."""
    quantized = inp.quant_bits < 16 if quantized is None else quantized
    if not inp.on_gpu:
        return CPU_FLOPS * machine_speed() * inp.shape_speed
    return GPU_FLOPS * parallel * (QUANTIZED_SPEED if quantized else 1.0)


def stage_load(shape: ModelShape, inp: PlanInput) -> Stage:
    """Reading the weights: the whole model, or only the embedding under offload sequential."""
    devices = _new_devices(inp)
    if inp.offload == "sequential":
        _streamed(devices, shape, inp, 0)
        read = weight_bytes(shape, inp, 0, head=False)
    else:
        _weights(devices, shape, inp, shape.layers, "weights")
        read = shape.total * DTYPE_BYTES.get(inp.checkpoint_dtype, 4)
    return Stage("load", devices, read / DISK_BYTES_PER_S, "disk at 1 GB/s (assumption)")


def stage_scoring(shape: ModelShape, inp: PlanInput) -> Stage:
    """The streamed pass: weights (or one block), one block's forward, the moments."""
    devices = _new_devices(inp)
    tokens = inp.batch_size * inp.seq_len
    if inp.offload == "sequential":
        _streamed(devices, shape, inp, inp.calibration_tokens)
    else:
        _weights(devices, shape, inp, shape.layers, "weights")
    add(devices[compute_devices(inp)[0]], "activations", forward_bytes(shape, inp, tokens))
    _moments(devices, shape, inp)
    flop = inp.calibration_tokens * (_flops(shape, shape.layers) + (2 * shape.layers + 1) * 2 * shape.hidden ** 2)
    seconds = flop / _rate(inp) + score_decompositions(shape) / fit_rate(inp) + _disk_pass(shape, inp)
    return Stage("scoring", devices, seconds, f"{inp.calibration_tokens:,} tokens")


def score_decompositions(shape: ModelShape) -> float:
    """FLOP of the scores' decompositions, as :data:`FIT_FLOPS` counts them: every state's centred Gram, once.

    (``prune.measure.moments.StateMoments.gram_eigh``.)
    """
    return (shape.layers + 1) * eigh_flops(shape.hidden) * shape.hidden ** 3


def eigh_flops(n: int) -> float:
    """FIT_FLOPS' operations per n^3 of an n x n float64 eigendecomposition (:data:`EIGH_FLOPS` and its wide kin)."""
    if n <= EIGH_NARROW:
        return EIGH_FLOPS
    if n >= EIGH_WIDE:
        return EIGH_WIDE_FLOPS
    share = math.log(n / EIGH_NARROW) / math.log(EIGH_WIDE / EIGH_NARROW)
    return EIGH_FLOPS + share * (EIGH_WIDE_FLOPS - EIGH_FLOPS)


def fit_rate(inp: PlanInput) -> float:
    """FLOP/s of the float64 closed-form work: :data:`FIT_FLOPS` at this CPU's speed (on a GPU, at its float64 rate).

    Not by the model's widths (``inp.shape_speed``): the decompositions' rate is LAPACK's, not the blocks' GEMMs'.
    On a GPU the fits' share of the CPU's float32 rate is taken of the GPU's float64 one, :data:`GPU_FP64_FLOPS`
    (of its bfloat16 one, they were planned 15 times too fast: a Llama-3-8B shape's shortlist took 257 s on an
    H200 against 17 s planned, most of it two ``fold-rotate`` fits' rounds at the MLP's 14,336 width).
    """
    return FIT_FLOPS * (machine_speed() if not inp.on_gpu else GPU_FP64_FLOPS / CPU_FLOPS)


def fit_flops(shape: ModelShape, width: int, tokens: int, rounds: int = 0) -> float:
    """FLOP of one span's closed-form fit over ``tokens``, as :data:`FIT_FLOPS` counts them: its sums and solves.

    The sums are the Gram of the regressor (``width`` wide: the hidden state, or the MLP's input for a fold) and
    its cross with the target; the solve decomposes that Gram (:func:`eigh_flops`); a rotating fit's ``rounds``
    (``Method.fit_rounds``) each take an SVD of the hidden width and solve against the regressor.
    """
    if not width:
        return 0.0
    sums = 2 * tokens * (width + shape.hidden) ** 2
    return sums + eigh_flops(width) * width ** 3 + rounds * (20 * shape.hidden ** 3 + 4 * width ** 2 * shape.hidden)


def _disk_pass(shape: ModelShape, inp: PlanInput) -> float:
    """Seconds to read every block once (offload sequential reads them per pass)."""
    if inp.offload != "sequential":
        return 0.0
    return shape.layers * weight_bytes(shape, inp, 1, embed=False, head=False) / DISK_BYTES_PER_S


def stage_fitting(shape: ModelShape, inp: PlanInput) -> Stage | None:
    """A replacement's fit: the scoring stage's memory plus the fit's sums, maps and recorded span states."""
    if inp.replace == "none" or not inp.drop:
        return None
    devices = _new_devices(inp)
    tokens = inp.batch_size * inp.seq_len
    passes = 2 if 0 < inp.fit_short < inp.seq_len else 1  # --fit-short cuts the same tokens again
    offloaded = inp.offload == "sequential"
    if offloaded:  # one block-by-block pass over both cuts: every state buffer holds them both
        _streamed(devices, shape, inp, passes * inp.calibration_tokens)
    else:
        _weights(devices, shape, inp, shape.layers, "weights")
    first = compute_devices(inp)[0]
    add(devices[first], "activations", forward_bytes(shape, inp, tokens) + 4 * tokens * shape.hidden * 4)
    add(devices[first], "maps", map_params(shape, inp) * inp.dtype_bytes)
    width = _fit_width(shape, inp.replace)
    # block by block, each span is solved and freed as soon as its output is complete (prune.replace.driver),
    # keeping its input's state buffer (and what a fold records of its host's MLP) until then
    if offloaded:
        kept = shape.hidden + (width + shape.hidden if width != shape.hidden else 0)
        add(devices[first], "span input buffer", passes * inp.calibration_tokens * kept * inp.act_bytes)
    _moments(devices, shape, inp, fit_bytes(shape, 1 if offloaded else inp.spans, width))
    # the solve, one span at a time: the uncentred Gram, the ridged copy and its factor, in float64
    # (prune.measure.least_squares); a fold's are the MLP width squared (1B shape: 1.6 GB)
    add(devices[first], "solve workspace (float64)", solve_bytes(width))
    flop = passes * inp.calibration_tokens * _flops(shape, shape.layers)
    # the time counts one span's sums and solve: the blocks a score ranks most removable mostly form one run (every
    # SmolLM2-135M drop of reports/ship-defaults, both shaped runs of reports/scale); each further span adds its own
    rounds = METHODS[inp.replace].fit_rounds if inp.replace in METHODS else 0
    solve = fit_flops(shape, width, passes * inp.calibration_tokens, rounds) / fit_rate(inp)
    note = f"{inp.spans} span(s) at most; closed-form sums" + ("" if inp.replace in closed_form_methods() else
                                                                f" (a trained {inp.replace} counted as one)")
    return Stage("fitting", devices, flop / _rate(inp) + solve + passes * _disk_pass(shape, inp), note)


def _fit_width(shape: ModelShape, method: str) -> int:
    """The width ``method``'s fit regresses on (its registration's ``fit_width``)."""
    spec = METHODS.get(method) if method in METHODS else None
    return spec.fit_width(shape.hidden, shape.intermediate) if spec is not None else shape.hidden


def _measuring(select: str) -> tuple[str, bool, bool]:
    """(how ``select`` steps, whether it repairs each set, whether it declared that) from its registration."""
    from prune.selection.strategies import SELECTIONS

    selection = SELECTIONS.get(select) if select in SELECTIONS else None
    if selection is None or not selection.measures:
        return "once", False, False
    return selection.measures, selection.repairs, True


def _crossfit(inp: PlanInput) -> bool:
    """Whether ``inp.select`` measures every row by repairs fitted on the other half (its registration says)."""
    from prune.selection.strategies import SELECTIONS

    return inp.select in SELECTIONS and SELECTIONS.get(inp.select).rows == "crossfit"


def _measuring_rows(inp: PlanInput, repaired: bool) -> int:
    """The calibration rows a set is measured on: all for a bare or cross-fitted selection, else one in eight."""
    return inp.samples if not repaired or _crossfit(inp) else max(1, inp.samples // MEASURE_EVERY)


def selection_sets(inp: PlanInput, free: int) -> tuple[int, int]:
    """(steps, candidate sets measured) of ``inp.select`` over ``free`` unprotected blocks."""
    kind, _, _ = _measuring(inp.select)
    count = min(inp.drop, free)
    if kind == "greedy":
        return count, sum(free - step for step in range(count))
    return (1, free) if kind == "once" else (1, 0)


def stage_selection(shape: ModelShape, inp: PlanInput, measuring: bool) -> Stage | None:
    """A selection that measures the model (``measuring``: it declares ``measures``): its passes and their logits.

    Time, at the planner's measured FLOP rate (the scoring pass's; assumed to hold for these passes too):

    - each candidate set is a forward over the measuring rows from the first block it changes on, half the
      blocks on average, and the LM head (``prune.selection.oracle.removal_perplexities``);
    - each step also runs the current set's model once over those rows (the states the candidates start
      from) and, for a repaired selection, the original model (the KL's reference) and one capture pass over
      the fitting rows that fits the spans its sets add (a span is fitted once and reused at every step);
    - the measuring rows are every calibration row for a bare selection (greedy-ppl, measured) and a cross-fitted
      one (each half fitted on the other: the capture passes read every row once), one row in ``MEASURE_EVERY``
      for another repaired one (the others fit);
    - under offload sequential each whole pass reads every block it runs, once per batch of those rows
      (``prune.loading.offload.streamed``; the scoring stage's disk rate), and one block is in memory.

    SmolLM2-135M, repaired-greedy with fold at drop 8 (28 free blocks, 196 sets): 788 s measured on an idle
    2-core machine, about 1,100 s by this count (the plan's other stages: about 96 s).
    """
    if not measuring or not inp.drop:
        return None
    kind, repaired, declared = _measuring(inp.select)
    free = max(shape.layers - inp.protected, 0)
    steps, sets = selection_sets(inp, free)
    tokens = inp.calibration_tokens
    if kind == "pass":  # one pass over the fitting rows and one over the measuring rows, streaming moments
        flop = tokens * (_flops(shape, shape.layers) + (2 * shape.layers + 1) * 2 * shape.hidden ** 2)
        note = f"one pass of {tokens:,} tokens"
    else:
        measure = _measuring_rows(inp, repaired) * inp.seq_len  # split_rows' or crossfit_halves' rows
        per_step = measure * _flops(shape, shape.layers, True) * (2 if repaired else 1)
        if repaired:  # the capture passes fitting the step's new spans (crossfit: each half's, every row)
            per_step += (tokens if _crossfit(inp) else tokens - measure) * _flops(shape, shape.layers)
        flop = steps * per_step + sets * measure * _flops(shape, shape.layers / 2, True)
        note = (f"{sets} candidate set(s) in {steps} step(s), each {'repaired, ' if repaired else ''}measured on "
                f"{measure:,} tokens" + ("" if declared else " (assumed one set per block)"))
    devices = _new_devices(inp)
    names = compute_devices(inp)
    reading = 0.0
    if inp.offload == "sequential":  # a whole pass reads each block as it is called, once per batch
        add(devices[names[0]], "one block + embedding", weight_bytes(shape, inp, 1, head=False))
        batches = -(-_measuring_rows(inp, repaired) // inp.batch_size)
        reads = 2 if kind == "pass" else (steps * (3 if repaired else 1) + sets) * batches
        reading = reads * _disk_pass(shape, inp)
    else:
        _weights(devices, shape, inp, shape.layers, "weights")
    add(devices[names[0]], "activations", forward_bytes(shape, inp, inp.batch_size * inp.seq_len))
    add(devices[names[-1]], "logits", perplexity_logit_bytes(shape, inp))
    if repaired and inp.replace != "none":  # every span fitted stays in the run's memo: one per block, and merged
        folds = 2 if _crossfit(inp) else 1  # a cross-fitted selection keeps one fit per half
        add(devices[names[0]], "fitted maps",
            folds * (free + inp.drop) * (shape.hidden ** 2 + shape.hidden) * inp.dtype_bytes)
    _moments(devices, shape, inp)
    return Stage("selection", devices, flop / _rate(inp) + reading, note)


def stage_shortlist(shape: ModelShape, inp: PlanInput, widths: Sequence[int], spans: float) -> list[Stage]:
    """``prune.ship``'s shortlist, phase by phase: what each holds on each device (its time is ``ship.costs``').

    ``widths``: the ``fit_width`` of each repair fitted (removal fits nothing); ``spans``: the distinct spans each
    of them fits over every block set. Every phase holds the weights, the scoring pass's moments and the measuring
    rows' that the same pass kept apart (``prune.pipeline.runner.score_calibration``'s ``measuring_apart``), and
    the decompositions the scores cached. Beside them, one after the other (the phases are not summed):

    - map errors: ``repaired-fast``'s fitting rows' moments, the whole pass's less the measuring rows'
      (``StateMoments.minus``), with the decompositions of their own maps (``prune.selection.map_errors``);
    - fits: one capture pass feeds every repair's fitters (``prune.selection.repaired.fit_together``), so the sums
      of every span of every repair live until the last is solved, beside the solved ones' maps, the widest
      solve's workspace and each span's recorded activations of a batch. A fit is counted at its registration's
      ``fit_width``: ``cosine`` (whose sums stay on the host) and ``magcomp`` (which sums two norms) as the hidden
      size's, an overcount of 0.4 GB a span each on a Llama-3-8B shape, since the registry does not say where or
      whether a fit keeps sums;
    - measuring: the fitted maps, the original's log-probabilities and states over the measuring rows, a
      candidate's logits.

    Block by block (``--offload sequential``) the pass frees each state's statistics, the measuring rows' with
    them, once its scores are taken: one block, the state buffers and three [d, d] matrices stay, no map errors'
    copy is made, and one span's recorded activations stay over the calibration (a fold's host MLP across its
    span). Every fit's sums are still counted at once: the spans of one set end at different blocks, but the
    sets' spans overlap.
    """
    names = compute_devices(inp)
    first, last = names[0], names[-1]
    offloaded = inp.offload == "sequential"
    rows = max(1, inp.samples // MEASURE_EVERY)  # prune.selection.repaired.measuring_rows
    tokens = inp.batch_size * inp.seq_len

    def kept(fits: float = 0.0) -> dict[str, Parts]:
        devices = _new_devices(inp)
        if offloaded:
            _streamed(devices, shape, inp, inp.calibration_tokens)
        else:
            _weights(devices, shape, inp, shape.layers, "weights")
        add(devices[first], "activations", forward_bytes(shape, inp, tokens))
        _moments(devices, shape, inp, fits)
        if not offloaded:
            for name in names:
                add(devices[name], "measuring rows' moments (float64)", moment_bytes(shape) / len(names))
                add(devices[name], "decompositions (float64)", decomposition_bytes(shape) / len(names))
        return devices

    stages = []
    maps = fitted_map_bytes(shape, spans, widths)
    if widths and not offloaded:
        devices = kept()
        for name in names:
            add(devices[name], "fitting rows' moments + decompositions (float64)",
                (moment_bytes(shape) + decomposition_bytes(shape)) / len(names))
        stages.append(Stage("shortlist: map errors", devices, 0.0, "repaired-fast's maps, from the scoring pass"))
    if widths:
        devices = kept(spans * sum(fit_bytes(shape, 1, width) for width in widths))
        add(devices[first], "solve workspace (float64)", solve_bytes(max(widths)))
        add(devices[first], "fitted maps", maps)
        span_tokens = inp.calibration_tokens if offloaded else spans * tokens  # each span's x, y, m and z
        add(devices[first], "recorded activations",
            span_tokens * (3 * shape.hidden + shape.intermediate) * inp.act_bytes)
        stages.append(Stage("shortlist: fits", devices, 0.0,
                            f"{len(widths)} repair(s) x {spans:g} span(s), their sums held at once"))
    devices = kept()
    add(devices[first], "fitted maps", maps)
    add(devices[first], "measuring states", measuring_state_bytes(shape, inp, rows))
    add(devices[last], "logits", measuring_logit_bytes(shape, inp, rows))
    stages.append(Stage("shortlist: measuring", devices, 0.0, f"{rows} measuring row(s)"))
    return stages


def stage_evaluation(shape: ModelShape, inp: PlanInput) -> Stage | None:
    """Held-out perplexity of the original and of the pruned model (the moments still alive), their logits.

    A block-by-block run (offload sequential) never holds the whole model and leaves this to ``eval.run``.
    """
    if not inp.heldout_samples or inp.offload == "sequential":
        return None
    devices = _new_devices(inp)
    names = compute_devices(inp)
    tokens = inp.batch_size * inp.seq_len
    _weights(devices, shape, inp, shape.layers - inp.drop, "weights (pruned)")
    add(devices[names[0]], "maps", map_params(shape, inp) * inp.dtype_bytes)
    add(devices[names[0]], "activations", forward_bytes(shape, inp, tokens))
    add(devices[names[-1]], "logits", perplexity_logit_bytes(shape, inp))
    _moments(devices, shape, inp)
    flop = inp.heldout_samples * inp.seq_len * (_flops(shape, shape.layers, True) +
                                                 _flops(shape, shape.layers - inp.drop, True))
    return Stage("evaluation", devices, flop / _rate(inp), f"{inp.heldout_samples} x {inp.seq_len} tokens, twice")


def _trainable_params(shape: ModelShape, inp: PlanInput) -> float:
    """Scalars that get a gradient and two AdamW states (``--train``)."""
    kept = shape.layers - inp.drop
    extra = {"all": kept * shape.block_params, "lora": lora_params(shape, kept, inp.distill.lora_r,
                                                                         inp.distill.lora_targets)}
    return map_params(shape, inp) + extra.get(inp.distill.train, 0)


def _student_and_teacher(devices: dict[str, Parts], shape: ModelShape, inp: PlanInput) -> None:
    """Student weights and training state, the teacher unless cached: sharded (FSDP) or spread (device map)."""
    names = compute_devices(inp)
    fsdp = inp.hardware.fsdp and len(names) > 1
    kept = shape.layers - inp.drop
    student = sum(placed(shape, inp, kept, 1))
    state = 3 * _trainable_params(shape, inp) * inp.dtype_bytes  # gradient + two AdamW states
    maps = map_params(shape, inp) * inp.dtype_bytes
    for i, name in enumerate(names):
        share = 1 / len(names)
        if fsdp:
            add(devices[name], "student (FSDP shard)", (student + maps) * share)
        else:
            add(devices[name], "student", placed(shape, inp, kept, len(names))[i])
            add(devices[name], "maps", maps if i == 0 else 0)
        add(devices[name], "grads + AdamW", state * share if fsdp or inp.distill.train == "all" else
            (state if i == 0 else 0))
        if not inp.distill.teacher_cache:
            teacher = placed(shape, inp, shape.layers, 1)[0] if fsdp else placed(shape, inp, shape.layers,
                                                                                 len(names))[i]
            add(devices[name], "teacher" + (" (replica)" if fsdp else ""), teacher)


def _training_buffers(devices: dict[str, Parts], shape: ModelShape, inp: PlanInput) -> None:
    """Activations kept for backward and the KL's logits: per GPU under FSDP, spread over a device map."""
    names = compute_devices(inp)
    fsdp = inp.hardware.fsdp and len(names) > 1
    spec = inp.distill
    tokens = spec.batch_size * spec.seq_len
    acts = train_activation_bytes(shape, shape.layers - inp.drop, tokens, inp.act_bytes, spec.train)
    # distill.forward.head_for_losses: the KL through the head unless sharded or the logits change after the head
    through_head = not fsdp and not shape.logits_after_head
    logits = kl_logit_bytes(shape, tokens, inp.act_bytes, bool(spec.teacher_cache), through_head) if spec.kl else 0.0
    for i, name in enumerate(names):
        add(devices[name], "activations (backward)", acts if fsdp else acts / len(names))
        add(devices[name], "logits (KL, float32)", logits if fsdp or i == len(names) - 1 else 0)


def stage_distillation(shape: ModelShape, inp: PlanInput, moments_alive: bool = True) -> Stage | None:
    """Distillation: student, teacher, training state, activations, logits (and, in prune.run, the moments)."""
    spec = inp.distill
    if not spec.steps or not inp.drop:
        return None
    devices = _new_devices(inp)
    _student_and_teacher(devices, shape, inp)
    _training_buffers(devices, shape, inp)
    if moments_alive:  # prune.run holds the scoring moments until it exports
        _moments(devices, shape, inp)
    tokens = spec.steps * spec.grad_accum * spec.batch_size * spec.seq_len
    backward = 3 if spec.train == "all" else 2  # frozen weights: gradients of the inputs only
    train_share, teacher_share = (1.0, 1.0) if inp.on_gpu else (TRAIN_SHARE, TEACHER_SHARE)
    student = backward * (_flops(shape, shape.layers - inp.drop, True) + 2 * map_params(shape, inp)) / (
        _rate(inp) * train_share)
    teacher = 0.0 if spec.teacher_cache else _flops(shape, shape.layers, True) / (_rate(inp) * teacher_share)
    where = "per GPU, FSDP" if inp.hardware.fsdp and inp.hardware.gpus > 1 else "device map"
    note = f"{spec.steps} steps x {spec.grad_accum * spec.batch_size} x {spec.seq_len} tokens ({where})"
    seconds = tokens * (student + teacher)
    if inp.on_gpu:  # a small model's step costs its launches, whatever its arithmetic
        seconds = max(seconds, spec.steps * spec.grad_accum * GPU_STEP_SECONDS)
    return Stage("distillation", devices, seconds, note)


def stage_teacher_cache(shape: ModelShape, inp: PlanInput) -> Stage | None:
    """Filling a teacher-logit cache before training: the teacher alone, one batch's forward and logits."""
    spec = inp.distill
    if not (spec.steps and inp.drop and spec.teacher_cache):
        return None
    devices = _new_devices(inp)
    _weights(devices, shape, inp, shape.layers, "teacher")
    tokens = spec.batch_size * spec.seq_len
    names = compute_devices(inp)
    add(devices[names[0]], "activations", forward_bytes(shape, inp, tokens))
    add(devices[names[-1]], "logits", tokens * shape.vocab * (4 + inp.act_bytes))
    read = spec.steps * spec.grad_accum * spec.batch_size
    total = (spec.cache_sequences or read) * spec.seq_len
    share = 1.0 if inp.on_gpu else TEACHER_SHARE
    return Stage("teacher cache", devices, total * _flops(shape, shape.layers, True) / (_rate(inp) * share),
                 f"top-{spec.teacher_cache} logits of {total:,} tokens")


def stage_local_heal(shape: ModelShape, inp: PlanInput, steps: int, depths: Sequence[tuple[int, ...]] | None = None,
                     blocks: int = 2, more_rows: int = 0) -> Stage | None:
    """The heal block by block (``distill.local_heal``, ``prune.ship --offload sequential``).

    Each cut records, over the fitting rows (and ``more_rows`` of ``--heal-data``), a pass of the slim model up to its
    pair of blocks and one of the original through the pair's depth, a batch at a time (so a skeleton reads each
    block once a batch), then takes ``steps`` Adam steps of the ``blocks`` blocks, every weight trained in float32;
    the KL after is a pass of both models over the measuring rows. ``depths``: each cut's blocks those passes run,
    (slim, original), and the blocks it trains where the cut says (a cut at the last block trains it alone), once
    the cuts are known; before that, one cut of ``blocks`` three quarters of the way down (SmolLM2-135M's fell at 42
    and 53 %; the most linear blocks of larger models lie deeper).
    Memory: a streamed block with the embedding, the original's embedding and head beside it, the recorded input
    and target states (in the model's dtype, on the CPU), then either the pair in float32 with its gradients and
    Adam's two states and one batch's activations for backward, or, in the KL after, the original's streamed block
    and a batch's logits of both models (the larger: on Gemma-3-270M's 262k vocabulary, the KL's).
    """
    if depths is None:
        depths = [(round(0.75 * (shape.layers - inp.drop)), round(0.75 * shape.layers))]
    if not steps or not inp.drop or not depths:
        return None
    trains = [depth[2] if len(depth) > 2 else blocks for depth in depths]
    blocks = max(trains)  # the memory of the largest pair
    devices = _new_devices(inp)
    first = compute_devices(inp)[0]
    measuring = max(1, inp.samples // MEASURE_EVERY)
    rows = inp.samples - measuring + more_rows
    tokens, batch = rows * inp.seq_len, inp.batch_size * inp.seq_len
    _streamed(devices, shape, inp, 0)
    add(devices[first], "the original's embedding and head", weight_bytes(shape, inp, 0))
    states = 2 * tokens * shape.hidden * inp.act_bytes
    add(devices["cpu"], "recorded states", states)
    trained = {"pair + gradients + Adam (float32)": 4 * blocks * shape.block_params * 4,
               "activations (backward)": train_activation_bytes(shape, blocks, batch, 4, "all")}
    for name, value in trained.items():
        add(devices[first], name, value)
    # the KL after holds the original's streamed block and a batch's logits of both once the training's parts (and,
    # on the CPU, the recorded states) went
    kl_after = weight_bytes(shape, inp, 1, embed=False, head=False) + divergence_logit_bytes(shape, inp, measuring)
    held = sum(trained.values()) + (states if first == "cpu" else 0.0)
    add(devices[first], "the KL after, beyond the training's parts", kl_after - held)
    run = sum(depth[0] + depth[1] for depth in depths)
    batches = -(-rows // inp.batch_size)
    passes = tokens * _flops(shape, run) / _rate(inp) + batches * run / shape.layers * _disk_pass(shape, inp)
    kl = (measuring * inp.seq_len * (_flops(shape, shape.layers - inp.drop, True) + _flops(shape, shape.layers, True))
          / _rate(inp) + 2 * _disk_pass(shape, inp) * -(-measuring // inp.batch_size))
    def training(count: int) -> float:
        # float32 on a GPU: its rate without the bfloat16 tensor cores (FP32_SHARE); a pair's step costs its launches
        seconds = steps * batch * 3 * _flops(shape, count) / (_rate(inp) * (FP32_SHARE if inp.on_gpu else TRAIN_SHARE))
        return max(seconds, steps * 3 * count * GPU_BLOCK_CALL_SECONDS) if inp.on_gpu else seconds

    return Stage("local heal", devices, passes + sum(training(count) for count in trains) + kl,
                 f"{len(depths)} cut(s) x ({steps} steps of {'/'.join(map(str, sorted(set(trains))))} block(s) + two "
                 "recording passes) + the KL after")
