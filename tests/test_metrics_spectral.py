"""Spectral norm (accelerated, warm-started power iteration) and condition number against torch.linalg."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from syncs import no_host_sync

from streamwatch.metrics._spectral import PowerIteration, as_matrix, condition_number, spectral_norm


def exact_norm(w: torch.Tensor) -> float:
    return float(torch.linalg.matrix_norm(as_matrix(w).double(), ord=2))


def with_gap(m: int, n: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """U diag(s) Vᵀ with σ₁ = 3, σ₂ = 2 and the rest below: a clear spectral gap."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    u, _ = torch.linalg.qr(torch.randn(m, k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, k, generator=g, dtype=torch.float64))
    s = torch.cat(
        [
            torch.tensor([3.0, 2.0], dtype=torch.float64)[:k],
            torch.linspace(1.5, 0.1, max(k - 2, 0), dtype=torch.float64),
        ]
    )
    return ((u * s) @ v.T).to(dtype)


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# -- as_matrix --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        ((5, 7), (5, 7)),
        ((8, 3, 3, 3), (8, 27)),
        ((6,), (1, 6)),
        ((), (1, 1)),
        ((0, 4), (0, 4)),
        ((4, 0), (4, 0)),
    ],
)
def test_as_matrix_views_out_by_the_rest(shape: tuple[int, ...], expected: tuple[int, int]) -> None:
    w = torch.zeros(shape, requires_grad=True)
    m = as_matrix(w)
    assert tuple(m.shape) == expected
    assert not m.requires_grad


# -- spectral_norm (stateless) ----------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "n"), [(40, 40), (60, 20), (20, 60), (1, 30), (30, 1), (2, 2), (3, 5)])
def test_spectral_norm_matches_matrix_norm_with_a_gap(m: int, n: int) -> None:
    w = with_gap(m, n, seed=m * 100 + n)
    sigma, v = spectral_norm(w, iterations=200)
    assert sigma.shape == ()
    assert sigma.dtype == torch.float32
    assert float(sigma) == pytest.approx(exact_norm(w), rel=1e-4)
    top = torch.linalg.svd(w.double()).Vh[0]
    assert float(torch.dot(v.double(), top).abs()) == pytest.approx(1.0, abs=1e-4)
    assert float(torch.linalg.vector_norm(v)) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("shape", [(64, 64), (128, 32), (32, 128), (16, 3, 3, 3), (50,), (1, 1), ()])
def test_spectral_norm_of_random_weights_of_every_shape(shape: tuple[int, ...]) -> None:
    w = gaussian(*shape, seed=len(shape))
    sigma, _ = spectral_norm(w, iterations=200)
    assert float(sigma) == pytest.approx(exact_norm(w), rel=1e-4)


def test_the_estimate_is_a_lower_bound_that_grows_with_the_iterations() -> None:
    w = gaussian(96, 80, seed=4)
    start = gaussian(80, seed=5)
    estimates = [float(spectral_norm(w, iterations=k, v=start)[0]) for k in range(1, 15)]
    exact = exact_norm(w)
    assert all(b >= a * (1 - 1e-6) for a, b in itertools.pairwise(estimates))
    assert all(e <= exact * (1 + 1e-6) for e in estimates)
    assert estimates[0] < exact * 0.999  # it does start below


def test_float64_is_computed_in_float64() -> None:
    w = with_gap(30, 20, seed=1, dtype=torch.float64)
    sigma, v = spectral_norm(w, iterations=100)
    assert sigma.dtype == v.dtype == torch.float64
    assert float(sigma) == pytest.approx(3.0, rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_is_upcast(dtype: torch.dtype) -> None:
    w = with_gap(24, 16, seed=2, dtype=dtype)
    sigma, v = spectral_norm(w, iterations=100)
    assert sigma.dtype == v.dtype == torch.float32
    assert float(sigma) == pytest.approx(exact_norm(w.float()), rel=1e-5)
    assert float(PowerIteration(iterations=50)("w", w)) == pytest.approx(exact_norm(w.float()), rel=1e-5)


def test_zero_weights_give_zero_not_nan() -> None:
    sigma, v = spectral_norm(torch.zeros(5, 4), iterations=3)
    assert float(sigma) == 0.0
    assert bool(torch.isfinite(v).all())
    assert float(torch.linalg.vector_norm(v)) == pytest.approx(1.0)
    assert float(PowerIteration()("w", torch.zeros(3, 3))) == 0.0


def test_a_single_unit_is_its_euclidean_norm() -> None:
    row = torch.tensor([[3.0, 0.0, -4.0]])
    assert float(spectral_norm(row, iterations=1)[0]) == pytest.approx(5.0, rel=1e-6)
    assert float(spectral_norm(row.T, iterations=1)[0]) == pytest.approx(5.0, rel=1e-6)
    assert float(spectral_norm(torch.tensor([-2.5]), iterations=1)[0]) == pytest.approx(2.5, rel=1e-6)
    assert float(spectral_norm(torch.tensor(-2.5), iterations=1)[0]) == pytest.approx(2.5, rel=1e-6)


def test_tiny_and_huge_weights_do_not_underflow_or_overflow() -> None:
    w = with_gap(20, 10, seed=3)
    for scale in (1e-30, 1e30):
        sigma, _ = spectral_norm(w * scale, iterations=100)
        assert float(sigma) == pytest.approx(3.0 * scale, rel=1e-5)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_weights_give_a_non_finite_estimate_not_an_exception(bad: float) -> None:
    w = gaussian(6, 5, seed=6)
    w[2, 3] = bad
    sigma, v = spectral_norm(w, iterations=5)
    assert not math.isfinite(float(sigma))
    assert bool(torch.isfinite(v).all())  # the (normalised) start vector comes back


def test_spectral_norm_validates_its_arguments() -> None:
    w = torch.ones(3, 4)
    for iterations in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="iterations"):
            spectral_norm(w, iterations=iterations)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        spectral_norm(w, v=torch.ones(3))
    with pytest.raises(ValueError, match="iterations"):
        PowerIteration(iterations=0)


# -- PowerIteration (warm-started) ------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(256, 256), (128, 256), (256, 128), (32, 16, 3, 3), (64,)])
def test_warm_start_tracks_a_drifting_weight_within_1e_3(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(*shape, generator=g) / math.sqrt(shape[-1])
    track = PowerIteration(iterations=2)
    errors = []
    for step in range(30):
        w = w + 1e-3 * torch.randn(*shape, generator=g) / math.sqrt(shape[-1])
        sigma = track("w", w)
        if step >= 25:
            errors.append((exact_norm(w) - float(sigma)) / exact_norm(w))
    assert max(errors) < 1e-3
    assert min(errors) > -1e-5  # a lower bound, up to float32 rounding


def test_each_key_keeps_its_own_state() -> None:
    a, b = with_gap(20, 12, seed=8), gaussian(9, 30, seed=9)
    shared, only_a, only_b = PowerIteration(), PowerIteration(), PowerIteration()
    for _ in range(5):
        assert torch.equal(shared("a", a), only_a("a", a))
        assert torch.equal(shared("b", b), only_b("b", b))


def test_a_shape_change_restarts_the_key() -> None:
    track = PowerIteration()
    for _ in range(3):
        track("w", gaussian(6, 4, seed=10))
    new = gaussian(4, 6, seed=11)
    assert torch.equal(track("w", new), PowerIteration()("w", new))
    same_width = gaussian(5, 6, seed=12)  # a new row count also restarts
    assert torch.equal(track("w", same_width), PowerIteration()("w", same_width))


def test_forget_drops_every_state() -> None:
    w = gaussian(10, 10, seed=13)
    track = PowerIteration()
    for _ in range(4):
        track("w", w)
    track.forget()
    assert torch.equal(track("w", w), PowerIteration()("w", w))


def test_the_first_vector_is_deterministic_per_seed() -> None:
    w = gaussian(40, 30, seed=14)
    assert torch.equal(PowerIteration(seed=1)("w", w), PowerIteration(seed=1)("w", w))
    assert not torch.equal(PowerIteration(seed=1)("w", w), PowerIteration(seed=2)("w", w))


def test_a_nan_step_is_reported_and_the_state_survives_it() -> None:
    w1, w2 = gaussian(12, 8, seed=15), gaussian(12, 8, seed=15) * 1.01
    broken = w1.clone()
    broken[0, 0] = math.nan
    seen_nan, clean = PowerIteration(), PowerIteration()
    seen_nan("w", w1)
    clean("w", w1)
    assert math.isnan(float(seen_nan("w", broken)))
    assert torch.equal(seen_nan("w", w2), clean("w", w2))  # as if the NaN step never happened
    for _ in range(30):
        sigma = seen_nan("w", w2)
    assert float(sigma) == pytest.approx(exact_norm(w2), rel=1e-5)


def test_zero_weights_then_real_ones_converge() -> None:
    track = PowerIteration()
    assert float(track("w", torch.zeros(8, 8))) == 0.0
    w = with_gap(8, 8, seed=16)
    for _ in range(20):
        sigma = track("w", w)
    assert float(sigma) == pytest.approx(3.0, rel=1e-5)


def test_a_dtype_change_keeps_the_state() -> None:
    w = with_gap(16, 12, seed=17)
    track = PowerIteration()
    for _ in range(10):
        track("w", w)
    sigma = track("w", w.double())
    assert sigma.dtype == torch.float64
    assert float(sigma) == pytest.approx(3.0, rel=1e-6)


# -- condition number -------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(30, 30), (40, 10), (10, 40), (8, 3, 3, 3), (7,)])
def test_condition_number_is_the_ratio_of_extreme_singular_values(shape: tuple[int, ...]) -> None:
    w = gaussian(*shape, seed=18)
    s = torch.linalg.svdvals(as_matrix(w))
    got = condition_number(w)
    assert got.shape == ()
    assert got.dtype == torch.float32
    assert float(got) == pytest.approx(float(s[0] / s[-1]), rel=1e-5)


def test_condition_number_of_a_known_matrix_is_not_ikkunas_product() -> None:
    w = torch.diag(torch.tensor([4.0, 2.0, 0.5]))
    assert float(condition_number(w)) == pytest.approx(8.0)  # ikkuna's σmax·σmin would be 2


def test_condition_number_of_singular_and_zero_weights_is_inf() -> None:
    assert float(condition_number(torch.zeros(4, 3))) == math.inf
    assert float(condition_number(torch.tensor([[1.0, 0.0], [0.0, 0.0]]))) == math.inf


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_condition_number_of_non_finite_weights_is_nan(bad: float) -> None:
    w = gaussian(5, 5, seed=19)
    w[1, 2] = bad
    assert math.isnan(float(condition_number(w)))


def test_condition_number_dtypes_and_empty_weights() -> None:
    w = gaussian(6, 4, seed=20).double()
    got = condition_number(w)
    s = torch.linalg.svdvals(w)
    assert got.dtype == torch.float64
    assert float(got) == pytest.approx(float(s[0] / s[-1]), rel=1e-12)
    assert condition_number(w.half()).dtype == torch.float32
    assert math.isnan(float(condition_number(torch.zeros(0, 3))))
    assert float(condition_number(torch.tensor([3.0, 4.0]))) == 1.0  # one row: a single singular value


# -- CUDA: no host synchronisation ------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_power_iteration_on_cuda_makes_no_host_sync_and_matches_the_cpu() -> None:
    w = with_gap(64, 48, seed=21)
    cpu, gpu = PowerIteration(), PowerIteration()
    on_device, half_on_device = w.cuda(), w.cuda().half()  # (a copy from pageable memory waits)
    with no_host_sync():
        estimates = [gpu("w", on_device) for _ in range(10)]
        half = gpu("h", half_on_device)
    for _ in range(10):
        expected = cpu("w", w)
    assert estimates[-1].device.type == "cuda"
    assert float(estimates[-1]) == pytest.approx(float(expected), rel=1e-5)
    assert math.isfinite(float(half))
