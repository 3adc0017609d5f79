"""Closed-form least squares between two residual states, from their streamed moments (float64)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prune.measure.moments import PairMoments


@dataclass
class LinearFit:
    """The affine map ``y ~ x @ weight + bias``."""

    weight: torch.Tensor  # [d_in, d_out] float64
    bias: torch.Tensor  # [d_out] float64

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the map to [..., d_in] states, in their own dtype."""
        return x @ self.weight.to(x) + self.bias.to(x)


def _spectrum(cxx: torch.Tensor, eigh: tuple[torch.Tensor, torch.Tensor] | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eigen-decomposition of a Gram matrix and the mask of eigenvalues above numerical noise.

    The cutoff is float64's even for Grams summed from float32 batch products: their error is relative
    to each entry, not to the largest eigenvalue (on SmolLM2 the smallest of 576 eigenvalues, 1e-6 of
    the largest, agrees with the float64 Gram's to 1e-6; a float32 cutoff would drop 553 of them).
    """
    evals, evecs = torch.linalg.eigh(cxx) if eigh is None else eigh
    keep = evals > evals.max().clamp_min(0) * cxx.shape[0] * torch.finfo(cxx.dtype).eps
    return evals, evecs, keep


def explained_sum_of_squares(cxx: torch.Tensor, cxy: torch.Tensor,
                             eigh: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``tr(Cxy^T Cxx^+ Cxy)``: the part of ``tr(Cyy)`` that the best linear map from X explains.

    ``eigh``: ``torch.linalg.eigh(cxx)`` when the caller has it (``PairMoments.cxx_eigh()``).
    """
    evals, evecs, keep = _spectrum(cxx, eigh)
    projected = evecs[:, keep].T @ cxy  # [rank, d_out]
    return ((projected**2).sum(1) / evals[keep]).sum()


def fit_linear_map(moments: PairMoments, ridge: float = 0.0) -> LinearFit:
    """Least squares ``A = (Cxx + lambda I)^-1 Cxy``, ``b = mean(Y) - mean(X) A``.

    Args:
        moments: centred moments of (X, Y).
        ridge: lambda relative to the mean diagonal of Cxx (scale-free); 0 gives the minimum-norm
            solution through the pseudo-inverse.
    """
    cxx, cxy = moments.cxx, moments.cxy
    if ridge > 0:
        ridged = cxx.clone()  # one copy, not an identity and two sums: a fold's Gram is the MLP width squared
        ridged.diagonal().add_(ridge * torch.diagonal(cxx).mean())
        weight = torch.linalg.solve(ridged, cxy)
        del ridged
    else:
        evals, evecs, keep = _spectrum(cxx, moments.cxx_eigh())
        basis = evecs[:, keep]  # [d_in, rank]
        weight = basis @ ((basis.T @ cxy) / evals[keep, None])
    bias = moments.mean_y - moments.mean_x.to(weight.device) @ weight
    return LinearFit(weight, bias)


def scale_update(fit: LinearFit, scale: float, start: LinearFit | None = None) -> LinearFit:
    """The map ``start + scale * (fit - start)``: a share of the way from ``start`` (default: the identity) to ``fit``.

    From the identity, ``h -> h + scale * (fit(h) - h)`` applies that share of the fitted update; 1 returns ``fit``.
    """
    if scale == 1:
        return fit
    if start is None:
        eye = torch.eye(fit.weight.shape[0], dtype=fit.weight.dtype, device=fit.weight.device)
        start = LinearFit(eye, torch.zeros_like(fit.bias))
    return LinearFit(torch.lerp(start.weight.to(fit.weight), fit.weight, scale),
                     torch.lerp(start.bias.to(fit.bias), fit.bias, scale))


def r_squared(fit: LinearFit, moments: PairMoments) -> float:
    """Coordinate-averaged ``1 - SSE_j / SST_j`` of ``fit`` on the tokens summarised by ``moments``.

    Works on held-out moments: the residual ``Y - XA - b`` is expanded in the centred Grams plus the
    offset between the held-out means and the map's prediction of them.
    """
    sse = residual_sums(fit, moments)
    sst = torch.diagonal(moments.cyy)
    valid = sst > 0
    return float((1 - sse[valid] / sst[valid]).mean())


def residual_sums(fit: LinearFit, moments: PairMoments) -> torch.Tensor:
    """Per output coordinate, the summed squared residual ``Y - XA - b`` over the tokens of ``moments``.

    Expanded in the centred Grams plus the offset between their means and the map's prediction of them, so it
    holds on moments the map was not fitted on.
    """
    a = fit.weight.to(moments.cxx)
    sse = torch.diagonal(moments.cyy) - 2 * (a * moments.cxy).sum(0) + ((moments.cxx @ a) * a).sum(0)
    offset = moments.mean_y - moments.mean_x @ a - fit.bias.to(a)
    return sse + moments.n * offset**2
