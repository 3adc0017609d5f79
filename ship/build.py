"""The build stage: ``prune.run``'s checkpoint of the chosen candidate, written as ``prune.run --out`` writes it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from prune.errors import LayercutError
from prune.loading.loader import LoadedModel
from prune.pipeline.config import PruneConfig
from prune.pipeline.runner import Scored, run_prune
from ship.shortlist import Shortlist
from ship.work import StageResult


@dataclass(kw_only=True)
class Built(StageResult):
    """``build.json``: the blocks removed and the repair, as the checkpoint holds them.

    ``as_measured``: the repair is the shortlist's fit (``--fit-rows fitting``) in float32, so the candidate's KL
    and perplexity on the measuring rows are the checkpoint's (False in a work folder built before 2026-12-03). In
    a lower precision the written weights are rounded where the shortlist's view of a cut need not be
    (fold-rotate's hosted form turns the stream in float64): the heal measures the checkpoint again.
    """

    blocks: list
    repair: str
    as_measured: bool = False


def chosen_config(config: PruneConfig, shortlist: Shortlist, out: Path) -> PruneConfig:
    """The ``prune.run`` config that writes the chosen checkpoint into ``out``.

    Its repair is fitted on the rows the shortlist fitted it on (``--fit-rows fitting``): the checkpoint is the
    candidate measured, its KL on the other rows is the checkpoint's, and the build reuses the fit.
    """
    select, score = shortlist.best.select
    return dataclasses.replace(config, drop=shortlist.count, target_params=None, target_speedup=None, select=select,
                               score=score, replace={"method": shortlist.best.repair, "fit_rows": "fitting"},
                               auto_replace=False, out=str(out), overwrite=True)


def build(config: PruneConfig, shortlist: Shortlist, out: Path, loaded: LoadedModel | None = None,
          scored: Scored | None = None) -> Built:
    """Write the chosen candidate's checkpoint into ``out``.

    ``loaded`` and ``scored``: the model and the shortlist's scoring pass, whose memo holds the shortlist's fits:
    the chosen one is put in place as it was measured, with no capture pass. A resumed run (a fresh memo, or
    none: ``prune.run``'s own load and scoring) fits it again on the same rows in the same batches, the same
    tensors. ``loaded`` is surgered in place.
    """
    chosen = shortlist.best
    run = chosen_config(config, shortlist, out)
    if loaded is None or scored is None:
        result = run_prune(run)
    else:
        result = run_prune(run, loaded=loaded, scored=scored)
    if result.dropped != chosen.blocks:
        raise LayercutError(f"prune.run chose blocks {result.dropped} where the shortlist measured "
                            f"{chosen.blocks}: report this (its selection is not deterministic)")
    float32 = result.loaded.model.dtype == torch.float32
    return Built(blocks=chosen.blocks, repair=chosen.repair, as_measured=run.replace.fit_rows == "fitting" and float32)
