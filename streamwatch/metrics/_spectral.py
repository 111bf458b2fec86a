"""Spectral statistics of weights: the largest singular value (power iteration) and the condition number.

The spectral norm ``σmax(W) = max |W v| / |v|`` bounds how much a layer can stretch its input, so its
growth during training flags exploding layers (ikkuna's ``SpectralNormSubscriber``). A weight tensor is
first viewed as a matrix (:func:`as_matrix`): ``(out, -1)`` for 2-D and higher (a conv kernel becomes
``(out_channels, in_channels·kh·kw)``), one row for a 1-D bias, ``(1, 1)`` for a scalar.

**Power iteration, conjugate-gradient accelerated** (:func:`spectral_norm`). ``σmax`` maximises
``|W x|`` over unit ``x`` (``σmax²`` is the top eigenvalue of ``WᵀW``, which is never formed). Plain
power iteration (``u = Wv/|Wv|, v = Wᵀu/|Wᵀu|``) converges at the rate ``(σ₂/σ₁)²`` per step, and a
square random matrix has a relative gap of only ``~n^(-2/3)`` at the top: 60 steps leave 0.2-1% error
on a 512×512 Gaussian matrix. Each step here has the same cost as a power step, one product with ``W``
and one with ``Wᵀ`` (``4·m·n`` flops, two reads of ``W``), but moves ``x`` to the exact maximiser of
``|W s|`` on ``span{x, d}`` (a 2×2 eigenproblem in closed form, ``½·atan2(2b, a − c)``), where the
search direction ``d`` is the residual ``WᵀWx/ρ − x`` plus a Polak–Ribière multiple of the previous
direction: nonlinear conjugate gradient on the sphere, which converges at about the square root of
the power rate (60 steps: ~1e-6 on the same matrix). The estimate is ``|W x|`` for the final unit
``x``: a lower bound on ``σmax`` that never decreases within a call.

:class:`PowerIteration` warm-starts each weight (``x``, ``d`` and the last residual per key) from the
previous call: weights change slowly, so two steps per training step accumulate into many and track
``σmax`` to better than 1e-3 relative within ~30 calls (measured: ≤ 5e-6 for random 64×64 to
1024×1024 weights drifting by 0.1% per call). The first vector is a deterministic normal sample (a
CPU ``torch.Generator`` seeded by ``seed``) copied to the device once, from pinned memory so that the
copy does not synchronise. Cost of a 2-step call: five matrix-vector products plus ~50 tiny kernels
per step (1024×1024 float32 on a 2-core CPU: ~1.1 ms, against ~0.8 ms for plain power iteration); on a
GPU, small weights are bound by those ~100 launches.

Everything stays on the device: no ``.item()``, no branching on values. Normalising divides by
``max(|x|, tiny)``, so zero weights give an estimate of 0 rather than NaN; a NaN/Inf weight gives a
NaN (or Inf) estimate and the previous state is kept (``torch.where``) so the next finite call
recovers. Computation is float32 (float64 for float64 weights); half precision is upcast.

**Condition number** (:func:`condition_number`) is ``σmax / σmin`` over the ``min(m, n)`` singular values
from ``torch.linalg.svdvals``: a full SVD, ``O(m·n·min(m, n))``, and on CUDA torch synchronises to
check convergence, so call it occasionally, not every step. (ikkuna reported ``σmax·σmin``; the ratio is
the condition number.) It is ``+inf`` when ``σmin`` is 0 and NaN when ``W`` has a NaN/Inf; in float32,
values beyond ~1e6 mostly measure rounding.

Example:
    >>> import torch
    >>> w = torch.diag(torch.tensor([3.0, 1.0, 0.5]))
    >>> track = PowerIteration(iterations=2)
    >>> for _ in range(10):
    ...     sigma = track("fc.weight", w)
    >>> round(float(sigma), 4), round(float(condition_number(w)), 4)
    (3.0, 6.0)
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch

from streamwatch._validate import check_int

__all__ = ["PowerIteration", "as_matrix", "condition_number", "spectral_norm"]


def as_matrix(w: torch.Tensor) -> torch.Tensor:
    """View a weight as a detached matrix: ``(out, -1)``; a 1-D tensor is one row, a scalar is ``(1, 1)``.

    Args:
        w: a weight of any shape.

    Returns:
        A 2-D view (or copy, for non-viewable strides) of ``w.detach()``.

    Example:
        >>> import torch
        >>> as_matrix(torch.zeros(8, 3, 5, 5)).shape, as_matrix(torch.zeros(4)).shape
        (torch.Size([8, 75]), torch.Size([1, 4]))
    """
    w = w.detach()
    if w.dim() == 0:
        return w.reshape(1, 1)
    if w.dim() == 1:
        return w.reshape(1, -1)
    return w.reshape(w.shape[0], math.prod(w.shape[1:]))  # not -1: a 0-row tensor has no inferable width


def _compute_dtype(w: torch.Tensor) -> torch.dtype:
    return torch.float64 if w.dtype == torch.float64 else torch.float32


def _initial_vector(n: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """A unit normal sample, identical on every device: drawn on the CPU, copied once without a sync."""
    generator = torch.Generator().manual_seed(seed)
    v: torch.Tensor = torch.randn(n, generator=generator, dtype=torch.float64)
    v = (v / torch.linalg.vector_norm(v).clamp_min(torch.finfo(v.dtype).tiny)).to(dtype)
    if device.type != "cuda":
        return v.to(device)
    pinned: torch.Tensor = v.pin_memory()  # a pageable host-to-device copy would synchronise; this does not
    moved: torch.Tensor = pinned.to(device, non_blocking=True)
    return moved


def _unit(x: torch.Tensor) -> torch.Tensor:
    """``x / max(|x|, tiny)``: zero stays zero, NaN propagates."""
    unit: torch.Tensor = x / torch.linalg.vector_norm(x).clamp_min(torch.finfo(x.dtype).tiny)
    return unit


def _check_iterations(iterations: int) -> None:
    check_int(iterations, "iterations")


def _direction(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The unit part of ``v`` orthogonal to the unit ``x`` (projected twice), or zero when that part is
    rounding noise (``<= 100·eps·|v|``): a noise direction would not be orthogonal to ``x``."""
    o = v - torch.dot(x, v) * x
    o = o - torch.dot(x, o) * x
    length = torch.linalg.vector_norm(o)
    keep = length > 100 * torch.finfo(v.dtype).eps * torch.linalg.vector_norm(v)
    return torch.where(keep, o / length.clamp_min(torch.finfo(v.dtype).tiny), torch.zeros_like(o))


def _ascend(
    matrix: torch.Tensor, iterations: int, x: torch.Tensor, d: torch.Tensor, g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``iterations`` conjugate-gradient steps maximising ``|W x|`` over unit ``x``: ``(sigma, x, d, g)``.

    ``g`` is the relative residual ``WᵀWx/ρ − x`` (``ρ = |Wx|²``), ``d`` the search direction; both come
    back for the next call. Each step maximises exactly over ``span{x, d}`` (a 2×2 eigenproblem in
    closed form), so the estimate never decreases within a call. ``W`` is scaled by ``max |W x|`` (free)
    so that squares neither underflow nor overflow, and ``g``/``d`` are scale-free across calls.
    """
    start = (x, d, g)
    tiny = torch.finfo(matrix.dtype).tiny
    x = _unit(x)
    wx = torch.mv(matrix, x)
    scale = wx.abs().amax() if wx.numel() else wx.new_ones(())
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # Wx = 0: nothing to scale
    wx = wx / scale
    for _ in range(iterations):
        rho = torch.dot(wx, wx)
        g_new = torch.mv(matrix.T, wx) / (scale * rho.clamp_min(tiny)) - x
        g_new = g_new - torch.dot(x, g_new) * x
        previous = torch.dot(g, g)  # Polak–Ribière+, restarting (beta = 0) without a previous residual
        beta = torch.where(previous > 0, torch.dot(g_new, g_new - g) / previous.clamp_min(tiny), 0.0)
        d = g_new + beta.clamp_min(0.0) * (d - torch.dot(x, d) * x)
        step = _direction(d, x)
        wd = torch.mv(matrix, step) / scale
        # top eigenvector of [[ρ, b], [b, c]] in the orthonormal basis {x, step}: angle ½·atan2(2b, ρ − c)
        angle = torch.atan2(2 * torch.dot(wx, wd), rho - torch.dot(wd, wd)) / 2
        x = torch.cos(angle) * x + torch.sin(angle) * step
        wx = torch.cos(angle) * wx + torch.sin(angle) * wd
        g = g_new
    sigma = torch.linalg.vector_norm(wx) * scale
    usable = torch.isfinite(sigma) & torch.isfinite(sum(torch.linalg.vector_norm(v) for v in (x, d, g)))
    kept = [torch.where(usable, new, old) for new, old in zip((x, d, g), start, strict=True)]
    return sigma, kept[0], kept[1], kept[2]


def spectral_norm(
    w: torch.Tensor, iterations: int = 50, v: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Estimate ``σmax`` of :func:`as_matrix` ``(w)`` by accelerated power iteration from ``v``; no sync.

    The stateless core of :class:`PowerIteration` (which also carries the search direction between calls).

    Args:
        w: the weight (any shape, any floating dtype, any device).
        iterations: steps, at least 1 (each one product with ``W`` and one with ``Wᵀ``).
        v: the start vector, of length ``as_matrix(w).shape[1]`` (need not be normalised); None starts
            from a fixed random vector (seed 0).

    Returns:
        ``(sigma, v)``: the 0-d estimate ``|W v|`` (a lower bound on ``σmax``; 0 for zero weights, NaN
        for NaN weights) and the unit right singular vector estimate, to pass back in as ``v`` next time
        (the normalised start vector when the weights are not finite). Both are float32 (float64 for
        float64 ``w``) on ``w``'s device.

    Raises:
        ValueError: ``iterations < 1`` or ``v`` has the wrong length.

    Example:
        >>> import torch
        >>> sigma, v = spectral_norm(torch.tensor([[3.0, 0.0], [0.0, -4.0]]))
        >>> round(float(sigma), 4), [round(abs(float(x)), 4) for x in v]
        (4.0, [0.0, 1.0])
    """
    _check_iterations(iterations)
    matrix = as_matrix(w).to(_compute_dtype(w))
    n = matrix.shape[1]
    if v is None:
        v = _initial_vector(n, matrix.dtype, matrix.device, seed=0)
    elif v.shape != (n,):
        raise ValueError(f"v must have shape ({n},) to match the weight viewed as {tuple(matrix.shape)}")
    start = _unit(v.detach().to(device=matrix.device, dtype=matrix.dtype))
    sigma, v, _, _ = _ascend(matrix, iterations, start, torch.zeros_like(start), torch.zeros_like(start))
    return sigma, v


class PowerIteration:
    """Warm-started power iteration for the largest singular value of weights, one state vector per key.

    Each call runs ``iterations`` steps of :func:`spectral_norm` from the key's previous vector and
    search direction, so the estimate sharpens over calls while the weight drifts slowly. A key whose
    matrix shape or device changes restarts from the seeded vector. Not thread-safe: one instance per
    thread. Memory: three vectors of ``as_matrix(w).shape[1]`` elements per key.

    Args:
        iterations: steps per call (each one product with ``W`` and one with ``Wᵀ``).
        seed: seeds the CPU generator of the first vector of each key.

    Raises:
        ValueError: ``iterations < 1``.

    Example:
        >>> import torch
        >>> track = PowerIteration(iterations=2, seed=0)
        >>> w = torch.tensor([[2.0, 1.0], [0.0, 1.0]])
        >>> [round(float(track("w", w)), 4) for _ in range(3)][-1]
        2.2882
    """

    def __init__(self, iterations: int = 2, seed: int = 0) -> None:
        _check_iterations(iterations)
        self.iterations = iterations
        self.seed = seed
        self._state: dict[Hashable, tuple[tuple[int, int], torch.device, list[torch.Tensor]]] = {}

    def __call__(self, key: Hashable, w: torch.Tensor) -> torch.Tensor:
        """Advance ``key``'s estimate on ``w`` and return it: a 0-d tensor on ``w``'s device.

        Args:
            key: identifies the weight (a parameter name, a module).
            w: its current value.

        Returns:
            The ``σmax`` estimate, float32 (float64 for float64 ``w``); NaN if ``w`` has NaN.

        Example:
            >>> import torch
            >>> round(float(PowerIteration()("bias", torch.tensor([3.0, 4.0]))), 4)
            5.0
        """
        matrix = as_matrix(w).to(_compute_dtype(w))
        shape = (matrix.shape[0], matrix.shape[1])
        state = self._state.get(key)
        if state is None or state[0] != shape or state[1] != matrix.device:
            v = _initial_vector(shape[1], matrix.dtype, matrix.device, self.seed)
            vectors = [v, torch.zeros_like(v), torch.zeros_like(v)]
        else:
            vectors = [t.to(matrix.dtype) for t in state[2]]
        sigma, *vectors = _ascend(matrix, self.iterations, *vectors)
        self._state[key] = (shape, matrix.device, vectors)
        return sigma

    def forget(self) -> None:
        """Drop every state vector: the next call for each key starts afresh.

        Example:
            >>> track = PowerIteration()
            >>> track.forget()
        """
        self._state.clear()


def condition_number(w: torch.Tensor) -> torch.Tensor:
    """``σmax / σmin`` of :func:`as_matrix` ``(w)`` over its ``min(m, n)`` singular values, as a 0-d tensor.

    A full SVD (``torch.linalg.svdvals``): ``O(m·n·min(m, n))``, and on CUDA torch synchronises inside
    it, so this is for occasional checks. Non-finite weights are replaced by zeros before the SVD (LAPACK
    would raise) and the result is masked to NaN.

    Args:
        w: the weight (any shape, any floating dtype, any device).

    Returns:
        float32 (float64 for float64 ``w``) on ``w``'s device: ``+inf`` when ``σmin == 0`` (including
        zero weights), NaN when ``w`` has NaN/Inf or is empty.

    Example:
        >>> import torch
        >>> w = torch.tensor([[4.0, 0.0], [0.0, 0.5]])
        >>> float(condition_number(w)), float(condition_number(torch.zeros(2, 2)))
        (8.0, inf)
    """
    dtype = _compute_dtype(w)
    matrix = as_matrix(w).to(dtype)
    if matrix.numel() == 0:  # a shape, not a value: no singular values at all
        return torch.full((), math.nan, dtype=dtype, device=matrix.device)
    finite = torch.isfinite(matrix).all()
    values = torch.linalg.svdvals(torch.where(finite, matrix, matrix.new_zeros(())))
    largest, smallest = values[0], values[-1]
    ratio = torch.where(smallest == 0, torch.full_like(largest, math.inf), largest / smallest)
    return torch.where(finite, ratio, torch.full_like(ratio, math.nan))
