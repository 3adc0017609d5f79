"""How removed blocks are replaced: :class:`ReplaceConfig` (a recipe's ``replace:`` section)."""

from __future__ import annotations

from dataclasses import dataclass

from prune.errors import LayercutError
from prune.replace.registry import FITS, METHODS, get_method

# Bound on the captured (input, target) pairs kept for Adam; beyond it only the first batches are used.
DEFAULT_CACHE_BYTES = 1 << 30


@dataclass
class ReplaceConfig:
    """How removed blocks are replaced.

    Attributes:
        method: a registered method (``prune.replace.METHODS``: none | linear | lowrank | fold | block).
        fit: independent (original model's inputs) | sequential (the surgered model's inputs).
        rank: rank of ``lowrank`` maps; None = ``max(1, d // 100)``.
        ridge: ridge of the closed-form fits, relative to the mean diagonal of the input Gram (0 = pseudo-inverse).
        update_scale: the share of the fitted update ``f(h) - h`` that a ``linear`` or ``fold`` map applies
            (1: least squares; towards 0: removal); None = the method's default, 0.7 for both. The
            least-squares map is the best in the residual stream's own squared error, not at the logits (see
            :class:`~prune.replace.linear.LinearOptions`).
        steps: Adam steps for ``lowrank`` (after its closed-form start) and ``block``; 0 skips training;
            None = the method's default.
        lr: Adam learning rate for those steps; None = the method's default.
        short: also fit on the calibration tokens cut into sequences of this many tokens (0: off; None:
            the method's default, 64 for ``linear``, else 0). Task prompts are short: their states are
            those of early positions, which long calibration sequences hold few of (on SmolLM2 a
            least-squares map fitted on 512-token sequences had a higher KL at the logits than removal
            on ARC prompts; fitted on both cuts, a lower one).
        batch_size: sequences per forward pass while capturing.
        cache_bytes: most bytes of captured activations kept for the Adam steps.
        seed: seeds the Adam batch order.
        progress: show tqdm bars.
    """

    method: str = "linear"
    fit: str = "independent"
    rank: int | None = None
    ridge: float = 0.0
    steps: int | None = None
    lr: float | None = None
    update_scale: float | None = None
    short: int | None = None
    batch_size: int = 4
    cache_bytes: int = DEFAULT_CACHE_BYTES
    seed: int = 0
    progress: bool = True

    def __post_init__(self):
        spec = get_method(self.method)
        if self.fit not in FITS:
            raise LayercutError(f"unknown --fit '{self.fit}': choose one of {', '.join(FITS)}")
        if self.fit not in spec.fits:
            takers = "|".join(m.name for m in METHODS.values() if self.fit in m.fits)
            raise LayercutError(f"--fit {self.fit} applies to replacements: pass --replace {takers}")
        options = spec.options(self.method, rank=self.rank, ridge=self.ridge, steps=self.steps, lr=self.lr,
                               update_scale=self.update_scale)
        for name, value in options.values().items():
            setattr(self, name, value)
        if self.short is None:
            self.short = spec.options.default_short
        if not isinstance(self.short, int) or self.short < 0 or self.short == 1:
            raise LayercutError(f"--fit-short takes a sequence length of at least 2 (0: off), got {self.short}")
        if self.batch_size <= 0:
            raise LayercutError(f"--batch-size must be positive, got {self.batch_size}")
