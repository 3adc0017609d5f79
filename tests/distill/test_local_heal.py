"""The heal block by block (``distill.local_heal``): which blocks each cut trains, and what training them does."""

from __future__ import annotations

import copy

import pytest
import torch

import distill.local_heal as local_heal
from distill.local_heal import (
    Cut,
    basis_changes,
    cut_depths,
    cuts_of,
    heal_cut,
    heal_locally,
    kept_cut_file,
    kept_cut_files,
    normalised_mse,
)
from prune.loading.offload import load_offloaded, materialized, streamed
from prune.model.adapters import get_blocks
from prune.model.surgery import block_layout, drop_blocks_
from prune.replace.capture import SpanBatch, record
from prune.replace.fitter import relative_mse
from prune.selection.repaired import divergence
from tests.helpers import make_tiny_model, make_tiny_tokenizer


@pytest.mark.parametrize(("layout", "cuts"), [
    # removal of blocks 3-4: the blocks either side of the gap, towards the original's block 5
    ([[0], [1], [2], [5], [6], [7]], [Cut((2, 3), 5)]),
    # a repair carried by block 2 (the span 3-4) and one by the last block (the span 7): each host and the next
    ([[0], [1], [2, 3, 4], [5], [6, 7]], [Cut((2, 3), 5), Cut((4,), 7)]),
    # the first blocks removed: the first kept block alone, towards its own depth
    ([[2], [3]], [Cut((0,), 2)]),
    # a repair of the first span carried by the block after it
    ([[0, 1, 2], [3]], [Cut((0, 1), 3)]),
    ([[0], [1], [2]], []),
])
def test_each_cut_trains_the_blocks_beside_it_towards_the_original_at_their_depth(layout, cuts):
    assert cuts_of(layout) == cuts


def test_blocks_removed_after_the_last_kept_one_train_it_towards_the_originals_last():
    """The layout alone cannot tell them (it ends at the last kept block): the original's block count does."""
    assert cuts_of([[0], [1], [2], [3], [4], [5]]) == []
    assert cuts_of([[0], [1], [2], [3], [4], [5]], blocks_before=8) == [Cut((5,), 7)]
    assert cuts_of([[0], [1, 2], [3]], blocks_before=4) == [Cut((1, 2), 3)]


def test_a_cut_below_a_change_of_basis_is_left_as_built(tmp_path, one_thread):
    """fold-rotate turns every weight upstream of its span: a shallower cut's states are the original's turned, so
    its target, read from the original, is in another basis; the deepest cut's is the original's own."""
    from distill.local_heal import in_original_basis

    cuts = cuts_of([[0], [1, 2], [3], [4, 5], [6], [7]])
    assert cuts == [Cut((1, 2), 3), Cut((3, 4), 6)]
    report = {"replacements": [{"method": "fold-rotate", "replaces": [5], "rotation_angle": 0.1},
                               {"method": "fold", "replaces": [2]}]}
    assert basis_changes(report) == [5]
    assert [in_original_basis(cut, [5]) for cut in cuts] == [False, True]
    original, slim = _pair(tmp_path)
    said = []
    records = heal_locally(slim, original, block_layout(slim), torch.randint(3, 320, (4, 64)), steps=2,
                           progress=False, basis_changes=[6], say=said.append)
    assert records == [] and "a deeper cut's repair turned the basis" in said[0]


def test_the_passes_that_record_a_cut_run_to_its_pair_and_through_its_target():
    """The slim model's pass stops as the pair's last block is called, the original's after its target block."""
    assert cut_depths([[0], [1], [2, 3, 4], [5], [6, 7]]) == [(3, 6, 2), (4, 8, 1)]


def _pair(tmp_path, model_type="llama", dropped=(3, 4), **overrides):
    torch.manual_seed(0)
    original = make_tiny_model(model_type, num_hidden_layers=8, **overrides)
    slim = copy.deepcopy(original)
    drop_blocks_(slim, list(dropped))
    tokenizer = make_tiny_tokenizer()
    for name, model in (("original", original), ("slim", slim)):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    return original, slim


def test_the_heal_brings_the_slim_model_closer_and_a_skeleton_heals_to_the_same_weights(tmp_path, one_thread):
    """On a random 8-block llama less blocks 3-4, 60 steps of blocks 2 and 3 cut the KL from the original on rows
    they never saw more than threefold (0.00135 -> 0.00034 when written); the same heal of the two checkpoints
    loaded as skeletons (one block in memory at a time) trains the same weights and measures the same KL."""
    original, slim = _pair(tmp_path)
    rows, unseen = torch.randint(3, 320, (16, 64)), torch.randint(3, 320, (4, 64))
    before = divergence(slim, original, unseen)["kl"]
    untouched = [p.clone() for p in get_blocks(slim)[1][5].parameters()]
    records = heal_locally(slim, original, block_layout(slim), rows, steps=60, lr=1e-3, progress=False,
                           say=lambda _: None)
    after = divergence(slim, original, unseen)["kl"]
    assert after < before / 3
    assert [r["blocks"] for r in records] == [[2, 3]] and records[0]["target"] == 5
    assert records[0]["loss_end"] < records[0]["loss_start"] / 5 and records[0]["tokens"] == 16 * 64
    assert all(torch.equal(a, b) for a, b in zip(untouched, get_blocks(slim)[1][5].parameters(), strict=True))

    student = load_offloaded(str(tmp_path / "slim"), dtype="float32").model
    teacher = load_offloaded(str(tmp_path / "original"), dtype="float32").model
    streamed_records = heal_locally(student, teacher, block_layout(slim), rows, steps=60, lr=1e-3, progress=False,
                                    say=lambda _: None)
    assert streamed_records == records
    for index in (2, 3):
        trained = materialized(get_blocks(student)[1][index])
        for a, b in zip(get_blocks(slim)[1][index].parameters(), trained.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    with streamed(student), streamed(teacher):
        assert divergence(student, teacher, unseen)["kl"] == pytest.approx(after, rel=1e-5)


def _killed_in_the_second_cut(tmp_path, monkeypatch):
    """Blocks 2 and 5 of 8 removed (two cuts): a heal in memory never killed, then one keeping its cuts in a work
    folder, killed in the second cut's steps. Returns the pair, layout, rows, work folder, the unbroken model and its
    records."""
    original, slim = _pair(tmp_path, dropped=(2, 5))
    layout, rows, work = block_layout(slim), torch.randint(3, 320, (8, 32)), tmp_path / "work"
    unbroken = copy.deepcopy(slim)
    records = heal_locally(unbroken, original, layout, rows, steps=10, progress=False, say=lambda _: None)
    steps, calls = local_heal.adam_steps, []

    def killed_in_the_second(*args, **kwargs):
        calls.append(kwargs["desc"])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return steps(*args, **kwargs)

    with monkeypatch.context() as patched, pytest.raises(KeyboardInterrupt):
        patched.setattr(local_heal, "adam_steps", killed_in_the_second)
        heal_locally(copy.deepcopy(slim), original, layout, rows, steps=10, progress=False, work=work,
                     say=lambda _: None)
    assert calls == ["heal blocks [1, 2]", "heal blocks [3, 4]"]
    return original, slim, layout, rows, work, unbroken, records


def test_a_killed_heal_goes_on_from_its_last_whole_cut_to_the_weights_of_an_unbroken_one(tmp_path, one_thread,
                                                                                          monkeypatch):
    """Two cuts, each kept in the work folder as it ends. A heal killed in the second cut's steps trains only that
    cut when run again, and ends at the weights and records of a heal never killed (the second cut's inputs are
    recorded through the first's kept weights); other rows or steps train both again."""
    original, slim, layout, rows, work, unbroken, records = _killed_in_the_second_cut(tmp_path, monkeypatch)
    assert [r["blocks"] for r in records] == [[1, 2], [3, 4]]
    assert sorted(path.name for path in work.iterdir()) == ["cut-1-2.safetensors"]
    assert kept_cut_files(work) == [kept_cut_file(work, Cut(blocks=(1, 2), target=0))]
    assert kept_cut_files(tmp_path / "none") == []
    trained, real = [], local_heal.adam_steps
    monkeypatch.setattr(local_heal, "adam_steps", lambda *a, **k: trained.append(k["desc"]) or real(*a, **k))
    again, said = copy.deepcopy(slim), []  # the built weights, as a run started again loads them
    assert heal_locally(again, original, layout, rows, steps=10, progress=False, work=work, say=said.append) == records
    assert trained == ["heal blocks [3, 4]"] and said[0].startswith("blocks [1, 2] healed before")
    for a, b in zip(unbroken.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)
    assert [r["tokens_read"] for r in records] == [10 * 4 * 32] * 2  # two whole batches of 4 rows
    for other in ({"rows": rows.flip(0)}, {"steps": 11}):  # other rows or settings: both cuts trained again
        trained.clear()
        said.clear()
        heal_locally(copy.deepcopy(slim), original, layout, **{"rows": rows, "steps": 10, **other}, progress=False,
                     work=work, say=said.append)
        assert trained == ["heal blocks [1, 2]", "heal blocks [3, 4]"] and "trained again" in said[0]


def test_a_skeleton_goes_on_from_cuts_kept_in_memory_to_the_same_weights(tmp_path, one_thread, monkeypatch):
    """The first cut kept by a heal in memory, killed in the second: the checkpoints loaded as skeletons (blocks on
    the meta device, the kept weights read into them as changes) train the second cut alone, to the weights of the
    heal in memory never killed (within 1e-6, as a skeleton's heal is)."""
    _, _, layout, rows, work, unbroken, _ = _killed_in_the_second_cut(tmp_path, monkeypatch)
    student = load_offloaded(str(tmp_path / "slim"), dtype="float32").model
    teacher = load_offloaded(str(tmp_path / "original"), dtype="float32").model
    said = []
    heal_locally(student, teacher, layout, rows, steps=10, progress=False, work=work, say=said.append)
    assert said[0].startswith("blocks [1, 2] healed before") and said[1].startswith("healing blocks [3, 4]")
    for index in (1, 2, 3, 4):
        trained = materialized(get_blocks(student)[1][index])
        for a, b in zip(get_blocks(unbroken)[1][index].parameters(), trained.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_layers_that_attend_differently_are_each_called_with_their_own_mask(tmp_path, one_thread):
    """Gemma-2's sliding and global layers take different masks (a window of 16 over rows of 64 tokens; the pair is
    slim blocks 2 and 3, the original's sliding block 2 and global block 5): before its first step the pair gives
    what the model's own pass gives, so its first loss is the model's own error, and the heal lowers the KL."""
    original, slim = _pair(tmp_path, "gemma2")
    blocks = get_blocks(slim)[1]
    assert slim.config.layer_types[2] != slim.config.layer_types[5]
    rows, unseen = torch.randint(3, 320, (4, 64)), torch.randint(3, 320, (4, 64))

    def states(recorder):
        recorder.input_of(blocks[2], "x")
        recorder.output_of(blocks[3], "out")

    seen = record(slim, rows, states)
    target = record(original, rows, lambda r: r.output_of(get_blocks(original)[1][5], "y"))["y"]
    own = float(normalised_mse(seen["out"], SpanBatch(seen["x"], target)))
    first = heal_cut(copy.deepcopy(slim), original, Cut((2, 3), 5), rows, steps=1, progress=False)
    assert first["loss_start"] == pytest.approx(own, rel=1e-4)
    before = divergence(slim, original, unseen)["kl"]  # 0.0045 -> 0.0019 when written
    heal_locally(slim, original, block_layout(slim), torch.randint(3, 320, (16, 64)), steps=60, lr=1e-3,
                 progress=False, say=lambda _: None)
    assert divergence(slim, original, unseen)["kl"] < 0.6 * before


def test_the_unit_rms_loss_weighs_every_dimension_as_the_next_blocks_norm_reads_it():
    """A stream with one outlier dimension 100 times the others: the stream's MSE calls an error of 5 % in the outlier
    the worse, though the next block's norm all but scales it away; the unit-RMS MSE calls the error of 100 % in the
    three small dimensions the worse, which the norm passes on whole."""
    y = torch.tensor([[[100.0, 1.0, 1.0, 1.0]]])
    batch = SpanBatch(x=torch.tensor([[[90.0, 0.0, 0.0, 0.0]]]), y=y)
    in_outlier, in_small = y + torch.tensor([5.0, 0, 0, 0]), y + torch.tensor([0, 1.0, 1.0, 1.0])
    assert relative_mse(in_outlier, y, batch.x) > 8 * relative_mse(in_small, y, batch.x)
    assert normalised_mse(in_small, batch) > 100 * normalised_mse(in_outlier, batch)
