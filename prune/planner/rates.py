"""The planner's throughputs: how fast a pass's arithmetic and a fit's float64 work run, on the CPU and on GPUs.

Every stage's time (:mod:`prune.planner.stages`, ``ship.costs``) divides its count of operations by a rate from
here: the CPU's, measured on one machine and scaled by this CPU's speed now (:mod:`prune.planner.machine`), or an
assumed share of a GPU's peak.
"""

from __future__ import annotations

import math

from prune.planner.inputs import PlanInput
from prune.planner.machine import machine_speed
from prune.planner.shape import ModelShape

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


def forward_flops(shape: ModelShape, blocks: int, head: bool = False) -> float:
    """FLOP of a forward per token through ``blocks`` blocks (and the head)."""
    return 2 * (blocks * shape.block_active_params + (shape.vocab * shape.hidden if head else 0))


def moment_flops(shape: ModelShape) -> float:
    """FLOP a token of the scoring statistics' float32 products: every state's Gram and each block's cross Gram."""
    return (2 * shape.layers + 1) * 2 * shape.hidden ** 2


def flop_rate(inp: PlanInput, quantized: bool | None = None, parallel: int = 1) -> float:
    """FLOP/s: the CPU's measured (at this CPU's speed now), or ``parallel`` GPUs' assumed (half for bitsandbytes)."""
    quantized = inp.quant_bits < 16 if quantized is None else quantized
    if not inp.on_gpu:
        return CPU_FLOPS * machine_speed() * inp.shape_speed
    return GPU_FLOPS * parallel * (QUANTIZED_SPEED if quantized else 1.0)


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


def block_solve_flops(shape: ModelShape, shares: int = 1) -> float:
    """FLOP of one block's least-squares map from statistics at the hidden width, as :data:`FIT_FLOPS` counts them.

    Its Gram decomposed (:func:`eigh_flops`), the solve's two products through the eigenvectors (``4 h^3``) and
    each share of the update's error checked against the held rows' Grams (``2 h^3`` a share;
    ``prune.measure.least_squares.fit_linear_map``, ``residual_sums``). ``repaired-fast`` solves one a block
    (``Selection.block_solves``): on the Llama-3.2-1B shape block by block its 16 maps took 33 s of a profiled
    124 s scoring pass (2 shares: 2.1 s a block, where this counts 14 h^3, 1.5 s at the run's probe), unplanned
    until then (2026-12-05, reports/planner-probe).
    """
    hidden = shape.hidden
    return (eigh_flops(hidden) + 4 + 2 * shares) * hidden ** 3
