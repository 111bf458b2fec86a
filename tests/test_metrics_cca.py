"""SVCCA against an independent numpy reference (classic covariance CCA), its invariances and edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from streamwatch.metrics._cca import ProbeSimilarity, flatten_samples, svcca


def reference_svcca(a: np.ndarray, b: np.ndarray, keep: float) -> float:
    """SVCCA the textbook way: SVD-reduce, then CCA as the singular values of Σaa^-1/2 Σab Σbb^-1/2."""

    def reduce(x: np.ndarray) -> np.ndarray:
        x = x - x.mean(axis=0)
        _, s, vt = np.linalg.svd(x, full_matrices=False)
        explained = np.cumsum(s**2) / np.sum(s**2)
        k = int(np.searchsorted(explained, keep)) + 1  # fewest directions explaining >= keep
        return x @ vt[: min(k, len(s))].T

    def inv_sqrt(cov: np.ndarray) -> np.ndarray:
        w, v = np.linalg.eigh(cov)
        return (v / np.sqrt(w)) @ v.T

    ra, rb = reduce(a), reduce(b)
    n = a.shape[0]
    saa, sbb, sab = ra.T @ ra / (n - 1), rb.T @ rb / (n - 1), ra.T @ rb / (n - 1)
    rho = np.linalg.svd(inv_sqrt(saa) @ sab @ inv_sqrt(sbb), compute_uv=False)
    return float(np.clip(rho[: min(ra.shape[1], rb.shape[1])], 0.0, 1.0).mean())


def correlated_pair(seed: int, n: int = 3000, p: int = 24, q: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Two views sharing a latent signal, with decaying spectra so that `keep` < 1 really drops directions."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 10, generator=g, dtype=torch.float64)
    a = z @ torch.randn(10, p, generator=g, dtype=torch.float64)
    b = torch.tanh(z[:, :6]) @ torch.randn(6, q, generator=g, dtype=torch.float64)
    a = a + 0.5 * torch.randn(n, p, generator=g, dtype=torch.float64) * torch.linspace(1.0, 0.05, p)
    b = b + torch.randn(n, q, generator=g, dtype=torch.float64) * torch.linspace(1.5, 0.1, q)
    return a, b


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_the_numpy_covariance_reference(seed: int, keep: float) -> None:
    a, b = correlated_pair(seed)
    expected = reference_svcca(a.numpy(), b.numpy(), keep)
    got = svcca(a, b, keep=keep)
    assert got.dtype == torch.float64
    assert got.shape == ()
    assert 0.0 < expected < 1.0
    assert float(got) == pytest.approx(expected, rel=1e-9, abs=1e-9)


def test_float32_input_is_computed_in_float64() -> None:
    a, b = correlated_pair(3)
    got = svcca(a.float(), b.float())
    assert got.dtype == torch.float64
    assert float(got) == pytest.approx(
        reference_svcca(a.float().double().numpy(), b.float().double().numpy(), 0.99)
    )


def test_identical_activations_score_one() -> None:
    a, _ = correlated_pair(4)
    assert float(svcca(a, a)) == pytest.approx(1.0, abs=1e-12)


def test_invariant_to_invertible_linear_maps_and_shifts() -> None:
    a, _ = correlated_pair(5)
    g = torch.Generator().manual_seed(5)
    r = torch.randn(a.shape[1], 40, generator=g, dtype=torch.float64)  # full column rank, wider
    assert float(svcca(a, 7.0 * a @ r - 3.0, keep=1.0)) == pytest.approx(1.0, abs=1e-9)
    # The SVD reduction keeps top-variance directions, which an orthogonal map (and a scale) preserves:
    q, _ = torch.linalg.qr(torch.randn(a.shape[1], a.shape[1], generator=g, dtype=torch.float64))
    assert float(svcca(a, 0.1 * a @ q + 5.0, keep=0.9)) == pytest.approx(1.0, abs=1e-9)


def test_independent_noise_scores_low_when_samples_outnumber_dims() -> None:
    g = torch.Generator().manual_seed(6)
    a = torch.randn(5000, 10, generator=g)
    b = torch.randn(5000, 12, generator=g)
    assert float(svcca(a, b)) < 0.05


def test_symmetric() -> None:
    a, b = correlated_pair(7)
    for keep in (0.8, 0.99):
        assert float(svcca(a, b, keep=keep)) == pytest.approx(float(svcca(b, a, keep=keep)), abs=1e-12)


def test_too_few_samples_make_every_correlation_trivially_one() -> None:
    """The documented caveat: with kept dims >= n - 1, even independent noise scores 1."""
    g = torch.Generator().manual_seed(8)
    a = torch.randn(20, 50, generator=g)
    b = torch.randn(20, 50, generator=g)
    assert float(svcca(a, b, keep=1.0)) == pytest.approx(1.0, abs=1e-9)


def test_conv_shaped_activations_via_flatten_samples() -> None:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(600, 3, 2, 2, generator=g)
    flat = flatten_samples(x)
    assert flat.shape == (600, 12)
    assert flat.dtype == torch.float64
    assert not flat.requires_grad
    assert torch.equal(flat, x.reshape(600, 12).double())
    assert float(svcca(flat, flatten_samples(2.0 * x + 1.0))) == pytest.approx(1.0, abs=1e-12)
    tokens = torch.randn(600, 4, 5, generator=g)  # (n, S, D)
    assert flatten_samples(tokens).shape == (600, 20)
    assert flatten_samples(torch.arange(5.0)).shape == (5, 1)


def test_flatten_samples_copies_and_detaches() -> None:
    x = torch.randn(10, 3, dtype=torch.float64, requires_grad=True)
    flat = flatten_samples(x)
    assert not flat.requires_grad
    with torch.no_grad():
        x.add_(1.0)
    assert not torch.equal(flat, x.detach())
    with pytest.raises(ValueError, match="0-d"):
        flatten_samples(torch.tensor(1.0))


def test_different_sample_counts_raise() -> None:
    with pytest.raises(ValueError, match="same probe inputs"):
        svcca(torch.randn(10, 3), torch.randn(11, 3))


@pytest.mark.parametrize("n", [0, 1])
def test_fewer_than_two_samples_raise(n: int) -> None:
    with pytest.raises(ValueError, match="at least 2 probe samples"):
        svcca(torch.randn(n, 3), torch.randn(n, 3))


def test_non_matrix_inputs_and_bad_keep_raise() -> None:
    with pytest.raises(ValueError, match="flatten_samples"):
        svcca(torch.randn(10, 3, 2), torch.randn(10, 3))
    for keep in (0.0, -0.5, 1.5, math.nan):
        with pytest.raises(ValueError, match="keep"):
            svcca(torch.randn(10, 3), torch.randn(10, 3), keep=keep)


@pytest.mark.parametrize("value", [0.0, 0.1, 1e6])
def test_constant_activations_have_no_similarity(value: float) -> None:
    """A dead (constant) layer has no variance over the probe batch: the result is NaN, not a crash."""
    const = torch.full((100, 8), value)
    live = torch.randn(100, 8, generator=torch.Generator().manual_seed(10))
    assert math.isnan(float(svcca(const, live)))
    assert math.isnan(float(svcca(live, const)))
    assert math.isnan(float(svcca(const, const)))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_activations_give_nan(bad: float) -> None:
    a = torch.randn(100, 8, generator=torch.Generator().manual_seed(11))
    b = a.clone()
    b[3, 2] = bad
    assert math.isnan(float(svcca(a, b)))
    assert math.isnan(float(svcca(b, a)))


def test_probe_similarity_first_call_stores_the_reference() -> None:
    a, b = correlated_pair(12)
    similarity = ProbeSimilarity()
    assert similarity("layer", a) is None
    got = similarity("layer", b)
    assert got is not None
    assert float(got) == pytest.approx(float(svcca(a, b)), abs=1e-12)
    assert similarity("other", b) is None  # keys are independent


def test_probe_similarity_previous_versus_first() -> None:
    a, b = correlated_pair(13, q=24)
    checkpoints = [a, b, b.clone()]
    previous, first = ProbeSimilarity(against="previous"), ProbeSimilarity(against="first")
    scores_previous = [previous("fc", x) for x in checkpoints]
    scores_first = [first("fc", x) for x in checkpoints]
    assert scores_previous[0] is None
    assert scores_first[0] is None
    a_to_b = float(svcca(a, b))
    assert a_to_b < 0.99
    assert [float(s) for s in scores_previous[1:] if s is not None] == pytest.approx([a_to_b, 1.0], abs=1e-12)
    assert [float(s) for s in scores_first[1:] if s is not None] == pytest.approx([a_to_b, a_to_b], abs=1e-12)


def test_probe_similarity_conv_activations_forget_and_errors() -> None:
    g = torch.Generator().manual_seed(14)
    x = torch.randn(300, 2, 3, 3, generator=g)
    similarity = ProbeSimilarity(keep=1.0)
    assert similarity("conv", x) is None
    x.mul_(3.0)  # the reference is a copy: mutating the caller's tensor does not change it
    score = similarity("conv", x + 1.0)
    assert score is not None
    assert float(score) == pytest.approx(1.0, abs=1e-12)
    with pytest.raises(ValueError, match="same probe inputs"):
        similarity("conv", x[:200])
    similarity.forget()
    assert similarity("conv", x[:200]) is None
    with pytest.raises(ValueError, match="at least 2"):
        similarity("single", x[:1])
    with pytest.raises(ValueError, match="against"):
        ProbeSimilarity(against="last")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keep"):
        ProbeSimilarity(keep=0.0)


def test_probe_similarity_dead_layer_gives_nan_then_recovers() -> None:
    similarity = ProbeSimilarity()
    live = torch.randn(100, 4, generator=torch.Generator().manual_seed(15))
    assert similarity("relu", torch.zeros(100, 4)) is None
    dead_score = similarity("relu", live)
    assert dead_score is not None
    assert math.isnan(float(dead_score))
    recovered = similarity("relu", 2.0 * live)  # "previous": the live activations are now the reference
    assert recovered is not None
    assert float(recovered) == pytest.approx(1.0, abs=1e-12)
