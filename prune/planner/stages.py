"""The stages of a plan (``prune.planner.estimate``): what each holds on each device, and how long it takes.

:class:`PlanInput` is a run's options as plain numbers; each ``stage_*`` function returns a :class:`Stage`
with the bytes per device (by what fills them, from :mod:`prune.planner.memory`) and its seconds.
Times divide each stage's arithmetic (2 x parameters a token passes through for a forward, x2 again for a
backward through frozen weights, x3 with gradients for every weight) by a throughput: measured on this
machine's CPU, and an assumed share of an H100's bf16 peak on a GPU (:mod:`prune.planner.rates`); the plan names
which one gave each time.
The distillation part takes plain numbers (:class:`DistillSpec`): prune never imports ``distill``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prune.planner.inputs import DTYPE_BYTES, PlanInput
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
from prune.planner.rates import (
    DISK_BYTES_PER_S,
    FP32_SHARE,
    GPU_BLOCK_CALL_SECONDS,
    GPU_STEP_SECONDS,
    TEACHER_SHARE,
    TRAIN_SHARE,
    block_solve_flops,
    fit_flops,
    fit_rate,
    flop_rate,
    forward_flops,
    moment_flops,
    score_decompositions,
)
from prune.planner.shape import ModelShape
from prune.replace.registry import METHODS, closed_form_methods
from prune.selection.repaired import MEASURE_EVERY


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
    flop = inp.calibration_tokens * (forward_flops(shape, shape.layers) + moment_flops(shape))
    seconds = flop / flop_rate(inp) + score_decompositions(shape) / fit_rate(inp) + disk_pass(shape, inp)
    return Stage("scoring", devices, seconds, f"{inp.calibration_tokens:,} tokens")


def disk_pass(shape: ModelShape, inp: PlanInput) -> float:
    """Seconds to read every block once (offload sequential reads them per pass).

    Counted at the disk's rate for every pass: a checkpoint larger than the memory left (a Llama-3-8B shape's 32 GB
    here) is read from disk each time; a smaller one is read from the page cache after its first pass, so this is
    an upper bound there.
    """
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
    flop = passes * inp.calibration_tokens * forward_flops(shape, shape.layers)
    # the time counts one span's sums and solve: the blocks a score ranks most removable mostly form one run (every
    # SmolLM2-135M drop of reports/ship-defaults, both shaped runs of reports/scale); each further span adds its own
    rounds = METHODS[inp.replace].fit_rounds if inp.replace in METHODS else 0
    solve = fit_flops(shape, width, passes * inp.calibration_tokens, rounds) / fit_rate(inp)
    note = f"{inp.spans} span(s) at most; closed-form sums" + ("" if inp.replace in closed_form_methods() else
                                                                f" (a trained {inp.replace} counted as one)")
    return Stage("fitting", devices, flop / flop_rate(inp) + solve + passes * disk_pass(shape, inp), note)


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


def block_solves(select: str) -> int:
    """The least-squares maps ``select`` solves per block from a pass's statistics (its registration says)."""
    from prune.selection.strategies import SELECTIONS

    return SELECTIONS.get(select).block_solves if select in SELECTIONS else 0


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
    - a one-pass selection (``measures`` "pass") reads its pass's statistics and solves its maps from them:
      ``block_solves`` a block (``prune.planner.rates.block_solve_flops``), at the float64 fits' rate;
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
    solves = 0.0
    if kind == "pass":  # one pass over the fitting rows and one over the measuring rows, streaming moments
        flop = tokens * (forward_flops(shape, shape.layers) + moment_flops(shape))
        solves = shape.layers * block_solves(inp.select) * block_solve_flops(shape) / fit_rate(inp)
        note = f"one pass of {tokens:,} tokens"
    else:
        measure = _measuring_rows(inp, repaired) * inp.seq_len  # split_rows' or crossfit_halves' rows
        per_step = measure * forward_flops(shape, shape.layers, True) * (2 if repaired else 1)
        if repaired:  # the capture passes fitting the step's new spans (crossfit: each half's, every row)
            per_step += (tokens if _crossfit(inp) else tokens - measure) * forward_flops(shape, shape.layers)
        flop = steps * per_step + sets * measure * forward_flops(shape, shape.layers / 2, True)
        note = (f"{sets} candidate set(s) in {steps} step(s), each {'repaired, ' if repaired else ''}measured on "
                f"{measure:,} tokens" + ("" if declared else " (assumed one set per block)"))
    devices = _new_devices(inp)
    names = compute_devices(inp)
    reading = 0.0
    if inp.offload == "sequential":  # a whole pass reads each block as it is called, once per batch
        add(devices[names[0]], "one block + embedding", weight_bytes(shape, inp, 1, head=False))
        batches = -(-_measuring_rows(inp, repaired) // inp.batch_size)
        reads = 2 if kind == "pass" else (steps * (3 if repaired else 1) + sets) * batches
        reading = reads * disk_pass(shape, inp)
    else:
        _weights(devices, shape, inp, shape.layers, "weights")
    add(devices[names[0]], "activations", forward_bytes(shape, inp, inp.batch_size * inp.seq_len))
    add(devices[names[-1]], "logits", perplexity_logit_bytes(shape, inp))
    if repaired and inp.replace != "none":  # every span fitted stays in the run's memo: one per block, and merged
        folds = 2 if _crossfit(inp) else 1  # a cross-fitted selection keeps one fit per half
        add(devices[names[0]], "fitted maps",
            folds * (free + inp.drop) * (shape.hidden ** 2 + shape.hidden) * inp.dtype_bytes)
    _moments(devices, shape, inp)
    return Stage("selection", devices, flop / flop_rate(inp) + solves + reading, note)


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
    flop = inp.heldout_samples * inp.seq_len * (forward_flops(shape, shape.layers, True) +
                                                 forward_flops(shape, shape.layers - inp.drop, True))
    return Stage("evaluation", devices, flop / flop_rate(inp), f"{inp.heldout_samples} x {inp.seq_len} tokens, twice")


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
    student = backward * (forward_flops(shape, shape.layers - inp.drop, True) + 2 * map_params(shape, inp)) / (
        flop_rate(inp) * train_share)
    teacher = 0.0 if spec.teacher_cache else forward_flops(shape, shape.layers, True) / (flop_rate(inp) * teacher_share)
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
    return Stage("teacher cache", devices, total * forward_flops(shape, shape.layers, True) / (flop_rate(inp) * share),
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
    passes = (tokens * forward_flops(shape, run) / flop_rate(inp)
              + batches * run / shape.layers * disk_pass(shape, inp))
    kl = (measuring * inp.seq_len * (forward_flops(shape, shape.layers - inp.drop, True)
                                     + forward_flops(shape, shape.layers, True))
          / flop_rate(inp) + 2 * disk_pass(shape, inp) * -(-measuring // inp.batch_size))
    def training(count: int) -> float:
        # float32 on a GPU: its rate without the bfloat16 tensor cores (FP32_SHARE); a pair's step costs its launches
        share = FP32_SHARE if inp.on_gpu else TRAIN_SHARE
        seconds = steps * batch * 3 * forward_flops(shape, count) / (flop_rate(inp) * share)
        return max(seconds, steps * 3 * count * GPU_BLOCK_CALL_SECONDS) if inp.on_gpu else seconds

    return Stage("local heal", devices, passes + sum(training(count) for count in trains) + kl,
                 f"{len(depths)} cut(s) x ({steps} steps of {'/'.join(map(str, sorted(set(trains))))} block(s) + two "
                 "recording passes) + the KL after")
