"""Power iteration on Hessian-vector products against the full Hessian, eigendecomposed directly."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from streamwatch.metrics._hessian import HessianEigen, hessian_max_eigenvalue

Problem = tuple[torch.nn.Module, torch.Tensor, torch.Tensor]


def small_problem(seed: int = 0) -> Problem:
    """Linear(3,4)-tanh-Linear(4,1) (21 parameters) and a fixed random batch for an MSE loss, in float64."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    x = torch.randn(32, 3, generator=g, dtype=torch.float64)
    y = torch.randn(32, 1, generator=g, dtype=torch.float64)
    return model, x, y


def closure(problem: Problem) -> Callable[[], torch.Tensor]:
    model, x, y = problem
    return lambda: torch.nn.functional.mse_loss(model(x), y)


def full_hessian_eigenvalues(problem: Problem, names: list[str]) -> torch.Tensor:
    """Eigenvalues of the loss Hessian over the flattened vector of the named parameters.

    Independent of the code under test: ``torch.autograd.functional.hessian`` of a function of the flat
    vector, the model run with those parameters substituted by ``torch.func.functional_call``.
    """
    model, x, y = problem
    named = dict(model.named_parameters())
    shapes = [named[n].shape for n in names]
    flat = torch.cat([named[n].detach().reshape(-1) for n in names])

    def loss_of(vector: torch.Tensor) -> torch.Tensor:
        chunks = torch.split(vector, [s.numel() for s in shapes])
        replaced = {n: c.reshape(s) for n, c, s in zip(names, chunks, shapes, strict=True)}
        return torch.nn.functional.mse_loss(torch.func.functional_call(model, replaced, (x,)), y)

    return torch.linalg.eigvalsh(torch.autograd.functional.hessian(loss_of, flat))


def dominant(eigenvalues: torch.Tensor) -> float:
    return float(eigenvalues[eigenvalues.abs().argmax()])


def test_matches_the_full_hessian_eigendecomposition() -> None:
    problem = small_problem()
    model, loss_fn = problem[0], closure(problem)
    params = list(model.parameters())
    assert sum(p.numel() for p in params) <= 40
    values_before = [p.detach().clone() for p in params]
    eigenvalues = full_hessian_eigenvalues(problem, [n for n, _ in model.named_parameters()])
    by_magnitude = eigenvalues[eigenvalues.abs().argsort(descending=True)]
    assert abs(float(by_magnitude[1])) < 0.8 * abs(float(by_magnitude[0]))  # a gap power iteration can use
    eigenvalue, vector = hessian_max_eigenvalue(loss_fn, params, iterations=300, tol=1e-12)
    assert eigenvalue.shape == ()
    assert eigenvalue.dtype == torch.float64
    assert float(eigenvalue) == pytest.approx(float(by_magnitude[0]), rel=1e-3)
    assert all(torch.equal(p.detach(), v) for p, v in zip(params, values_before, strict=True))
    assert [v.shape for v in vector] == [p.shape for p in params]
    assert float(sum((v * v).sum() for v in vector)) == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize(
    ("spectrum", "expected"),
    [((5.0, -1.0, 2.0, 0.5), 5.0), ((-7.0, 3.0, 1.0, 0.0), -7.0), ((1.0, 1.0, 0.5, 0.25), 1.0)],
)
def test_quadratic_loss_has_the_exact_answer(spectrum: tuple[float, ...], expected: float) -> None:
    g = torch.Generator().manual_seed(1)
    q, _ = torch.linalg.qr(torch.randn(4, 4, generator=g, dtype=torch.float64))
    a = q @ torch.diag(torch.tensor(spectrum, dtype=torch.float64)) @ q.T
    x = torch.nn.Parameter(torch.randn(4, generator=g, dtype=torch.float64))
    eigenvalue, (vector,) = hessian_max_eigenvalue(lambda: 0.5 * x @ a @ x, [x], iterations=200, tol=0.0)
    assert float(eigenvalue) == pytest.approx(expected, rel=1e-9)
    if spectrum[0] != spectrum[1]:  # a simple eigenvalue: the vector is its eigenvector, up to sign
        assert float(abs(vector @ q[:, 0])) == pytest.approx(1.0, rel=1e-9)


def test_parameters_and_their_grads_are_untouched() -> None:
    problem = small_problem()
    model, loss_fn = problem[0], closure(problem)
    params = list(model.parameters())
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(i))
    grads_before = [p.grad for p in params]
    values_before = [p.detach().clone() for p in params]
    hessian_max_eigenvalue(loss_fn, params, iterations=5)
    for i, (p, grad, value) in enumerate(zip(params, grads_before, values_before, strict=True)):
        assert p.grad is grad
        assert torch.equal(p.grad, torch.full_like(p, float(i)))
        assert torch.equal(p.detach(), value)
    model.zero_grad(set_to_none=True)
    hessian_max_eigenvalue(loss_fn, params, iterations=5)
    assert all(p.grad is None for p in params)


def test_frozen_and_unused_parameters_are_skipped() -> None:
    problem = small_problem()
    model, loss_fn = problem[0], closure(problem)
    unused = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    first, *trainable = model.parameters()
    first.requires_grad_(False)
    expected = dominant(full_hessian_eigenvalues(problem, ["0.bias", "2.weight", "2.bias"]))
    assert expected != pytest.approx(dominant(full_hessian_eigenvalues(small_problem(), ["0.weight"])))

    params = [first, unused, *trainable]
    eigenvalue, vector = hessian_max_eigenvalue(loss_fn, params, iterations=300, tol=1e-12)
    assert float(eigenvalue) == pytest.approx(expected, rel=1e-3)
    assert torch.equal(vector[0], torch.zeros_like(first))
    assert torch.equal(vector[1], torch.zeros_like(unused))
    assert first.grad is None
    assert unused.grad is None


def test_nan_loss_gives_nan() -> None:
    problem = small_problem()
    model, loss_fn = problem[0], closure(problem)
    params = list(model.parameters())
    eigenvalue, vector = hessian_max_eigenvalue(lambda: loss_fn() * math.nan, params)
    assert math.isnan(float(eigenvalue))
    assert all(torch.isfinite(v).all() for v in vector)
    with torch.no_grad():
        params[-1].fill_(math.nan)
    assert math.isnan(float(hessian_max_eigenvalue(loss_fn, params)[0]))
    assert math.isnan(float(HessianEigen()(loss_fn, params)))
    # A finite loss whose Hessian is not: d²√w/dw² at w = 0.
    w = torch.nn.Parameter(torch.tensor([0.0, 1.0]))
    assert math.isnan(float(hessian_max_eigenvalue(lambda: torch.sqrt(w).sum(), [w])[0]))


def test_loss_without_curvature_gives_zero() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    linear, _ = hessian_max_eigenvalue(lambda: 3.0 * w.sum(), [w])
    constant, _ = hessian_max_eigenvalue(lambda: torch.tensor(4.0), [w])
    assert float(linear) == 0.0
    assert float(constant) == 0.0


def test_works_under_no_grad_and_leaves_the_global_rng_alone() -> None:
    problem = small_problem()
    model, loss_fn = problem[0], closure(problem)
    params = list(model.parameters())
    expected, _ = hessian_max_eigenvalue(loss_fn, params)
    state = torch.get_rng_state()
    with torch.no_grad():
        got, _ = hessian_max_eigenvalue(loss_fn, params)
    assert torch.equal(torch.get_rng_state(), state)
    assert float(got) == float(expected)  # deterministic start vector


def test_invalid_arguments_raise() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match="requires grad"):
        hessian_max_eigenvalue(lambda: w.sum(), [w.detach()])
    with pytest.raises(ValueError, match="scalar"):
        hessian_max_eigenvalue(lambda: w * w, [w])
    with pytest.raises(ValueError, match="iterations"):
        hessian_max_eigenvalue(lambda: (w * w).sum(), [w], iterations=0)
    with pytest.raises(ValueError, match="one tensor per parameter"):
        hessian_max_eigenvalue(lambda: (w * w).sum(), [w], v0=[])
    with pytest.raises(ValueError, match="iterations"):
        HessianEigen(iterations=0)


def test_warm_start_converges_in_fewer_iterations() -> None:
    problem = small_problem()
    model, loss_fn = problem[0], closure(problem)
    params = list(model.parameters())
    sharpness = HessianEigen(iterations=200, tol=1e-6)
    assert sharpness.last_iterations == 0
    cold = sharpness(loss_fn, params)
    cold_iterations = sharpness.last_iterations
    warm = sharpness(loss_fn, params)
    assert 2 <= sharpness.last_iterations < cold_iterations
    assert float(warm) == pytest.approx(float(cold), rel=1e-5)

    # After a small training step the stored direction is still a good start.
    with torch.no_grad():
        for p in params:
            p.add_(1e-3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2), dtype=p.dtype))
    sharpness(loss_fn, params)
    assert sharpness.last_iterations < cold_iterations

    sharpness.forget()
    sharpness(loss_fn, params)
    assert sharpness.last_iterations == cold_iterations  # (the cold start again)


def test_warm_start_finds_a_direction_that_became_the_sharpest() -> None:
    """From the last eigenvector alone, a direction that became the sharpest since (the top two
    eigenvalues swapped) has no weight: λ barely moved, the early stop returned the old direction's,
    second, eigenvalue (2.0 where the answer is 4.0). Checked against the exact eigenvalues."""
    x = torch.nn.Parameter(torch.tensor([0.3, -0.7, 0.2], dtype=torch.float64))
    # a large parameter without curvature where the loss reaches it (an embedding's rows the fixed batch
    # never touches): a random half spread over it left almost nothing where the Hessian acts
    table = torch.nn.Embedding(100_000, 1).double()
    row = torch.tensor([0])
    g = torch.Generator().manual_seed(3)
    q, _ = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))
    for params in ([x], [table.weight, x]):
        sharpness = HessianEigen(iterations=100)
        for spectrum in ((1.0, 2.0, 0.5), (4.0, 2.0, 0.5), (2.2, 2.0, 0.5), (1.0, 3.0, 0.1)):
            a = q @ torch.diag(torch.tensor(spectrum, dtype=torch.float64)) @ q.T
            got = float(sharpness(lambda a=a: 0.5 * x @ a @ x + table(row).sum(), params))
            assert got == pytest.approx(float(torch.linalg.eigvalsh(a).max()), rel=1e-3), (
                len(params),
                spectrum,
            )


def test_v0_warm_starts_the_function() -> None:
    problem = small_problem()
    model, loss_fn = problem[0], closure(problem)
    params = list(model.parameters())
    eigenvalue, vector = hessian_max_eigenvalue(loss_fn, params, iterations=300, tol=1e-12)
    again, _ = hessian_max_eigenvalue(loss_fn, params, iterations=1, v0=vector)
    assert float(again) == pytest.approx(float(eigenvalue), rel=1e-9)


def test_the_metric_leaves_modes_rng_and_grads_as_it_found_them() -> None:
    """A loss closure that calls ``m.eval()`` (as advised) must not leave the model in eval mode, nor may
    its forward (dropout, batch norm) change the RNG, the buffers or ``.grad`` seen by training."""
    import streamwatch as sw

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 8),
        torch.nn.BatchNorm1d(8),
        torch.nn.Tanh(),
        torch.nn.Dropout(0.5),
        torch.nn.Linear(8, 1),
    )
    x, y = torch.randn(16, 3), torch.randn(16, 1)
    calls: list[bool] = []

    def in_eval(m: torch.nn.Module) -> torch.Tensor:
        m.eval()
        return torch.nn.functional.mse_loss(m(x), y)

    def in_train(m: torch.nn.Module) -> torch.Tensor:  # dropout draws; batch norm updates its statistics
        calls.append(m.training)
        return torch.nn.functional.mse_loss(m(x), y)

    for loss_fn in (in_eval, in_train):
        model.train()
        model[1].eval()  # frozen
        model.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        model[0].bias.grad = None
        grads = [p.grad for p in model.parameters()]
        values = [None if g is None else g.clone() for g in grads]
        buffers = [b.clone() for b in model.buffers()]
        modes = [m.training for m in model.modules()]
        state = torch.get_rng_state()
        with sw.observe(
            model, metrics=[sw.metrics.HessianMaxEig(loss_fn, every=1, iterations=3)], every=1
        ) as watch:
            watch.step()
            watch.step()
            assert watch.statistics().hook_errors == 0
        assert math.isfinite(
            next(s.value for s in watch.snapshot() if s.name == "streamwatch_hessian_max_eig")
        )
        assert [m.training for m in model.modules()] == modes
        assert torch.equal(torch.get_rng_state(), state)
        assert all(torch.equal(a, b) for a, b in zip(model.buffers(), buffers, strict=True))
        for p, grad, value in zip(model.parameters(), grads, values, strict=True):
            assert p.grad is grad
            assert grad is None or torch.equal(grad, value)  # type: ignore[arg-type]
    assert calls == [True, True]  # the training-mode closure did run in training mode


def test_warm_calls_with_one_iteration_or_an_opposite_random_half_stay_finite() -> None:
    """The warm start's extra product used up ``iterations=1`` (NaN on every call after the first, and
    a NaN is never stored); and a last eigenvector pointing exactly against H·r (rank one: both on the
    same line) cancelled it to zero (NaN for good). Checked against the exact eigenvalue."""
    x = torch.nn.Parameter(torch.tensor([1.0, 2.0, -1.0]))
    a = torch.tensor([[3.0, 1.0, 0.0], [1.0, 3.0, 0.0], [0.0, 0.0, 1.0]])
    one = HessianEigen(iterations=1)
    values = [float(one(lambda: 0.5 * x @ a @ x, [x])) for _ in range(4)]
    assert all(math.isfinite(v) for v in values)
    assert values[-1] <= 4.0 + 1e-5  # (a Rayleigh quotient: never above the largest eigenvalue)
    for seed in range(6):
        u = torch.randn(3, generator=torch.Generator().manual_seed(seed))
        sharpness = HessianEigen(iterations=20)
        for _ in range(3):
            got = float(sharpness(lambda u=u: -0.5 * (u @ x) ** 2, [x]))
            assert got == pytest.approx(-float(u @ u), rel=1e-4), seed
