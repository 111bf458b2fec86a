"""Sparse gradients (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``): summarised as the
whole tensor they stand for — each row checked against the dense gradient (``to_dense()``) computed
plainly — duplicates summed, unstored zeros in the count, the minimum and the maximum; on a device without
a host sync (here: the device route's ops, forced on the CPU, hold no op that waits for the device)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import streamwatch as sw
from streamwatch import SeriesKey
from streamwatch._sparse import _summed_runs, stored_values
from tests.test_observe_battery import assert_row, row

WAITS = {"_coalesce", "_local_scalar_dense", "nonzero", "_unique2", "unique_consecutive", "unique_dim"}
"""Ops whose output size or value the host must read from the device: a host sync on CUDA."""


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _coo(shape: tuple[int, ...], sparse_dims: int, entries: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randint(0, shape[d], (entries,), generator=g) for d in range(sparse_dims)])
    values = torch.randn(entries, *shape[sparse_dims:], generator=g)
    values[values.abs() < 0.3] = 0.0  # stored zeros too
    return torch.sparse_coo_tensor(indices, values, shape, check_invariants=True)


def _same_statistics(flat: torch.Tensor, dense: torch.Tensor) -> None:
    """(Duplicates are summed in float32 in another order than ``to_dense()``'s: equal within rounding.)"""
    a, b = flat.double(), dense.double()
    for stat in (
        lambda t: t.sum(),
        lambda t: t.pow(2).sum(),
        lambda t: t.abs().sum(),
        lambda t: t.pow(4).sum(),
        torch.min,
        torch.max,
    ):
        torch.testing.assert_close(stat(a), stat(b), rtol=1e-5, atol=1e-6)
    assert int((a != 0).sum()) == int((b != 0).sum())


@pytest.mark.parametrize(
    ("shape", "sparse_dims", "entries"),
    [((50, 8), 1, 40), ((6, 7, 3), 2, 30), ((30,), 1, 25), ((4, 2), 1, 9), ((3, 5), 1, 2)],
)
@pytest.mark.parametrize("route", ["stored_values", "device"])
def test_stored_values_have_the_dense_tensors_statistics(
    shape: tuple[int, ...], sparse_dims: int, entries: int, route: str
) -> None:
    """Duplicated entries (an embedding's repeated tokens) summed; one zero for the elements not
    stored. ``(4, 2)`` with 9 entries covers every row: the case where no zero may be appended."""
    for seed in range(5):
        g = _coo(shape, sparse_dims, entries, seed)
        if route == "device" and entries * (g.numel() // shape[0] if sparse_dims == 1 else 1) >= g.numel():
            continue  # (the device route is taken only where the entries cannot cover every element)
        flat = stored_values(g) if route == "stored_values" else _summed_runs(g)
        _same_statistics(flat, g.to_dense())


def test_a_coalesced_or_compressed_tensor_is_read_as_stored() -> None:
    g = _coo((20, 3), 1, 15, seed=1).coalesce()
    _same_statistics(stored_values(g), g.to_dense())
    full = torch.arange(1.0, 7.0).reshape(2, 3).to_sparse()  # every element stored: no zero appended
    assert stored_values(full).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


@pytest.mark.parametrize("read", [stored_values, _summed_runs])
def test_the_zeros_not_stored_are_the_minimum_of_a_positive_tensor(
    read: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    values = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    positive = torch.sparse_coo_tensor([[0, 3, 0]], values, (5, 2), check_invariants=True)
    flat = read(positive)
    assert (float(flat.min()), float(flat.max())) == (0.0, 8.0)
    _same_statistics(flat, positive.to_dense())


def test_the_device_route_never_asks_the_device_for_a_size() -> None:
    """On a GPU, ``coalesce()`` waits for the device (the number of distinct entries sizes its output):
    the device route sorts and adds into a buffer sized by the stored entries instead."""
    g = _coo((100, 16), 1, 64, seed=2)
    with _Ops() as ops:
        _summed_runs(g)
    assert ops.names
    assert not WAITS & set(ops.names), ops.names
    with _Ops() as ops:
        g.coalesce()
    assert WAITS & set(ops.names)  # (the dispatch mode does see a coalesce)


def _model(bag: bool) -> nn.Module:
    torch.manual_seed(0)
    if bag:
        return nn.Sequential(nn.EmbeddingBag(40, 6, mode="sum", sparse=True), nn.Linear(6, 2))
    return nn.Sequential(nn.Embedding(40, 6, sparse=True), nn.Flatten(), nn.Linear(30, 2))


@pytest.mark.parametrize("case", ["embedding", "bag", "accumulated", "counted", "adam"])
def test_a_sparse_gradient_is_summarised_as_the_dense_gradient_it_stands_for(case: str) -> None:
    model = _model(case == "bag")
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("0.")]
    optimizers: list[torch.optim.Optimizer] = (
        [torch.optim.SparseAdam(list(model[0].parameters())), torch.optim.Adam(dense_params)]
        if case == "adam"
        else [torch.optim.SGD(model.parameters(), lr=0.5)]
    )
    records = sw.sinks.collect()
    applied: list[torch.Tensor] = []
    g = torch.Generator().manual_seed(3)
    key = SeriesKey("train", "0", "param_grad", "weight")
    observe = {"stats": ("nonfinite",)} if case == "counted" else {}
    with sw.observe(model, optimizers, every=1, sinks=[records], **observe) as watch:  # type: ignore[arg-type]
        for _ in range(4):
            for opt in optimizers:
                opt.zero_grad()
            for _ in range(2 if case == "accumulated" else 1):  # a token seen twice: entries to sum
                tokens = torch.randint(0, 12, (3, 5), generator=g)
                loss = nn.functional.cross_entropy(model(tokens), torch.randint(0, 2, (3,), generator=g))
                loss.backward()
            grad = model[0].weight.grad
            assert grad is not None
            assert grad.is_sparse
            assert not grad.is_coalesced()
            applied.append(grad.to_dense())
            for opt in optimizers:
                opt.step()
            watch.step(loss=loss)
        assert watch.flush()
        skipped = dict(watch.statistics().skipped)
    assert "sparse" not in skipped, skipped
    assert [r.step for r in records.items] == [0, 1, 2, 3]
    for record, dense in zip(records.items, applied, strict=True):
        assert_row(record, key, dense, counted=case == "counted")
        assert row(record, key)["zeros"] >= 28 * 6  # (tokens 12-39 never looked up: zeros not stored)


def test_a_sparse_activation_is_skipped_and_counted() -> None:
    """Per-unit activity needs the dense layout: a module that returns a sparse tensor is skipped."""

    class ToSparse(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.to_sparse()

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), ToSparse())
    records = sw.sinks.collect()
    with sw.observe(model, every=1, sinks=[records]) as watch:
        model(torch.randn(2, 4))
        watch.step()
        assert watch.flush()
        assert watch.statistics().skipped.get("sparse", 0) >= 1
    assert SeriesKey("train", "0", "activation", "") in records.items[0].keys


def test_an_opt_in_histogram_of_a_sparse_gradient_is_skipped_and_counted() -> None:
    """A histogram of the stored entries would miss the zeros not stored: counted, not drawn wrong."""
    model = _model(bag=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    histogram = sw.metrics.Histogram(kinds=("param_grad",))
    with sw.observe(model, opt, every=1, metrics=[histogram]) as watch:
        loss = model(torch.randint(0, 12, (3, 5))).sum()
        loss.backward()
        opt.step()
        watch.step(loss=loss)
        assert watch.flush()
        assert watch.statistics().skipped == {"sparse_metric": 1}
    layers = {s.labels.get("layer") for s in watch.snapshot() if "histogram" in s.name}
    assert layers == {"2"}  # (the Linear; the Embedding is 0)


@pytest.mark.parametrize("case", ["sgd", "adam"])
def test_training_with_a_sparse_gradient_is_bit_identical_with_and_without_the_watch(case: str) -> None:
    """The stored values are read, never changed: ``coalesce()`` makes a new tensor, the gradient the
    optimizer applies stays the uncoalesced one. Weights, the last gradients and the RNG state match."""

    def trained(watched: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        model = _model(bag=False)
        dense_params = [p for n, p in model.named_parameters() if not n.startswith("0.")]
        optimizers: list[torch.optim.Optimizer] = (
            [torch.optim.SparseAdam(list(model[0].parameters())), torch.optim.Adam(dense_params)]
            if case == "adam"
            else [torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)]
        )
        g = torch.Generator().manual_seed(4)
        torch.manual_seed(5)
        watch = sw.observe(model, optimizers, every=1, cadence={"param": 1, "update": 1}) if watched else None
        for _ in range(5):
            for opt in optimizers:
                opt.zero_grad()
            tokens = torch.randint(0, 12, (3, 5), generator=g)
            loss = nn.functional.cross_entropy(model(tokens), torch.randint(0, 2, (3,), generator=g))
            loss.backward()
            for opt in optimizers:
                opt.step()
            if watch is not None:
                watch.step(loss=loss)
        if watch is not None:
            watch.close()
        grad = model[0].weight.grad
        assert grad is not None
        return model.state_dict(), grad.to_dense(), torch.get_rng_state()

    (plain, plain_grad, plain_rng), (seen, seen_grad, seen_rng) = trained(False), trained(True)
    assert plain.keys() == seen.keys()
    for name in plain:
        assert torch.equal(plain[name], seen[name]), name
    assert torch.equal(plain_grad, seen_grad)
    assert torch.equal(plain_rng, seen_rng)
