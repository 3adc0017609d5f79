"""``ship.heal``: how many steps the time left buys."""

from __future__ import annotations

import dataclasses
import math

import pytest

from ship.config import ShipConfig


def test_the_heal_takes_the_steps_the_time_budget_leaves(tmp_path, tiny_folder):
    from prune.pipeline.config import PruneConfig
    from ship.heal import HEAL_MARGIN, HEAL_MIN_STEPS, heal_steps
    from ship.work import StageResult

    def steps(budget, heldout=(), verify=True):
        config = ShipConfig(prune=PruneConfig(load={"model": str(tiny_folder)}, drop=2), out=str(tmp_path / "o"),
                            engine="transformers", time_budget=budget, heldout=list(heldout), verify=verify,
                            heal_steps=200)
        done = [StageResult(seconds=10.0), StageResult(seconds=100.0), StageResult(seconds=20.0)]
        return heal_steps(config, 200.0, done)  # 1 s a step planned

    # spent 130 s; the reserve for the checks: the build's 20 s x (1 text + 2) = 60 s; a step 1 s x HEAL_MARGIN
    assert steps(None) == (200, "--heal-steps 200")  # --heal-steps 200 given
    assert steps(190 + 100 * HEAL_MARGIN)[0] == 100
    assert steps(190 + 100 * HEAL_MARGIN, heldout=["a", "b"])[0] == 100 - math.ceil(20 / HEAL_MARGIN)  # 20 s more
    assert steps(130 + 100 * HEAL_MARGIN, verify=False)[0] == 100
    assert steps(10_000)[0] == 200
    few, why = steps(190 + (HEAL_MIN_STEPS - 1) * HEAL_MARGIN)
    assert few == 0 and f"under {HEAL_MIN_STEPS}" in why
    # the heal block by block: 100 of its planned 200 s are its passes, paid whatever the steps (a step is 0.5 s)
    config = ShipConfig(prune=PruneConfig(load={"model": str(tiny_folder)}, drop=2), out=str(tmp_path / "o"),
                        engine="transformers", time_budget=190 + 150 * HEAL_MARGIN, heal_steps=200)
    done = [StageResult(seconds=10.0), StageResult(seconds=100.0), StageResult(seconds=20.0)]
    assert heal_steps(config, 200.0, done, fixed=100.0)[0] == 100  # 150 s left after the checks; 100 for the passes
    assert heal_steps(config, 200.0, done)[0] == 150  # spread over the steps, the passes bought 50 steps too many


def test_heal_data_is_planned_as_more_rows_for_the_teachers_cache(tiny_folder, tmp_path):
    from prune.pipeline.config import PruneConfig
    from ship.plan import planned_heal

    def planned(**changes):
        prune = PruneConfig(load={"model": str(tiny_folder)}, data={"samples": 16, "seq_len": 32}, drop=2)
        config = ShipConfig(prune=prune, out=str(tmp_path / "o"), engine="transformers", **changes)
        return planned_heal(config, prune)

    alone, more = planned(), planned(heal_data="builtin", heal_samples=256)
    assert alone > 0 and more > alone  # the same steps; the teacher's cache writes 256 more rows


def test_the_models_own_heal_text_is_planned_as_sampling_in_the_heal_stage(tiny_folder, tmp_path):
    """--heal-data self samples before the heal trains: the heal stage's plan holds it, the training's does not."""

    from prune.pipeline.config import PruneConfig
    from prune.planner.estimate import hardware_for, plan_config
    from ship.costs import stage_seconds
    from ship.plan import ship_work

    prune = PruneConfig(load={"model": str(tiny_folder)}, data={"samples": 16, "seq_len": 32, "data": "builtin"},
                        drop=2)

    def work(data, samples=16):
        config = ShipConfig(prune=prune, out=str(tmp_path / "o"), engine="transformers", heal_steps=50,
                            heal_samples=samples, heal_data=data)
        return ship_work(config, None, 2, 10.0)

    assert work("builtin").heal_self_batches == 0 and work("self:chat").heal_self_batches == 2
    assert work("self", samples=20).heal_self_batches == 3  # whole batches of 8, as the sampling draws them
    assert work("self:batch=64", samples=20).heal_self_batches == 1  # one batch of 64 rows: a third of the steps
    planned = plan_config(prune, hardware_for("cpu"))
    seconds = stage_seconds(planned.shape, planned.inp, work("self:chat"))
    read = stage_seconds(planned.shape, planned.inp, work("builtin"))
    assert read["heal"] == 10.0 < seconds["heal"] and read["shortlist"] == seconds["shortlist"]
    more = stage_seconds(planned.shape, planned.inp, work("self:chat", samples=64))
    assert more["heal"] - 10.0 == pytest.approx(4 * (seconds["heal"] - 10.0))  # four times the batches


def test_the_heal_is_planned_holding_the_original_beside_the_checkpoint_and_no_scoring_statistics(tiny_folder,
                                                                                                  tmp_path):
    """Ship's heal keeps the original (it measures the KL after training) though the teacher's cache stands in for
    it during training, and the build has released the scoring pass: the plan's peak counts the one, not the other."""
    from prune.pipeline.config import PruneConfig
    from ship.plan import _heal_plan, make_plan, planned_heal_peak

    prune = PruneConfig(load={"model": str(tiny_folder)}, data={"samples": 16, "seq_len": 32}, drop=2)

    def config(**changes):
        return ShipConfig(prune=prune, out=str(tmp_path / "o"), engine="transformers", **changes)

    assert planned_heal_peak(config(heal_steps=0), prune) is None
    peak = planned_heal_peak(config(heal_steps=50), prune)
    training = next(s for s in _heal_plan(config(heal_steps=50), prune).stages if s.name == "distillation")
    original = next(s for s in _heal_plan(config(heal_steps=50), prune).stages if s.name == "load").devices["cpu"]
    parts = training.devices["cpu"]
    assert "teacher" not in parts and "moments (float64)" in parts  # prune.run's plan: cached teacher, live moments
    assert peak["cpu"] == sum(parts.values()) - parts["moments (float64)"] + original["weights"]
    plan = make_plan(config(heal_steps=50))
    assert plan.planned_heal_peak == peak and plan.planned_peak["cpu"] >= peak["cpu"]
    # one plan of the heal gives both: keeping the original adds memory, not seconds
    from ship.plan import planned_heal

    assert plan.planned_heal_seconds == planned_heal(config(heal_steps=50), prune) > 0
    assert make_plan(config(heal_steps=0)).planned_heal_peak is None
    # --lora-r 4 on q_proj alone: fewer adapters, their gradients and Adam's moments than rank 64 on every Linear
    narrow = config(heal_steps=50, heal_train={"lora_r": 4, "lora_targets": "q_proj"})
    assert planned_heal_peak(narrow, prune)["cpu"] < planned_heal_peak(config(heal_steps=50, heal_train={
        "lora_r": 4}), prune)["cpu"] < peak["cpu"]  # the layers adapted count, and the rank


def test_the_card_says_what_the_heal_trained():
    """As the heal trained it (its heal.json), whatever the defaults are now."""
    import dataclasses

    from distill.heal import HEAL_OPTIONS, heal_settings
    from ship.heal import Healing

    healed = Healing(steps=50, why="--heal-steps 50", kept=True, kl_before=0.5, kl_after=0.4, ppl_before=30.0,
                     ppl_after=28.0, tokens=25_600, **heal_settings())
    rank, alpha = HEAL_OPTIONS.get("lora_r", 8), HEAL_OPTIONS.get("lora_alpha", 16)
    assert f"LoRA of rank {rank} and alpha {alpha:g} on every Linear of the kept blocks, merged" in healed.words()
    assert "LoRA of rank 5 and alpha 7 on" in dataclasses.replace(healed, lora_r=5, lora_alpha=7.0).words()
    named = dataclasses.replace(healed, lora_r=5, lora_alpha=7.0, lora_targets="q_proj,v_proj")
    assert "LoRA of rank 5 and alpha 7 on the q_proj, v_proj layers of the kept blocks, merged" in named.words()
    older = dataclasses.replace(healed, lora_r=None, lora_alpha=None)  # a heal.json from before they were kept
    assert "LoRA on every Linear of the kept blocks, merged" in older.words()
    every = Healing(steps=50, why="w", kept=True, kl_before=0.5, kl_after=0.4, ppl_before=3.0, ppl_after=2.0,
                    **heal_settings({"train": "all"}))
    assert every.lr == 2e-5 and every.lora_r is None
    assert "every weight but the embedding and the head, so the checkpoint stays plain" in every.words()
    assert "LoRA" not in every.words() and "merged" not in every.words()


def test_the_heal_texts_sampling_is_reserved_beside_the_engine_checks(tiny_folder, tmp_path, monkeypatch):
    """The steps get what the budget leaves after the export, the checks and the heal's own sampling of its text."""
    import ship.shipper as shipper
    from prune.pipeline.config import PruneConfig
    from ship.plan import Plan

    asked = []
    monkeypatch.setattr(shipper, "heal_steps", lambda config, planned, done, reserve=None, fixed=0.0: (
        asked.append((planned, reserve)) or (0, "no steps")))
    monkeypatch.setattr(shipper, "heal", lambda *args, **kwargs: None)
    prune = PruneConfig(load={"model": str(tiny_folder)}, drop=2)
    config = ShipConfig(prune=prune, out=str(tmp_path / "o"), engine="transformers", heal_steps=50,
                        heal_data="self:chat")
    plan = Plan(drop=2, planned_heal_seconds=20.0,
                planned_stages={"shortlist": 1.0, "build": 1.0, "heal": 32.5, "export": 5.0, "verify": 7.0})
    shipper.Shipper(config, say=lambda line: None).heal(plan, [])
    assert asked[-1] == (20.0, 5.0 + 7.0 + 12.5)  # the heal stage's 32.5 s less its 20 s of training
    plan.planned_stages = {**plan.planned_stages, "heal": 20.0}  # nothing sampled: the checks alone
    shipper.Shipper(config, say=lambda line: None).heal(plan, [])
    assert asked[-1] == (20.0, 12.0)
    plan.planned_stages = None  # no plan of the stages: heal_steps reserves by the build's time itself
    shipper.Shipper(config, say=lambda line: None).heal(plan, [])
    assert asked[-1] == (20.0, None)


def test_a_skeletons_heal_is_planned_block_by_block(tiny_folder, tmp_path):
    """Under --offload sequential the plan's heal is the pair of blocks' steps and the two recording passes (no
    teacher's cache, no student in memory): its memory is a streamed block, the recorded states and the pair with
    Adam's states, far below the heal in memory; it grows with the steps and is none without them."""
    from prune.pipeline.config import PruneConfig
    from prune.planner.estimate import hardware_for, plan_config
    from prune.planner.memory import divergence_logit_bytes, weight_bytes
    from prune.planner.stages import stage_local_heal
    from ship.plan import make_plan

    def config(offload, **changes):
        prune = PruneConfig(load={"model": str(tiny_folder), "offload": offload},
                            data={"samples": 16, "seq_len": 32, "data": "builtin"}, drop=2)
        return ShipConfig(prune=prune, out=str(tmp_path / "o"), engine="transformers", **changes)

    streamed, memory = make_plan(config("sequential", heal_steps=50)), make_plan(config("none", heal_steps=50))
    sized = plan_config(config("sequential").prune, hardware_for("cpu"))
    stage = stage_local_heal(sized.shape, sized.inp, 50)
    assert stage.seconds > 0 and streamed.planned_heal_seconds == pytest.approx(stage.seconds)
    assert streamed.planned_heal_peak == {"cpu": pytest.approx(sum(stage.devices["cpu"].values()))}
    assert {"recorded states", "pair + gradients + Adam (float32)"} <= set(stage.devices["cpu"])
    assert streamed.planned_heal_peak["cpu"] < memory.planned_heal_peak["cpu"]
    assert stage_local_heal(sized.shape, sized.inp, 100).seconds > stage.seconds
    # once the cuts are known their passes are counted to their depths: a second cut costs its passes and
    # steps again, a shallower one less (the tiny model's 4 blocks less 2: before loading, one cut at 3/4 of the depth)
    one = stage_local_heal(sized.shape, sized.inp, 50, [(2, 3)])
    assert one.seconds == pytest.approx(stage.seconds)
    # ... less the KL after the heal, measured once
    assert one.seconds < stage_local_heal(sized.shape, sized.inp, 50, [(2, 3), (2, 3)]).seconds < 2 * one.seconds
    assert stage_local_heal(sized.shape, sized.inp, 50, [(1, 1)]).seconds < one.seconds
    # a cut at the last block trains it alone: half the pair's steps
    alone = stage_local_heal(sized.shape, sized.inp, 50, [(2, 3, 1)])
    assert alone.seconds < one.seconds and "50 steps of 1 block(s)" in alone.note
    assert make_plan(config("sequential", heal_steps=0)).planned_heal_seconds is None
    # the KL after holds the original's streamed block (no second embedding) and the 2 measuring rows' float32
    # log-probabilities of the original, once the training's parts and the recorded states went: the larger phase
    # is planned (on a 262k vocabulary, the KL's)
    for shape in (sized.shape, dataclasses.replace(sized.shape, vocab=262_144)):
        parts = stage_local_heal(shape, sized.inp, 50).devices["cpu"]
        held = parts["pair + gradients + Adam (float32)"] + parts["activations (backward)"] + parts["recorded states"]
        block = weight_bytes(shape, sized.inp, 1, embed=False, head=False)
        kl = divergence_logit_bytes(shape, sized.inp, 2) + block
        assert held + parts.get("the KL after, beyond the training's parts", 0.0) == pytest.approx(max(held, kl))
    assert kl > 2 * held  # the wide vocabulary's
    # two rows of the original's float32 log-probabilities of 32 positions (the model's logits are made a row's
    # chunk at a time: prune.model.head), three float32 chunks of one row's 32 beside them; a whole batch of 4
    # where the rows are more
    chunks = 262_144 * 3 * 32 * 4
    assert divergence_logit_bytes(shape, sized.inp, 2) == 262_144 * 2 * 32 * 4 + chunks
    assert divergence_logit_bytes(shape, sized.inp, 9) == divergence_logit_bytes(shape, sized.inp) == 2 * (
        divergence_logit_bytes(shape, sized.inp, 2)) - chunks


@pytest.mark.parametrize(("changes", "words"), [
    ({"heal_data": "self"}, "--heal-data self with --offload sequential: a skeleton cannot sample"),
    ({"processes": 2}, "--processes 2 with --offload sequential: the heal block by block"),
])
def test_what_the_heal_block_by_block_cannot_do_is_refused_in_one_line(tiny_folder, tmp_path, changes, words):
    from prune.errors import LayercutError
    from prune.pipeline.config import PruneConfig

    prune = PruneConfig(load={"model": str(tiny_folder), "offload": "sequential"}, data={"data": "builtin"}, drop=2)
    with pytest.raises(LayercutError, match=words):
        ShipConfig(prune=prune, out=str(tmp_path / "o"), engine="transformers", **changes)
    ShipConfig(prune=prune, out=str(tmp_path / "o"), engine="transformers", heal_steps=0, **changes)
