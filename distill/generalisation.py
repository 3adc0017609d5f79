"""Whether training still pays off: the loss on held-out sequences beside the loss on the ones trained on.

Also how many times a run reads each training sequence, and the warning when that is so often that the
text is memorised (see ``MANY_READS``).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch

from distill.batches import BatchOrder
from distill.forward import evaluate_losses
from distill.layout import Layout

if TYPE_CHECKING:
    from distill.loop import Run

logger = logging.getLogger(__name__)


def seen_rows(order: BatchOrder, quotas: list[int], row_sources: torch.Tensor | None, batches: int) -> torch.Tensor:
    """Distinct rows from the first ``batches`` micro-batches training draws: ``quotas[i]`` of source ``i``.

    ``row_sources`` gives each row's source (None: one source, ``quotas`` of one entry).
    """
    wanted = list(quotas)
    rows: list[int] = []
    for index in range(batches):
        for row in order.rows(index).tolist():
            source = 0 if row_sources is None else int(row_sources[row])
            if row not in rows and wanted[source] > 0:
                rows.append(row)
                wanted[source] -= 1
        if not any(wanted):
            break
    return torch.tensor(rows, dtype=torch.long)


class Generalisation:
    """The loss on held-out sequences beside the loss on training sequences, before and after training.

    The per-step loss in the log is measured on the batch being fitted, so it keeps falling while the model
    memorises a small text; the same loss on sequences training never draws shows whether the steps still
    pay. Both sets are scored the same way (eval mode, :func:`evaluate_losses`) and, for a mixture, hold as
    many sequences of each source (self-sampled text and a novel sit at different loss levels). Before
    training neither set has been fitted, so their levels differ only by which sequences they hold; how far
    each falls is what to compare. A resumed run keeps the first measurement in its checkpoints.
    """

    def __init__(self, run: Run, heldout_ids: torch.Tensor | None, layout: Layout,
                 sources: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.run, self.layout, self.sets = run, layout, {}
        self.measured: dict[str, dict] = {}
        self.first_step = 0
        if heldout_ids is None or heldout_ids.shape[0] == 0:
            return
        row_sources, heldout_sources = sources if sources is not None else (None, None)
        if row_sources is None or heldout_sources is None:
            row_sources, quotas = None, [heldout_ids.shape[0]]
        else:
            quotas = torch.bincount(heldout_sources, minlength=int(row_sources.max()) + 1).tolist()
        # within one pass over the sequences every row comes up once, so every quota a source can fill is filled
        batches = min(run.micro_batches(), math.ceil(run.token_ids.shape[0] / run.config.batch_size) + 1)
        seen = seen_rows(run.order, quotas, row_sources, batches)
        self.sets = {"training": run.token_ids[seen], "held_out": heldout_ids.long()}
        # each set's rows in the run's teacher source: held-out row i is len(token_ids) + i (forward.TeacherSource)
        self.rows = {"training": seen, "held_out": run.token_ids.shape[0] + torch.arange(heldout_ids.shape[0])}
        self.measured = {name: {} for name in self.sets}

    def measure(self, when: str) -> None:
        """Score both sets under the run's autocast and keep the losses under ``when`` ("before", "after")."""
        for name, ids in self.sets.items():
            with self.run.accelerator.autocast():
                self.measured[name][when] = evaluate_losses(self.run.student, self.run.teacher, ids, self.run.config,
                                                            self.layout, source=self.run.source, rows=self.rows[name])

    def start(self, step: int, kept: dict | None) -> None:
        """Measure "before" at step 0; a resumed run takes it from its checkpoint, else measures it at ``step``."""
        if not self.sets:
            return
        if step > 0 and kept and all(name in kept and "before" in kept[name] for name in self.sets):
            self.first_step = int(kept.get("first_step", 0))
            for name in self.sets:
                self.measured[name]["before"] = kept[name]["before"]
            return
        self.first_step = step
        self.measure("before")

    def kept(self) -> dict | None:
        """What a checkpoint keeps: the first measurement, so a resumed run reports from where it began."""
        if not self.sets:
            return None
        return {"first_step": self.first_step, **{name: {"before": self.measured[name]["before"]}
                                                  for name in self.sets}}

    def summary(self) -> dict | None:
        """The ``generalisation`` of :class:`~distill.train.DistillResult`; None without held-out sequences."""
        if not self.sets:
            return None
        return {"sequences": {name: int(ids.shape[0]) for name, ids in self.sets.items()},
                "before_step": self.first_step, "reads": round(reads_per_sequence(self.run), 2), **self.measured}


def heldout_strata(data) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each calibration row's source and each held-out row's, for a mixture; None for one source."""
    if data.row_sources is None or data.heldout_ids is None:
        return None
    counts = torch.tensor([ids.shape[0] for ids in data.heldout_by_source.values()])
    return data.row_sources, torch.repeat_interleave(torch.arange(len(counts)), counts)


# A warning, not a default: on SmolLM2-135M at drop 8 (reports/smollm2-135m-tasks-draw/), 2,000 steps that read
# 512 sequences 16 times each left the tasks where 200 steps had (+0.7 +- 1.8 points) while the training KL kept
# falling; on 2,048 sequences, 4 reads each, the same steps gained +3.5 +- 1.5.
MANY_READS = 8
FEW_READS = 4


def reads_per_sequence(run: Run) -> float:
    """How many times the run's steps draw each training sequence, over every step of ``run.config``."""
    return run.micro_batches() * run.config.batch_size / run.token_ids.shape[0]


def warn_many_reads(run: Run) -> None:
    """Warn when the run reads each sequence more than ``MANY_READS`` times, and say how many would do."""
    reads = reads_per_sequence(run)
    if reads <= MANY_READS:
        return
    samples = run.token_ids.shape[0]
    logger.warning(
        "%d steps read each of the %d distillation sequences %.0f times: text read this often is memorised, the "
        "training loss falls while held-out quality stands still; give about %d sequences (distill.run --samples, "
        "prune.run --distill-samples, distill.data.samples in a recipe) for %d reads, and compare the held-out "
        "loss with the training one",
        run.config.steps, samples, reads, math.ceil(samples * reads / FEW_READS), FEW_READS)
