"""SVCCA: how similar a layer's representation of a fixed probe batch stays between checkpoints.

SVCCA (Raghu et al., 2017, "SVCCA: Singular Vector Canonical Correlation Analysis for Deep Learning
Dynamics and Interpretability") compares two views of the same ``n`` probe inputs — a layer's
activations ``a`` (n×p) at one checkpoint and ``b`` (n×q) at another — in four steps:

1. centre every neuron (column) over the probe samples;
2. SVD-reduce each matrix to its top ``k`` singular directions, the fewest that explain a fraction
   ``keep`` (default 0.99) of the variance: the low-variance directions are mostly noise;
3. CCA between the two reduced subspaces: canonical correlations ρ_1 ≥ … ≥ ρ_m, m = min(k_a, k_b);
4. report their mean ρ̄ ∈ [0, 1]. 1 means the same subspace, whatever invertible linear map relates
   the two (CCA is invariant to those); independent data gives values near 0 (see the sample-size
   caveat below).

CCA uses the QR/SVD formulation, not inverse square roots of covariance matrices: the canonical
correlations are the singular values of Q_aᵀ Q_b (the cosines of the principal angles between the two
column spaces), where Q is an orthonormal basis of a reduced matrix. The left singular vectors U_k of
step 2 already are such a basis (the reduced matrix is U_k·diag(S_k): same column space as its QR
factor), so no QR is needed and nothing is inverted: ill-conditioned activations, which made
covariance-based CCA fail in ikkuna, are harmless. Everything runs in float64 on the input's device.

Cost: one thin SVD per matrix, O(n·p·min(n, p)), plus the singular values of a k_a×k_b matrix — about
50 ms for two 512×256 matrices on a 2-core CPU (MKL; much slower while other processes compete for the
cores). Choosing ``k`` reads the singular values on the host: one device sync per matrix. This is a
sampled metric for checkpoints, not for every step. :class:`ProbeSimilarity` caches each reference's
basis (n×k, not the raw activations), so a checkpoint costs one SVD per layer.

Sample size — the probe batch must have many more samples than kept directions. After centring the
samples span n - 1 dimensions, so when k_a + k_b > n - 1 at least k_a + k_b - (n - 1) correlations are 1
for *any* data, and once k ≥ n - 1 every correlation is trivially 1. Even below that, independent data
scores well above 0 (roughly √(k/n)). Use n ≥ 10× the kept dimensions (to be safe, 10× the layer width;
for convolutions, pool the spatial dimensions first or use a larger probe batch).

Edge cases: fewer than 2 samples, or ``a`` and ``b`` with different sample counts, raise
:class:`ValueError`. Non-finite activations (NaN, ±inf) give NaN. A layer with no variance over the probe
batch (constant, e.g. a dead ReLU layer) also gives NaN — no variance, no similarity.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Literal

import torch

__all__ = ["ProbeSimilarity", "flatten_samples", "svcca"]

_EPSILON = 1e-6
"""Default relative threshold for "no variance" and numerically-zero directions (see :func:`svcca`)."""


def flatten_samples(x: torch.Tensor) -> torch.Tensor:
    """Flatten activations to one row per probe sample, as a detached float64 copy.

    Args:
        x: Activations with the sample dimension first: ``(n,)``, ``(n, p)``, ``(n, C, H, W)``,
            ``(n, S, D)``, ...

    Returns:
        ``(n, prod(x.shape[1:]))`` float64 tensor on ``x``'s device, never sharing memory with ``x``.

    Raises:
        ValueError: If ``x`` is 0-d.

    Example:
        >>> import torch
        >>> flatten_samples(torch.zeros(8, 3, 4, 4)).shape
        torch.Size([8, 48])
    """
    if x.ndim == 0:
        raise ValueError("flatten_samples needs a sample dimension first; got a 0-d tensor")
    return x.detach().reshape(x.shape[0], -1).to(torch.float64, copy=True)


def _check_keep(keep: float) -> None:
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"keep is the fraction of variance to keep, in (0, 1]; got {keep!r}")


def _basis(x: torch.Tensor, keep: float, epsilon: float) -> torch.Tensor | None:
    """Orthonormal basis (n×k, float64) of the centred, SVD-reduced ``x``; None when undefined.

    Undefined means non-finite activations or no variance (largest centred singular value at most
    ``epsilon`` times the norm of the uncentred activations, so a constant layer counts whatever its
    value). Directions with singular value at most ``epsilon`` times the largest are numerically zero
    and never kept, even with ``keep=1``.
    """
    x = x.detach().to(torch.float64)
    if not bool(torch.isfinite(x).all()):
        return None
    centred = x - x.mean(dim=0, keepdim=True)
    u: torch.Tensor
    s: torch.Tensor
    u, s, _ = torch.linalg.svd(centred, full_matrices=False)
    s_host = s.cpu()
    scale = float(torch.linalg.vector_norm(x))
    if s_host.numel() == 0 or float(s_host[0]) <= epsilon * scale:
        return None
    rank = int((s_host > epsilon * s_host[0]).sum())
    variance = s_host.square()
    explained = torch.cumsum(variance, dim=0) / variance.sum()
    k = min(int((explained < keep).sum()) + 1, rank)
    return u[:, :k]


def _mean_correlation(qa: torch.Tensor | None, qb: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Mean of the canonical correlations between the spans of two orthonormal bases (NaN if undefined)."""
    if qa is None or qb is None:
        return torch.tensor(math.nan, dtype=torch.float64, device=device)
    rho: torch.Tensor = torch.linalg.svdvals(qa.mT @ qb)
    return rho.clamp(0.0, 1.0).mean()


def _check_samples(n_a: int, n_b: int) -> None:
    if n_a != n_b:
        raise ValueError(
            f"svcca compares the same probe inputs: a has {n_a} samples but b has {n_b} "
            "(the sample dimension comes first)"
        )
    if n_a < 2:
        raise ValueError(f"svcca needs at least 2 probe samples to centre over (got {n_a}); use many more")


def svcca(a: torch.Tensor, b: torch.Tensor, keep: float = 0.99, epsilon: float = _EPSILON) -> torch.Tensor:
    """Mean SVCCA correlation between two activation matrices of the same probe inputs.

    Centres each neuron, SVD-reduces each matrix to the directions explaining ``keep`` of its
    variance, and averages the canonical correlations between the two reduced subspaces (see the module
    docstring). The probe batch must have many more samples than kept directions — n ≥ 10× is a good
    rule: when the kept dimensions approach n - 1 the correlations are all 1 trivially, whatever the
    data. Reads the singular values on the host (a device sync); a sampled metric.

    Args:
        a: ``(n, p)`` activations at one checkpoint (use :func:`flatten_samples` for more dimensions).
        b: ``(n, q)`` activations of the same ``n`` probe inputs at another checkpoint.
        keep: Fraction of each matrix's variance its kept directions must explain, in (0, 1].
        epsilon: Relative threshold for "no variance" (largest centred singular value at most
            ``epsilon`` times the activations' norm) and for numerically-zero directions (singular
            values at most ``epsilon`` times the largest, never kept).

    Returns:
        0-d float64 tensor on ``a``'s device: the mean canonical correlation in [0, 1]; NaN when either
        input has a non-finite value or no variance over the probe batch (e.g. a dead ReLU layer).

    Raises:
        ValueError: If ``a`` or ``b`` is not 2-d, their sample counts differ, there are fewer than 2
            samples, or ``keep`` is not in (0, 1].

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> a = torch.randn(500, 8, generator=g)
        >>> round(float(svcca(a, 3 * a @ torch.randn(8, 8, generator=g) + 1, keep=1.0)), 6)
        1.0
        >>> round(float(svcca(a, torch.randn(500, 8, generator=g))), 1)
        0.1
    """
    _check_keep(keep)
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(
            f"svcca takes (n_samples, features) matrices, got shapes {tuple(a.shape)} and {tuple(b.shape)}; "
            "flatten other activations with flatten_samples"
        )
    _check_samples(a.shape[0], b.shape[0])
    return _mean_correlation(_basis(a, keep, epsilon), _basis(b, keep, epsilon), a.device)


class ProbeSimilarity:
    """Keeps a layer's reference activations on a fixed probe batch and scores later activations against them.

    Feed it, at every checkpoint, each layer's activations on the *same* probe inputs (in the same
    order, model in eval mode). The first call for a key stores the reference and returns None; later
    calls return :func:`svcca` against the reference:

    * ``against="previous"`` (default, SVCCA "between checkpoints"): the reference is replaced by the
      newest activations after each call, so each value compares consecutive checkpoints — how much the
      layer moved since last time; values near 1 mean it has settled (ikkuna freezes such layers).
    * ``against="first"``: the first activations stay the reference — drift since the start.

    Only the reduced orthonormal basis of the reference is kept (n×k float64, not the activations), so
    each call costs one SVD. A reference without variance or with non-finite values makes the scores
    against it NaN.

    Args:
        keep: Fraction of variance kept by the SVD reduction, in (0, 1]; see :func:`svcca`.
        against: ``"previous"`` or ``"first"``, as above.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.randn(400, 6, generator=g)
        >>> similarity = ProbeSimilarity(keep=1.0)
        >>> similarity("fc1", x) is None
        True
        >>> round(float(similarity("fc1", 2 * x @ torch.randn(6, 6, generator=g))), 6)
        1.0
    """

    def __init__(self, keep: float = 0.99, against: Literal["previous", "first"] = "previous") -> None:
        _check_keep(keep)
        if against not in ("previous", "first"):
            raise ValueError(f"against must be 'previous' or 'first', got {against!r}")
        self.keep = keep
        self.against: Literal["previous", "first"] = against
        self._references: dict[Hashable, tuple[int, torch.Tensor | None]] = {}

    def __call__(self, key: Hashable, activations: torch.Tensor) -> torch.Tensor | None:
        """Score ``activations`` against the reference for ``key``; None on the first call for it.

        Args:
            key: Identifies the layer (e.g. its qualified name).
            activations: ``(n, ...)`` activations of the probe batch, sample dimension first.

        Returns:
            0-d float64 tensor (see :func:`svcca`), or None when this call stored the first reference.

        Raises:
            ValueError: If the sample count differs from the reference's, or is below 2.

        Example:
            >>> import torch
            >>> similarity = ProbeSimilarity()
            >>> similarity("conv1", torch.randn(64, 3, 4, 4)) is None
            True
        """
        x = flatten_samples(activations)
        n = x.shape[0]
        stored = self._references.get(key)
        if stored is None:
            _check_samples(n, n)
            self._references[key] = (n, _basis(x, self.keep, _EPSILON))
            return None
        n_ref, reference = stored
        _check_samples(n_ref, n)
        current = _basis(x, self.keep, _EPSILON)
        if self.against == "previous":
            self._references[key] = (n, current)
        return _mean_correlation(reference, current, x.device)

    def forget(self) -> None:
        """Drop every reference: the next call for each key starts afresh.

        Example:
            >>> import torch
            >>> similarity = ProbeSimilarity()
            >>> similarity("fc", torch.randn(50, 2))
            >>> similarity.forget()
            >>> similarity("fc", torch.randn(50, 2)) is None
            True
        """
        self._references.clear()
