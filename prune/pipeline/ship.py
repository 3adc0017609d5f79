"""From a model and a budget to the best checkpoint an engine serves, verified there (``python -m prune.ship``).

The stages, each kept in ``OUT.work/`` so that a run stopped anywhere (Ctrl-C, ``kill -9``) continues where it
stopped when the same command is typed again:

1. **plan** (``plan.json``): the budget as a block count, the memory and time the planner gives the run;
   what cannot fit the machine or ``--time-budget`` is refused before a weight is read.
2. **shortlist** (``shortlist.json``): one scoring pass; the block sets the one-pass measures choose (the top-k
   of every registered score, the best span, ``repaired-fast``), each crossed with every training-free repair
   whose checkpoint is a plain one of the original architecture (the methods that register as ``vanilla`` and
   ``closed_form``, and removal). Each candidate is fitted on most calibration rows and measured on the rows
   no fit saw (``prune.selection.repaired.RepairedCosts``): the KL of its next-token distribution from the
   original model's, and its perplexity. The lowest KL wins; a candidate with more parameters than the
   original model (a repair that unties a tied head) or than ``--target-params`` is not one.
3. **build** (``checkpoint/``): ``prune.run`` with the winner's selection, score and repair, written as
   ``prune.run --out`` writes it; the card names that command, which rebuilds the same checkpoint.
4. **heal** (``heal.json``, ``healed/``): at most ``--heal-steps`` steps of distillation towards the original
   (KL of the next-token distributions; LoRA on the kept blocks, merged, so the checkpoint stays plain), as
   many as the time left allows, on the calibration rows the shortlist's fits read; kept only when it lowers the
   KL on the shortlist's measuring rows, which it never trains on.
5. **export**: for llama.cpp, the GGUF of ``--gguf-type`` beside the checkpoint (``gguf/``).
6. **verify** (``verify/``): the checkpoint in the engine, against transformers on the same token ids
   (``python -m eval.bench serving``: perplexity of the original and the slim model on each held-out text, the
   same greedy ids) and its speed against the original's (``python -m eval.bench speed``). The engines live
   above ``prune`` (``eval``), so they run as child processes: their memory and their failures stay theirs.
7. **card**: ``OUT/README.md`` says what was chosen and why (the shortlist's table), what was lost, the speed
   in the engine and the commands that reproduce it; then the checkpoint (healed or not) becomes ``OUT``.

Random choices are seeded and every stage is deterministic, so a resumed run gives the result the
uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from prune.atomic import check_output_dir, output_lock, write_file_atomic
from prune.checkpoint.write import REPORT_FILE, portable, portable_name
from prune.errors import LayercutError
from prune.measure.scores import SCORES
from prune.model.adapters import get_blocks
from prune.model.layouts import LAYOUTS, VANILLA
from prune.pipeline.config import PruneConfig
from prune.pipeline.removal import planned_blocks
from prune.pipeline.runner import Scored, preflight, run_prune, score_calibration
from prune.replace import METHODS, ReplaceConfig, check_replacement_supported, parameter_count
from prune.selection.repaired import RepairedCosts, divergence, split_rows
from prune.selection.strategies import SELECTIONS

logger = logging.getLogger(__name__)

# the engines a plain checkpoint reaches, spelled as eval.bench's --engine spells them ("llama.cpp" -> "llamacpp")
ENGINES = {name.replace(".", ""): name for name in LAYOUTS[VANILLA].engines}
REFERENCE = "transformers"
PLAN, SHORTLIST, CHECKPOINT, VERIFY, SETTINGS = "plan.json", "shortlist.json", "checkpoint", "verify", "ship.json"
HELDOUT, BUILD, VERIFIED = "heldout.txt", "build.json", "verify.json"
HEAL, HEALED, EXPORT, CALIBRATION = "heal.json", "healed", "export.json", "calibration.safetensors"
# the healing: KL on the logits (distill's default objective) through LoRA on every Linear of the kept blocks and
# the fold's projections trained in full, merged at the end (a plain checkpoint). LoRA, not the projections alone:
# on the selection split (SmolLM2-135M, drop 8, fold-rotate, 200 steps; reports/servable-repairs/) it left the
# lower perplexity on every text
HEAL_OPTIONS = {"train": "lora"}
# sequences of this many tokens (distill's default length): calibration rows are cut into them
HEAL_SEQ_LEN = 128
# the planner's distillation time is multiplied by this before the steps are fitted into the time left: its FLOP
# count leaves out LoRA's many small products and the float32 KL over the vocabulary (SmolLM2-135M, 2-core CPU:
# 1.97 s a step planned, 4.9 s measured in prune.ship's healing, reports/ship/)
HEAL_MARGIN = 2.5
# fewer steps than this are not worth a teacher's load: healing is skipped
HEAL_MIN_STEPS = 20
CARD = "README.md"
# the share of --time-budget the shortlist may spend measuring; building and verifying take the rest
SHORTLIST_SHARE = 0.5
# what the planner's time of prune.run is multiplied by before it is held against --time-budget: the shortlist
# fits each repair in a capture pass of its own, and the engine checks load both models once per held-out text.
# Measured on a 2-core CPU (reports/ship/): 22x (Gemma-3-270M, drop 4), 37x and 43x (SmolLM2-135M, drops 4, 8),
# four held-out texts each
PLAN_FACTOR = 40.0


@dataclass
class ShipConfig:
    """One ``prune.ship`` run.

    Attributes:
        prune: the model, its calibration and the budget (``drop``, ``target_speedup`` or ``target_params``);
            its ``select``, ``score`` and ``replace`` are what the shortlist chooses.
        out: the folder the checkpoint and its card end in (``OUT.work/`` holds every stage's output).
        engine: ``transformers``, ``llamacpp`` or ``vllm``: where the checkpoint is verified.
        time_budget: seconds the whole run may take (None: no limit); the plan is held against it.
        heldout: held-out text files (or datasets specs), one per domain, for the card's perplexities; none:
            the calibration source's held-out rows.
        gguf_type: the GGUF written for llama.cpp (``prune.checkpoint.gguf.OUTTYPES``).
        converter: llama.cpp's ``convert_hf_to_gguf.py`` (default: ``$LLAMA_CPP_CONVERTER``).
        verify: run the engine checks (off: the card says the checkpoint was not verified).
        speed_repeats: timed rounds of the speed check.
        prompt_len: prompt tokens of the speed check (its prefill).
        new_tokens: tokens it generates (its decode).
        threads: CPU threads passed to the engines (None: theirs).
        heal_steps: at most this many distillation steps after the build (0: no healing); with
            ``time_budget``, as many as fit in the time left.
    """

    prune: PruneConfig
    out: str
    engine: str = "llamacpp"
    time_budget: float | None = None
    heldout: list[str] = field(default_factory=list)
    gguf_type: str = "f32"
    converter: str | None = None
    verify: bool = True
    speed_repeats: int = 3
    prompt_len: int = 256
    new_tokens: int = 64
    threads: int | None = None
    heal_steps: int = 200

    def __post_init__(self):
        if self.engine not in ENGINES:
            raise LayercutError(f"--engine {self.engine}: choose one of {', '.join(ENGINES)}")
        if not self.prune.removes:
            raise LayercutError("prune.ship needs a budget: pass --drop K, --target-speedup X or --target-params N")
        if self.prune.unit != "block":
            raise LayercutError("prune.ship removes whole blocks: drop --unit")
        if self.prune.load.offload != "none":
            raise LayercutError("prune.ship measures candidates with the whole model in memory: drop --offload "
                                "(block by block: python -m prune.run --offload sequential)")
        if self.time_budget is not None and self.time_budget <= 0:
            raise LayercutError(f"--time-budget must be positive, got {self.time_budget:g} s")
        if self.heal_steps < 0:
            raise LayercutError(f"--heal-steps must be 0 (no healing) or more, got {self.heal_steps}")

    @property
    def work(self) -> Path:
        """``OUT.work/``: every stage's output."""
        return Path(str(self.out).rstrip("/") + ".work")

    def settings(self) -> dict:
        """What the result depends on (a resumed run must match it): the model, data, budget and the engine."""
        config = self.prune
        return {"model": config.load.model, "dtype": config.load.dtype, "data": dataclasses.asdict(config.data),
                "drop": config.drop, "target_params": config.target_params, "target_speedup": config.target_speedup,
                "protect": config.protect, "batch_size": config.batch_size, "engine": self.engine,
                "heldout": list(self.heldout), "gguf_type": self.gguf_type if self.engine == "llamacpp" else None,
                "heal_steps": self.heal_steps}


@dataclass
class Candidate:
    """One row of the shortlist: a block set (and the selections that chose it) with one repair."""

    blocks: list[int]
    repair: str
    chosen_by: list[str]  # "select/score" of each selection that chose this set
    params: int | None = None
    kl: float | None = None
    ppl: float | None = None
    note: str = ""

    @property
    def measured(self) -> bool:
        """Whether it was measured (and could be repaired)."""
        return self.kl is not None and math.isfinite(self.kl)

    @property
    def select(self) -> tuple[str, str]:
        """(``--select``, ``--score``) of the first selection that chose its blocks."""
        select, _, score = self.chosen_by[0].partition("/")
        return select, score


def servable_repairs() -> list[str]:
    """The training-free repairs whose checkpoint is a plain one, best default first, and removal last."""
    ranked = sorted((m for m in METHODS.values() if m.servable and m.closed_form),
                    key=lambda m: 0 if m.default_for is None else -1)
    return [m.name for m in ranked] + ["none"]


def applicable(method: str, model) -> str | None:
    """None where ``method`` can repair ``model``'s layout, else why not (its one-line refusal)."""
    try:
        check_replacement_supported(model, method)
    except LayercutError as err:
        return str(err)
    return None


def check_engine(config: ShipConfig) -> None:
    """Refuse, before any work, an engine check this environment cannot run (one line naming the fix)."""
    import importlib.util

    module = {"llamacpp": "llama_cpp", "vllm": "vllm"}.get(config.engine)
    if config.verify and module and importlib.util.find_spec(module) is None:
        extra = "pip install 'layercut[llamacpp]'" if config.engine == "llamacpp" else \
            "run prune.ship from vLLM's own environment (it pins its torch)"
        raise LayercutError(f"--engine {config.engine} checks the checkpoint in {ENGINES[config.engine]}, which is "
                            f"not installed here: {extra}, or pass --no-verify")
    if config.engine == "llamacpp":
        from prune.checkpoint.gguf import QUANTIZER_TYPES, check_quantizer, find_converter

        find_converter(config.converter)
        if config.gguf_type in QUANTIZER_TYPES:
            check_quantizer(config.gguf_type)


# ---- the stages ------------------------------------------------------------------------------------------------


class Shipper:
    """Runs the stages of one :class:`ShipConfig`, skipping those whose output ``OUT.work/`` already holds."""

    def __init__(self, config: ShipConfig, say: Callable[[str], None] = print):
        self.config = config
        self.work = config.work
        self.say = say
        self.loaded = None
        self.scored: Scored | None = None
        self.started = time.perf_counter()

    def run(self) -> Path:
        """Every stage; returns ``OUT``."""
        config = self.config
        out = Path(config.out)
        with output_lock(config.out):
            if self._shipped(out):
                self.say(f"{config.out} is shipped already (its card: {out / CARD}); remove it to ship again")
                return out
            check_output_dir(out, overwrite=False)
            self._start_work()
            plan = self._stage(PLAN, self.plan)
            shortlist = self._stage(SHORTLIST, self.shortlist)
            checkpoint = self.work / CHECKPOINT
            if not (checkpoint / REPORT_FILE).is_file():  # its output went (removed): build and heal again
                for stage in (BUILD, HEAL, EXPORT):
                    (self.work / stage).unlink(missing_ok=True)
            built = self._stage(BUILD, lambda: self.build(shortlist))
            healed = self._stage(HEAL, lambda: self.heal(plan, [plan, shortlist, built]))
            final = self.work / HEALED if healed["kept"] else checkpoint
            if config.engine == "llamacpp" and not self.gguf(final).is_file():
                (self.work / EXPORT).unlink(missing_ok=True)
            exported = self._stage(EXPORT, lambda: self.export(final))
            verified = self._stage(VERIFIED, lambda: self.verify(final)) if config.verify else None
            times = {"plan": plan["seconds"], "shortlist": shortlist["seconds"], "build": built["seconds"],
                     "heal": healed["seconds"], "export": exported["seconds"],
                     "verify": verified["seconds"] if verified else 0.0}
            self.card(final, plan, shortlist, verified, times, healed)
            os.replace(final, out)
        self.say(f"wrote {out}/ ({self.elapsed():.0f} s); every stage's output is in {self.work}/")
        return out

    def elapsed(self) -> float:
        """Seconds since this call started."""
        return time.perf_counter() - self.started

    def _shipped(self, out: Path) -> bool:
        marker = out / SETTINGS
        if not marker.is_file():
            return False
        if json.loads(marker.read_text(encoding="utf-8")).get("digest") != settings_digest(self.config):
            raise LayercutError(f"{out} was shipped with other settings: choose another --out or remove it")
        return True

    def _start_work(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        marker = self.work / SETTINGS
        settings = self.config.settings()
        if marker.is_file():
            if json.loads(marker.read_text(encoding="utf-8")).get("settings") != settings:
                raise LayercutError(f"{self.work} holds a run with other settings (model, data, budget or engine): "
                                    "type that command again to continue it, or remove the folder")
            self.say(f"continuing the run kept in {self.work}/")
        else:
            _write_atomic(marker, {"settings": settings})

    def _stage(self, name: str, make: Callable[[], dict]) -> dict:
        """The stage's JSON from ``OUT.work/`` when a run wrote it, else made now and kept (written atomically)."""
        path = self.work / name
        if path.is_file():
            return json.loads(path.read_text(encoding="utf-8"))
        began = time.perf_counter()
        result = make()
        result["seconds"] = round(time.perf_counter() - began, 2)
        _write_atomic(path, result)
        return result

    # ---- plan ----------------------------------------------------------------------------------------------

    def plan(self) -> dict:
        """The budget as a block count and the planner's memory and time, refused when either cannot fit."""
        from prune.planner.estimate import check_plan, hardware_for, plan_config

        config = self.config.prune
        amounts = preflight(config)
        planned = None
        try:
            planned = plan_config(config, hardware_for(config.load.device))
        except Exception as err:  # noqa: BLE001 - a model the planner cannot shape is planned once loaded
            logger.info("no plan for %s before loading (%s)", config.load.model, err)
        if planned is not None:
            check_plan(planned)
            budget = self.config.time_budget
            if budget is not None and planned.seconds * PLAN_FACTOR > budget:
                raise LayercutError(f"--time-budget {_duration(budget)}: the planner gives prune.run "
                                    f"{_duration(planned.seconds)} here, and a shipped run takes about "
                                    f"{PLAN_FACTOR:g}x that ({_duration(planned.seconds * PLAN_FACTOR)}): give "
                                    "more time, a smaller --samples, or a smaller budget")
        check_engine(self.config)
        result = {"num_blocks": None if amounts is None else amounts.num_blocks,
                  "params": None if amounts is None else amounts.params,
                  "drop": None if amounts is None else amounts.drop}
        if planned is not None:
            result.update(planned_seconds=planned.seconds, planned_peak=planned.to_dict()["peak"])
            result["planned_heal_seconds"] = self._planned_heal(config)
        self.say(_plan_line(result, self.config))
        return result

    def _planned_heal(self, config: PruneConfig) -> float | None:
        """The planner's seconds for ``--heal-steps`` steps of the healing (None: no healing, or no plan)."""
        from prune.planner.estimate import hardware_for, plan_config

        if not self.config.heal_steps:
            return None
        options = {**HEAL_OPTIONS, "steps": self.config.heal_steps}
        try:
            planned = plan_config(dataclasses.replace(config, distill=options), hardware_for(config.load.device))
        except Exception as err:  # noqa: BLE001 - the heal is then fitted to the time by its steps alone
            logger.info("no plan for the healing (%s)", err)
            return None
        stage = next((s for s in planned.stages if s.name == "distillation"), None)
        return None if stage is None else stage.seconds

    # ---- shortlist -----------------------------------------------------------------------------------------

    def _load(self):
        if self.loaded is None:
            self.say(f"loading {self.config.prune.load.model}")
            self.loaded = self.config.prune.load.load()
        return self.loaded

    def shortlist(self) -> dict:
        """Score once, list the candidates, measure them on rows no fit saw; the lowest KL is chosen."""
        config = self.config.prune
        loaded = self._load()
        model = loaded.model
        self.say("scoring every block (one pass)")
        self.scored = score_calibration(loaded, config, cosine_pairs="all")
        heldout = self.scored.calibration.heldout_ids
        self._keep_calibration(self.scored.calibration.token_ids)
        if heldout is not None and not self.config.heldout:
            _write_text_atomic(self.work / HELDOUT, "\n\n".join(loaded.tokenizer.decode(row)
                                                                for row in heldout.tolist()))
        count = self._count(model)
        base = dataclasses.replace(config, drop=count, target_params=None, target_speedup=None, replace="none",
                                   auto_replace=False, out=None)
        amounts = base.resolve(model)
        dense = parameter_count(model)
        repairs = [(name, applicable(name, model)) for name in servable_repairs()]
        candidates = self._candidates(model, base, amounts, [name for name, why in repairs if why is None])
        costs = {name: RepairedCosts(model, self.scored.calibration.token_ids, ReplaceConfig(method=name,
                                     batch_size=config.batch_size), batch_size=config.batch_size,
                                     memo=self.scored.memo)
                 for name, why in repairs if why is None}
        deadline = None if self.config.time_budget is None else self.config.time_budget * SHORTLIST_SHARE
        target = self._target_params(model)
        with tqdm(total=len(candidates), desc="shortlist", unit="candidate") as bar:
            for repair, cost in costs.items():  # one capture pass fits every span of a repair's candidates
                todo = [c for c in candidates if c.repair == repair]
                if deadline is not None and self.elapsed() > deadline and any(c.measured for c in candidates):
                    for candidate in todo:
                        candidate.note = "not measured: --time-budget spent"
                    bar.update(len(todo))
                    continue
                for candidate in todo:  # sized before any fit: a repair that makes the model bigger is not fitted
                    self._size(candidate, model, dense, target)
                todo = [c for c in todo if not c.note]
                cost.fit_sets([c.blocks for c in todo])
                for candidate, measured in zip(todo, cost.measure_sets([c.blocks for c in todo]), strict=True):
                    candidate.kl, candidate.ppl = measured["kl"], measured["ppl"]
                    if not math.isfinite(candidate.kl):
                        candidate.note = f"--replace {candidate.repair} cannot repair these spans"
                bar.update(len([c for c in candidates if c.repair == repair]))
        measured = [c for c in candidates if c.measured]
        if not measured:
            raise LayercutError("no candidate could be measured: " + "; ".join(
                f"{c.repair} {c.blocks}: {c.note}" for c in candidates[:3]))
        best = min(measured, key=lambda c: (c.kl, c.params or 0))
        reference = costs["none"].measure_sets([()])[0] if "none" in costs else None
        rows = costs["none"].measure_ids.shape if "none" in costs else None
        return {"count": count, "params_before": dense,
                "dense_ppl": None if reference is None else reference["ppl"],
                "measuring_rows": None if rows is None else list(rows),
                "not_applicable": {name: why for name, why in repairs if why is not None},
                "candidates": [dataclasses.asdict(c) for c in candidates], "chosen": candidates.index(best)}

    def _count(self, model) -> int:
        """The budget as a block count: ``--drop`` and ``--target-speedup`` say it; ``--target-params`` by sizes."""
        config = self.config.prune
        amounts = config.resolve(model)
        if amounts.drop is not None:
            return amounts.drop
        blocks = get_blocks(model)[1]
        sizes = sorted((sum(p.numel() for p in block.parameters()) for block in blocks), reverse=True)
        excess, count = amounts.params - amounts.target_params, 0
        while excess > 0 and count < len(sizes):
            excess -= sizes[count]
            count += 1
        return count

    def _target_params(self, model) -> int | None:
        return self.config.prune.resolve(model).target_params

    def _candidates(self, model, base: PruneConfig, amounts, repairs: list[str]) -> list[Candidate]:
        """Every block set a one-pass selection chooses, crossed with every repair (``repaired-fast``: its own)."""
        calibration, moments, scores = self.scored.calibration, self.scored.moments, self.scored.scores
        found: dict[tuple[tuple[int, ...], str], Candidate] = {}
        choices = [("topk", score) for score in SCORES] + [("span", "linearity")]
        for select, score in choices:
            blocks = tuple(planned_blocks(model, calibration, moments, scores,
                                          dataclasses.replace(base, select=select, score=score), amounts,
                                          self.scored.memo))
            for repair in repairs:
                found.setdefault((blocks, repair), Candidate(list(blocks), repair, [])).chosen_by.append(
                    f"{select}/{score}")
        # a selection that declares a one-pass measure of each block's repair chooses for that repair alone
        for name, selection in SELECTIONS.items():
            if not (selection.repairs and selection.measures == "pass"):
                continue
            for repair in (r for r in repairs if r != "none"):
                variant = dataclasses.replace(base, select=name, replace=repair)
                blocks = tuple(planned_blocks(model, calibration, moments, scores, variant, amounts, self.scored.memo))
                found.setdefault((blocks, repair), Candidate(list(blocks), repair, [])).chosen_by.append(
                    f"{name}/linearity")
        return list(found.values())

    def _size(self, candidate: Candidate, model, dense: int, target: int | None) -> None:
        """Its parameter count: the kept blocks' and what its repair declares it adds (``Method.adds_params``).

        A candidate above the original's count (or ``--target-params``) is noted as not one.
        """
        removed = sum(p.numel() for b in candidate.blocks for p in get_blocks(model)[1][b].parameters())
        method = METHODS[candidate.repair]
        candidate.params = dense - removed + (method.adds_params(model) if method.adds_params else 0)
        if candidate.params > dense:
            candidate.note = f"not a candidate: {candidate.params:,} parameters, more than the original's {dense:,}"
        elif target is not None and candidate.params > target:
            candidate.note = f"not a candidate: {candidate.params:,} parameters, above --target-params {target:,}"

    # ---- build ---------------------------------------------------------------------------------------------

    def chosen_config(self, shortlist: dict) -> PruneConfig:
        """The ``prune.run`` config that writes the chosen checkpoint."""
        chosen = Candidate(**shortlist["candidates"][shortlist["chosen"]])
        select, score = chosen.select
        return dataclasses.replace(self.config.prune, drop=shortlist["count"], target_params=None,
                                   target_speedup=None, select=select, score=score, replace=chosen.repair,
                                   auto_replace=False, out=str(self.work / CHECKPOINT), overwrite=True)

    def build(self, shortlist: dict) -> dict:
        """``checkpoint/``: prune.run's checkpoint of the chosen candidate."""
        folder = self.work / CHECKPOINT
        config = self.chosen_config(shortlist)
        chosen = Candidate(**shortlist["candidates"][shortlist["chosen"]])
        if not (folder / REPORT_FILE).is_file():
            self.say(f"building {_describe(shortlist)}")
            if self.loaded is None or self.scored is None:  # a resumed run: prune.run's own load and scoring
                result = run_prune(config)
            else:
                result = run_prune(config, loaded=self.loaded, scored=self.scored)
            self.loaded = None  # surgered in place: not the original any more
            if result.dropped != chosen.blocks:
                raise LayercutError(f"prune.run chose blocks {result.dropped} where the shortlist measured "
                                    f"{chosen.blocks}: report this (its selection is not deterministic)")
        return {"blocks": chosen.blocks, "repair": chosen.repair}

    # ---- heal ----------------------------------------------------------------------------------------------

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
            raise LayercutError(f"{path} is missing: remove {self.work} and run again")
        return load_file(str(path))["token_ids"]

    def heal_steps(self, plan: dict, done: Sequence[dict]) -> tuple[int, str]:
        """(steps, why): ``--heal-steps``, or fewer when ``--time-budget`` leaves time for fewer.

        The time left is the budget less the stages done and a reserve for the engine checks (the build's time
        per held-out text and two more: measured on a 2-core CPU, reports/ship/); a step costs the planner's
        time x ``HEAL_MARGIN``.
        """
        steps = self.config.heal_steps
        if not steps:
            return 0, "--heal-steps 0"
        budget = self.config.time_budget
        planned = plan.get("planned_heal_seconds")
        if budget is None:
            return steps, f"--heal-steps {steps}"
        if not planned:
            return 0, "no plan of its time to hold against --time-budget"
        spent = sum(stage.get("seconds", 0.0) for stage in done)
        reserve = done[-1].get("seconds", 0.0) * (max(len(self.config.heldout), 1) + 2) if self.config.verify else 0
        left = budget - spent - reserve
        per_step = planned / self.config.heal_steps * HEAL_MARGIN
        fits = max(int(left // per_step), 0)
        if fits < HEAL_MIN_STEPS:
            return 0, (f"--time-budget leaves {_duration(max(left, 0))} after the engine checks' reserve: "
                       f"{fits} steps at the planned {per_step:.1f} s each, under {HEAL_MIN_STEPS}")
        if fits < steps:
            return fits, f"{fits} of --heal-steps {steps}: what --time-budget leaves ({_duration(left)})"
        return steps, f"--heal-steps {steps}"

    def heal(self, plan: dict, done: Sequence[dict]) -> dict:
        """Distil the built checkpoint towards the original; kept (``healed/``) when its KL falls.

        The KL is measured on the shortlist's measuring rows, which the healing never trains on.
        """
        from prune.checkpoint.save_load import load, save
        from prune.checkpoint.write import HELDOUT_BEFORE_DISTILL, read_report
        from prune.model.surgery import LAYOUT_ATTR
        from prune.pipeline.steps import build_step

        steps, why = self.heal_steps(plan, done)
        result = {"steps": steps, "why": why, "kept": False, **HEAL_OPTIONS}
        healed = self.work / HEALED
        shutil.rmtree(healed, ignore_errors=True)  # a killed heal's: this one starts again
        if not steps:
            self.say(f"not healing: {why}")
            return result
        config = self.config.prune
        fit_ids, measure_ids = split_rows(self._calibration())
        train, unseen = _cut(fit_ids, HEAL_SEQ_LEN), _cut(measure_ids, HEAL_SEQ_LEN)
        original = self._load()
        checkpoint = self.work / CHECKPOINT
        student = load(checkpoint, dtype=config.load.dtype, device=config.load.device)
        report = read_report(checkpoint)
        if getattr(student.model.config, LAYOUT_ATTR, None) is None:
            setattr(student.model.config, LAYOUT_ATTR, report.get("layout"))
        before = divergence(student.model, original.model, measure_ids, config.batch_size)
        self.say(f"healing: {steps} steps of distillation towards the original ({why}); KL before {before['kl']:.4f}")
        options = {**HEAL_OPTIONS, "steps": steps, "seed": config.data.seed}
        step_config = dataclasses.replace(config, out=str(healed))  # the step's work folder goes beside healed/
        step = build_step("distill", options, step_config)
        done_step = step(student, step_config, token_ids=train, heldout_ids=unseen, teacher=original)
        for folder in done_step.cleanup:
            shutil.rmtree(folder, ignore_errors=True)
        after = divergence(student.model, original.model, measure_ids, config.batch_size)
        result.update(kl_before=before["kl"], kl_after=after["kl"], ppl_before=before["ppl"], ppl_after=after["ppl"],
                      kept=after["kl"] < before["kl"], tokens=int(train.numel()),
                      distill_seconds=done_step.report.get("seconds"))
        self.say(f"healed: KL {before['kl']:.4f} -> {after['kl']:.4f} on rows it did not train on; "
                 + ("kept" if result["kept"] else "not kept (the built checkpoint ships)"))
        if result["kept"]:
            if isinstance(report.get("heldout"), dict):  # measured before healing: say so
                report["heldout"] = {**report["heldout"], "stage": HELDOUT_BEFORE_DISTILL}
            report["heal"] = {**done_step.report, "kl_before": before["kl"], "kl_after": after["kl"]}

            def card(staging: Path) -> None:
                if (checkpoint / CARD).is_file():
                    shutil.copy2(checkpoint / CARD, staging / CARD)

            save(student.model, student.tokenizer, healed, report, extra=card)
        return result

    # ---- export --------------------------------------------------------------------------------------------

    def export(self, final: Path) -> dict:
        """For llama.cpp, the GGUF of ``--gguf-type`` beside the checkpoint that ships."""
        if self.config.engine != "llamacpp":
            return {"gguf": None}
        from prune.checkpoint.gguf import export_gguf

        gguf = self.gguf(final)
        if not gguf.is_file():
            self.say(f"writing the {self.config.gguf_type} GGUF")
            export_gguf(final, gguf, self.config.gguf_type, self.config.converter)
        return {"gguf": gguf.name}

    def gguf(self, folder: Path) -> Path:
        """Where the GGUF of ``folder`` goes: ``gguf/<OUT's name>-<type>.gguf`` (so it keeps OUT's name)."""
        from prune.checkpoint.gguf import GGUF_FOLDER

        return folder / GGUF_FOLDER / f"{Path(self.config.out).resolve().name}-{self.config.gguf_type}.gguf"

    # ---- verify --------------------------------------------------------------------------------------------

    def verify(self, checkpoint: Path) -> dict:
        """The engine's perplexity and greedy ids against transformers', per held-out text, and its speed."""
        config = self.config
        folder = self.work / VERIFY
        folder.mkdir(exist_ok=True)
        heldout = list(config.heldout) or [f"calibration held-out rows={self._heldout_text()}"]
        engines = REFERENCE if config.engine == REFERENCE else f"{REFERENCE},{config.engine}"
        domains = {}
        for index, spec in enumerate(heldout):
            label, text = heldout_label(spec)
            name = f"{index}-{re.sub(r'[^A-Za-z0-9_.-]+', '_', label)}"[:60]
            args = ["serving", "--model", f"original={config.prune.load.model}", "--model", f"slim={checkpoint}",
                    "--heldout", text, "--engines", engines, *self._windows()]
            domains[label] = self._child(args, folder / name, "serving.json")
        quantized = None
        if config.engine == "llamacpp" and config.gguf_type != "f32":
            args = ["serving", "--model", f"slim-{config.gguf_type}={self.gguf(checkpoint)}", "--heldout",
                    heldout_label(heldout[0])[1],
                    "--engines", "llamacpp", "--greedy-tokens", "0", *self._windows()]
            quantized = self._child(args, folder / "quantized", "serving.json")
        speed_model = str(self.gguf(checkpoint)) if config.engine == "llamacpp" and config.gguf_type == "f32" \
            else str(checkpoint)
        args = ["speed", "--baseline", config.prune.load.model, "--model", speed_model, "--engine", config.engine,
                "--repeats", str(config.speed_repeats), "--prompt-len", str(config.prompt_len),
                "--new-tokens", str(config.new_tokens)]
        speed = self._child(args, folder / "speed", "speed.json")
        return {"domains": domains, "quantized": quantized, "speed": speed, "heldout": [portable(t) for t in heldout]}

    def _windows(self) -> list[str]:
        """The serving bench's windows: the calibration's sequence length; as many tokens as its held-out rows."""
        data = self.config.prune.data
        tokens = max(data.heldout_samples, 1) * data.seq_len if not self.config.heldout else 4096
        return ["--seq-len", str(data.seq_len), "--tokens", str(tokens)]

    def _heldout_text(self) -> Path:
        """The calibration source's held-out rows as text (written by the shortlist: never scored nor fitted on)."""
        path = self.work / HELDOUT
        if not path.is_file():
            raise LayercutError(f"{path} is missing: remove {self.work} and run again")
        return path

    def _child(self, args: list[str], out: Path, result: str) -> dict:
        """``python -m eval.bench ARGS --out OUT`` unless ``OUT/RESULT`` is there; its JSON."""
        path = out / result
        if not path.is_file():
            args = [*args, "--out", str(out)]
            if self.config.threads:
                args += ["--threads", str(self.config.threads)]
            if self.config.converter:
                args += ["--converter", str(self.config.converter)]
            command = [sys.executable, "-m", "eval.bench", *args]
            self.say(f"verifying: {' '.join(shlex.quote(a) for a in command[1:])}")
            out.mkdir(parents=True, exist_ok=True)
            log = out / "log.txt"
            with log.open("w", encoding="utf-8") as handle:
                done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, check=False)
            if done.returncode != 0 or not path.is_file():
                tail = [line for line in log.read_text(encoding="utf-8").splitlines() if line.strip()][-1:]
                raise LayercutError(f"the engine check failed ({' '.join(args[:1])}, exit {done.returncode}): "
                                    f"{tail[0] if tail else 'no output'} (its log: {log})")
        return json.loads(path.read_text(encoding="utf-8"))

    # ---- card ----------------------------------------------------------------------------------------------

    def card(self, checkpoint: Path, plan: dict, shortlist: dict, verified: dict | None,
             times: dict[str, float], healed: dict | None = None) -> None:
        """``OUT/README.md`` above prune.run's card, and the settings that mark the folder shipped."""
        report = json.loads((checkpoint / REPORT_FILE).read_text(encoding="utf-8"))
        previous = (checkpoint / CARD).read_text(encoding="utf-8") if (checkpoint / CARD).is_file() else ""
        if _CARD_MARK in previous:  # a resumed run wrote it already
            front, body = _front_matter(previous)
            previous = front + body.split(_PRUNE_CARD_MARK, 1)[-1].lstrip("\n")
        text = ship_card(self.config, report, plan, shortlist, verified, self.chosen_config(shortlist), times,
                         healed)
        # the hub reads its metadata from a YAML block that must open the file: prune.run's card has one
        front, body = _front_matter(previous)
        _write_text_atomic(checkpoint / CARD, front + text + "\n\n" + _PRUNE_CARD_MARK + "\n\n" + body)
        # in the shipped folder (what a user uploads): no path of this machine
        _write_atomic(checkpoint / SETTINGS, {"settings": portable(self.config.settings()),
                                              "digest": settings_digest(self.config), "shortlist": shortlist,
                                              "verified": portable(_shipped_figures(verified))})


# ---- the card ------------------------------------------------------------------------------------------------

_CARD_MARK = "<!-- prune.ship -->"
_PRUNE_CARD_MARK = "<!-- prune.run's card -->"


def ship_card(config: ShipConfig, report: dict, plan: dict, shortlist: dict, verified: dict | None,
              chosen: PruneConfig, times: dict[str, float], healed: dict | None = None) -> str:
    """The page of a shipped checkpoint: the choice and its evidence, the loss, the speed, the commands."""
    name = portable_name(report.get("model_name"), report.get("source_model"))
    before, after = report["num_blocks_before"], report["num_blocks_after"]
    candidate = shortlist["candidates"][shortlist["chosen"]]
    engine = ENGINES[config.engine]
    lines = [_CARD_MARK, f"# {name}, {before} -> {after} blocks, for {engine}", "",
             f"Made with `prune.ship` in {sum(times.values()) / 60:.1f} min ("
             + ", ".join(f"{stage} {seconds:.0f} s" for stage, seconds in times.items())
             + f"): blocks {candidate['blocks']} removed, "
             f"{_repair_words(candidate['repair'])}; a plain {report['architecture']} checkpoint "
             f"({candidate['params']:,} parameters, the original {shortlist['params_before']:,}).", ""]
    lines += ["## What was chosen, and why", "",
              f"Every candidate was fitted on calibration rows and measured on {_rows(shortlist)} it was not fitted "
              "on: the KL divergence of its next-token distribution from the original model's (the choice: "
              "lowest), and its perplexity"
              + (f" (the original's: {shortlist['dense_ppl']:.3f})." if shortlist.get("dense_ppl") else "."), "",
              "| | blocks removed | repair | chosen by | parameters | KL | perplexity | note |",
              "|---|---|---|---|---|---|---|---|"]
    order = sorted(range(len(shortlist["candidates"])),
                   key=lambda i: (shortlist["candidates"][i]["kl"] is None, shortlist["candidates"][i]["kl"] or 0))
    for rank, index in enumerate(order, 1):
        c = shortlist["candidates"][index]
        mark = "**chosen**" if index == shortlist["chosen"] else str(rank)
        lines.append(f"| {mark} | {_blocks(c['blocks'])} | {c['repair']} | {', '.join(c['chosen_by'])} | "
                     f"{_count(c['params'])} | {_num(c['kl'], 4)} | {_num(c['ppl'], 3)} | {c['note']} |")
    for repair, why in shortlist.get("not_applicable", {}).items():
        lines.append(f"\n`--replace {repair}` does not apply to this model: {why}")
    if healed is not None:
        lines += ["", _heal_words(healed)]
    lines += ["", "## What was lost", ""]
    heldout = report.get("heldout")
    if heldout:
        stage = " before healing" if heldout.get("stage") else ""  # prune.run measured it; the heal came after
        lines.append(f"Held-out rows of the calibration source ({heldout['tokens']:,} tokens), in transformers"
                     f"{stage}: "
                     f"perplexity {heldout['original']:.3f} -> {heldout['pruned']:.3f} (x{heldout['ratio']:.3f})"
                     + (f"; removing the same blocks with nothing in their place: {heldout['removal']:.3f} "
                        f"(x{heldout['removal_ratio']:.3f})." if "removal" in heldout else "."))
    if verified:
        header = "| held-out text | original | slim | ratio |"
        if config.engine != REFERENCE:
            header += f" slim in {engine} | {engine} vs transformers | same greedy ids |"
        lines += ["", f"Perplexity in transformers on each held-out text ({_texts(verified)}):", "", header,
                  "|" + "---|" * (header.count("|") - 1)]
        for domain, rows in verified["domains"].items():
            lines.append(_domain_row(domain, rows, config.engine))
        if verified.get("quantized"):
            q = _row(verified["quantized"], f"slim-{config.gguf_type}", "llamacpp")
            if q:
                lines.append(f"\nThe {config.gguf_type} GGUF in llama.cpp, on the first text: perplexity "
                             f"{q['ppl']:.3f}.")
        lines += ["", f"## Speed in {engine}", "", _speed_words(verified["speed"], before, after)]
    else:
        lines += ["", "Not verified in an engine (--no-verify)."]
    kept = bool(healed and healed.get("kept"))
    lines += ["", "## Reproduce", "", "```bash", ship_command(config),
              "# the checkpoint before healing, without the shortlist:" if kept
              else "# the same checkpoint, without the shortlist:", prune_command(chosen, before), "```"]
    if config.engine == "llamacpp":
        name = f"gguf/{Path(str(config.out)).resolve().name}-{config.gguf_type}.gguf"
        lines += ["", f"The GGUF for llama.cpp is `{name}`."]
    return "\n".join(portable(line) for line in lines)


def _heal_words(healed: dict) -> str:
    """The card's paragraph on the healing: how many steps and why, and whether it was kept."""
    if not healed.get("steps"):
        return f"Not healed: {healed.get('why', '')}."
    said = (f"Healed: {healed['steps']} steps of distillation towards the original ({healed['why']}; KL of the "
            f"next-token distributions, LoRA on every Linear of the kept blocks, merged, so the checkpoint stays "
            f"plain), on {healed.get('tokens', 0):,} calibration tokens. On the calibration rows it did not train "
            f"on (the shortlist's measuring rows): KL "
            f"{healed['kl_before']:.4f} -> {healed['kl_after']:.4f}, perplexity {healed['ppl_before']:.3f} -> "
            f"{healed['ppl_after']:.3f}: ")
    return said + ("kept." if healed["kept"] else "not kept; the checkpoint is the one built, unhealed.")


def _cut(token_ids, length: int):
    """Rows of ``token_ids`` [n, seq] cut into rows of ``length`` tokens (the rows as they are when shorter)."""
    rows, seq = token_ids.shape
    if seq <= length:
        return token_ids
    usable = seq // length * length
    return token_ids[:, :usable].reshape(rows * (usable // length), length)


def _front_matter(card: str) -> tuple[str, str]:
    """(``---`` YAML block with its newline, the rest) of a model card; ("", card) without one."""
    if card.startswith("---\n"):
        end = card.find("\n---\n", 4)
        if end != -1:
            return card[: end + 5] + "\n", card[end + 5 :].lstrip("\n")
    return "", card


def ship_command(config: ShipConfig) -> str:
    """The ``prune.ship`` command of ``config``, as a user types it."""
    p = config.prune
    budget = (f"--drop {p.drop}" if p.drop is not None else f"--target-speedup {p.target_speedup}"
              if p.target_speedup is not None else f"--target-params {p.target_params}")
    parts = ["python -m prune.ship", f"--model {_quote(p.load.model)}", budget, f"--engine {config.engine}"]
    if config.time_budget is not None:
        parts.append(f"--time-budget {_duration(config.time_budget)}")
    parts += [f"--heldout {_quote(text)}" for text in config.heldout]
    if config.engine == "llamacpp" and config.gguf_type != "f32":
        parts.append(f"--gguf-type {config.gguf_type}")
    if config.heal_steps != ShipConfig.heal_steps:
        parts.append(f"--heal-steps {config.heal_steps}")
    parts += _data_flags(p)
    parts.append(f"--out {_quote(Path(str(config.out)).name)}")
    return " ".join(parts)


def _data_flags(config: PruneConfig) -> list[str]:
    """The calibration flags that differ from their defaults."""
    data, defaults = config.data, type(config.data)()
    return [f"--{key.replace('_', '-')} {_quote(str(getattr(data, key)))}"
            for key in ("data", "samples", "seq_len", "seed", "heldout_samples")
            if getattr(data, key) != getattr(defaults, key)]


def prune_command(config: PruneConfig, num_blocks: int) -> str:
    """The ``prune.run`` command that writes the chosen checkpoint."""
    parts = ["python -m prune.run", f"--model {_quote(config.load.model)}", f"--drop {config.drop}"]
    if config.select != "topk":
        parts.append(f"--select {config.select}")
    if config.score != "linearity":
        parts.append(f"--score {config.score}")
    parts.append(f"--replace {config.replace.method}")
    return " ".join(parts + _data_flags(config) + ["--out slim/"])


def _domain_row(domain: str, serving: dict, engine: str) -> str:
    original, slim = _row(serving, "original", REFERENCE), _row(serving, "slim", REFERENCE)
    served = _row(serving, "slim", engine) if engine != REFERENCE else slim
    label = domain
    if not (original and slim):
        return f"| {label} | not measured | | |"
    if engine == REFERENCE:
        return f"| {label} | {original['ppl']:.3f} | {slim['ppl']:.3f} | x{slim['ppl'] / original['ppl']:.3f} |"
    gap = "" if not served or engine == REFERENCE else f"{(served['ppl'] / slim['ppl'] - 1) * 100:+.3f} %"
    same = ""
    if served and engine != REFERENCE and served.get("greedy") and slim.get("greedy"):
        same = "yes" if served["greedy"] == slim["greedy"] else "**no**"
    return (f"| {label} | {original['ppl']:.3f} | {slim['ppl']:.3f} | x{slim['ppl'] / original['ppl']:.3f} | "
            f"{_num(served and served.get('ppl'), 3)} | {gap} | {same} |")


def _row(serving: dict | None, model: str, engine: str) -> dict | None:
    """The serving bench's row of ``model`` in ``engine`` (``eval.bench serving``'s ``rows``), if it ran."""
    row = (serving or {}).get("rows", {}).get(model, {}).get(engine)
    return row if row and row.get("runs") and row.get("ppl") is not None else None


def _speed_words(speed: dict, before: int, after: int) -> str:
    ideal = before / after
    ratios = speed.get("ratios") or []
    if not ratios:
        return f"No speed figures (the ideal decode speed-up is L/(L-k) = {ideal:.3f}x)."
    r = ratios[0]
    repeats = speed.get("options", {}).get("repeats", "")
    return (f"Against the original in {speed.get('engine', '')}, {repeats} timed rounds: prefill "
            f"x{r['prefill']:.3f}, decode x{r['decode']:.3f} (ratio of median throughputs; ideal L/(L-k) = "
            f"{ideal:.3f}x; paired rounds: prefill x{r['prefill_paired']['min']:.3f}-x{r['prefill_paired']['max']:.3f},"
            f" decode x{r['decode_paired']['min']:.3f}-x{r['decode_paired']['max']:.3f}).")


def _texts(verified: dict) -> str:
    texts = verified.get("heldout") or []
    if len(texts) == 1 and Path(texts[0]).name == HELDOUT:
        return "the held-out rows of the calibration source, as text"
    return ", ".join(f"`{portable(text)}`" for text in texts)


def _shipped_figures(verified: dict | None) -> dict | None:
    if verified is None:
        return None
    return {"domains": {d: s.get("rows") for d, s in verified["domains"].items()},
            "speed": verified["speed"].get("ratios")}


def _describe(shortlist: dict) -> str:
    c = shortlist["candidates"][shortlist["chosen"]]
    return f"blocks {c['blocks']} with --replace {c['repair']} (KL {c['kl']:.4f} on rows no fit saw)"


def _repair_words(repair: str) -> str:
    return "nothing in their place" if repair == "none" else f"repaired by `--replace {repair}` " \
        f"({METHODS[repair].description})"


def _plan_line(plan: dict, config: ShipConfig) -> str:
    what = f"{plan['drop']} of {plan['num_blocks']} blocks" if plan.get("drop") is not None else "the budget's blocks"
    time_ = f"; the planner gives prune.run {_duration(plan['planned_seconds'])}" if "planned_seconds" in plan else ""
    return f"plan: {what} go, verified in {ENGINES[config.engine]}{time_}"


def _rows(shortlist: dict) -> str:
    rows = shortlist.get("measuring_rows")
    return f"{rows[0]} x {rows[1]} calibration tokens" if rows else "calibration rows"


def _blocks(blocks: Sequence[int]) -> str:
    return ", ".join(str(b) for b in blocks)


def _count(value) -> str:
    return "" if value is None else f"{value:,}"


def _num(value, digits: int) -> str:
    return "" if value is None or (isinstance(value, float) and not math.isfinite(value)) else f"{value:.{digits}f}"


def _quote(text: str) -> str:
    return shlex.quote(str(portable(str(text))))


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f}m" if seconds >= 120 else f"{seconds:.0f}s"


def heldout_label(spec: str) -> tuple[str, str]:
    """``LABEL=TEXT`` (as ``eval.compare --heldout`` takes) or a bare TEXT, labelled by its folder and name."""
    label, sep, text = spec.partition("=")
    if sep and label and "/" not in label and not Path(spec).exists():  # a label, not a path holding "="
        return label, text
    path = Path(spec)
    return (f"{path.parent.name}/{path.stem}" if path.parent.name else path.stem), spec


def parse_duration(text: str) -> float:
    """``30m``, ``1h``, ``90s`` or seconds -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    value = str(text).strip().lower()
    scale = units.get(value[-1:], None)
    number = value[:-1] if scale else value
    try:
        seconds = float(number) * (scale or 1)
    except ValueError:
        raise LayercutError(f"--time-budget {text}: give a duration such as 30m, 1h or 900s") from None
    if seconds <= 0:
        raise LayercutError(f"--time-budget {text}: give a positive duration such as 30m")
    return seconds


def _write_atomic(path: Path, data: dict) -> None:
    _write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def _write_text_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` under a temporary name first: a kill leaves the old file or none, never half."""
    write_file_atomic(path, lambda staging: staging.write_text(text, encoding="utf-8"))


def settings_digest(config: ShipConfig) -> str:
    """A short digest of :meth:`ShipConfig.settings` (names a run in logs)."""
    return hashlib.sha256(json.dumps(config.settings(), sort_keys=True, default=str).encode()).hexdigest()[:10]


def remove_work(config: ShipConfig) -> None:
    """Delete ``OUT.work/`` (``--overwrite``)."""
    shutil.rmtree(config.work, ignore_errors=True)
