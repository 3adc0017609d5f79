"""What each layer already predicts: R^2 of the shortcuts, Precision@k, surprisal, early exit.

Conventions (used in every table and figure):

* "layer l" is residual state ``l``: the stream after ``l`` blocks, before the final norm (0 = the
  embeddings, L = the last block's output, which is what the full model reads).
* Predictions at layer ``l`` are ``softmax(lm_head(final_norm(shortcut(h_l))))``, in float32.
* The reference is the full model's own top-1 token at every position, so the full model has
  Precision@1 = 1 by definition. Precision@k: that token is among the shortcut's k most likely.
  Surprisal: ``-log p_shortcut(reference)`` in nats.
* Early exit at threshold lambda: a token leaves at the first layer ``l`` in 1..L-1 whose top-1
  probability is above lambda and takes that layer's top-1; otherwise it runs all L blocks. "Layers
  used" counts blocks run: exiting at layer ``l`` (after 0-based block ``l-1``) uses ``l``.

Everything is accumulated batch by batch (counts, sums, one confidence and one hit per token and
layer for the early-exit sweep); hidden states live only for the batch that made them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from eval.lens.shortcuts import ShortcutSet, batch_states
from prune.measure.least_squares import LinearFit, fit_linear_map, r_squared
from prune.measure.moments import StateMoments
from prune.model.adapters import final_norm, lm_head, num_blocks

logger = logging.getLogger(__name__)

PRECISION_KS = (1, 5, 10)
# Positions whose [chunk, vocab] float32 logits exist at once (49k vocab: 100 MB per 512).
CHUNK_TOKENS = 512
# Thresholds for the early-exit sweep: a fine grid plus the high-confidence tail where most exits happen.
DEFAULT_LAMBDAS: tuple[float, ...] = tuple(
    sorted({round(i / 100, 4) for i in range(101)} | {0.991, 0.993, 0.995, 0.997, 0.998, 0.999, 0.9995, 0.9999})
)
PRECISION_GOAL = 0.95


def lens_logits(model: nn.Module, states: torch.Tensor) -> torch.Tensor:
    """The model's own final norm and LM head on [n, d] states -> [n, vocab] float32 logits."""
    head = lm_head(model)
    h = states.to(device=head.weight.device, dtype=head.weight.dtype)
    logits = head(final_norm(model)(h)).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:  # Gemma 2 squashes its logits; the probabilities must match the model's own
        logits = torch.tanh(logits / cap) * cap
    return logits


@dataclass
class TokenScores:
    """Per-token comparison of a prediction with the reference tokens (all [n])."""

    hits: torch.Tensor  # [n, len(PRECISION_KS)] bool: reference within top-k
    surprisal: torch.Tensor  # [n] float32, nats
    confidence: torch.Tensor  # [n] float32: top-1 probability
    correct: torch.Tensor  # [n] bool: top-1 == reference


def score_tokens(logits: torch.Tensor, reference: torch.Tensor) -> TokenScores:
    """Compare [n, vocab] logits with reference token ids [n]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    top_values, top = logprobs.topk(max(PRECISION_KS), dim=-1)  # [n, kmax]
    reference = reference.to(top.device)
    found = top == reference[:, None]  # [n, kmax]
    hits = torch.stack([found[:, :k].any(-1) for k in PRECISION_KS], dim=-1)
    surprisal = -logprobs.gather(-1, reference[:, None]).squeeze(-1)
    return TokenScores(hits.cpu(), surprisal.cpu(), top_values[:, 0].exp().cpu(), found[:, 0].cpu())


def score_states(model: nn.Module, states: torch.Tensor, reference: torch.Tensor) -> TokenScores:
    """:func:`score_tokens` on [n, d] states through the LM head, ``CHUNK_TOKENS`` positions at a time."""
    parts = [
        score_tokens(lens_logits(model, states[i : i + CHUNK_TOKENS]), reference[i : i + CHUNK_TOKENS])
        for i in range(0, states.shape[0], CHUNK_TOKENS)
    ]
    return TokenScores(
        hits=torch.cat([p.hits for p in parts]),
        surprisal=torch.cat([p.surprisal for p in parts]),
        confidence=torch.cat([p.confidence for p in parts]),
        correct=torch.cat([p.correct for p in parts]),
    )


def reference_tokens(model: nn.Module, last_state: torch.Tensor) -> torch.Tensor:
    """The full model's top-1 token [n] from the last block's output [n, d]."""
    return torch.cat([
        lens_logits(model, last_state[i : i + CHUNK_TOKENS]).argmax(-1).cpu()
        for i in range(0, last_state.shape[0], CHUNK_TOKENS)
    ])  # fmt: skip


@dataclass
class _Accumulator:
    """Running sums for one (shortcut, layer)."""

    hits: torch.Tensor = field(default_factory=lambda: torch.zeros(len(PRECISION_KS), dtype=torch.float64))
    surprisal: float = 0.0
    n: int = 0
    confidence: list[torch.Tensor] = field(default_factory=list)
    correct: list[torch.Tensor] = field(default_factory=list)

    def add(self, scores: TokenScores) -> None:
        self.hits += scores.hits.double().sum(0)
        self.surprisal += float(scores.surprisal.double().sum())
        self.n += scores.surprisal.shape[0]
        self.confidence.append(scores.confidence)
        self.correct.append(scores.correct)


class _SquaredError:
    """Per-coordinate SSE of predictions of the last state, and its held-out SST (float64)."""

    def __init__(self):
        self.sse: dict[tuple[str, int], torch.Tensor] = {}
        self.shift: torch.Tensor | None = None
        self.sum = self.sumsq = None
        self.n = 0

    def add_target(self, target: torch.Tensor) -> None:
        y = target.double().cpu()
        self.shift = y.mean(0) if self.shift is None else self.shift  # shift first: massive activations reach 1e3
        y = y - self.shift
        self.sum = y.sum(0) if self.sum is None else self.sum + y.sum(0)
        self.sumsq = (y**2).sum(0) if self.sumsq is None else self.sumsq + (y**2).sum(0)
        self.n += y.shape[0]

    def add(self, key: tuple[str, int], prediction: torch.Tensor, target: torch.Tensor) -> None:
        sse = ((prediction.double() - target.double().to(prediction.device)) ** 2).sum(0).cpu()
        self.sse[key] = self.sse[key] + sse if key in self.sse else sse

    def r2(self, key: tuple[str, int]) -> float:
        sst = self.sumsq - self.sum**2 / self.n
        valid = sst > 0
        return float((1 - self.sse[key][valid] / sst[valid]).mean())


@dataclass
class LensPredictions:
    """Per-layer prediction quality of every shortcut on held-out tokens.

    Attributes:
        names: shortcut kinds evaluated.
        num_layers: L; lists below have L + 1 entries (layers 0..L; layer L is the full model).
        precision: kind -> {k: [Precision@k per layer]}.
        surprisal: kind -> [mean surprisal (nats) per layer].
        r2: kind -> [token-level held-out R^2 of the shortcut's prediction of h_L per layer].
        confidence: kind -> [tokens, L + 1] top-1 probability (early exit).
        correct: kind -> [tokens, L + 1] top-1 equals the reference (early exit).
        reference: [samples, seq] the full model's top-1 token ids.
        tokens: number of held-out tokens scored.
    """

    names: list[str]
    num_layers: int
    precision: dict[str, dict[int, list[float]]]
    surprisal: dict[str, list[float]]
    r2: dict[str, list[float]]
    confidence: dict[str, torch.Tensor]
    correct: dict[str, torch.Tensor]
    reference: torch.Tensor
    tokens: int


@torch.no_grad()
def evaluate_shortcuts(
    model: nn.Module,
    shortcuts: ShortcutSet,
    token_ids: torch.Tensor,
    *,
    names: Sequence[str] | None = None,
    batch_size: int = 4,
    progress: bool = True,
) -> LensPredictions:
    """Precision@k, surprisal, early-exit data and R^2 of each shortcut at each layer on ``token_ids`` [samples, seq].

    The reference top-1 comes from the same forward pass (the last state through the LM head).
    """
    names = list(names or shortcuts.names)
    count = num_blocks(model)
    device = lm_head(model).weight.device
    shortcuts.to(device)
    acc = {(name, layer): _Accumulator() for name in names for layer in range(count + 1)}
    errors, references = _SquaredError(), []
    starts = range(0, token_ids.shape[0], batch_size)
    # One tick per (batch, shortcut, layer): the LM head over every position is the slow part.
    bar = tqdm(total=len(starts) * len(names) * count, desc="lens predictions", unit="layer", disable=not progress)
    for start in starts:
        states = [s.to(device) for s in batch_states(model, token_ids[start : start + batch_size], count)]
        target = states[count]  # [n, d]
        reference = reference_tokens(model, target)  # [n]
        references.append(reference)
        errors.add_target(target)
        full = score_states(model, target, reference)
        for name in names:
            acc[(name, count)].add(full)
            for layer in range(count):
                prediction = shortcuts.apply(name, layer, states[layer])  # [n, d]
                errors.add((name, layer), prediction, target)
                acc[(name, layer)].add(score_states(model, prediction, reference))
                bar.update(1)
        del states
    bar.close()
    return _collect(names, count, acc, errors, torch.cat(references).view(token_ids.shape))


def _collect(names, count, acc, errors: _SquaredError, reference: torch.Tensor) -> LensPredictions:
    """Turn the running sums into per-layer lists."""
    layers = range(count + 1)
    precision = {
        name: {k: [float(acc[(name, layer)].hits[i] / acc[(name, layer)].n) for layer in layers]
               for i, k in enumerate(PRECISION_KS)}
        for name in names
    }  # fmt: skip
    surprisal = {name: [acc[(name, layer)].surprisal / acc[(name, layer)].n for layer in layers] for name in names}
    r2 = {name: [errors.r2((name, layer)) for layer in range(count)] + [1.0] for name in names}
    confidence = {n: torch.stack([torch.cat(acc[(n, layer)].confidence) for layer in layers], 1) for n in names}
    correct = {n: torch.stack([torch.cat(acc[(n, layer)].correct) for layer in layers], 1) for n in names}
    return LensPredictions(names, count, precision, surprisal, r2, confidence, correct, reference, reference.numel())


def mat_r2_per_layer(fit_moments: StateMoments, eval_moments: StateMoments, target: int, ridge: float) -> list[float]:
    """Held-out R^2 of the closed-form ``mat`` map from each state ``l < target`` to ``target``, from moments."""
    return [r_squared(fit_linear_map(fit_moments.pair(i, target), ridge), eval_moments.pair(i, target))
            for i in range(target)]  # fmt: skip


def identity_r2(eval_moments: StateMoments, source: int, target: int) -> float:
    """Held-out R^2 of predicting state ``target`` by state ``source`` itself."""
    moments = eval_moments.pair(source, target)
    eye = torch.eye(moments.cxx.shape[0], dtype=moments.cxx.dtype, device=moments.cxx.device)
    return r_squared(LinearFit(eye, torch.zeros_like(moments.mean_y)), moments)


def heatmap_states(num_layers: int, stride: int = 1) -> list[int]:
    """States on the heatmap axes: every ``stride``-th state and always the last one."""
    return sorted(set(range(0, num_layers + 1, max(1, stride))) | {num_layers})


def heatmap_pairs(states: Sequence[int]) -> list[tuple[int, int]]:
    """Every (l, l') with l < l' among ``states``."""
    return [(a, b) for i, a in enumerate(states) for b in states[i + 1 :]]


def r2_heatmap(
    fit_moments: StateMoments, eval_moments: StateMoments, states: Sequence[int], ridge: float, progress: bool = True
) -> dict[str, list[list[float | None]]]:
    """Held-out R^2 from state l (rows) to state l' (columns) for ``id`` and ``mat`` (Figure 2 of the paper).

    The diagonal is 1 (a state predicts itself); below it (l' < l) is None.
    """
    size = len(states)
    grids: dict[str, list[list[float | None]]] = {"id": [[None] * size for _ in range(size)],
                                                   "mat": [[None] * size for _ in range(size)]}  # fmt: skip
    for i in range(size):
        grids["id"][i][i] = grids["mat"][i][i] = 1.0
    pairs = [(i, j) for i in range(size) for j in range(i + 1, size)]
    for i, j in tqdm(pairs, desc="heatmap", unit="pair", disable=not progress):
        source, target = states[i], states[j]
        grids["id"][i][j] = identity_r2(eval_moments, source, target)
        grids["mat"][i][j] = r_squared(fit_linear_map(fit_moments.pair(source, target), ridge),
                                       eval_moments.pair(source, target))  # fmt: skip
    return grids


@dataclass
class ExitPoint:
    """One threshold of the early-exit sweep."""

    threshold: float
    precision: float
    layers: float  # mean number of blocks run


def early_exit_sweep(
    confidence: torch.Tensor, correct: torch.Tensor, thresholds: Sequence[float] = DEFAULT_LAMBDAS
) -> list[ExitPoint]:
    """Exit at the first layer in 1..L-1 with top-1 probability > lambda, else run all L blocks.

    Args:
        confidence: [tokens, L + 1] top-1 probability per layer.
        correct: [tokens, L + 1] whether that layer's top-1 is the full model's.
        thresholds: the lambdas.
    """
    count = confidence.shape[1] - 1
    candidates = confidence[:, 1:count]  # [tokens, L - 1]
    points = []
    for lam in thresholds:
        leaves = candidates > lam  # [tokens, L - 1]
        any_exit = leaves.any(1)
        first = torch.where(any_exit, leaves.float().argmax(1) + 1, torch.full_like(any_exit, count, dtype=torch.long))
        hit = correct.gather(1, first[:, None]).squeeze(1) | (first == count)
        points.append(ExitPoint(float(lam), float(hit.double().mean()), float(first.double().mean())))
    return points


def fixed_exit(correct: torch.Tensor) -> list[float]:
    """Precision@1 of always exiting at layer l, for l = 0..L (the fixed-layer baseline)."""
    return [float(v) for v in correct.double().mean(0)]


def layers_at_precision(points: Sequence[ExitPoint], goal: float = PRECISION_GOAL) -> float | None:
    """Fewest mean layers among sweep points whose Precision@1 reaches ``goal`` (None if none does)."""
    good = [p.layers for p in points if p.precision >= goal]
    return min(good) if good else None
