"""The planner's seconds for each of ``prune.ship``'s stages, from the model's config alone.

``prune.planner`` times ``prune.run``'s stages by their arithmetic at a measured rate. A ship runs other work,
counted here in the same units before any weight is read:

- shortlist: the calibration's own text from the model, where the data samples it and no earlier run kept it
  (``--data`` with ``self``; SmolLM2-135M's default sample ships with layercut), a decode step per token of a
  batch of rows, each reading every weight; the scoring pass (every state's statistics, and beside them the
  measuring rows' alone, which ``repaired-fast`` reads, and the maps it solves from them: ``block_solves``), one
  capture pass over the fitting rows that feeds every repair's fits, the fits' own sums and solves (``fit_width``
  of each repair's registration), and the measuring passes (the original's, which every repair shares, one per
  candidate from its first changed block, and each repair's and removal's one check of that shortcut through
  the kept blocks), each with
  its vocabulary-wide work; block by block each whole pass reads the blocks it runs from disk;
- build: the held-out perplexities of the original, of the blocks removed alone and of the checkpoint, the
  checkpoint written (the chosen repair is the shortlist's fit, put in place as it is);
- heal: ``prune.planner``'s distillation stage for ``--heal-steps`` (:func:`ship.plan.planned_heal`);
- export: llama.cpp's converter reading and writing the float32 checkpoint, and its quantizer;
- verify: the held-out tokens through the original (unless its rows are kept) and the checkpoint in
  transformers, the shipped file in its engine, the generation fidelity check (both models decoding held-out
  prompts, in memory only; the original's side unless an earlier run kept it), the lm-eval tasks of ``--tasks``
  (:func:`tasks_seconds`) and the speed check's rounds (not for a skeleton in transformers, which reads each
  block from disk); each check in a fresh process.

The shortlist's memory is counted here too (:func:`shortlist_stages`): ``prune.run``'s plan, which ship asks
about the build (``--replace none``), holds one set of moments and no fit, where the shortlist holds two sets, the
scores' decompositions and every repair's fits at once (a Llama-3-8B shape on an H200,
2026-12-04: 61.3 GB measured, 26.3 GB planned for the whole run).

Rates are ``prune.planner.rates``' FLOP rate times what a kind of pass reached of it on this 2-core machine
(SmolLM2-135M, ``--drop 8 --samples 32``, idle, 2026-12-02; ``reports/ship-fast/``), and byte rates for what reads
and writes files, all at the reference machine's speed and multiplied by this CPU's now
(:func:`prune.planner.machine.machine_speed`), but for the checkpoint's write (``WRITE_BYTES_PER_S``). On a GPU
the same counts run at the GPU rate, and what is not arithmetic is counted apart (``GPU_*``, measured on an
H200): processes, candidates and block calls.

They were fitted on the run ``after8`` of reports/ship-fast, whose scoring pass took 7.8 s a batch, and are given
here at the reference speed, where the same pass took 4.03 s (its run ``r8``, 2026-12-02): every rate x 1.94,
and the shares x 1.94 x 1.8e11 / 1.22e11 (``CPU_FLOPS`` was 1.8e11 when they were fitted). A share over 1: that pass
outruns the scoring pass, which also multiplies every state's float32 moments.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from eval.bench.checks import GREEDY_TOKENS
from prune.planner.inputs import PlanInput
from prune.planner.machine import machine_speed
from prune.planner.memory import weight_bytes
from prune.planner.rates import (
    DISK_BYTES_PER_S,
    GPU_BLOCK_CALL_SECONDS,
    block_solve_flops,
    fit_flops,
    fit_rate,
    flop_rate,
    forward_flops,
    moment_flops,
    score_decompositions,
)
from prune.planner.shape import ModelShape
from prune.planner.stages import Stage, disk_pass, stage_shortlist
from prune.selection.repaired import MEASURE_EVERY
from prune.selection.strategies import pass_selections

# what a kind of pass reaches of the planner's FLOP rate here (measured: see the module's docstring)
SCORING_SHARE = 1.145  # the scoring pass, every state's Gram and every pair's cosines (32 s for 16,384 tokens)
CAPTURE_SHARE = 1.574  # a capture pass recording a span's activations for its fits
LOGITS_SHARE = 1.288  # a pass that reads the logits (the shortlist's measuring)
# prune.run's held-out perplexity (the build's passes: the original's, then removal's and the checkpoint's over the
# kept blocks): 1.15-1.54x the seconds LOGITS_SHARE gave them at full depth on four SmolLM2-135M drop-4 builds
# (2026-12-03/04, reports/ship-defaults; 25.9 s of a profiled 28.0 s build against 21.0 s), a quarter slower, and
# at drop 4 the kept blocks' passes are 0.93x the full depth's arithmetic
PERPLEXITY_SHARE = LOGITS_SHARE / 1.34
ENGINE_SHARE = 1.002  # llama.cpp scoring every position of a window (logits_all)
# the verify stage's transformers check: every 512-token window's perplexity, then 32 greedy tokens, each held-out
# text tokenized whole first (fitted on the run r8 of reports/ship-fast: 83 s for both models against 50 s at
# LOGITS_SHARE)
SERVING_SHARE = 0.776
# The vocabulary-wide work of a measuring pass on the CPU, per logit (a token x the vocabulary): its logits' fresh
# tensor, the log-softmax and the KL. Beside the arithmetic it was most of what the planner missed of Gemma-3-270M's
# shortlist (262k vocabulary; 2026-12-05, 4 sets measured in 135 s against 52 s planned, its original pass and
# candidates 1.5x their time in a small process: a fresh tensor's pages cost more while a process holds a few GB on
# this machine). Fitted on that run and SmolLM2-135M's (49k; 16 candidates, 124 s) at the reference speed, the
# original's pass counted once and each candidate over its view's blocks from its set's first one: their
# shortlists 1.18x and 0.86x their plans (reports/shortlist-logits).
LOGIT_SECONDS = 1.4e-8
SAMPLE_BYTES_PER_S = 3.3e9  # a sampling step reads every weight: 48 tokens/s for 8 rows of SmolLM2-135M
CONVERT_BYTES_PER_S = 4.27e7  # llama.cpp's converter: float32 checkpoint bytes a second
QUANTIZE_SHARE = 0.4  # its quantizer after it (q4_k_m), as a share of the conversion's time
# safetensors written through a staging folder: a copy through memory and the page cache, not the arithmetic the
# probe times, so not scaled by it: the Llama-3.2-1B shape's build wrote its 3.97 GB at 456 MB/s on a host whose
# probe read 2.02x (planned at 2.02 x 388 MB/s: its build 1.71x the plan; 2026-12-05, reports/planner-probe)
WRITE_BYTES_PER_S = 3.88e8
PROCESS_SECONDS = 4.12  # a fresh Python importing torch and transformers, and loading a model
# On a GPU (one H200, 2026-12-04, bfloat16: reports/gpu-ship/h200-2026-12-04) the stages of a model this small cost
# what is not arithmetic. A verify check's fixed cost: its process (3.4-4.1 s to start there: the evening's run,
# h200-2026-12-04b), CUDA's context, both models read and warmed up, and the speed check's fresh process per model
# for its memory figure. SmolLM2-135M's verify took 96.3 s and the Llama-3.2-1B shape's 92.5 s, about 12 and 10 s
# of it in their block calls, for three checks each; a model's bytes are read on top of it at the disk's rate.
GPU_PROCESS_SECONDS = 27.0
# The shortlist's own: the calibration drawn and tokenized, the model read to the GPU and warmed (5.3 s for one
# candidate on Gemma-3-270M's shape), then about 0.4 s a candidate (SmolLM2-135M's 20 in 12.8 s)
GPU_SHORTLIST_SECONDS = 4.9
GPU_CANDIDATE_SECONDS = 0.4


# the verify stage's lm-eval tasks (--tasks): a request, a prompt and one answer, is scored in one forward pass of
# about this many tokens. Assumed, not measured: a task's spec gives no length, and the offline tasks' prompts run
# from a line (PIQA, ARC) to a paragraph (HellaSwag, IFEval's instructions)
TASK_REQUEST_TOKENS = 64
# the rows of each offline task (tests/eval/quality/test_lmeval.py counts them on shared/data): a tasks check without
# --limit scores them all; another task's rows are not known before lm-eval builds it
TASK_ROWS = {"arc_easy": 2376, "arc_challenge": 1172, "hellaswag": 10042, "piqa": 1838, "lambada_openai": 5153,
             "winogrande": 1267, "boolq": 3270, "ifeval": 541}


@dataclass(frozen=True)
class TaskWork:
    """One lm-eval task of the verify stage's tasks check, as counts (:func:`task_work`).

    Attributes:
        name: lm-eval's task name.
        rows: rows scored on each model (None: not known, so not counted).
        requests: forward passes a row asks for: one per choice of a task scored by log-likelihood (1 / its chance
            level), one for an open answer (LAMBADA's word, IFEval's prompt).
        max_gen_toks: a generating task's token budget (IFEval's 256): the decode steps of each batch of rows.
        batch: requests (or rows, decoding) per forward pass.
    """

    name: str
    rows: int | None
    requests: int = 1
    max_gen_toks: int | None = None
    batch: int = 8


def task_work(tasks: Sequence[str], limit, batch: int, data_dir: Path | None = None) -> tuple[TaskWork, ...]:
    """The tasks check's work: each task's rows as ``limit`` picks them (:func:`eval.quality.rows.task_rows`).

    A task of known size (:data:`TASK_ROWS`) is counted as ``limit`` reads it; another only where ``limit`` is a
    count of rows or a draw of N. With a data folder (``data_dir``, resolved) an offline alias is the task it runs
    (``lambada``: ``lambada_openai``'s 5,153 rows), as :func:`eval.quality.lmeval.plan_tasks` runs it.

    Raises:
        LayercutError: ``limit`` is a range outside a task of known size (the check would refuse it after the heal).
    """
    from eval.quality.lmeval import OFFLINE_ALIASES, row_draw, task_rows, task_table

    names = (OFFLINE_ALIASES.get(name, name) if data_dir is not None else name for name in tasks)
    table, work = task_table(), []
    for name in dict.fromkeys(names):
        spec = table[name] if name in table else None
        total = TASK_ROWS.get(name)
        rows = (len(task_rows(limit, total, name)) if total is not None
                else limit if isinstance(limit, int) else row_draw(limit))
        requests = round(1 / spec.chance) if spec is not None and spec.chance > 0 else 1
        work.append(TaskWork(name, rows, requests, spec.max_gen_toks if spec is not None else None, batch))
    return tuple(work)


@dataclass(frozen=True)
class ShipWork:
    """What a ship run does, as counts: its model's budget and what its shortlist will try.

    Attributes:
        drop: blocks removed.
        repairs: the training-free repairs the shortlist fits (removal not counted), by ``fit_width``.
        map_shares: the distinct shares of their update among every repair the model takes, before any size cap
            or budget leaves one out: the one-pass selections (``Selection.block_solves``) solve each block's map
            from the scoring pass's statistics and check it at each share, whatever the shortlist then fits
            (0: no repair, no maps).
        rounds: each of those repairs' ``fit_rounds`` (none given: every fit solved once).
        sets: block sets the one-pass selections are expected to choose (each crossed with every repair).
        spans: distinct spans per set, on average (a top-k choice of scattered blocks has several); both are
            guesses before the scoring pass, counted after it (:func:`ship.plan.replan_shortlist`).
        depth: the share of the model's blocks a candidate's measuring pass runs, on average: its view's blocks
            from its set's first one on (half, guessed, before the sets are known).
        self_batches: batches of the model's own text sampled for calibration (0: none, or shipped), each a
            token per step for ``seq_len`` steps (``prune.data.self_text.self_batches``).
        heal_self_batches: batches of it sampled for ``--heal-data`` (``self``, ``self:chat``) before the heal
            trains.
        heldout_tokens: held-out tokens the verify stage scores per text, and ``texts`` of them.
        gguf: the engine reads a GGUF (llama.cpp): the export runs, and the engine scores it.
        quantized: the GGUF goes through llama.cpp's quantizer after the conversion (``q4_k_m``).
        original_kept: the original's serving rows and its engine file are kept from an earlier run.
        fidelity_kept: the original's side of the generation fidelity check is kept from an earlier run.
        tasks: the lm-eval tasks the verify stage scores (``--tasks``; none: no tasks check).
        tasks_kept: the original's scores of those tasks are kept from an earlier run.
        verify: the engine checks run (``--no-verify``: not).
        speed: the speed check runs (not for a skeleton in transformers, which reads each block from disk).
    """

    drop: int
    repairs: tuple[int, ...]
    rounds: tuple[int, ...] = ()
    map_shares: int = 0
    sets: int = 3
    spans: float = 2
    depth: float = 0.5
    self_batches: int = 0
    heal_self_batches: int = 0
    heldout_tokens: int = 4096
    texts: int = 1
    gguf: bool = True
    quantized: bool = False
    original_kept: bool = False
    fidelity_kept: bool = False
    tasks: tuple[TaskWork, ...] = ()
    tasks_kept: bool = False
    speed_rounds: int = 3
    prompt_len: int = 256
    new_tokens: int = 64
    heal_seconds: float = 0.0
    verify: bool = True
    speed: bool = True


def stage_seconds(shape: ModelShape, inp: PlanInput, work: ShipWork) -> dict[str, float]:
    """Seconds of each stage (``shortlist``, its calibration included, ``build``, ``heal``, ``export``, ``verify``)."""
    rate = flop_rate(inp)
    layers, kept = shape.layers, shape.layers - work.drop
    tokens = inp.samples * inp.seq_len
    rows = max(1, inp.samples // MEASURE_EVERY)  # the measuring rows (prune.selection.repaired.measuring_rows)
    measure = rows * inp.seq_len
    moments = moment_flops(shape)

    def passes(count: float, blocks: float, share: float, head: bool = False, extra: float = 0.0) -> float:
        return count * (forward_flops(shape, blocks, head) + extra) / (rate * share)

    fits_rate = fit_rate(inp)  # the fits run where the model does
    cpu = machine_speed()  # the converter, the sampling's reads and the processes run at this CPU's speed

    def sampled(batches: int) -> float:  # a token of every row of a batch each step, every weight read per step
        return batches * inp.seq_len * weight_bytes(shape, inp, layers) / (SAMPLE_BYTES_PER_S * cpu)

    sampling = sampled(work.self_batches)
    fitted = list(zip(work.repairs, work.rounds or (0,) * len(work.repairs), strict=True))  # (width, rounds)
    fits = sum(fit_flops(shape, width, tokens - measure, rounds) for width, rounds in fitted) * work.sets * work.spans
    candidates = work.sets * (len(work.repairs) + 1)
    # the one-pass selections' own solves from those statistics (repaired-fast: a map a block, checked at each
    # share), done before the budget chooses the repairs: the same with any of them left out
    solves = sum(selection.block_solves for selection in pass_selections()) if work.map_shares else 0
    # each repair's measure (removal's too) checks once that a pass started at a candidate's first changed block
    # gives the candidate's whole pass over its kept blocks: one measuring row in float32, a batch of them in 16
    # bits (prune.selection.repaired)
    checked = (1 if inp.act_bytes >= 4 else min(inp.batch_size, rows)) * inp.seq_len
    shortlist = (passes(tokens, layers, SCORING_SHARE, extra=moments)
                 + score_decompositions(shape) / fits_rate
                 + layers * solves * block_solve_flops(shape, work.map_shares) / fits_rate
                 + measure * moments / 2 / (rate * SCORING_SHARE)  # the measuring rows' statistics kept apart
                 + (passes(tokens - measure, layers, CAPTURE_SHARE) if work.repairs else 0.0)  # removal fits nothing
                 + fits / fits_rate
                 + passes(measure, layers, LOGITS_SHARE, head=True)  # the original's, shared by every repair
                 + passes(measure * candidates, layers * work.depth, LOGITS_SHARE, head=True)
                 + passes(checked * (len(work.repairs) + 1), kept, LOGITS_SHARE, head=True))
    if inp.offload == "sequential":  # each whole pass reads every block it runs from disk, once per batch of rows
        batches = -(-rows // inp.batch_size)
        reads = (1 + bool(work.repairs) + batches * (1 + candidates * work.depth)  # scoring, capture, measuring
                 + (len(work.repairs) + 1) * kept / layers)  # the checks' row through the kept blocks
        shortlist += reads * disk_pass(shape, inp)
    if not inp.on_gpu:  # each measuring pass's logits, log-softmax and KL; the checks' logits made and compared
        logits = (1 + candidates) * measure + (len(work.repairs) + 1) * checked
        shortlist += logits * shape.vocab * LOGIT_SECONDS / cpu
    checkpoint = weight_bytes(shape, inp, kept)
    # the shortlist's fit of the chosen candidate is put in place as it is (--fit-rows fitting): prune.run's
    # held-out perplexity of the original, of the blocks removed alone and of the checkpoint, the checkpoint
    # written (a skeleton measures no held-out rows there: it never holds the whole model)
    heldout = 0 if inp.offload == "sequential" else inp.heldout_samples * inp.seq_len
    build = (passes(heldout, layers, PERPLEXITY_SHARE, head=True)
             + 2 * passes(heldout, kept, PERPLEXITY_SHARE, head=True) + checkpoint / WRITE_BYTES_PER_S)
    # the quantizer reads the converted float32 file and writes a quarter of it
    export = (1 + QUANTIZE_SHARE * work.quantized) * checkpoint / (CONVERT_BYTES_PER_S * cpu) if work.gguf else 0.0
    held = work.texts * work.heldout_tokens
    models = (0 if work.original_kept else 1) + 1
    texts_passes = _serving_passes(inp, work)
    if not work.verify:
        verify = 0.0
    elif inp.on_gpu:  # launches and processes, not arithmetic
        verify = _gpu_verify_seconds(shape, inp, work)
    else:
        verify = (passes(held * (0 if work.original_kept else 1), layers, SERVING_SHARE, head=True)
                  + passes(held, kept, SERVING_SHARE, head=True)
                  + (passes(held, kept, ENGINE_SHARE, head=True) if work.gguf else 0.0)
                  + _speed_seconds(shape, inp, work)
                  + (_fidelity_seconds(shape, inp, work) if inp.offload == "none" else 0.0)
                  + tasks_seconds(shape, inp, work)
                  # the original's engine file for the speed check, of the shipped file's type
                  + (0.0 if work.original_kept or not work.gguf or not work.speed
                     else (1 + QUANTIZE_SHARE * work.quantized) * weight_bytes(shape, inp, layers)
                     / (CONVERT_BYTES_PER_S * cpu))
                  + (models + 1 + work.speed) * PROCESS_SECONDS / cpu
                  # block by block the serving check reads each model's blocks from its checkpoint once for its
                  # windows and once a greedy token (a Llama-3-8B shape's original and slim: 57 GB a pass, past the
                  # page cache: about 15 minutes of reads on 2026-12-06)
                  + texts_passes * ((0 if work.original_kept else layers) + kept) / layers * disk_pass(shape, inp))
    if inp.on_gpu:
        shortlist += GPU_SHORTLIST_SECONDS + candidates * GPU_CANDIDATE_SECONDS
    heal = work.heal_seconds + sampled(work.heal_self_batches)
    return {"shortlist": sampling + shortlist, "build": build, "heal": heal,
            "export": export, "verify": verify}


def shortlist_stages(shape: ModelShape, inp: PlanInput, work: ShipWork) -> list[Stage]:
    """The shortlist's memory per device, phase by phase (:func:`prune.planner.stages.stage_shortlist`).

    Each repair fits every distinct span of every block set once, all of them in one pass: ``sets x spans``, the
    guess its seconds are counted on before the scoring pass has chosen the sets.
    """
    return stage_shortlist(shape, inp, work.repairs, work.sets * work.spans)


def stage_peaks(stages: Sequence[Stage]) -> dict[str, float]:
    """Each device's most bytes in any of ``stages``: a stage's phases hold their parts in turn, not together."""
    devices = dict.fromkeys(device for stage in stages for device in stage.devices)
    return {device: max(stage.peak(device) for stage in stages) for device in devices}


def _serving_passes(inp: PlanInput, work: ShipWork) -> int:
    """A model's forward passes in the serving check: whole windows of each text, then one a greedy token.

    Windows as ``eval.bench.serving.windows_of`` cuts them: whole ones only, at least one.
    """
    return work.texts * (max(1, work.heldout_tokens // inp.seq_len) + GREEDY_TOKENS)


def _gpu_verify_seconds(shape: ModelShape, inp: PlanInput, work: ShipWork) -> float:
    """The verify stage on a GPU: a fresh process per check, and the block calls of every decode step and pass.

    Each check that runs (serving; fidelity in memory only; speed unless ``work.speed`` is False) starts a process
    that reads both models; every pass and decode step costs a call of each block it runs
    (:data:`prune.planner.rates.GPU_BLOCK_CALL_SECONDS`). Their arithmetic is left out: a 70B model's 4,096 held-out
    tokens are about a second of it.
    """
    from eval.quality.fidelity import FidelityOptions

    layers, kept = shape.layers, shape.layers - work.drop
    both = weight_bytes(shape, inp, layers) + weight_bytes(shape, inp, kept)
    checks = 1 + (inp.offload == "none") + work.speed  # serving; fidelity only in memory; speed where it runs

    def calls(count: float, blocks: int) -> float:
        return count * blocks * GPU_BLOCK_CALL_SECONDS

    served = ((0 if work.original_kept else 1), 1, 1 if work.gguf else 0)  # original, slim, shipped
    serving = sum(n * calls(_serving_passes(inp, work), blocks)
                  for n, blocks in zip(served, (layers, kept, kept), strict=True))
    options = FidelityOptions()
    steps = math.ceil(options.prompts / options.batch_size) * (options.new_tokens + 1)
    fidelity = (calls(steps, kept) + (0 if work.fidelity_kept else calls(steps, layers)) + calls(1, layers)
                if inp.offload == "none" else 0.0)
    speed = sum((work.speed_rounds + 1) * calls(work.new_tokens + 1, blocks) for blocks in (layers, kept)
                if work.speed)
    # block by block the serving check reads both models from disk once a window and once a greedy token, as on the CPU
    reads = _serving_passes(inp, work) * ((0 if work.original_kept else layers) + kept) / layers * disk_pass(shape, inp)
    return (checks * (GPU_PROCESS_SECONDS + both / DISK_BYTES_PER_S) + serving + fidelity + speed + reads
            + tasks_seconds(shape, inp, work))


def tasks_seconds(shape: ModelShape, inp: PlanInput, work: ShipWork) -> float:
    """The lm-eval tasks check (``eval.bench.checks.TasksCheck``): each model loaded in turn, scoring every task.

    A task scored by log-likelihood: rows x requests forward passes of :data:`TASK_REQUEST_TOKENS` tokens, every
    position through the head (lm-eval takes the answer's log-likelihood from the logits of the whole request).
    A generating task: its prompts' passes, then ``max_gen_toks`` decode steps for each batch of rows, each step
    reading every weight (as the fidelity check's decoding). On both models, unless an earlier run kept the
    original's scores (``work.tasks_kept``): the checkpoint's alone. A task whose rows are unknown counts nothing
    (the plan warns). On a GPU: the check's process and the models' bytes read, a call of every block a pass or
    step runs, as :func:`_gpu_verify_seconds` counts the other checks, and the arithmetic of every token, prompts
    and written ones, at the GPU's rate (:func:`prune.planner.rates.flop_rate`): unlike the other checks' few
    thousand tokens, a whole task's are minutes of it on a large model (full HellaSwag's 2.6 million tokens on a 70B
    shape: about 15 minutes for the original, four times its block calls).
    """
    if not work.tasks:
        return 0.0
    depths = (shape.layers - work.drop,) if work.tasks_kept else (shape.layers, shape.layers - work.drop)
    total = 0.0
    for blocks in depths:
        for task in (task for task in work.tasks if task.rows):
            requests = task.rows * task.requests
            steps = math.ceil(task.rows / task.batch) * (task.max_gen_toks or 0)
            if inp.on_gpu:
                tokens = requests * TASK_REQUEST_TOKENS + task.rows * (task.max_gen_toks or 0)
                total += ((math.ceil(requests / task.batch) + steps) * blocks * GPU_BLOCK_CALL_SECONDS
                          + tokens * forward_flops(shape, blocks, True) / flop_rate(inp))
            else:
                total += (requests * TASK_REQUEST_TOKENS * forward_flops(shape, blocks, True)
                          / (flop_rate(inp) * SERVING_SHARE)
                          + steps * weight_bytes(shape, inp, blocks) / (SAMPLE_BYTES_PER_S * machine_speed()))
    if inp.on_gpu:
        return total + GPU_PROCESS_SECONDS + sum(weight_bytes(shape, inp, b) for b in depths) / DISK_BYTES_PER_S
    return total + len(depths) * PROCESS_SECONDS / machine_speed()  # a fresh Python, then a model loaded each


def _fidelity_seconds(shape: ModelShape, inp: PlanInput, work: ShipWork) -> float:
    """The generation fidelity check (``eval.bench.checks.FidelityCheck``), in a process of its own.

    At ``FidelityOptions``' defaults, the original and the checkpoint each decode every prompt in its batches (a
    step reads every weight, as the calibration's sampling does), then the original scores what the checkpoint
    wrote in one pass. With the original's side kept by an earlier run (``work.fidelity_kept``), only the
    checkpoint decodes.
    """
    from eval.quality.fidelity import FidelityOptions

    options = FidelityOptions()
    tokens = options.prompts * (options.prompt_tokens + options.new_tokens)
    written = options.prompts * options.new_tokens  # only these positions reach the head, decoding and scoring
    steps = math.ceil(options.prompts / options.batch_size) * options.new_tokens

    def passes(blocks: int) -> float:
        flop = tokens * forward_flops(shape, blocks) + written * forward_flops(shape, 0, True)
        return flop / (flop_rate(inp) * SERVING_SHARE)

    total = 2 * PROCESS_SECONDS / machine_speed()  # a fresh Python, and the second model's load
    decoders = (shape.layers - work.drop,) if work.fidelity_kept else (shape.layers, shape.layers - work.drop)
    for blocks in decoders:
        total += passes(blocks) + steps * weight_bytes(shape, inp, blocks) / (SAMPLE_BYTES_PER_S * machine_speed())
    return total + passes(shape.layers)


def _speed_seconds(shape: ModelShape, inp: PlanInput, work: ShipWork) -> float:
    """The speed check: a warm-up and the timed rounds of the original and the checkpoint.

    A round is a prefill of ``prompt_len`` tokens and ``new_tokens`` single-token decode steps, each step reading
    every weight. Nothing where it does not run (``work.speed``).
    """
    total = 0.0
    if not work.speed:
        return total
    for blocks in (shape.layers, shape.layers - work.drop):
        prefill = work.prompt_len * forward_flops(shape, blocks, True) / (flop_rate(inp) * ENGINE_SHARE)
        decode = work.new_tokens * weight_bytes(shape, inp, blocks) / (SAMPLE_BYTES_PER_S * machine_speed() * 8 / 2)
        total += (work.speed_rounds + 1) * 2 * (prefill + decode)
    return total
