"""``distill.heal``: the rows prune.ship's heal trains and measures on, and its options, ship's own."""

from __future__ import annotations

import torch

from distill.heal import HEAL_BATCH, HEAL_OPTIONS, HEAL_SEQ_LEN, HealRows, heal_rows


def test_rows_longer_than_the_heals_length_are_cut_and_shorter_ones_kept():
    ids = torch.arange(3 * (2 * HEAL_SEQ_LEN + 5)).reshape(3, -1)  # [3, 261]: two whole cuts a row, 5 left over
    cut = heal_rows(ids)
    assert cut.shape == (6, HEAL_SEQ_LEN)
    assert torch.equal(cut[1], ids[0, HEAL_SEQ_LEN:2 * HEAL_SEQ_LEN]) and torch.equal(cut[2], ids[1, :HEAL_SEQ_LEN])
    short = ids[:, :64]
    assert heal_rows(short) is short


def test_the_heal_trains_on_the_fitting_rows_and_measures_on_the_others():
    calibration = torch.arange(16 * 2 * HEAL_SEQ_LEN).reshape(16, -1)
    rows = HealRows.of(calibration)
    assert torch.equal(rows.measure, calibration[[7, 15]])  # prune.selection.repaired.split_rows: every 8th row
    assert rows.train.shape == (14 * 2, HEAL_SEQ_LEN)
    measured = {tuple(row) for row in heal_rows(rows.measure).tolist()}
    assert not measured & {tuple(row) for row in rows.train.tolist()}
    assert rows.tokens(10) == 10 * HEAL_BATCH * HEAL_SEQ_LEN


def test_ship_reads_the_heals_options_and_cut_from_here():
    import ship.config

    assert ship.config.HEAL_OPTIONS is HEAL_OPTIONS and ship.config.heal_rows is heal_rows
    assert HEAL_OPTIONS == {"train": "lora", "lora_r": 64, "lora_alpha": 128.0, "teacher_cache": "topk=256",
                            "batch_size": HEAL_BATCH}
    assert ship.config.heal_sequences(16, 2 * HEAL_SEQ_LEN) == 28
