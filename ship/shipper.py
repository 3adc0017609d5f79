"""The stages of one run in order, each result kept in ``OUT.work/`` (:class:`Shipper`).

plan -> shortlist -> build -> heal -> export -> verify -> card, then the checkpoint (healed or not) becomes
``OUT``. A stage whose result ``OUT.work/`` holds is not run again; one whose output went (a removed folder) runs
again with the stages after it. Random choices are seeded and every stage is deterministic, so a resumed run
gives the result the uninterrupted one would.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from eval.quality.lmeval import check_chat_template
from prune.atomic import check_output_dir, output_lock, write_file_atomic
from prune.checkpoint.report import REPORT_FILE, read_report
from prune.checkpoint.write import portable
from prune.data.self_text import check_chat_sources
from prune.errors import LayercutError
from prune.loading.loader import LoadedModel
from prune.model.adapters import is_offloaded
from prune.pipeline.runner import Scored, score_calibration
from prune.replace import ReplaceConfig
from prune.selection.repaired import update_share
from ship.build import Built, build, chosen_config
from ship.card import CARD, ship_card
from ship.config import SHORTLIST_SHARE, ShipConfig, applicable, duration_words, servable_repairs
from ship.heal import Healing, began_with, forget_heal, heal, heal_steps
from ship.plan import (
    Plan,
    block_budget,
    check_disk_left,
    make_plan,
    memory_words,
    plan_line,
    replan_local_heal,
    replan_shortlist,
)
from ship.shortlist import Progress, Shortlist, make_shortlist
from ship.verify import Verified, verify
from ship.work import (
    BUILD,
    CALIBRATION,
    CHECKPOINT,
    EXPORT,
    HEAL,
    HEALED,
    HELDOUT,
    PLAN,
    SETTINGS,
    SHORTLIST,
    SHORTLIST_PROGRESS,
    VERIFIED,
    VERIFY,
    StageResult,
    WorkFolder,
    write_json_atomic,
    write_text_atomic,
)


@dataclass(kw_only=True)
class Exported(StageResult):
    """``export.json``: the GGUF written for llama.cpp (its name), None for an engine that serves the folder."""

    gguf: str | None = None


class Shipper:
    """Runs the stages of one :class:`ShipConfig`, skipping those whose output ``OUT.work/`` already holds."""

    def __init__(self, config: ShipConfig, say: Callable[[str], None] = print):
        self.config = config
        self.work = WorkFolder(config.work)
        self.say = say
        self.loaded: LoadedModel | None = None
        self.scored: Scored | None = None
        self.started = time.perf_counter()

    def run(self) -> Path:
        """Every stage; returns ``OUT``."""
        config, work = self.config, self.work
        out = Path(config.out)
        with output_lock(config.out):
            if self._shipped(out):
                self.say(f"{config.out} is shipped already (its card: {out / CARD}); remove it to ship again")
                return out
            check_output_dir(out, overwrite=False)
            plan = self.plan()
            shortlist = work.stage(SHORTLIST, Shortlist, lambda: self.shortlist(plan))
            self._forget_lost_outputs()
            built = work.stage(BUILD, Built, lambda: self.build(shortlist))
            healed = work.stage(HEAL, Healing, lambda: self.heal(plan, [plan, shortlist, built]))
            self._release()  # no stage after the heal reads the original: its memory is the engine checks'
            final = work / HEALED if healed.kept else work / CHECKPOINT
            if config.gguf and not self.gguf(final).is_file():
                self._remake(EXPORT)
            exported = work.stage(EXPORT, Exported, lambda: self.export(final))
            verified = work.stage(VERIFIED, Verified, lambda: self.verify(final)) if config.verify else None
            times = {"plan": plan.seconds, "shortlist": shortlist.seconds, "build": built.seconds,
                     "heal": healed.seconds, "export": exported.seconds,
                     "verify": verified.seconds if verified else 0.0}
            planned = plan.planned_stages
            if planned and shortlist.planned_seconds is not None:  # beside it, as counted once the sets were known
                planned = {**planned, "shortlist once its sets were known": shortlist.planned_seconds}
            if planned and healed.planned_seconds is not None:  # and the heal block by block once its cuts were
                planned = {**planned, "heal once its cuts were known": round(healed.planned_seconds, 1)}
            self.card(final, shortlist, verified, times, healed, planned)
            os.replace(final, out)
        self.say(f"wrote {out}/ ({self.elapsed():.0f} s); every stage's output is in {work.path}/")
        return out

    def elapsed(self) -> float:
        """Seconds since this call started."""
        return time.perf_counter() - self.started

    def _shipped(self, out: Path) -> bool:
        marker = out / SETTINGS
        if not marker.is_file():
            return False
        if self.work.read_json(marker).get("digest") != self.config.digest():
            raise LayercutError(f"{out} was shipped with other settings: choose another --out or remove it")
        return True

    def plan(self) -> Plan:
        """The kept plan of this run's settings, else a new one; the folder is marked only once a plan passed."""
        work, settings = self.work, self.config.settings()
        plan = work.read(PLAN, Plan) if work.open(settings) else None
        if plan is not None:
            self.say(f"continuing the run kept in {work.path}/")
            healed = work.read(HEAL, Healing)  # the disk may have filled since it was planned
            check_disk_left(self.config, plan, None if healed is None else healed.kept)
        else:
            began = time.perf_counter()
            plan = make_plan(self.config)
            plan.seconds = round(time.perf_counter() - began, 2)
            work.mark(settings)  # only now: a refused plan leaves nothing that blocks the corrected command
            work.write(PLAN, plan)
        self.say(plan_line(plan, self.config))
        return plan

    def _forget_lost_outputs(self) -> None:
        """Stages whose folder went (removed, or shipped as ``OUT`` and then removed) run again."""
        work = self.work
        if not (work / CHECKPOINT / REPORT_FILE).is_file():
            self._remake(BUILD, HEAL, EXPORT)
        healed = work.read(HEAL, Healing)
        if healed is not None and healed.kept and not (work / HEALED / REPORT_FILE).is_file():
            self._remake(HEAL, EXPORT)

    def _remake(self, *stages: str) -> None:
        """These stages run again, and the checks after them: their figures were of files made again."""
        self.work.forget(*stages, VERIFIED)
        shutil.rmtree(self.work / VERIFY, ignore_errors=True)
        if BUILD in stages:  # a killed heal's kept cuts were trained on the checkpoint that went
            forget_heal(self.work / HEALED)

    # ---- the stages that need the model --------------------------------------------------------------------

    def _release(self) -> None:
        """Drop the original and the scoring pass; on a GPU hand their memory back to the device.

        The engine checks run in processes of their own: vLLM takes a share of the GPU's whole memory, which
        this process's cached blocks would otherwise hold.
        """
        import torch

        self.loaded = self.scored = None
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def _load(self) -> LoadedModel:
        if self.loaded is None:
            self.say(f"loading {self.config.prune.load.model}")
            self.loaded = self.config.prune.load.load()
        return self.loaded

    def _score(self, loaded: LoadedModel) -> Scored:
        """The scoring pass, the measuring rows' statistics kept apart (repaired-fast then needs no pass of its own).

        Block by block: the adjacent pairs' cosines alone (a skeleton's pass holds two states at a time; the
        shortlist's selections read no other), and repaired-fast's map errors taken as the pass frees each block's
        statistics, at the update shares of the repairs the shortlist will try.
        """
        if is_offloaded(loaded.model):
            model, batch = loaded.model, self.config.prune.batch_size
            shares = sorted({update_share(ReplaceConfig(method=name, batch_size=batch)) for name in servable_repairs()
                             if name != "none" and applicable(name, model) is None})
            return score_calibration(loaded, self.config.prune, cosine_pairs="adjacent", measuring_apart=True,
                                     shares=shares)
        return score_calibration(loaded, self.config.prune, cosine_pairs="all", measuring_apart=True)

    def shortlist(self, plan: Plan) -> Shortlist:
        """Score once, then measure every candidate (:func:`ship.shortlist.make_shortlist`)."""
        config = self.config.prune
        loaded = self._load()
        if self.config.heal_data:  # a heal text this tokenizer cannot draw is refused before the shortlist's minutes
            try:
                check_chat_sources(loaded.tokenizer, self.config.heal_data_config())
            except LayercutError as err:  # in the words of ship's own flag
                raise LayercutError(str(err).replace("--data", "--heal-data")) from None
        if self.config.tasks:  # a GGUF's tokenizer is read only now (ship.plan.check_tasks read the others')
            check_chat_template(loaded.tokenizer, self.config.tasks)
        self.say("scoring every block (one pass)")
        self.scored = self._score(loaded)
        calibration = self.scored.calibration
        self._keep_calibration(calibration.token_ids)
        if calibration.heldout_ids is not None and not self.config.heldout:
            write_text_atomic(self.work / HELDOUT, "\n\n".join(loaded.tokenizer.decode(row)
                                                               for row in calibration.heldout_ids.tolist()))
        count = plan.drop if plan.drop is not None else block_budget(config, loaded.model,
                                                                     config.resolve(loaded.model))
        budget = self.config.time_budget

        peaks = {}

        def replan(sets: list[list[int]], repairs: Collection[str] | None) -> float | None:
            replanned = replan_shortlist(self.config, loaded.model, count, sets, repairs)
            if replanned is None:
                return None
            seconds = replanned.seconds
            if repairs is None:  # the whole stage's, said once, with its memory
                peaks["known"] = replanned.peak
                before = (plan.planned_stages or {}).get("shortlist")
                guessed = (plan.planned_stage_peaks or {}).get("shortlist")
                self.say(f"{len({tuple(s) for s in sets})} block sets to fit and measure: the planner now gives the "
                         f"shortlist {duration_words(seconds)}"
                         + (f" and {memory_words(peaks['known'])}" if peaks["known"] else "")
                         + (f" (planned before loading: {duration_words(before)}"
                            + (f", {memory_words(guessed)}" if guessed else "") + ")" if before else ""))
            return seconds

        done = make_shortlist(self.scored, loaded.model, config, count, deadline=shortlist_deadline(budget, plan),
                              elapsed=self.elapsed,
                              progress=Progress(self.work / SHORTLIST_PROGRESS), replan=replan, say=self.say)
        done.planned_peak = peaks.get("known")
        return done

    def build(self, shortlist: Shortlist) -> Built:
        """``checkpoint/``: prune.run's checkpoint of the chosen candidate."""
        self.say(f"building {shortlist.best.describe()}")
        if self.scored is None:  # a resumed run: the shortlist's own pass again, so the fits read the same sums
            self.scored = self._score(self._load())
        done = build(self.config.prune, shortlist, self.work / CHECKPOINT, self.loaded, self.scored)
        # the model was surgered in place: not the original any more. The scoring pass goes too: its float64
        # statistics (twice, with the measuring rows' apart) and the shortlist's fits, which hold that model, sit
        # on the model's device, and no later stage reads them (the heal reads the calibration rows back from
        # OUT.work/). On a GPU they were, by a reading of the code, about 20 GB of a Llama-3-8B shape's 72.7 GB
        # heal (reports/gpu-ship)
        self._release()
        return done

    def heal(self, plan: Plan, done: list[StageResult]) -> Healing:
        """``healed/``: the built checkpoint distilled towards the original, when that lowers the KL."""
        later = plan.planned_stages or {}
        # the steps' time is what is left after the engine checks and the heal's own sampling of --heal-data
        sampling = max(later["heal"] - (plan.planned_heal_seconds or 0.0), 0.0) if later else 0.0
        reserve = later["export"] + later["verify"] + sampling if later else None
        known = fixed = None
        if self.config.local_heal:  # block by block the recording passes stop at the cuts: planned again, placed
            replanned = replan_local_heal(self.config, read_report(self.work / CHECKPOINT))
            known, fixed = replanned if replanned is not None else (None, None)
        planned = known or plan.planned_heal_seconds
        steps, why = heal_steps(self.config, planned, done, reserve, fixed=fixed or 0.0)
        began = began_with(self.work / HEALED) if self.config.local_heal else None
        if began is not None and began[0] != steps:
            self.say(f"the heal began with {began[0]} steps a cut ({began[1]}) and kept cuts of them: it goes on with "
                     f"those, not the {steps} planned now")
            steps, why = began
        if not steps:
            return heal(self.config, steps, why, self.work / CHECKPOINT, self.work / HEALED, None, None, say=self.say)
        calibration = self._calibration()
        shortlist, built = (next(s for s in done if isinstance(s, kind)) for kind in (Shortlist, Built))
        # the checkpoint is the candidate the shortlist measured on the heal's measuring rows: no pass again
        before = {"kl": shortlist.best.kl, "ppl": shortlist.best.ppl} if built.as_measured else None
        original = self._load()
        more = None
        if self.config.heal_data:  # drawn again on a resumed run: the same spec and seed give the same rows
            from prune.data.calibration import calibration_data

            more = calibration_data(original.tokenizer, self.config.heal_data_config(), model=original.model).token_ids
        healed = heal(self.config, steps, why, self.work / CHECKPOINT, self.work / HEALED, calibration, original,
                      say=self.say, before=before, more=more)
        healed.planned_seconds = known
        return healed

    def export(self, final: Path) -> Exported:
        """For llama.cpp, the GGUF of ``--gguf-type`` beside the checkpoint that ships."""
        if not self.config.gguf:
            return Exported()
        from prune.checkpoint.gguf import export_gguf

        gguf = self.gguf(final)
        if not gguf.is_file():
            self.say(f"writing the {self.config.gguf_type} GGUF")
            export_gguf(final, gguf, self.config.gguf_type, self.config.converter)
        return Exported(gguf=gguf.name)

    def gguf(self, folder: Path) -> Path:
        """Where the GGUF of ``folder`` goes: named after ``OUT``, which the folder becomes."""
        from prune.checkpoint.gguf import default_output

        return default_output(folder, self.config.gguf_type, name=self.config.name)

    def verify(self, final: Path) -> Verified:
        """The shipped file in its engine against transformers, per held-out text, and its speed."""
        heldout = list(self.config.heldout) or [f"calibration held-out rows={self._heldout_text()}"]
        gguf = self.gguf(final) if self.config.gguf else None
        return verify(self.config, final, gguf, heldout, self.work / VERIFY, say=self.say)

    def card(self, final: Path, shortlist: Shortlist, verified: Verified | None, times: dict[str, float],
             healed: Healing | None, planned: dict | None = None) -> None:
        """``README.md`` of the checkpoint that ships, and the settings that mark the folder shipped."""
        report = read_report(final)
        gguf = self.gguf(final).relative_to(final).as_posix() if self.config.gguf else None
        chosen = chosen_config(self.config.prune, shortlist, Path("slim"))
        write_text_atomic(final / CARD, ship_card(self.config, report, shortlist, verified, chosen, times, healed,
                                                  gguf, planned))
        # in the shipped folder (what a user uploads): no path of this machine
        write_json_atomic(final / SETTINGS, {"settings": portable(self.config.settings()),
                                             "digest": self.config.digest(), "shortlist": shortlist.to_json(),
                                             "verified": portable(_shipped_figures(verified)),
                                             "seconds": {stage: round(value, 1) for stage, value in times.items()},
                                             "planned": planned})

    # ---- what a resumed run reads back --------------------------------------------------------------------

    def _keep_calibration(self, token_ids) -> None:
        """The calibration rows, for the healing of a resumed run (drawing them again may sample text)."""
        from safetensors.torch import save_file

        path = self.work / CALIBRATION
        if not path.is_file():
            write_file_atomic(path, lambda staging: save_file({"token_ids": token_ids.contiguous()}, str(staging)))

    def _calibration(self):
        from safetensors.torch import load_file

        if self.scored is not None:
            return self.scored.calibration.token_ids
        path = self.work / CALIBRATION
        if not path.is_file():
            raise LayercutError(f"{path} is missing: {self.work.start_over()}")
        try:
            return load_file(str(path))["token_ids"]
        except Exception as err:  # noqa: BLE001 - any damage to the file reads as one line
            raise LayercutError(f"{path} is damaged ({type(err).__name__}): {self.work.start_over()}") from None

    def _heldout_text(self) -> Path:
        """The calibration source's held-out rows as text (written by the shortlist: never scored nor fitted on)."""
        path = self.work / HELDOUT
        if not path.is_file():
            raise LayercutError(f"{path} is missing: {self.work.start_over()}")
        return path


def _shipped_figures(verified: Verified | None) -> dict | None:
    if verified is None:
        return None
    return {"domains": {d: s.get("rows") for d, s in verified.domains.items()}, "speed": verified.speed.get("ratios"),
            "files": verified.files}


def remove_work(config: ShipConfig) -> None:
    """Delete ``OUT.work/`` (``--overwrite``)."""
    WorkFolder(config.work).remove()


def shortlist_deadline(budget: float | None, plan: Plan) -> float | None:
    """Seconds into the run by which the shortlist should end (None: no ``--time-budget``).

    ``SHORTLIST_SHARE`` of the budget, or less where the planner's build, export and engine checks need more than
    the rest: a 12-minute SmolLM2-135M drop-4 run with four held-out texts gave its engine checks 6 of its 13.4
    minutes (2026-12-03). The heal takes what is left after them.
    """
    if budget is None:
        return None
    stages = plan.planned_stages or {}
    after = sum(stages.get(stage, 0.0) for stage in ("build", "export", "verify"))
    return min(budget * SHORTLIST_SHARE, budget - after)
