"""The heal stage: distil the built checkpoint towards the original, kept when it helps on rows it never trained on.

At most ``--heal-steps`` steps (KL of the next-token distributions; LoRA on the kept blocks, merged, so the
checkpoint stays plain), as many as the time left allows, on the calibration rows the shortlist's fits read;
kept only when it lowers the KL on the shortlist's measuring rows. The training is ``distill``'s own step
(:class:`distill.step.DistillStep`), called here with the original already in memory; with ``--processes N`` it
writes the teacher's cache here and trains on N processes launched by accelerate, each loading the built checkpoint
(:mod:`distill.launch`), and the measuring and writing stay here. Under ``--offload sequential`` neither the
student nor the original is ever whole in memory: the heal runs block by block (:func:`heal_blocks`), judged and
kept by the same test.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from distill.checkpoints import default_work_folder, list_checkpoints
from distill.heal import HealRows, heal_settings, heal_student, heal_training
from distill.local_heal import heal_built, kept_cut_files, local_heal_settings
from prune.atomic import atomic_directory, write_file_atomic, write_json
from prune.checkpoint.report import REPORT_FILE, read_report
from prune.checkpoint.save_load import write_model
from prune.checkpoint.write import HELDOUT_BEFORE_DISTILL
from prune.loading.loader import LoadedModel
from prune.loading.offload import load_offloaded, streamed
from prune.selection.repaired import divergence, split_rows
from ship.config import HEAL_OPTIONS, ShipConfig, duration_words
from ship.work import StageResult

# the planner's healing time (its rates measured on this heal's own kind of step, prune.planner.rates.TRAIN_SHARE)
# is multiplied by this before the steps are fitted into the time left: a heal that overruns takes the engine
# checks' time
HEAL_MARGIN = 1.15
# what the heal block by block trains (distill.local_heal), as heal.json records it
LOCAL_SETTINGS = {key: local_heal_settings()[key] for key in ("train", "lr")}
# fewer steps than this are not worth a teacher's load: healing is skipped
HEAL_MIN_STEPS = 20
# files of the built checkpoint that the healed one is written without (its own weights and card replace them)
_NOT_CARRIED = (".safetensors", ".bin", ".gguf")
# the heal block by block's folder of kept cuts, in healed.work/, and the steps it began with there
KEPT_CUTS = "blocks"
_BEGAN = "steps.json"


@dataclass(kw_only=True)
class Healing(StageResult):
    """``heal.json``: the steps and why, whether it was kept, and the KL and perplexity around it."""

    steps: int
    why: str
    kept: bool = False
    train: str = HEAL_OPTIONS["train"]
    kl_before: float | None = None
    kl_after: float | None = None
    ppl_before: float | None = None
    ppl_after: float | None = None
    tokens: int | None = None
    distill_seconds: float | None = None
    processes: int = 1  # the processes the training ran on (the world size they reported)
    lora_r: int | None = None  # LoRA's rank and alpha as trained (None: not LoRA, or a heal.json written before)
    lora_alpha: float | None = None
    lora_targets: str | None = None  # the layers adapted by name (None: every Linear of the kept blocks)
    lr: float | None = None  # the peak learning rate
    data: str | None = None  # --heal-data, trained on beside the calibration rows
    planned_seconds: float | None = None  # block by block: the planner's seconds once the build placed the cuts

    def trained(self) -> str:
        """What the heal trained, in the card's words."""
        if self.train == "blocks":
            return "the two blocks beside each cut, every weight, one cut at a time"
        if self.train != "lora":
            return "every weight but the embedding and the head"
        scale = f" and alpha {self.lora_alpha:g}" if self.lora_alpha is not None else ""
        where = (f"the {', '.join(self.lora_targets.split(','))} layers" if self.lora_targets
                 else "every Linear")
        return f"LoRA{f' of rank {self.lora_r}' if self.lora_r else ''}{scale} on {where} of the kept blocks, merged"

    def words(self) -> str:
        """The card's paragraph on the healing: how many steps and why, and whether it was kept."""
        if not self.steps:
            return f"Not healed: {self.why}."
        if self.train == "blocks":
            said = (f"Healed block by block: {self.steps} steps a cut ({self.why}; the MSE to the original's hidden "
                    f"states after the cut, each token's scaled to unit RMS, {self.trained()}, from the slim model's "
                    f"own inputs), on {self._text()}. ")
            return said + self._judged()
        said = (f"Healed: {self.steps} steps of distillation towards the original ({self.why}; KL of the "
                f"next-token distributions, from the original's top-{_cache_k()} logits written once, "
                f"{self.trained()}, so the checkpoint stays plain), on {self._text()}{_over(self.processes)}. ")
        return said + self._judged()

    def _text(self) -> str:
        return f"{self.tokens or 0:,} tokens of the calibration" + (f" and `--heal-data {self.data}`"
                                                                     if self.data else "")

    def _judged(self) -> str:
        return ("On the calibration rows it did not train "
                f"on (the shortlist's measuring rows): KL {self.kl_before:.4f} -> {self.kl_after:.4f}, perplexity "
                f"{self.ppl_before:.3f} -> {self.ppl_after:.3f}: "
                + ("kept." if self.kept else "not kept; the checkpoint is the one built, unhealed."))


def _over(processes: int) -> str:
    return f", over {processes} processes" if processes > 1 else ""


def _cache_k() -> str:
    """K of the heal's teacher cache (``HEAL_OPTIONS``' ``topk=K``)."""
    return HEAL_OPTIONS["teacher_cache"].partition("=")[2]


def heal_steps(config: ShipConfig, planned: float | None, done: Sequence[StageResult],
               reserve: float | None = None, fixed: float = 0.0) -> tuple[int, str]:
    """(steps, why): ``--heal-steps``, or fewer when ``--time-budget`` leaves time for fewer.

    The time left is the budget less the stages done and a reserve for the export and the engine checks:
    ``reserve``, the planner's seconds for them (``ship.costs``), else the build's time per held-out text and
    two more (measured on a 2-core CPU, reports/ship/); a step costs the planner's time (``planned``, for
    ``--heal-steps`` steps, less ``fixed``: what it costs whatever the steps, paid first) x ``HEAL_MARGIN``.
    """
    steps = config.heal_steps
    if config.no_heal:
        return 0, config.no_heal
    budget = config.time_budget
    if budget is None:
        return steps, f"--heal-steps {steps}"
    if not planned:
        return 0, "no plan of its time to hold against --time-budget"
    spent = sum(stage.seconds for stage in done)
    if reserve is None:
        reserve = done[-1].seconds * (max(len(config.heldout), 1) + 2) if config.verify else 0
    left = budget - spent - reserve - fixed * HEAL_MARGIN
    per_step = (planned - fixed) / config.heal_steps * HEAL_MARGIN
    fits = max(int(left // per_step), 0)
    if fits < HEAL_MIN_STEPS:
        return 0, (f"--time-budget leaves {duration_words(max(left, 0))} after the engine checks' reserve: "
                   f"{fits} steps at the planned {per_step:.1f} s each, under {HEAL_MIN_STEPS}")
    if fits < steps:
        return fits, f"{fits} of --heal-steps {steps}: what --time-budget leaves ({duration_words(left)})"
    return steps, f"--heal-steps {steps}"


def heal(config: ShipConfig, steps: int, why: str, checkpoint: Path, healed: Path, calibration,
         original: LoadedModel, say=print, before: dict | None = None, more=None) -> Healing:
    """Distil ``checkpoint`` towards ``original``; written to ``healed`` when its KL falls on unseen rows.

    ``calibration``: the shortlist's rows [samples, seq]; the heal trains on its fitting rows, cut into
    ``HEAL_SEQ_LEN`` tokens, and measures on its measuring rows (:class:`distill.heal.HealRows`); the training is
    :func:`distill.heal.heal_training`, which ``eval.bench heal-curve`` runs too. A heal killed after a checkpoint
    of its training (``healed.work/checkpoints/``, distill's own) continues from it to the same weights.
    ``before``: the checkpoint's ``{"kl", "ppl"}`` on the measuring rows where the shortlist measured them
    (the build put its fit in place), else measured here; ``more``: ``--heal-data``'s rows, trained on too.
    """
    settings = LOCAL_SETTINGS if config.local_heal else heal_settings(config.heal_train)
    result = Healing(steps=steps, why=why, **settings)
    shutil.rmtree(healed, ignore_errors=True)  # a killed heal's output: written again (its training resumes)
    if not steps:
        say(f"not healing: {why}")
        forget_heal(healed)  # what a killed heal kept (a run continued under a budget now spent) is of no use
        return result
    if config.local_heal:
        return heal_blocks(config, result, checkpoint, healed, calibration, original, say, before, more)
    prune = config.prune
    rows = HealRows.of(calibration, more)
    student, report = heal_student(checkpoint, prune.load.dtype, prune.load.device)
    if before is None:
        before = divergence(student.model, original.model, rows.measure, prune.batch_size)
    kept = list_checkpoints(default_work_folder(healed))  # the step's work folder: beside healed/
    resumed = f"; resuming from step {kept[-1][0]}" if kept else ""
    say(f"healing: {steps} steps of distillation towards the original ({why}){_over(config.processes)}; KL before "
        f"{before['kl']:.4f}" + resumed)
    done = heal_training(student, original, rows, steps, dataclasses.replace(prune, out=str(healed)), resume=True,
                         processes=config.processes, folder=checkpoint, train=config.heal_train or None)
    for folder in done.cleanup:
        shutil.rmtree(folder, ignore_errors=True)
    after = divergence(student.model, original.model, rows.measure, prune.batch_size)
    result = dataclasses.replace(result, tokens=int(rows.train.numel()), distill_seconds=done.report.get("seconds"),
                                 processes=done.report.get("processes", 1))
    return _judge_and_keep(config, result, before, after, student, report, done.report, checkpoint, healed, say)


def heal_blocks(config: ShipConfig, result: Healing, checkpoint: Path, healed: Path, calibration,
                original: LoadedModel, say=print, before: dict | None = None, more=None) -> Healing:
    """The heal block by block (``--offload sequential``): each cut's pair of blocks trained towards the original.

    The built checkpoint is loaded as a skeleton beside the original's (:func:`distill.local_heal.heal_built`);
    it trains on the calibration's fitting rows (and ``more``, ``--heal-data``'s) as they are, ``result.steps`` steps
    a cut, and is kept by the same test as the heal in memory: a lower KL on the measuring rows. Each cut's trained
    pair is kept in ``healed.work/blocks/`` as it ends: a killed heal goes on from its last whole cut, to the same
    weights.
    """
    prune = config.prune
    fit, measure = split_rows(calibration)
    rows = fit if more is None else torch.cat([fit, more])
    student = load_offloaded(str(checkpoint), dtype=prune.load.dtype, device=prune.load.device)
    report = read_report(checkpoint)

    def divergence_now() -> dict:
        with streamed(student.model), streamed(original.model):
            return divergence(student.model, original.model, measure, prune.batch_size)

    if before is None:
        before = divergence_now()
    say(f"healing block by block: {result.steps} steps a cut ({result.why}); KL before {before['kl']:.4f}")
    kept = default_work_folder(healed) / KEPT_CUTS
    kept.mkdir(parents=True, exist_ok=True)
    write_file_atomic(kept / _BEGAN, lambda staging: write_json(staging, {"steps": result.steps, "why": result.why}))
    records = heal_built(student.model, original.model, report, rows, steps=result.steps,
                         batch_size=prune.batch_size, seed=prune.data.seed, progress=prune.replace.progress,
                         work=kept, say=say)
    if not records:
        say("not healing: no cut whose state the original gives")
        forget_heal(healed)
        return dataclasses.replace(result, steps=0, why="no cut whose state after it the original gives")
    result = dataclasses.replace(result, tokens=int(rows.numel()))
    result = _judge_and_keep(config, result, before, divergence_now(), student, report, {"block_by_block": records},
                             checkpoint, healed, say)
    forget_heal(healed)  # the trained pairs are in healed/ now, or were not kept
    return result


def began_with(healed: Path) -> tuple[int, str] | None:
    """``(steps, why)`` a killed heal block by block began with, where it kept cuts; None where none began.

    A run continued goes on with them: its cuts were trained at that many steps, though a budget planned again
    (the machine's speed probed again, the time spent before counted again) may now give another count.
    """
    kept = default_work_folder(healed) / KEPT_CUTS
    if not kept_cut_files(kept):
        return None
    try:
        began = json.loads((kept / _BEGAN).read_text(encoding="utf-8"))
        return int(began["steps"]), str(began["why"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def forget_heal(healed: Path) -> None:
    """Remove what a heal kept while it trained: ``healed.work/`` (kept cuts, distillation's checkpoints).

    Its output is written, or it will not heal, or the checkpoint it healed is built again.
    """
    shutil.rmtree(default_work_folder(healed), ignore_errors=True)


def _judge_and_keep(config: ShipConfig, result: Healing, before: dict, after: dict, student: LoadedModel, report: dict,
            record: dict, checkpoint: Path, healed: Path, say) -> Healing:
    """Either heal's result judged on the measuring rows; when its KL fell, the healed checkpoint written.

    ``record``: what the training reports, kept in the healed checkpoint's ``layercut.json`` beside the KLs.
    """
    result = dataclasses.replace(result, kl_before=before["kl"], kl_after=after["kl"], ppl_before=before["ppl"],
                                 ppl_after=after["ppl"], kept=after["kl"] < before["kl"], data=config.heal_data)
    say(f"healed: KL {before['kl']:.4f} -> {after['kl']:.4f} on rows it did not train on; "
        + ("kept" if result.kept else "not kept (the built checkpoint ships)"))
    if result.kept:
        if isinstance(report.get("heldout"), dict):  # measured before healing: the card says so
            report["heldout"] = {**report["heldout"], "stage": HELDOUT_BEFORE_DISTILL}
        report["heal"] = {**record, "kl_before": before["kl"], "kl_after": after["kl"]}
        with atomic_directory(healed, overwrite=True) as staging:
            write_model(staging, student.model, student.tokenizer, healed, report)
            carry_extras(checkpoint, staging)
    return result


def carry_extras(built: Path, healed: Path) -> None:
    """Copy the built checkpoint's other files (scores, plots) that the healed one was written without."""
    for path in sorted(built.iterdir()):
        target = healed / path.name
        if path.is_file() and not target.exists() and path.suffix not in _NOT_CARRIED and path.name not in (
                REPORT_FILE, "README.md"):
            shutil.copy2(path, target)
