"""``ship.costs``: the planner's seconds for each of ship's stages, counted from the model's config alone."""

from __future__ import annotations

import dataclasses

import pytest

from prune.planner.inputs import Hardware, PlanInput
from prune.planner.shape import shape_of_model
from ship.costs import ShipWork, stage_seconds
from tests.helpers import make_tiny_model

STAGES = ["shortlist", "build", "heal", "export", "verify"]


@pytest.fixture(scope="module")
def shape():
    return shape_of_model(make_tiny_model("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=8))


def seconds(shape, work: ShipWork, **inputs) -> dict[str, float]:
    return stage_seconds(shape, PlanInput(model="tiny", samples=32, seq_len=512, **inputs), work)


def test_every_stage_is_costed_and_each_piece_of_work_costs_where_it_is_done(shape, monkeypatch):
    work = ShipWork(drop=2, repairs=(512, 768, 256))
    base = seconds(shape, work)
    assert list(base) == STAGES and all(base[s] > 0 for s in STAGES if s != "heal") and base["heal"] == 0
    # the model's own text, sampled for calibration, is the shortlist's
    sampled = seconds(shape, dataclasses.replace(work, self_batches=3))
    assert sampled["shortlist"] > base["shortlist"] and {s: sampled[s] for s in STAGES[1:]} == \
        {s: base[s] for s in STAGES[1:]}
    # another repair to fit and measure, more calibration, more held-out text: each where it is spent
    assert seconds(shape, dataclasses.replace(work, repairs=(*work.repairs, 768)))["shortlist"] > base["shortlist"]
    more = stage_seconds(shape, PlanInput(model="tiny", samples=64, seq_len=512), work)
    # the build fits nothing (the shortlist's fit is put in place); a skeleton's measures no held-out rows
    assert more["shortlist"] > base["shortlist"] and more["build"] == base["build"]
    assert seconds(shape, work, offload="sequential")["build"] < base["build"]
    texts = seconds(shape, dataclasses.replace(work, texts=4))
    assert texts["verify"] > base["verify"] and texts["shortlist"] == base["shortlist"]
    # the original's kept rows are not measured again; no checks, no verify; an engine serving folders: no export
    assert seconds(shape, dataclasses.replace(work, original_kept=True))["verify"] < base["verify"]
    assert seconds(shape, dataclasses.replace(work, verify=False))["verify"] == 0
    assert seconds(shape, dataclasses.replace(work, gguf=False))["export"] == 0
    assert seconds(shape, dataclasses.replace(work, heal_seconds=90.0))["heal"] == 90.0
    # generation fidelity decodes in memory only: a skeleton's verify is without it, by at least its two loads
    from ship.costs import _fidelity_seconds

    fidelity = _fidelity_seconds(shape, PlanInput(model="tiny", samples=32, seq_len=512), work)
    assert 0 < fidelity < base["verify"]
    # the original's side kept by an earlier run: only the checkpoint decodes, the original still judges it
    kept = _fidelity_seconds(shape, PlanInput(model="tiny", samples=32, seq_len=512),
                             dataclasses.replace(work, fidelity_kept=True))
    from prune.planner.machine import machine_speed
    from ship.costs import PROCESS_SECONDS

    assert 2 * PROCESS_SECONDS / machine_speed() < kept < fidelity  # both loads still paid for
    monkeypatch.setattr("ship.costs._fidelity_seconds", lambda *_: 1000.0)
    assert seconds(shape, work)["verify"] - base["verify"] == pytest.approx(1000.0 - fidelity)
    assert seconds(shape, work, offload="sequential")["verify"] < base["verify"]


def test_a_gpu_runs_the_arithmetic_faster_and_pays_for_its_launches_processes_and_files(shape):
    from prune.planner.rates import GPU_BLOCK_CALL_SECONDS
    from ship.costs import GPU_CANDIDATE_SECONDS, GPU_PROCESS_SECONDS, GPU_SHORTLIST_SECONDS

    work = ShipWork(drop=2, repairs=(512,))
    one_gpu = Hardware(gpus=1, gpu_memory=80e9)
    cpu, gpu = seconds(shape, work), seconds(shape, work, hardware=one_gpu)
    assert gpu["export"] == cpu["export"] > 0  # llama.cpp's converter reads and writes files on the CPU
    # the shortlist: its arithmetic is next to nothing on a GPU; what it pays is a fixed cost and one a candidate
    candidates = work.sets * (len(work.repairs) + 1)
    floor = GPU_SHORTLIST_SECONDS + candidates * GPU_CANDIDATE_SECONDS
    assert floor < gpu["shortlist"] < floor + 0.1
    wider = seconds(shape, dataclasses.replace(work, repairs=(512, 512)), hardware=one_gpu)
    assert wider["shortlist"] - gpu["shortlist"] == pytest.approx(work.sets * GPU_CANDIDATE_SECONDS, abs=0.05)
    # verify: three checks' processes (a tiny model's bytes are nothing), then a call of every block it runs
    assert 3 * GPU_PROCESS_SECONDS < gpu["verify"] < 3 * GPU_PROCESS_SECONDS + 5
    more = seconds(shape, dataclasses.replace(work, speed_rounds=work.speed_rounds + 1), hardware=one_gpu)
    calls = (work.new_tokens + 1) * (shape.layers + shape.layers - work.drop)  # a round of each model
    assert more["verify"] - gpu["verify"] == pytest.approx(calls * GPU_BLOCK_CALL_SECONDS)
    # a skeleton decodes nothing for fidelity: one check fewer; its serving check reads both models from disk once a
    # window and once a greedy token
    from eval.bench.checks import GREEDY_TOKENS
    from prune.planner.stages import disk_pass

    offloaded = seconds(shape, work, hardware=one_gpu, offload="sequential")
    skeleton = PlanInput(model="tiny", samples=32, seq_len=512, hardware=one_gpu, offload="sequential")
    passes = (max(1, work.heldout_tokens // 512) + GREEDY_TOKENS) * work.texts  # whole windows, as windows_of
    reads = passes * (2 * shape.layers - work.drop) / shape.layers * disk_pass(shape, skeleton)
    assert reads > 0 and gpu["verify"] - (offloaded["verify"] - reads) > GPU_PROCESS_SECONDS
    # a held-out text of 1,000 tokens is one window of 512 (its tail left out), as on the CPU: the same passes as 512
    served = {held: seconds(shape, dataclasses.replace(work, heldout_tokens=held), hardware=one_gpu)["verify"]
              for held in (512, 1000, 1024)}
    assert served[1000] == pytest.approx(served[512]) and served[1024] > served[512]


def test_the_measures_run_from_each_set_s_first_block_and_pay_for_every_logit_on_the_cpu(shape, monkeypatch):
    from prune.planner.machine import machine_speed
    from prune.planner.rates import flop_rate, forward_flops
    from ship.costs import LOGITS_SHARE

    work = ShipWork(drop=2, repairs=(512,))
    inp = PlanInput(model="tiny", samples=32, seq_len=512)
    measure, candidates = 4 * 512, work.sets * 2  # one row in 8 measures; removal and the repair, each set
    # a candidate runs the blocks from its set's first one, and the head
    deep = seconds(shape, dataclasses.replace(work, depth=0.75))["shortlist"]
    shallow = seconds(shape, dataclasses.replace(work, depth=0.25))["shortlist"]
    assert deep - shallow == pytest.approx(
        measure * candidates * (forward_flops(shape, 6, True) - forward_flops(shape, 2, True))
        / (flop_rate(inp) * LOGITS_SHARE))
    # every measuring pass's logits (the original's, shared by the repairs, and each candidate's), on the CPU only
    monkeypatch.setattr("ship.costs.LOGIT_SECONDS", 0.0)
    bare, gpu = seconds(shape, work)["shortlist"], seconds(shape, work, hardware=Hardware(gpus=1, gpu_memory=8e10))
    monkeypatch.setattr("ship.costs.LOGIT_SECONDS", 1e-6)
    checked = 2 * 512  # each repair's check of the shortcut, removal's too: one row at full depth in float32
    assert seconds(shape, work)["shortlist"] - bare == pytest.approx(
        ((1 + candidates) * measure + checked) * shape.vocab * 1e-6 / machine_speed())
    assert seconds(shape, work, hardware=Hardware(gpus=1, gpu_memory=8e10)) == gpu


def test_the_one_pass_selection_s_maps_and_each_repair_s_check_of_the_shortcut_are_counted(shape, monkeypatch):
    """On a Llama-3.2-1B shape block by block repaired-fast's 16 maps took 33 s of the scoring pass and the four
    checks a row each through the kept blocks: neither was planned, its shortlist 1.30x its plan (2026-12-05)."""
    from prune.planner.machine import machine_speed
    from prune.planner.rates import block_solve_flops, eigh_flops, fit_rate, flop_rate, forward_flops
    from ship.costs import LOGIT_SECONDS, LOGITS_SHARE

    inp = PlanInput(model="tiny", samples=32, seq_len=512)
    # a map a block: its Gram's decomposition, the solve's products, each share of the update checked
    assert block_solve_flops(shape, 2) == (eigh_flops(256) + 4 + 4) * 256 ** 3
    work = ShipWork(drop=2, repairs=(512, 256), map_shares=2)
    maps = shape.layers * block_solve_flops(shape, 2) / fit_rate(inp)
    assert seconds(shape, work)["shortlist"] - seconds(shape, dataclasses.replace(work, map_shares=0))[
        "shortlist"] == pytest.approx(maps)
    # the maps are solved before the budget chooses the repairs: a plan of removal alone still holds them, so
    # what a repair adds over it (ship.shortlist._within_time) does not
    alone = dataclasses.replace(work, repairs=())
    assert seconds(shape, alone)["shortlist"] - seconds(shape, dataclasses.replace(alone, map_shares=0))[
        "shortlist"] == pytest.approx(maps)
    # the check: one row in float32, through the kept blocks and the head; in 16 bits a batch of rows (its last
    # bit is above the check's tolerance)
    one_row = 512 * (forward_flops(shape, shape.layers - 2, True) / (flop_rate(inp) * LOGITS_SHARE)
                     + shape.vocab * LOGIT_SECONDS / machine_speed())
    wide = seconds(shape, work, dtype="bfloat16")["shortlist"] - seconds(shape, work)["shortlist"]
    assert wide == pytest.approx((4 - 1) * 3 * one_row)  # 4 measuring rows a batch, three repairs with removal


def test_the_plan_s_maps_are_what_the_one_pass_selection_solves(monkeypatch):
    """repaired-fast (``block_solves`` 1) decomposes one Gram and solves one map a block, and checks each share."""
    import torch

    import prune.selection.map_errors as map_errors
    from prune.selection.strategies import SELECTIONS

    model = make_tiny_model("llama")
    blocks = len(model.model.layers)
    solved, checked = [], []
    fit, residual = map_errors.fit_linear_map, map_errors.residual_sums
    monkeypatch.setattr(map_errors, "fit_linear_map", lambda *a, **k: solved.append(1) or fit(*a, **k))
    monkeypatch.setattr(map_errors, "residual_sums", lambda *a, **k: checked.append(1) or residual(*a, **k))
    eigh, decomposed = torch.linalg.eigh, []
    monkeypatch.setattr(torch.linalg, "eigh", lambda *a, **k: decomposed.append(1) or eigh(*a, **k))
    token_ids = torch.randint(0, model.config.vocab_size, (16, 32), generator=torch.Generator().manual_seed(0))
    map_errors.map_errors_of_shares(model, token_ids, [0.7, 1.0], batch_size=4)
    assert SELECTIONS.get("repaired-fast").block_solves == 1
    assert len(solved) == len(decomposed) == blocks and len(checked) == 2 * blocks


def test_block_by_block_each_whole_pass_of_the_shortlist_reads_the_blocks_it_runs_from_disk(shape):
    from prune.planner.stages import disk_pass

    work = ShipWork(drop=2, repairs=(512,))  # 3 sets: 6 candidates, each from half the blocks on
    offloaded = PlanInput(model="tiny", samples=32, seq_len=512, offload="sequential")
    assert disk_pass(shape, offloaded) > 0
    # the scoring pass, the fits' capture pass, the original's and the candidates' measures (4 rows: one batch),
    # the two repairs' (removal's and the fit's) checks of one row through the 6 kept blocks of 8
    reads = 1 + 1 + (1 + 6 * 0.5) + 2 * 6 / 8
    assert (seconds(shape, work, offload="sequential")["shortlist"] - seconds(shape, work)["shortlist"]
            == pytest.approx(reads * disk_pass(shape, offloaded)))
    # twice the measuring rows (8 of 64), two batches of them: each measuring pass reads every block twice
    more = stage_seconds(shape, dataclasses.replace(offloaded, samples=64), work)["shortlist"] - stage_seconds(
        shape, PlanInput(model="tiny", samples=64, seq_len=512), work)["shortlist"]
    assert more == pytest.approx((reads + 1 + 6 * 0.5) * disk_pass(shape, offloaded))


def test_a_replanned_shortlist_counts_its_sets_first_blocks(tiny_folder):
    from prune.pipeline.config import PruneConfig
    from prune.planner.shape import shape_of_model
    from ship.config import ShipConfig
    from ship.plan import _replanned

    model = make_tiny_model("llama")
    config = ShipConfig(prune=PruneConfig(load={"model": str(tiny_folder)}, data={"data": "builtin", "seq_len": 64},
                                          drop=2), out="unused")
    layers = shape_of_model(model).layers
    _, work = _replanned(config, model, 2, [[1, 2], [layers - 2, layers - 1], [2, 1]], None)
    # each view lacks its set's 2 blocks and runs from its first one's place: layers - 3 blocks, then none
    assert work.sets == 2 and work.depth == pytest.approx((layers - 3) / (2 * layers))


@pytest.mark.parametrize("gpus", [0, 1])
def test_a_speed_check_that_does_not_run_is_not_costed(shape, gpus):
    from ship.costs import GPU_PROCESS_SECONDS, PROCESS_SECONDS, _speed_seconds

    work = ShipWork(drop=2, repairs=(512,))
    inputs = {"offload": "sequential", **({"hardware": Hardware(gpus=1, gpu_memory=80e9)} if gpus else {})}
    timed, untimed = seconds(shape, work, **inputs), seconds(shape, dataclasses.replace(work, speed=False), **inputs)
    assert {s: untimed[s] for s in STAGES if s != "verify"} == {s: timed[s] for s in STAGES if s != "verify"}
    skipped = timed["verify"] - untimed["verify"]
    if gpus:  # its process, which reads both models, and its rounds' block calls
        from prune.planner.memory import weight_bytes
        from prune.planner.rates import DISK_BYTES_PER_S, GPU_BLOCK_CALL_SECONDS

        inp = PlanInput(model="tiny", samples=32, seq_len=512, **inputs)
        both = weight_bytes(shape, inp, shape.layers) + weight_bytes(shape, inp, shape.layers - work.drop)
        calls = (work.speed_rounds + 1) * (work.new_tokens + 1) * (2 * shape.layers - work.drop)
        assert skipped == pytest.approx(GPU_PROCESS_SECONDS + both / DISK_BYTES_PER_S + calls * GPU_BLOCK_CALL_SECONDS)
    else:  # its process, both models' rounds, and the original's GGUF for llama.cpp, which only it reads
        from prune.planner.machine import machine_speed
        from prune.planner.memory import weight_bytes
        from ship.costs import CONVERT_BYTES_PER_S

        inp = PlanInput(model="tiny", samples=32, seq_len=512)
        rounds = _speed_seconds(shape, inp, work)
        converted = weight_bytes(shape, inp, shape.layers) / (CONVERT_BYTES_PER_S * machine_speed())
        assert rounds > 0 and skipped == pytest.approx(rounds + PROCESS_SECONDS / machine_speed() + converted)


@pytest.mark.parametrize(("offload", "engine", "speed"), [("none", "transformers", True),
                                                           ("sequential", "transformers", False),
                                                           ("sequential", "llamacpp", True)])
def test_ship_work_costs_the_speed_check_where_verify_runs_it(offload, engine, speed, tiny_folder):
    from prune.pipeline.config import PruneConfig
    from ship.config import ShipConfig
    from ship.plan import ship_work

    prune = PruneConfig(load={"model": str(tiny_folder), "offload": offload}, data={"data": "builtin"}, drop=2)
    config = ShipConfig(prune=prune, out="slim",
                        engine=engine, heal_steps=0)
    assert ship_work(config, None, 2, None).speed is speed


def test_a_skeleton_s_serving_check_reads_both_models_from_disk_once_a_window_and_once_a_greedy_token(shape,
                                                                                                     monkeypatch):
    """The Llama-3-8B shape's verify block by block was planned at 84 s and read 57 GB from disk for each of its
    window and its 32 greedy tokens (2026-12-06): each decode step of a skeleton runs every block again."""
    import ship.costs as costs
    from eval.bench.checks import GREEDY_TOKENS

    work = ShipWork(drop=2, repairs=(512,), heldout_tokens=1024)
    read = {}
    for disk in (0.0, 1.0):  # one second a whole pass
        monkeypatch.setattr(costs, "disk_pass", lambda shape_, inp, disk=disk: disk)
        read[disk] = seconds(shape, work, offload="sequential")["verify"]
        kept = seconds(shape, dataclasses.replace(work, original_kept=True), offload="sequential")["verify"]
    windows = 1024 // 512
    slim = (shape.layers - work.drop) / shape.layers
    assert read[1.0] - read[0.0] == pytest.approx((windows + GREEDY_TOKENS) * (1 + slim))
    assert read[1.0] - kept > (windows + GREEDY_TOKENS) * 1.0  # a kept original's rows read nothing again


def test_the_tasks_check_costs_its_rows_on_both_models_unless_the_original_s_scores_are_kept(shape):
    from prune.planner.machine import machine_speed
    from ship.costs import PROCESS_SECONDS, TaskWork, task_work, tasks_seconds

    # rows: --limit's, else the task's own where known (a draw's N, a range of a known task); unknown: none counted
    assert task_work(["piqa"], 200, 4) == (TaskWork("piqa", 200, 2, None, 4),)  # two solutions a row
    assert task_work(["piqa", "ifeval"], None, 4) == (TaskWork("piqa", 1838, 2, None, 4),
                                                      TaskWork("ifeval", 541, 1, 256, 4))
    assert [t.rows for t in task_work(["hellaswag", "piqa"], "-500:", 4)] == [500, 500]
    assert task_work(["copa"], None, 4)[0].rows is None and task_work(["copa"], "30~0:", 4)[0].rows == 30
    inp = PlanInput(model="tiny", samples=32, seq_len=512)
    loads = PROCESS_SECONDS / machine_speed()  # a fresh process and a model's load, for each model

    def part(tasks, limit, drop=2, kept=False, batch=4):
        return tasks_seconds(shape, inp, ShipWork(drop=drop, repairs=(), tasks=task_work(tasks, limit, batch),
                                                   tasks_kept=kept))

    assert part(["piqa"], 400) - 2 * loads == pytest.approx(4 * (part(["piqa"], 100) - 2 * loads))
    assert part(["copa"], None) == pytest.approx(2 * loads)  # rows unknown: the plan warns and counts none
    # the original's scores kept: the checkpoint's alone, half the part where both models are as deep
    assert part(["piqa"], 100, drop=0, kept=True) == pytest.approx(part(["piqa"], 100, drop=0) / 2)
    assert part(["piqa"], 100, kept=True) < part(["piqa"], 100) / 2  # the checkpoint is the shallower
    # IFEval decodes 256 tokens for each batch of rows: a larger batch takes fewer steps; a scored task, the same
    assert part(["ifeval"], 64, batch=8) < part(["ifeval"], 64) and part(["piqa"], 64, batch=8) == part(["piqa"], 64)
    assert part(["ifeval"], 64) > part(["piqa"], 64)
    # in the verify stage, on the CPU as on a GPU
    work = ShipWork(drop=2, repairs=(512,))
    with_tasks = dataclasses.replace(work, tasks=task_work(["piqa"], 100, 4))
    assert seconds(shape, with_tasks)["verify"] - seconds(shape, work)["verify"] == pytest.approx(part(["piqa"], 100))
    gpu = Hardware(gpus=1, gpu_memory=80e9)
    assert seconds(shape, with_tasks, hardware=gpu)["verify"] > seconds(shape, work, hardware=gpu)["verify"]
    assert seconds(shape, with_tasks)["shortlist"] == seconds(shape, work)["shortlist"]


def test_with_a_data_folder_an_offline_alias_is_planned_as_the_task_it_runs(tmp_path):
    from ship.costs import TaskWork, task_work

    # lambada runs lambada_openai's 5,153 rows from a data folder (eval.quality.lmeval.plan_tasks), once however named
    assert task_work(["lambada"], None, 4, tmp_path) == (TaskWork("lambada_openai", 5153, 1, None, 4),)
    assert task_work(["lambada", "lambada_openai"], "-500:", 4, tmp_path) == (
        TaskWork("lambada_openai", 500, 1, None, 4),)
    # from the hub it is lm-eval's lambada, whose rows the planner does not know (the plan warns)
    assert task_work(["lambada"], None, 4) == (TaskWork("lambada", None, 1, None, 4),)


def test_a_whole_task_on_a_gpu_costs_its_tokens_arithmetic_beside_its_block_calls():
    from transformers import LlamaConfig

    from prune.planner.memory import weight_bytes
    from prune.planner.rates import DISK_BYTES_PER_S, GPU_BLOCK_CALL_SECONDS, GPU_FLOPS, forward_flops
    from prune.planner.shape import shape_of_config
    from ship.costs import GPU_PROCESS_SECONDS, TASK_REQUEST_TOKENS, task_work, tasks_seconds
    from tests.prune.planner.test_planner import LLAMA3_70B

    shape = shape_of_config(LlamaConfig(**LLAMA3_70B))
    inp = PlanInput(model="llama-3-70b", samples=32, seq_len=512, hardware=Hardware(gpus=1, gpu_memory=80e9))
    # the checkpoint alone (60 blocks) on full HellaSwag: 10,042 rows of four endings, eight requests a pass
    work = ShipWork(drop=20, repairs=(), tasks=task_work(["hellaswag"], None, 8), tasks_kept=True)
    requests, kept = 10042 * 4, 60
    calls = -(-requests // 8) * kept * GPU_BLOCK_CALL_SECONDS
    arithmetic = requests * TASK_REQUEST_TOKENS * forward_flops(shape, kept, True) / GPU_FLOPS
    loads = GPU_PROCESS_SECONDS + weight_bytes(shape, inp, kept) / DISK_BYTES_PER_S
    assert tasks_seconds(shape, inp, work) == pytest.approx(loads + calls + arithmetic)
    # what counting the block calls alone left out: about four times them, a quarter of an hour
    assert 3 * calls < arithmetic and 600 < arithmetic < 1200
    # a generating task's written tokens each run through the model too
    ifeval = dataclasses.replace(work, tasks=task_work(["ifeval"], 64, 8))
    steps = 8 * 256  # eight batches of 256 decode steps
    assert tasks_seconds(shape, inp, ifeval) == pytest.approx(
        loads + (8 + steps) * kept * GPU_BLOCK_CALL_SECONDS
        + 64 * (TASK_REQUEST_TOKENS + 256) * forward_flops(shape, kept, True) / GPU_FLOPS)
