"""The plan stage: the budget as a block count, the planner's memory and time, refused before any weight is read."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from eval.speed.engines import ENGINES, display_name
from prune.checkpoint.gguf import QUANTIZER_TYPES
from prune.errors import LayercutError
from prune.model.adapters import get_blocks
from prune.pipeline.config import PruneConfig
from prune.pipeline.resolve import Amounts
from prune.pipeline.runner import on_meta, preflight
from prune.planner.machine import machine_speed
from ship.config import (
    HEAL_OPTIONS,
    HEAL_SEQ_LEN,
    SHORTLIST_SHARE,
    ShipConfig,
    applicable,
    duration_words,
    heal_sequences,
    params_cap,
    servable_repairs,
)
from ship.costs import (
    PROCESS_SECONDS,
    ShipWork,
    shortlist_stages,
    stage_peaks,
    stage_seconds,
    task_work,
    tasks_seconds,
)
from ship.disk import check_disk, ship_needs
from ship.work import StageResult

logger = logging.getLogger(__name__)

# the lm-eval tasks' share of the verify stage from which a --time-budget refusal names --tasks and --limit among
# the ways out: a smaller one is not what makes the run too long
TASKS_NAMED_SHARE = 0.25


@dataclass(kw_only=True)
class Plan(StageResult):
    """``plan.json``: the model's size and the budget as blocks (None: known once loaded), the planner's figures."""

    num_blocks: int | None = None
    params: int | None = None
    drop: int | None = None
    planned_seconds: float | None = None
    planned_peak: dict | None = None  # each device's bytes in the stage that holds the most there
    planned_peak_stage: dict | None = None  # each device's stage of planned_peak: shortlist, build or heal
    planned_stage_peaks: dict | None = None  # each stage's bytes per device (ship.plan._plan_peaks)
    planned_heal_seconds: float | None = None
    planned_heal_peak: dict | None = None  # each device's bytes in the heal (planned_heal_peak); in planned_peak too
    planned_stages: dict | None = None  # the planner's seconds per stage (ship.costs)

    def planned_total(self, *, heal: bool = True) -> float | None:
        """The planner's seconds for the whole run (without the heal, which fits itself into what is left)."""
        if not self.planned_stages:
            return None
        return sum(seconds for stage, seconds in self.planned_stages.items() if heal or stage != "heal")


def blocks_for_target(model, amounts: Amounts) -> int:
    """The fewest blocks whose removal brings the parameters to ``amounts.target_params`` (largest first).

    ``model`` may be the meta-device skeleton: only the blocks' parameter counts are read.
    """
    if amounts.drop is not None:
        return amounts.drop
    sizes = sorted((sum(p.numel() for p in block.parameters()) for block in get_blocks(model)[1]), reverse=True)
    excess, count = amounts.params - amounts.target_params, 0
    while excess > 0 and count < len(sizes):
        excess -= sizes[count]
        count += 1
    return count


def block_budget(config: PruneConfig, model, amounts: Amounts) -> int:
    """The budget as a block count, refused in one line when it leaves too few blocks (``--target-params``)."""
    count = blocks_for_target(model, amounts)
    removable = amounts.num_blocks - len(amounts.protected)
    if count > removable:
        given = f"--target-params {config.target_params}" if config.target_params is not None else "the budget"
        raise LayercutError(f"{given} needs {count} of the {amounts.num_blocks} blocks removed, and only "
                            f"{removable} may go (--protect {config.protect}): give a larger target")
    return count


def make_plan(config: ShipConfig) -> Plan:
    """Resolve the budget from the model's config alone; refuse what cannot fit the machine or the time."""
    from prune.planner.estimate import check_plan

    prune = config.prune
    meta = on_meta(prune.load.model)
    amounts = preflight(prune, meta)
    count = None
    if amounts is not None and meta.skeleton is not None:
        count = block_budget(prune, meta.skeleton, amounts)
    targets = config.heal_train.get("lora_targets")
    # a misspelt layer refused now, not after the shortlist (a model with no skeleton: when the heal loads it)
    if targets is not None and meta.skeleton is not None:
        from distill.trainable import lora_target_names

        lora_target_names(meta.skeleton, targets=targets)
    check_engine(config)
    check_tasks(config)
    sized = _sized(prune, count)
    planned = _planned(sized)
    plan = Plan(num_blocks=None if amounts is None else amounts.num_blocks,
                params=None if amounts is None else amounts.params, drop=count)
    if planned is not None:
        check_plan(planned)
        plan.planned_seconds = planned.seconds
        # prune.run's own plan: the build's held-out evaluation (its scoring pass is the shortlist's, which keeps
        # more beside it and is counted there)
        peaks = {"build": planned.to_dict()["peak"]}
        if config.local_heal:
            local = _local_heal(config, planned)
            plan.planned_heal_seconds = local.seconds if local else None
            plan.planned_heal_peak = _stage_peak(local)
        else:
            healing = _heal_plan(config, sized, keeps_original=True)  # one plan: the original kept adds memory only
            plan.planned_heal_seconds = _heal_seconds(healing, config, sized)
            plan.planned_heal_peak = _heal_peak(healing)
        kept = count is not None and _fidelity_kept(config)
        tasks_kept = count is not None and _tasks_kept(config)
        if count is not None:
            check_disk(ship_needs(config, planned.shape, planned.inp, count, _original_file(config)))
            work = ship_work(config, meta.skeleton, count, plan.planned_heal_seconds, fidelity_kept=kept,
                             tasks_kept=tasks_kept)
            for task in (task for task in work.tasks if task.rows is None):
                logger.warning("the planner does not know how many rows lm-eval's %s has: the verify stage's plan "
                               "leaves it out (--limit N counts it)", task.name)
            plan.planned_stages = {stage: round(seconds, 1) for stage, seconds in stage_seconds(
                planned.shape, planned.inp, work).items()}
            peaks = {"shortlist": stage_peaks(shortlist_stages(planned.shape, planned.inp, work)), **peaks}
        if plan.planned_heal_peak:
            peaks["heal"] = plan.planned_heal_peak
        _plan_peaks(plan, peaks, planned.limits)
        budget, needed = config.time_budget, plan.planned_total(heal=False)
        if budget is not None and needed is not None and needed > budget:
            # the shortlist leaves out the repairs its share of the budget cannot pay for (ship.shortlist): the
            # run is refused only when removal alone, which fits nothing, does not fit
            least_work = ship_work(config, meta.skeleton, count, None, only=(), fidelity_kept=kept,
                                   tasks_kept=tasks_kept)
            least = {stage: round(seconds, 1) for stage, seconds in stage_seconds(
                planned.shape, planned.inp, least_work).items()}
            least_total = sum(seconds for stage, seconds in least.items() if stage != "heal")
            if least_total > budget:
                raise LayercutError(
                    f"--time-budget {duration_words(budget)}: the planner gives this run "
                    f"{duration_words(least_total)} before any healing ({_stage_words(least)})"
                    + (" with no repair tried" if least_total < needed else "")
                    + ": give more time, a smaller --samples, "
                    + _fewer_tasks(tasks_seconds(planned.shape, planned.inp, least_work), least.get("verify", 0.0))
                    + "or a smaller budget")
            logger.warning("--time-budget %s: the planner gives this run %s before any healing; the shortlist "
                           "tries the repairs that fit in %d%% of the budget once its block sets are known",
                           duration_words(budget), duration_words(needed), round(100 * SHORTLIST_SHARE))
    elif config.time_budget is not None:
        logger.warning("the planner cannot cost %s before loading: --time-budget is held against the stages "
                       "as they run", prune.load.model)
    return plan


# what the warning adds for a stage planned above a device's memory: the shortlist's block sets are a guess before
# the scoring pass, the heal can be left out (prune.run's own plan, the build's, is refused before this: check_plan)
_UNFIT = {"shortlist": "every repair's fits of every block set are held at once, and the sets are a guess until "
                       "the scoring pass has chosen them",
          "heal": "pass --heal-steps 0 to ship the checkpoint as built"}


def _sized(prune: PruneConfig, count: int | None) -> PruneConfig:
    """``prune`` with its budget resolved to ``count`` blocks (None: as given)."""
    if count is None:
        return prune
    return dataclasses.replace(prune, drop=count, target_params=None, target_speedup=None)


def _planned(sized: PruneConfig):
    """The planner's plan of ``sized`` from its config alone; None where it cannot shape the model."""
    from prune.planner.estimate import hardware_for, plan_config

    try:
        return plan_config(sized, hardware_for(sized.load.device))
    except Exception as err:  # noqa: BLE001 - a model the planner cannot shape is planned once loaded
        logger.info("no plan for %s before loading (%s)", sized.load.model, err)
        return None


def check_disk_left(config: ShipConfig, plan: Plan, heal_kept: bool | None = None) -> None:
    """A resumed run's disk check: the files it has still to write, refused in one line when the disk is short.

    The disk may have filled since the run was planned; the files written before it was stopped are left out, and
    once its heal is done (``heal_kept`` not None) the folder that ships is the one the heal chose.
    """
    if plan.drop is None:
        return
    planned = _planned(_sized(config.prune, plan.drop))
    if planned is None:
        return
    check_disk(ship_needs(config, planned.shape, planned.inp, plan.drop, _original_file(config), heal_kept))


def _plan_peaks(plan: Plan, peaks: dict[str, dict[str, float]], limits: dict[str, float]) -> None:
    """Set ``plan``'s peaks from each stage's bytes per device (``peaks``); warn where a stage may not fit.

    A ship's stages run one after the other, each releasing what the next does not read (``Shipper.build`` the
    scoring pass): a device's peak is the most any one stage holds there, not their sum, and the plan says which.
    """
    plan.planned_stage_peaks = peaks
    devices = dict.fromkeys(device for stage in peaks.values() for device in stage)
    plan.planned_peak = {device: max(stage.get(device, 0.0) for stage in peaks.values()) for device in devices}
    plan.planned_peak_stage = {device: max(peaks, key=lambda name, device=device: peaks[name].get(device, 0.0))
                               for device in devices}
    for name, advice in _UNFIT.items():
        for device, need in peaks.get(name, {}).items():
            if need > limits.get(device, float("inf")):
                logger.warning("the %s is planned at %.1f GB on %s, which has %.1f GB: it may not fit (%s)", name,
                               need / 1e9, device, limits[device] / 1e9, advice)


def ship_work(config: ShipConfig, skeleton, drop: int, heal_seconds: float | None,
              only: Collection[str] | None = None, fidelity_kept: bool = False, tasks_kept: bool = False) -> ShipWork:
    """What the run will do, as :mod:`ship.costs` counts it.

    The repairs the shortlist fits (those the skeleton takes, of ``only`` where given), the text it samples, the
    held-out tokens it verifies on, the lm-eval tasks it scores; ``fidelity_kept`` and ``tasks_kept``: the cache
    holds the original's side of the fidelity check, of the tasks check (:meth:`ship.config.ShipConfig.fidelity_check`,
    :meth:`~ship.config.ShipConfig.tasks_check`, asked by the caller).
    """
    from eval.quality.lmeval import resolve_data_dir
    from prune.data.self_text import self_batches
    from prune.planner.shape import shape_of_model
    from prune.replace import METHODS, parameter_count
    from prune.selection.repaired import update_share

    shape = shape_of_model(skeleton) if skeleton is not None else None
    # as the shortlist sizes them (ship.config.params_cap): a repair adding more than its cap allows is never fitted
    removal = parameter_count(skeleton) - drop * shape.block_params if shape else 0
    target = config.prune.resolve(skeleton).target_params if skeleton is not None else None
    takes = [name for name in servable_repairs() if name != "none"
             and (skeleton is None or applicable(name, skeleton) is None)]
    repairs = [name for name in takes if (only is None or name in only) and (skeleton is None or not (
        METHODS[name].adds_params and removal + METHODS[name].adds_params(skeleton) > params_cap(removal, target)))]
    widths = tuple(METHODS[name].fit_width(shape.hidden, shape.intermediate) if shape else 1 for name in repairs)
    # the one-pass selection's maps are checked at the share of every repair the model takes (ship.shortlist's
    # prepare), before a size cap or the budget leaves one out
    shares = {update_share(dataclasses.replace(config.prune, replace=name).replace) for name in takes}
    data = config.prune.data
    original = _original_file(config)  # the original's engine file for the speed check, written by an earlier run
    original_kept = original is not None and original.is_file()
    return ShipWork(drop=drop, repairs=widths, map_shares=len(shares), fidelity_kept=fidelity_kept,
                    rounds=tuple(METHODS[name].fit_rounds for name in repairs),
                    self_batches=self_batches(data, config.prune.load.model),
                    heal_self_batches=self_batches(config.heal_data_config(), config.prune.load.model)
                    if config.heal_data and not config.no_heal else 0,
                    heldout_tokens=4096 if config.heldout else max(data.heldout_samples, 1) * data.seq_len,
                    texts=max(len(config.heldout), 1), gguf=config.gguf, original_kept=original_kept,
                    quantized=config.gguf and config.gguf_type in QUANTIZER_TYPES, speed_rounds=config.speed_repeats,
                    prompt_len=config.prompt_len, new_tokens=config.new_tokens,
                    heal_seconds=(heal_seconds or 0.0) if config.heal_steps else 0.0, verify=config.verify,
                    speed=not config.no_speed, tasks_kept=tasks_kept,
                    tasks=task_work(config.tasks, config.limit, config.prune.batch_size,
                                    resolve_data_dir(config.data_dir)) if config.verify and config.tasks else ())


@dataclass(frozen=True)
class ReplannedShortlist:
    """The shortlist's stage planned again once its block sets are known (:func:`replan_shortlist`).

    Attributes:
        seconds: the stage's time for the repairs counted.
        peak: its memory per device, every repair counted (None where only some were).
    """

    seconds: float
    peak: dict[str, float] | None


def replan_shortlist(config: ShipConfig, model, drop: int, sets: Sequence[Sequence[int]],
                     repairs: Collection[str] | None = None) -> ReplannedShortlist | None:
    """The planner's shortlist seconds and memory again once the scoring pass has chosen its block ``sets``.

    None: no sets, or no plan. ``repairs``: the repairs counted (default: every one the model takes; removal is
    always measured); the memory is counted for every repair only.

    Before any weight is read the planner can only guess how many block sets the one-pass selections choose and
    how scattered they are (``ShipWork.sets`` and ``spans``), and every repair fits each span of each set: on
    the project's runs SmolLM2-135M's selections gave 3-4 sets of 10-11 spans in all, a random-weight
    Llama-3.2-1B shape 2 sets of one span each, whose fits the guess (6 spans) planned at three times their
    cost. With the sets known the same arithmetic counts them, and the repairs ``model`` (the loaded one) takes.
    Every repair's sums of every span are held at once (:func:`ship.costs.shortlist_stages`), so the memory
    guessed before loading (three sets of two spans) is far from a run's too: 95.1 GB planned for a Llama-3-8B
    shape whose two sets of one span each took 61.3 GB on an H200 (63.25 GB counted with them).
    """
    replanned = _replanned(config, model, drop, sets, repairs)
    if replanned is None:
        return None
    planned, work = replanned
    seconds = stage_seconds(planned.shape, planned.inp, work)["shortlist"]
    peak = stage_peaks(shortlist_stages(planned.shape, planned.inp, work)) if repairs is None else None
    return ReplannedShortlist(seconds, peak)


def replanned_shortlist(config: ShipConfig, model, drop: int, sets: Sequence[Sequence[int]],
                        repairs: Collection[str] | None = None) -> float | None:
    """:func:`replan_shortlist`'s seconds (None: no plan)."""
    replanned = replan_shortlist(config, model, drop, sets, repairs)
    return None if replanned is None else replanned.seconds


def replanned_shortlist_peak(config: ShipConfig, model, drop: int,
                             sets: Sequence[Sequence[int]]) -> dict[str, float] | None:
    """:func:`replan_shortlist`'s memory per device, every repair counted (None: no plan)."""
    replanned = replan_shortlist(config, model, drop, sets)
    return None if replanned is None else replanned.peak


def _replanned(config: ShipConfig, model, drop: int, sets: Sequence[Sequence[int]],
               repairs: Collection[str] | None):
    """``plan_config``'s plan and the shortlist's work with ``sets`` counted (None: no sets, or no plan)."""
    from prune.planner.estimate import hardware_for, plan_config
    from prune.replace import spans_of

    sets = list(dict.fromkeys(tuple(sorted(blocks)) for blocks in sets))
    if not sets:
        return None
    sized = dataclasses.replace(config.prune, drop=drop, target_params=None, target_speedup=None)
    try:
        planned = plan_config(sized, hardware_for(config.prune.load.device))
    except Exception as err:  # noqa: BLE001 - as make_plan: a model the planner cannot shape has no plan
        logger.info("no plan for %s (%s)", config.prune.load.model, err)
        return None
    spans = {span for blocks in sets for span in spans_of(blocks)}  # a repair fits a span once for every set
    # a candidate's pass runs its view's blocks from the first it changes: the set's first block's place on
    layers = planned.shape.layers
    run = sum(layers - len(blocks) - min(blocks, default=0) for blocks in sets)
    work = dataclasses.replace(ship_work(config, model, drop, None, only=repairs), sets=len(sets),
                               spans=len(spans) / len(sets), depth=run / (len(sets) * layers))
    return planned, work


def _original_file(config: ShipConfig) -> Path | None:
    """Where the speed check keeps the original's GGUF of the shipped type (None: no GGUF, or no local folder)."""
    if not config.gguf or config.no_speed:
        return None
    from eval.speed.engines.base import checkpoint_folder
    from eval.speed.engines.llamacpp import gguf_export_path

    if Path(config.prune.load.model).suffix == ".gguf":  # a GGUF original is timed as it is, converted to nothing
        return None
    folder = checkpoint_folder(config.prune.load.model)
    return gguf_export_path(Path(folder), config.gguf_type) if folder is not None else None


def _fidelity_kept(config: ShipConfig) -> bool:
    """Whether an earlier run kept the original's side of the verify stage's fidelity check (asked once a plan).

    Its prompts come from ``--heldout``'s texts (without them, from rows the shortlist draws: not known yet). A text
    the check would refuse is refused there, in the verify stage's words: the plan only costs it as measured.
    """
    if not (config.verify and config.heldout and config.prune.load.offload == "none"):
        return False
    try:
        return config.fidelity_check("", list(config.heldout)).original_kept()
    except Exception as err:  # noqa: BLE001 - a cost, not a check
        logger.info("the planner costs the fidelity check's original side as measured (%s)", err)
        return False


def _tasks_kept(config: ShipConfig) -> bool:
    """Whether an earlier run kept the original's scores of the verify stage's lm-eval tasks (asked once a plan)."""
    if not (config.verify and config.tasks):
        return False
    try:
        return config.tasks_check("").original_kept()
    except Exception as err:  # noqa: BLE001 - a cost, not a check
        logger.info("the planner costs the tasks check's original side as measured (%s)", err)
        return False


def _fewer_tasks(tasks: float, verify: float) -> str:
    """The ``--time-budget`` refusal's way out through ``--tasks`` and ``--limit`` (else nothing).

    Named where the tasks' ``tasks`` seconds are a real share of the verify stage's ``verify``
    (:data:`TASKS_NAMED_SHARE`).
    """
    if not tasks or tasks < TASKS_NAMED_SHARE * verify:
        return ""
    return (f"fewer --tasks or a smaller --limit (the tasks take {duration_words(tasks)} of the verify stage's "
            f"{duration_words(verify)}), ")


def _stage_words(stages: dict) -> str:
    return ", ".join(f"{stage} {duration_words(seconds)}" for stage, seconds in stages.items() if seconds >= 1)


def _local_heal(config: ShipConfig, planned):
    """The planner's heal block by block (``--offload sequential``): ``--heal-steps`` steps a cut, one cut.

    One cut: the blocks a score ranks most removable mostly form one run (as the fitting stage counts them).
    """
    from prune.planner.stages import stage_local_heal

    if config.no_heal:
        return None
    return stage_local_heal(planned.shape, planned.inp, config.heal_steps, more_rows=_more_rows(config))


def _more_rows(config: ShipConfig) -> int:
    return config.heal_samples if config.heal_data else 0


def replan_local_heal(config: ShipConfig, report: dict) -> tuple[float, float] | None:
    """The heal block by block's seconds once the build's cuts are known (``report``: its ``layercut.json``).

    The plan before loading puts one cut three quarters of the way down (:func:`prune.planner.stages.stage_local_heal`);
    its passes stop at the cuts, so where they fell is most of what it missed. Returns (seconds, of them the part
    no step count changes: the recording passes and the KL after); None: no plan.
    """
    from distill.local_heal import cut_depths
    from prune.planner.estimate import hardware_for, plan_config
    from prune.planner.stages import stage_local_heal

    before, layout = report["num_blocks_before"], report["layout"]
    sized = dataclasses.replace(config.prune, drop=before - len(layout), target_params=None, target_speedup=None)
    try:
        planned = plan_config(sized, hardware_for(config.prune.load.device))
    except Exception as err:  # noqa: BLE001 - the heal is then fitted to the time by the plan made before loading
        logger.info("no plan for the heal once its cuts were known (%s)", err)
        return None
    depths = cut_depths(layout, before)

    def seconds(steps: int) -> float | None:
        stage = stage_local_heal(planned.shape, planned.inp, steps, depths, more_rows=_more_rows(config))
        return stage.seconds if stage is not None else None

    whole, one, two = seconds(config.heal_steps), seconds(1), seconds(2)
    if whole is None or one is None or two is None:
        return None
    return whole, one - (two - one)


def _stage_peak(stage) -> dict[str, float] | None:
    return {device: sum(parts.values()) for device, parts in stage.devices.items()} if stage is not None else None


def _heal_plan(config: ShipConfig, prune: PruneConfig, keeps_original: bool = False):
    """The planner's run of ``--heal-steps`` steps of the healing (None: no healing, or no plan).

    Its sequences are those the heal trains on (:func:`ship.config.heal_sequences`); no held-out rows: the
    heal's KL before and after is measured by ship, not by distillation.
    """
    from prune.planner.estimate import hardware_for, plan_config

    if config.no_heal or not config.heal_steps or config.local_heal:
        return None
    # --heal-data's sequences train too (the teacher's cache writes them)
    train = heal_sequences(prune.data.samples, prune.data.seq_len, config.heal_samples if config.heal_data else 0)
    options = {**HEAL_OPTIONS, **config.heal_train, "steps": config.heal_steps,
               "data": {"samples": train, "heldout_samples": 0, "seq_len": HEAL_SEQ_LEN}}
    try:
        return plan_config(dataclasses.replace(prune, distill=options), hardware_for(prune.load.device),
                           keeps_original=keeps_original)
    except Exception as err:  # noqa: BLE001 - the heal is then fitted to the time by its steps alone
        logger.info("no plan for the healing (%s)", err)
        return None


def planned_heal_peak(config: ShipConfig, prune: PruneConfig) -> dict[str, float] | None:
    """Each device's bytes while the heal trains (None: no healing, or no plan).

    As ship's heal holds them: the checkpoint with LoRA, its optimizer, a batch's activations and logits, and the
    original beside it, which measures the KL after training even where the teacher's cache stands in for it; not
    the scoring pass's statistics, which the build released (``Shipper.build``).
    """
    return _heal_peak(_heal_plan(config, prune, keeps_original=True))


def _heal_peak(planned) -> dict[str, float] | None:
    stage = next((s for s in planned.stages if s.name == "distillation"), None) if planned is not None else None
    if stage is None:
        return None
    released = ("moments (float64)", "fit sums (float64)")
    return {device: sum(value for part, value in parts.items() if part not in released
                        and not (part == "original (kept)" and "teacher" in parts))  # a teacher is the original
            for device, parts in stage.devices.items()}


def planned_heal(config: ShipConfig, prune: PruneConfig) -> float | None:
    """The planner's seconds for ``--heal-steps`` steps of the healing (None: no healing, or no plan).

    With the teacher's cache, writing it counts too (once, before any process starts). On ``--processes N`` the
    training's arithmetic is the same, spread (:func:`spread_training`).
    """
    return _heal_seconds(_heal_plan(config, prune), config, prune)


def _heal_seconds(planned, config: ShipConfig, prune: PruneConfig) -> float | None:
    from prune.planner.estimate import hardware_for

    if planned is None:
        return None
    stages = {s.name: s.seconds for s in planned.stages if s.name in ("teacher cache", "distillation")}
    if not stages:
        return None
    gpus = hardware_for(prune.load.device).gpus
    return stages.get("teacher cache", 0.0) + spread_training(stages.get("distillation", 0.0), config.processes, gpus)


def spread_training(seconds: float, processes: int, gpus: int) -> float:
    """The planner's ``seconds`` of training, on ``processes`` processes.

    On GPUs, one each, a process does 1/N of the arithmetic; on the CPU they share its cores: the same arithmetic
    at the same rate, no faster. Either way each process starts Python and torch and loads the checkpoint
    (``ship.costs.PROCESS_SECONDS``): at once on GPUs, in turn on the CPU's shared cores.
    """
    if processes <= 1:
        return seconds
    starts = (1 if gpus else processes) * PROCESS_SECONDS / machine_speed()
    return (seconds / processes if gpus else seconds) + starts


def check_engine(config: ShipConfig) -> None:
    """Refuse, before any work, an engine check this environment cannot run (one line naming the fix)."""
    engine = ENGINES.get(config.engine)
    if config.verify and not engine.available():
        raise LayercutError(f"{engine.missing_message()} to check the checkpoint in {engine.display}, or pass "
                            "--no-verify")
    if config.gguf:
        from prune.checkpoint.gguf import QUANTIZER_TYPES, check_quantizer, find_converter

        find_converter(config.converter)
        if config.gguf_type in QUANTIZER_TYPES:
            check_quantizer(config.gguf_type)


def check_tasks(config: ShipConfig) -> None:
    """Refuse, before any model loads, lm-eval tasks the verify stage would fail on (one line naming the fix).

    A hub task's data is read now (cached for the check), and a task that goes through the chat template (IFEval)
    needs a tokenizer that has one: read now, but from a ``.gguf`` (converted when the model loads: its tokenizer is
    checked then, by :meth:`ship.shipper.Shipper.shortlist`).
    """
    if not (config.verify and config.tasks):
        return
    from eval.quality.lmeval import check_chat_template, check_registry_data, plan_tasks, resolve_data_dir, task_table

    check_registry_data(plan_tasks(config.tasks, resolve_data_dir(config.data_dir))[1])
    load = config.prune.load
    source = load.tokenizer or load.model
    table = task_table()
    if any(name in table and table[name].chat for name in config.tasks):
        from prune.loading.loader import load_tokenizer, resolve_model_name

        if not resolve_model_name(source).lower().endswith(".gguf"):  # resolving converts nothing
            check_chat_template(load_tokenizer(source), config.tasks)


def memory_words(peak: dict[str, float]) -> str:
    """Bytes per device in words: "3.1 GB", or "31.6 GB on cuda:0, 30.2 GB on cuda:1" where there are several."""
    if len(peak) == 1:
        return f"{next(iter(peak.values())) / 1e9:.1f} GB"
    return ", ".join(f"{need / 1e9:.1f} GB on {device}" for device, need in peak.items())


def plan_line(plan: Plan, config: ShipConfig) -> str:
    """What the plan says, in one line."""
    what = f"{plan.drop} of {plan.num_blocks} blocks" if plan.drop is not None else "the budget's blocks"
    total = plan.planned_total()
    time_ = (f"; the planner gives it {duration_words(total)} ({_stage_words(plan.planned_stages)})"
             if total is not None else "")
    return f"plan: {what} go, verified in {display_name(config.engine)}{time_}"
