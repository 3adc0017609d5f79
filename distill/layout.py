"""Which teacher residual state each student block is matched to.

A layercut student records, for each of its blocks ``j``, the original block indices that position
now computes (``model.config.layercut_layout``, written by ``prune``; e.g. ``[[0], ..., [11, 12, 13],
[14], ...]`` after blocks 12-13 were replaced by a map attached to block 11). Student block ``j``'s
output is compared with the teacher's state ``max(layout[j]) + 1``, the output of the last original
block it stands for.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn

from prune.errors import LayercutError
from prune.model.adapters import num_blocks
from prune.model.surgery import LAYOUT_ATTR, block_layout

logger = logging.getLogger(__name__)

Layout = list[list[int]]


def layout_from_dropped(num_blocks_before: int, dropped: Sequence[int]) -> Layout:
    """Layout of a plain removal: each kept original block at its new position."""
    gone = set(int(i) for i in dropped)
    return [[i] for i in range(num_blocks_before) if i not in gone]


def _recorded_layout(student: nn.Module) -> Layout | None:
    """The layout the student carries, or None when it carries none.

    ``prune.model.surgery.block_layout`` (which also knows replacement wrappers) is used when the model
    records a layout; it falls back to the identity when none is recorded, which we must not mistake
    for a real layout, hence the attribute check first.
    """
    if getattr(student.config, LAYOUT_ATTR, None) is None:
        return None
    return [list(map(int, group)) for group in block_layout(student)]


def check_layout(layout: Layout, student_blocks: int, teacher_blocks: int) -> Layout:
    """Validate a layout against both depths: one non-empty group per student block, increasing indices."""
    if len(layout) != student_blocks:
        raise LayercutError(
            f"the student's layout has {len(layout)} entries but the student has {student_blocks} blocks: "
            "the checkpoint's config.json layercut_layout is stale; re-export the student with prune.run"
        )
    previous = -1
    for position, group in enumerate(layout):
        if not group or min(group) <= previous:
            raise LayercutError(
                f"the student's layout is not increasing at block {position} ({layout}): re-export the student"
            )
        previous = max(group)
    if previous >= teacher_blocks:
        raise LayercutError(
            f"the student stands for original block {previous} but the teacher has only {teacher_blocks} blocks: "
            "pass the model the student was pruned from as --teacher"
        )
    return layout


def resolve_layout(student: nn.Module, teacher: nn.Module, report: dict | None = None) -> Layout:
    """The student's layout, from its config, else from its ``layercut.json`` report's ``dropped`` list.

    Args:
        student: the surgered model.
        teacher: the original model.
        report: the student's ``layercut.json`` content, if it has one.

    Raises:
        LayercutError: the student records no layout and is as deep as the teacher (not a layercut
            student), or is shallower without saying which blocks went, or the layout does not fit.
    """
    student_blocks, teacher_blocks = num_blocks(student), num_blocks(teacher)
    layout = _recorded_layout(student)
    if layout is None and report and report.get("dropped") is not None and report.get("num_blocks_before"):
        layout = layout_from_dropped(int(report["num_blocks_before"]), report["dropped"])
        logger.info("layout rebuilt from layercut.json: dropped blocks %s", report["dropped"])
    if layout is None:
        if student_blocks == teacher_blocks:
            raise LayercutError(
                f"the student has as many blocks as the teacher ({teacher_blocks}) and no layercut layout: it is "
                "not a pruned model; pass a folder written by prune.run (or distill a model with blocks removed)"
            )
        raise LayercutError(
            f"the student has {student_blocks} blocks, the teacher {teacher_blocks}, and the student records no "
            "layout (config layercut_layout or layercut.json 'dropped'): export it with prune.run"
        )
    return check_layout(layout, student_blocks, teacher_blocks)


def teacher_targets(layout: Layout) -> list[int]:
    """Teacher state index for each student block's output: ``max(layout[j]) + 1``."""
    return [max(group) + 1 for group in layout]
