"""How fast this CPU runs now, against the machine the planner's rates were measured on.

The planner's CPU rates (``prune.planner.rates.CPU_FLOPS``, ``ship.costs``' shares and byte rates) were measured
on one 2-core machine. The same machine ran the same ship twice as fast on the evening of the day it was costed
(its scoring pass 7.8 s a batch, then 4.0 s: another tenant of the host), and another machine is another speed.
So before a plan, :func:`machine_speed` times the forward of a block of the reference widths on the threads the
run will use and divides the reference time by it; the CPU rates are multiplied by that factor. It is measured once
per process (1.5-2 seconds, 3-4 on a busy host), and ``$LAYERCUT_MACHINE_SPEED`` fixes it (tests set 1: their plans
must not depend on the machine's load).

    from prune.planner.machine import machine_speed
    machine_speed()   # 1.6: this CPU runs the planner's work 1.6x as fast as the reference machine did

A whole block, not one matrix product: a Sapphire Rapids host ran a float32 product 2.0-2.2x as fast as the
reference machine, and the stages 1.5-1.7x (their norms, attention, activations and copies gained less), so a
product's probe planned every stage about 1.3x too short there (2026-12-05).

A model of another width runs at another FLOP rate on the same CPU: a Llama-3.2-1B-shaped block at about 1.5x
SmolLM2-135M's, whose scoring gave the rates. :func:`shape_speed` times a block of the model's widths against one
of the reference widths, in turns, on the threads and batch the run will use; the CPU rates are multiplied by it too.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import statistics
import time
from collections.abc import Callable

import torch

from prune.errors import LayercutError

logger = logging.getLogger(__name__)

SPEED_ENV = "LAYERCUT_MACHINE_SPEED"
# the block the reference rates were measured on: SmolLM2-135M's widths (hidden, MLP, heads)
REFERENCE_BLOCK = (576, 1536, 9)
PROBE_BATCH = (4, 512)  # sequences x tokens a forward: the scoring batch CPU_FLOPS was measured on
PROBE_WARMUP_SECONDS = 0.5  # forwards before the timed rounds: the first ones run slow (threads, clocks, pages)
PROBE_ROUNDS = 12  # forwards timed after the warm-up; their lower quartile is the probe's time
# The probe's time on the reference machine (2 threads of this project's 2-core machine, idle, 2026-12-02). That
# machine is gone; its time is carried over from a host that ran both (2026-12-05, idle, 2 threads): the probe read
# 0.075-0.087 s there in three readings around two `prune.run --drop 4 --samples 32` scoring passes of SmolLM2-135M
# at 785-826 tokens/s against the reference's 482 (1.63-1.71x), and its prune.ship of SmolLM2-135M healed its drop 4
# and built it 1.50x and 1.66x as fast as a host whose product probe read 1.05x the reference (1.58x and 1.74x the
# reference's speed): 0.085 s x 1.6.
REFERENCE_SECONDS = 0.135


def probe_seconds(rounds: int = PROBE_ROUNDS) -> float:
    """Seconds of a float32 forward of a :data:`REFERENCE_BLOCK` on torch's threads: the rounds' lower quartile.

    Not the median of a few rounds straight after the first forward: that read a shared 2-core host at 0.73-1.01x
    within one minute (2026-12-04), and a plan made just after a run gave every stage 1.33x the seconds the same
    run then took. Another tenant slows some rounds, never speeds one up, so the quicker rounds after a warm-up
    are the machine's own speed; on an idle machine the rounds agree and this is their median.
    """
    forward, _ = _block_forward(*REFERENCE_BLOCK, *PROBE_BATCH)
    began = time.perf_counter()
    while time.perf_counter() - began < PROBE_WARMUP_SECONDS:
        forward()
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        forward()
        times.append(time.perf_counter() - began)
    return quick_rounds(times)


def quick_rounds(times: list[float]) -> float:
    """The lower quartile of the rounds' ``times`` (the quickest of fewer than four): what an idle CPU gives.

    It holds while a quarter of the rounds or more ran unslowed.
    """
    return statistics.quantiles(times, n=4)[0] if len(times) >= 4 else min(times)


@functools.cache
def machine_speed() -> float:
    """The speed of this CPU as a multiple of the reference machine's: ``$LAYERCUT_MACHINE_SPEED``, else measured.

    Raises:
        LayercutError: ``$LAYERCUT_MACHINE_SPEED`` is not a positive number.
    """
    fixed = os.environ.get(SPEED_ENV)
    if fixed:
        try:
            speed = float(fixed)
        except ValueError:
            speed = math.nan
        if not (math.isfinite(speed) and speed > 0):
            raise LayercutError(f"${SPEED_ENV}={fixed!r}: give a positive number (1: the reference machine), "
                                "or unset it to measure this CPU")
        return speed
    speed = REFERENCE_SECONDS / probe_seconds()
    logger.info("this CPU runs the planner's work at %.2fx the reference machine (%d threads)", speed,
                torch.get_num_threads())
    return speed


# turns of (reference block, the model's block), after two of each as a warm-up (a fresh block's first calls run
# slow: its pages, the threads); each side's lower quartile gives its rate. Three turns and the median of their
# ratios read a Llama-3-8B-shaped block at 1.37-2.41x in fresh processes on one idle host (2026-12-05): one slowed
# reference round moved the whole plan 1.7x. Eight and the quartiles read 1.38-1.50x there (the 1B shape's
# 1.22-1.39x), about 10 s a plan for the 8B shape's block with its weights drawn. Past SHAPE_SECONDS of timed turns
# a wider block stops at SHAPE_MIN_ROUNDS (a 70B block's forward takes seconds).
SHAPE_ROUNDS = 8
SHAPE_MIN_ROUNDS = 4
SHAPE_SECONDS = 8.0


def _block_forward(hidden: int, intermediate: int, heads: int, sequences: int,
                   seq_len: int) -> tuple[Callable[[], None], int]:
    """A Llama block of these widths with random float32 weights, as a call running it on a batch; FLOP a call."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    heads = heads if heads and hidden % heads == 0 else 1
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                         num_key_value_heads=heads, num_hidden_layers=1, vocab_size=2, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "sdpa"
    generator = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        block = LlamaDecoderLayer(config, 0)
    block = block.to_empty(device="cpu").eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.02, generator=generator)
    states = torch.randn(sequences, seq_len, hidden, generator=generator)
    positions = torch.arange(seq_len)[None].expand(sequences, -1)
    rotary = LlamaRotaryEmbedding(config)(states, positions)

    def run() -> None:
        with torch.no_grad():
            block(states, position_embeddings=rotary, attention_mask=None, position_ids=positions)

    flop = 2 * sum(p.numel() for p in block.parameters()) * sequences * seq_len
    return run, flop


@functools.cache
def shape_speed(hidden: int, intermediate: int, heads: int, sequences: int = 4, seq_len: int = 512) -> float:
    """The FLOP rate of a block of these widths over the reference widths' (:data:`REFERENCE_BLOCK`) on this CPU now.

    Both blocks run on ``sequences`` x ``seq_len`` tokens (the run's batch; one sequence block by block), in turns,
    after a warm-up: the machine's own speed cancels out of their ratio. Each side's rate is taken at the lower
    quartile of its rounds (:func:`quick_rounds`), as the machine's probe is: a slowed round never speeds one up.
    1 for the reference widths, and where ``$LAYERCUT_MACHINE_SPEED`` fixes the machine (tests: a plan must not
    depend on the machine's load). A block of 8B's widths costs about 0.85 s a turn here and its 0.9 GB of float32
    weights while it runs; past :data:`SHAPE_SECONDS` of turns, at least :data:`SHAPE_MIN_ROUNDS` are taken.
    """
    if os.environ.get(SPEED_ENV) or (hidden, intermediate) == REFERENCE_BLOCK[:2]:
        return 1.0
    reference, reference_flop = _block_forward(*REFERENCE_BLOCK, PROBE_BATCH[0], seq_len)  # CPU_FLOPS's own batch
    model, model_flop = _block_forward(hidden, intermediate, heads, sequences, seq_len)
    for _ in range(2):
        reference()
        model()
    reference_times, model_times = [], []
    started = time.perf_counter()
    while len(model_times) < SHAPE_ROUNDS and (len(model_times) < SHAPE_MIN_ROUNDS
                                               or time.perf_counter() - started < SHAPE_SECONDS):
        began = time.perf_counter()
        reference()
        middle = time.perf_counter()
        model()
        model_times.append(time.perf_counter() - middle)
        reference_times.append(middle - began)
    factor = (model_flop / quick_rounds(model_times)) / (reference_flop / quick_rounds(reference_times))
    logger.info("a block of width %d (MLP %d) runs at %.2fx the FLOP rate of the reference widths here", hidden,
                intermediate, factor)
    return factor
