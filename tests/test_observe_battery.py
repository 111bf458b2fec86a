"""A battery of odd modules and inputs under ``sw.observe``: monitoring never changes training, and the rows
(or the skip counts) are right for each case.

Every case trains a tiny model for ``STEPS`` SGD steps twice from the same initial state — unobserved, then
observed with every kind sampled on every step — and checks that losses, gradients and final weights are
bit-identical, that no hook failed, that every ``param`` / ``param_grad`` / ``update`` row matches the
unobserved run's tensors, and then the case's own rows against plain torch references.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import streamwatch as sw
from streamwatch import PipelineError, SeriesKey, StepRecord, WatchStatistics
from streamwatch._summary import COLUMNS

# Every test runs with the fused CPU kernel and with the eager torch summaries.
pytestmark = pytest.mark.usefixtures("summary_kernel")

STEPS = 3
ALL_TAPS = ("input", "activation", "output_grad", "param", "param_grad", "update")
Batch = tuple[Any, ...]


# -- the harness ----------------------------------------------------------------------------------------


def randn(k: int, *shape: int, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Step ``k``'s data: the same tensors every time they are asked for."""
    generator = torch.Generator().manual_seed(1000 + k)
    return (torch.randn(*shape, generator=generator) * scale).to(dtype)


def randint(k: int, high: int, *shape: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(2000 + k)
    return torch.randint(0, high, shape, generator=generator)


def fit(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The default step: forward, mean squared output, backward."""
    loss = model(*batch).float().pow(2).mean()
    loss.backward()
    return loss


@dataclass(frozen=True)
class Case:
    build: Callable[[], nn.Module]
    data: Callable[[int], Batch]
    check: Callable[[Run], None]
    step: Callable[[nn.Module, Batch], torch.Tensor] = fit
    observe: Mapping[str, Any] = field(default_factory=dict)
    params: Callable[[nn.Module], list[nn.Parameter]] = lambda model: list(model.parameters())
    lr: float = 0.1


@dataclass
class Trained:
    model: nn.Module
    losses: list[torch.Tensor]
    states: list[dict[str, torch.Tensor]]  # state_dict before step k; the last one after the last step
    grads: list[dict[str, torch.Tensor | None]]  # every parameter's .grad just before optimizer.step()


@dataclass
class Run:
    case: Case
    initial: nn.Module
    baseline: Trained
    observed: Trained
    records: list[StepRecord]
    stats: WatchStatistics
    warned: list[str]
    close_error: PipelineError | None

    def model_at(self, k: int) -> nn.Module:
        """A fresh copy of the model with the weights it had before step ``k`` (of the unobserved run)."""
        model = copy.deepcopy(self.initial)
        model.load_state_dict(self.baseline.states[k])
        return model

    def data(self, k: int) -> Batch:
        return self.case.data(k)

    @property
    def counted(self) -> bool:
        return "nonfinite" in self.case.observe.get("stats", ())


def _train(case: Case, model: nn.Module, watch_sinks: list[sw.Sink] | None) -> tuple[Trained, Any]:
    torch.manual_seed(0)  # dropout draws the same masks in both runs
    optimizer = torch.optim.SGD(case.params(model), lr=case.lr)
    watch = None
    if watch_sinks is not None:
        watch = sw.observe(
            model,
            optimizer,
            cadence={"param": 1, "update": 1},
            sinks=watch_sinks,
            **({"every": 1} | case.observe),  # every step sampled: each one checked
        )
    trained = Trained(model, [], [], [])
    for k in range(STEPS):
        trained.states.append(copy.deepcopy(model.state_dict()))
        optimizer.zero_grad()
        loss = case.step(model, case.data(k))
        trained.grads.append(
            {
                name: None if p.grad is None else p.grad.detach().clone()
                for name, p in model.named_parameters()
            }
        )
        optimizer.step()
        trained.losses.append(loss.detach().clone())
        if watch is not None:
            watch.step(loss=loss)
    trained.states.append(copy.deepcopy(model.state_dict()))
    return trained, watch


def run_case(case: Case) -> Run:
    torch.manual_seed(0)
    initial = case.build()
    baseline, _ = _train(case, copy.deepcopy(initial), None)
    records = sw.sinks.collect()
    close_error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        observed, watch = _train(case, copy.deepcopy(initial), [records])
        try:
            watch.close()
        except PipelineError as err:
            close_error = err
    stats = watch.statistics()
    warned = [str(w.message) for w in caught]
    return Run(case, initial, baseline, observed, list(records.items), stats, warned, close_error)


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bit-for-bit equality (NaN payloads included), which ``torch.equal`` is not for NaN."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def reference(x: torch.Tensor, unit_dim: int | None = None, counted: bool = False) -> dict[str, float]:
    """The columns of one summarised tensor, computed plainly in float64."""
    a = x.detach().to(torch.float64)
    has_nan = bool(a.isnan().any())
    nonfinite = int((~torch.isfinite(a)).sum())
    ref = {
        "count": float(a.numel()),
        "sum": float(a.sum()),
        "sumsq": float((a * a).sum()),
        "min": float(a.min()),
        "max": float(a.max()),
        "zeros": math.nan if has_nan else float((a == 0).sum()),
        "nonfinite": float(nonfinite) if counted else float(nonfinite > 0),
        "units": math.nan,  # no unit activity taken: unknown, not 0
        "dead": math.nan,
        "samples": math.nan,
        "active": math.nan,
        "sumabs": float(a.abs().sum()),
        "sumcube": float((a * a * a).sum()),
        "sumfourth": float(((a * a) * (a * a)).sum()),
    }
    if unit_dim is not None:
        units = a.shape[unit_dim]
        # (sample, unit) pairs active anywhere in their positions (monitorch); dim 0 is the batch
        pairs = (a != 0).movedim(unit_dim, 1).reshape(a.shape[0], units, -1).any(dim=2)
        ref["units"] = float(units)
        ref["samples"] = float(a.shape[0])
        ref["dead"] = math.nan if has_nan else float(units - int(pairs.any(dim=0).sum()))
        ref["active"] = math.nan if has_nan else float(pairs.sum())
    return ref


def row(record: StepRecord, key: SeriesKey) -> dict[str, float]:
    assert key in record.keys, f"no row {key} at step {record.step}; rows: {sorted(record.keys)}"
    values = record.table[record.keys.index(key)]
    return {name: float(v) for name, v in zip(COLUMNS, values, strict=True)}


def assert_row(
    record: StepRecord, key: SeriesKey, x: torch.Tensor, *, unit_dim: int | None = None, counted: bool = False
) -> None:
    got, want = row(record, key), reference(x, unit_dim, counted)
    magnitude = x.detach().to(torch.float64).abs().nan_to_num(posinf=0.0)
    # signed sums may cancel: their rounding is relative to the sum of their terms' magnitudes
    scale = {"sum": float(magnitude.sum()) + 1.0, "sumcube": float(magnitude.pow(3).sum()) + 1.0}
    for name in COLUMNS:
        np.testing.assert_allclose(
            got[name],
            want[name],
            rtol=1e-5,
            atol=1e-6 * scale[name] if name in scale else 1e-9,
            equal_nan=True,
            err_msg=f"step {record.step} {key} column {name!r}",
        )


def act(layer: str, name: str = "", phase: str = "train") -> SeriesKey:
    return SeriesKey(phase, layer, "activation", name)


def ograd(layer: str, name: str = "") -> SeriesKey:
    return SeriesKey("train", layer, "output_grad", name)


def names(record: StepRecord, kind: str, phase: str = "train") -> set[tuple[str, str]]:
    """(layer, leaf name) of every row of one kind and phase."""
    return {(k.layer, k.name) for k in record.keys if k.kind == kind and k.phase == phase}


def assert_param_rows(run: Run) -> None:
    """param / param_grad / update rows equal the unobserved run's weights, gradients and deltas."""
    for k, record in enumerate(run.records):
        before, after, grads = run.baseline.states[k], run.baseline.states[k + 1], run.baseline.grads[k]
        expected = set()
        for qualified, _ in run.initial.named_parameters():
            layer, _, pname = qualified.rpartition(".")
            keys = {
                kind: SeriesKey("train", layer, kind, pname) for kind in ("param", "param_grad", "update")
            }
            expected.add(keys["param"])
            assert_row(record, keys["param"], after[qualified], counted=run.counted)
            grad = grads[qualified]
            if grad is not None:  # (the optimizer steps only parameters with a gradient)
                expected |= {keys["param_grad"], keys["update"]}
                assert_row(record, keys["param_grad"], grad, counted=run.counted)
                # Δ exactly (half-precision weights: their difference in float32, as streamwatch takes it)
                wide = torch.promote_types(after[qualified].dtype, torch.float32)
                delta = after[qualified].to(wide) - before[qualified].to(wide)
                assert_row(record, keys["update"], delta, counted=run.counted)
        got = {key for key in record.keys if key.kind in ("param", "param_grad", "update")}
        assert got == expected


# -- the cases' modules ---------------------------------------------------------------------------------


class Leaf(nn.Module):
    """A leaf module (no children, so it is tapped) with its own weight."""

    def __init__(self, n_in: int = 4, n_out: int = 6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) * n_in**-0.5)

    def affine(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


class TupleOut(Leaf):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.affine(x)
        return h, torch.tanh(h)


class ListOut(Leaf):
    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        h = self.affine(x)
        return [h, torch.relu(h)]


class DictOut(Leaf):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.affine(x)
        return {"mean": h, "gate": torch.sigmoid(h)}


class EmptyOut(Leaf):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.affine(x)
        return h, h[:, :0]


class WithNone(Leaf):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.affine(x), None


class SideEffect(nn.Module):
    """Returns None; its only effect is counting its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> None:
        self.calls += 1


class RowCount(nn.Module):
    def forward(self, x: torch.Tensor) -> int:
        return x.shape[0]


class Mask(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x > 0


class Spectrum(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.fft(x)


class Sparsify(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to_sparse()


class Nest(nn.Module):
    """The batch's two halves as one nested tensor (a prototype API, whose warning is not ours)."""

    def __init__(self, layout: torch.layout) -> None:
        super().__init__()
        self.layout = layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[0] // 2
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The PyTorch API of nested tensors", UserWarning)
            return torch.nested.as_nested_tensor([x[:half], x[half:]], layout=self.layout)


def _unnest(h: torch.Tensor, nested: torch.Tensor) -> torch.Tensor:
    return h + torch.cat(nested.unbind())


class StopGrad(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()


class Poison(nn.Module):
    """Puts a NaN into element [0, 0] of its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        out[0, 0] = math.nan
        return out


class _InfGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[0, 0] = math.inf
        return grad


class InfGrad(nn.Module):
    """Identity forward; the gradient it passes back has +inf at [0, 0]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _InfGrad.apply(x)


class KwargsOnly(Leaf):
    def forward(self, *, x: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.sigmoid(self.affine(x)) * scale


class Parameterless(nn.Module):
    """No parameters of its own: the trained weight lives outside the model (not registered)."""

    def __init__(self) -> None:
        super().__init__()
        object.__setattr__(self, "w", nn.Parameter(torch.randn(4)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.w)


class Split(nn.Module):
    """``head(combine(*split(x)))`` for a leaf ``split`` with an odd output."""

    def __init__(self, split: nn.Module, combine: Callable[[Any], torch.Tensor], n: int = 6) -> None:
        super().__init__()
        self.split = split
        self.head = nn.Linear(n, 2)
        self.combine = combine

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.combine(self.split(x)))


class Through(nn.Module):
    """``head(mid(lin(x)))`` with an odd middle module; ``mix`` decides how its output reaches the head."""

    def __init__(self, mid: nn.Module, mix: Callable[[torch.Tensor, Any], torch.Tensor]) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.mid = mid
        self.head = nn.Linear(6, 2)
        self.mix = mix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self.head(self.mix(h, self.mid(h)))


class NoneAndInt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.probe = SideEffect()
        self.count = RowCount()
        self.pair = WithNone()
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.probe(x)
        rows = self.count(x)
        h, _ = self.pair(x)
        return self.head(h) * (rows / x.shape[0])


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.shared(self.shared(x)))


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 5, batch_first=True)
        self.head = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, (h, c) = self.lstm(x)
        return self.head(out[:, -1] + h[0] + c[0])


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6)
        self.out = nn.Linear(6, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids))


class GateNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.gate = KwargsOnly(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(x=self.lin(x), scale=2.0))


class Detached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.stop = StopGrad()
        self.head = nn.Linear(6, 2)
        self.aux = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return self.head(h) + self.aux(self.stop(h))


def mlp(*middle: nn.Module, n_in: int = 4, hidden: int = 8, n_out: int = 2) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_in, hidden), *middle, nn.Linear(hidden, n_out))


def frozen_mlp() -> nn.Sequential:
    model = mlp(nn.Tanh())
    model[0].requires_grad_(False)
    return model


def x8(k: int) -> Batch:
    return (randn(k, 8, 4),)


# -- the cases' checks ----------------------------------------------------------------------------------


def check_split(
    leaf_names: tuple[str, ...], outputs: Callable[[nn.Module, torch.Tensor], list[torch.Tensor]]
) -> Callable[[Run], None]:
    """The split leaf's rows are named ``leaf_names`` and hold ``outputs(split, x)``; grads are tapped."""

    def check(run: Run) -> None:
        for k, record in enumerate(run.records):
            assert names(record, "activation") == {("split", n) for n in leaf_names} | {("head", "")}
            assert names(record, "output_grad") == {("split", n) for n in leaf_names} | {("head", "")}
            model, (x,) = run.model_at(k), run.data(k)
            with torch.no_grad():
                for name, value in zip(leaf_names, outputs(model.split, x), strict=True):
                    assert_row(record, act("split", name), value, unit_dim=1)
        assert run.stats.skipped == {}

    return check


def check_skipped(reason: str, per_step: int, kept: frozenset[str] = frozenset()) -> Callable[[Run], None]:
    """The middle module's odd output is skipped (activation and its gradient) and counted; its ``kept``
    leaves and everything else are tapped."""

    def check(run: Run) -> None:
        assert run.stats.skipped == {reason: per_step * STEPS}
        expected = {("lin", ""), ("head", "")} | {("mid", name) for name in kept}
        for k, record in enumerate(run.records):
            assert names(record, "activation") == expected
            assert names(record, "output_grad") == expected
            model, (x,) = run.model_at(k), run.data(k)
            with torch.no_grad():
                assert_row(record, act("lin"), model.lin(x), unit_dim=1)

    return check


def check_none_and_int(run: Run) -> None:
    # Per step: the None from `probe`, the int from `count` and the None leaf of `pair`.
    assert run.stats.skipped == {"non_tensor": 3 * STEPS}
    assert run.observed.model.probe.calls == STEPS  # the side effect ran once per forward, not more
    for k, record in enumerate(run.records):
        assert names(record, "activation") == {("pair", "0"), ("head", "")}
        model, (x,) = run.model_at(k), run.data(k)
        with torch.no_grad():
            assert_row(record, act("pair", "0"), model.pair.affine(x), unit_dim=1)


def check_bool(run: Run) -> None:
    assert run.stats.skipped == {}
    for k, record in enumerate(run.records):
        assert names(record, "activation") == {("lin", ""), ("mid", ""), ("head", "")}
        assert names(record, "output_grad") == {("lin", ""), ("head", "")}  # a mask has no gradient
        model, (x,) = run.model_at(k), run.data(k)
        with torch.no_grad():
            mask = model.lin(x) > 0
        assert_row(record, act("mid"), mask, unit_dim=1)
        assert row(record, act("mid"))["sum"] == int(mask.sum())


def check_inplace_relu(run: Run) -> None:
    for k, record in enumerate(run.records):
        model, (x,) = run.model_at(k), run.data(k)
        pre = model[0](x)
        pre.retain_grad()
        post = torch.relu(pre)  # out of place: the reference keeps both tensors
        post.retain_grad()
        model[2](post).pow(2).mean().backward()
        assert float(pre.detach().min()) < 0  # the ReLU changes something
        assert_row(record, act("0"), pre, unit_dim=1)
        assert_row(record, act("1"), post, unit_dim=1)
        assert_row(record, ograd("0"), pre.grad, unit_dim=1)
        assert_row(record, ograd("1"), post.grad, unit_dim=1)
        assert row(record, act("0"))["min"] < 0
        assert row(record, act("1"))["min"] == 0


def check_twice(run: Run) -> None:
    for k, record in enumerate(run.records):
        model, (x,) = run.model_at(k), run.data(k)
        first = model.shared(x)
        second = model.shared(first)
        first.retain_grad()
        second.retain_grad()
        model.head(second).pow(2).mean().backward()
        assert row(record, act("shared"))["count"] == 2 * x.shape[0] * 4
        assert_row(record, act("shared"), torch.cat([first, second]), unit_dim=1)
        assert_row(record, ograd("shared"), torch.cat([first.grad, second.grad]), unit_dim=1)


def check_lstm(run: Run) -> None:
    leaves = {("lstm", "0"), ("lstm", "1.0"), ("lstm", "1.1"), ("head", "")}
    for k, record in enumerate(run.records):
        assert names(record, "activation") == leaves
        assert names(record, "output_grad") == leaves
        model, (x,) = run.model_at(k), run.data(k)
        with torch.no_grad():
            out, (h, c) = model.lstm(x)
        assert_row(record, act("lstm", "0"), out, unit_dim=2)
        assert_row(record, act("lstm", "1.0"), h, unit_dim=2)
        assert_row(record, act("lstm", "1.1"), c, unit_dim=2)


def check_parameterless(run: Run) -> None:
    for record in run.records:
        assert not [key for key in record.keys if key.kind in ("param", "param_grad", "update")]
    with torch.no_grad():
        assert_row(run.records[0], act(""), torch.tanh(run.data(0)[0] * run.initial.w), unit_dim=1)


def check_frozen(run: Run) -> None:
    for record in run.records:
        assert names(record, "param") == {("0", "weight"), ("0", "bias"), ("2", "weight"), ("2", "bias")}
        assert names(record, "param_grad") == {("2", "weight"), ("2", "bias")}
        # a frozen layer is not stepped: no update row (a Δ of 0 read as an update ratio of -inf)
        assert names(record, "update") == {("2", "weight"), ("2", "bias")}


def check_nan(run: Run) -> None:
    assert all(torch.isnan(loss) for loss in run.observed.losses)  # training went on, NaN and all
    first = run.records[0]
    assert row(first, act("0"))["nonfinite"] == 0
    poisoned = row(first, act("1"))
    assert poisoned["nonfinite"] == 1
    assert math.isnan(poisoned["sum"])
    model, (x,) = run.model_at(0), run.data(0)
    with torch.no_grad():
        assert_row(first, act("1"), model[1](model[0](x)), unit_dim=1)
    assert row(first, SeriesKey("train", "2", "param", "weight"))["nonfinite"] == 1


def check_inf_grad(run: Run) -> None:
    first = run.records[0]
    assert row(first, ograd("0"))["nonfinite"] == 1  # exact counts: stats=("dead", "nonfinite")
    assert row(first, ograd("1"))["nonfinite"] == 0
    assert row(first, ograd("0"))["max"] == math.inf
    assert row(first, SeriesKey("train", "0", "param_grad", "weight"))["nonfinite"] == 4
    assert row(first, SeriesKey("train", "0", "param_grad", "bias"))["nonfinite"] == 1
    model, (x,) = run.model_at(0), run.data(0)
    h = model[0](x)
    h.retain_grad()
    model[2](_InfGrad.apply(h)).pow(2).mean().backward()
    assert_row(first, ograd("0"), h.grad, unit_dim=1, counted=True)


MICRO = 3


def accumulate(model: nn.Module, batch: Batch) -> torch.Tensor:
    total = torch.zeros(())
    for x in batch:
        loss = model(x).pow(2).mean() / MICRO
        loss.backward()
        total = total + loss.detach()
    return total


def check_accumulation(run: Run) -> None:
    for k, record in enumerate(run.records):
        model, micro = run.model_at(k), run.data(k)
        outs = []
        for x in micro:
            out = model(x)
            out.retain_grad()
            (out.pow(2).mean() / MICRO).backward()
            outs.append(out)
        assert row(record, act("2"))["count"] == MICRO * 8 * 2
        with torch.no_grad():
            assert_row(record, act("0"), torch.cat([model[0](x) for x in micro]), unit_dim=1)
        assert_row(record, ograd("2"), torch.cat([o.grad for o in outs]), unit_dim=1)
        # param_grad is the accumulated gradient (the generic check), not the last micro-step's share:
        last_share = row(record, SeriesKey("train", "2", "param_grad", "weight"))["sumsq"]
        assert last_share == pytest.approx(float(model[2].weight.grad.pow(2).sum()), rel=1e-5)


def train_then_eval(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, held_out = batch
    model.eval()
    with torch.no_grad():
        model(held_out)
    model.train()
    return fit(model, (x,))


def check_eval(run: Run) -> None:
    leaves = {("0", ""), ("1", ""), ("2", ""), ("3", "")}
    for k, record in enumerate(run.records):
        assert names(record, "activation", "eval") == leaves
        assert names(record, "activation", "train") == leaves
        assert names(record, "output_grad", "eval") == set()
        assert {key.phase for key in record.keys if key.kind != "activation"} == {"train"}
        model, (x, held_out) = run.model_at(k), run.data(k)
        model.eval()
        with torch.no_grad():
            assert_row(record, act("0", phase="eval"), model[0](held_out), unit_dim=1)
            assert_row(record, act("3", phase="eval"), model(held_out), unit_dim=1)
            assert_row(record, act("0"), model[0](x), unit_dim=1)


def nested() -> nn.Module:
    return nn.Sequential(
        nn.Sequential(nn.Linear(4, 6), nn.ReLU()),
        nn.Sequential(nn.Sequential(nn.Linear(6, 6), nn.Tanh())),
        nn.Linear(6, 2),
    )


def check_nested(run: Run) -> None:
    leaves = {("0.0", ""), ("0.1", ""), ("1.0.0", ""), ("1.0.1", ""), ("2", "")}
    for k, record in enumerate(run.records):
        assert names(record, "activation") == leaves
        assert names(record, "output_grad") == leaves
        assert {layer for layer, _ in names(record, "param")} == {"0.0", "1.0.0", "2"}
        model, (x,) = run.model_at(k), run.data(k)
        with torch.no_grad():
            assert_row(record, act("1.0.1"), model[1](model[0](x)), unit_dim=1)


def tied_step(model: nn.Module, batch: Batch) -> torch.Tensor:
    ids, targets = batch
    loss = nn.functional.cross_entropy(model(ids), targets)
    loss.backward()
    return loss


def check_tied(run: Run) -> None:
    for record in run.records:
        for kind in ("param", "param_grad", "update"):
            assert names(record, kind) == {("emb", "weight")}  # one parameter, one row each
    # The generic check compared the row to the whole gradient (embedding + output projection).


def check_kwargs(run: Run) -> None:
    for k, record in enumerate(run.records):
        assert ("gate", "") in names(record, "activation")
        assert ("gate", "") in names(record, "output_grad")
        model, (x,) = run.model_at(k), run.data(k)
        with torch.no_grad():
            assert_row(record, act("gate"), model.gate(x=model.lin(x), scale=2.0), unit_dim=1)


def check_low_precision(dtype: torch.dtype) -> Callable[[Run], None]:
    def check(run: Run) -> None:
        for k, record in enumerate(run.records):
            model, (x,) = run.model_at(k), run.data(k)
            with torch.no_grad():
                out = model(x)
            assert out.dtype == dtype
            got = row(record, act(""))
            assert got["nonfinite"] == 0
            assert_row(record, act(""), out, unit_dim=1)
            if dtype == torch.float16:
                assert got["sumsq"] > 4 * torch.finfo(torch.float16).max  # would overflow in float16

    return check


def check_integer_inputs(run: Run) -> None:
    for k, record in enumerate(run.records):
        model, (ids,) = run.model_at(k), run.data(k)
        assert_row(record, SeriesKey("train", "0", "input", "0"), ids.to(torch.float64))
        assert row(record, SeriesKey("train", "0", "input", "0"))["sum"] == int(ids.sum())
        with torch.no_grad():
            assert_row(record, SeriesKey("train", "1", "input", "0"), model[0](ids))
        assert names(record, "input_grad") == set()  # not tapped (and integer ids have none)


def check_batch_of_one(run: Run) -> None:
    for k, record in enumerate(run.records):
        model, (x,) = run.model_at(k), run.data(k)
        with torch.no_grad():
            hidden = model[1](model[0](x))
        assert hidden.shape == (1, 8)
        assert row(record, act("1"))["dead"] == int((hidden == 0).sum())  # one sample: zero means dead
        assert_row(record, act("1"), hidden, unit_dim=1)


def check_one_d(run: Run) -> None:
    for k, record in enumerate(run.records):
        model, (x,) = run.model_at(k), run.data(k)
        with torch.no_grad():
            hidden = model[1](model[0](x))
        assert hidden.dim() == 1
        assert math.isnan(row(record, act("1"))["units"])  # a 1-D tensor has no units to be dead
        assert math.isnan(row(record, act("1"))["dead"])
        assert_row(record, act("1"), hidden)
        assert_row(record, act("2"), model(x).detach())


def check_detached(run: Run) -> None:
    for k, record in enumerate(run.records):
        assert names(record, "activation") == {("lin", ""), ("stop", ""), ("head", ""), ("aux", "")}
        assert names(record, "output_grad") == {("lin", ""), ("head", ""), ("aux", "")}
        model, (x,) = run.model_at(k), run.data(k)
        with torch.no_grad():
            assert_row(record, act("stop"), model.lin(x), unit_dim=1)


NO_UPDATE_TAP = {"taps": ("activation", "output_grad", "param", "param_grad")}

CASES = {
    "tuple_output": Case(
        lambda: Split(TupleOut(), lambda out: out[0] * out[1]),
        x8,
        check_split(("0", "1"), lambda split, x: [split.affine(x), torch.tanh(split.affine(x))]),
    ),
    "list_output": Case(
        lambda: Split(ListOut(), lambda out: out[0] + out[1]),
        x8,
        check_split(("0", "1"), lambda split, x: [split.affine(x), torch.relu(split.affine(x))]),
    ),
    "dict_output": Case(
        lambda: Split(DictOut(), lambda out: out["mean"] * out["gate"]),
        x8,
        check_split(("mean", "gate"), lambda split, x: [split.affine(x), torch.sigmoid(split.affine(x))]),
    ),
    "none_and_int_output": Case(NoneAndInt, x8, check_none_and_int),
    "bool_output": Case(lambda: Through(Mask(), lambda h, mask: h * mask), x8, check_bool),
    "complex_output": Case(
        lambda: Through(Spectrum(), lambda h, s: s.abs()), x8, check_skipped("complex", 2)
    ),
    "sparse_output": Case(
        lambda: Through(Sparsify(), lambda h, s: s.to_dense()), x8, check_skipped("sparse", 2)
    ),
    # before: a strided nested tensor failed 3 hooks a step ("NestedTensorImpl doesn't support sizes")
    # and close() raised PipelineError; a jagged one was counted as "sparse"
    "nested_output": Case(lambda: Through(Nest(torch.strided), _unnest), x8, check_skipped("nested", 2)),
    "jagged_nested_output": Case(
        lambda: Through(Nest(torch.jagged), _unnest), x8, check_skipped("nested", 2)
    ),
    "empty_output": Case(
        lambda: Through(EmptyOut(6, 6), lambda h, out: out[0] + out[1].sum()),
        x8,
        check_skipped("empty", 2, kept=frozenset({"0"})),
    ),
    "inplace_relu": Case(lambda: mlp(nn.ReLU(inplace=True)), x8, check_inplace_relu),
    "called_twice": Case(Twice, x8, check_twice),
    "lstm": Case(Recurrent, lambda k: (randn(k, 4, 7, 3),), check_lstm),
    "no_parameters": Case(Parameterless, x8, check_parameterless, params=lambda model: [model.w]),
    "no_parameters_without_update_tap": Case(
        Parameterless, x8, check_parameterless, params=lambda model: [model.w], observe=NO_UPDATE_TAP
    ),
    "frozen_parameters": Case(frozen_mlp, x8, check_frozen),
    "nan_activation": Case(lambda: mlp(Poison(), hidden=6), x8, check_nan),
    "inf_gradient": Case(
        lambda: mlp(InfGrad(), hidden=6), x8, check_inf_grad, observe={"stats": ("dead", "nonfinite")}
    ),
    "gradient_accumulation": Case(
        lambda: mlp(nn.ReLU()),
        lambda k: tuple(randn(MICRO * k + i, 8, 4) for i in range(MICRO)),
        check_accumulation,
        step=accumulate,
    ),
    "eval_no_grad": Case(
        lambda: mlp(nn.ReLU(), nn.Dropout(0.5)),
        lambda k: (randn(k, 8, 4), randn(100 + k, 5, 4)),
        check_eval,
        step=train_then_eval,
    ),
    "nested_containers": Case(nested, x8, check_nested),
    "weight_tying": Case(
        TiedLM, lambda k: (randint(k, 10, 12), randint(50 + k, 10, 12)), check_tied, tied_step
    ),
    "kwargs_only_forward": Case(GateNet, x8, check_kwargs),
    "bfloat16": Case(
        lambda: nn.Linear(32, 32).to(torch.bfloat16),
        lambda k: (randn(k, 64, 32, dtype=torch.bfloat16),),
        check_low_precision(torch.bfloat16),
    ),
    "float16": Case(
        lambda: nn.Linear(16, 16).to(torch.float16),
        lambda k: (randn(k, 64, 16, scale=40.0, dtype=torch.float16),),
        check_low_precision(torch.float16),
        step=lambda model, batch: _mean_backward(model(*batch).float()),
    ),
    "integer_inputs": Case(
        lambda: nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 3)),
        lambda k: (randint(k, 20, 6, 5),),
        check_integer_inputs,
        observe={"taps": ALL_TAPS},
    ),
    "batch_of_one": Case(lambda: mlp(nn.ReLU(), n_out=1), lambda k: (randn(k, 1, 4),), check_batch_of_one),
    "one_d_activation": Case(lambda: mlp(nn.Tanh(), n_out=1), lambda k: (randn(k, 4),), check_one_d),
    "detached_output": Case(Detached, x8, check_detached),
}


def _mean_backward(out: torch.Tensor) -> torch.Tensor:
    loss = out.mean()
    loss.backward()
    return loss


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_observing_changes_nothing_and_rows_are_right(case: Case) -> None:
    run = run_case(case)

    # (1) monitoring does not change training, bit for bit
    for k in range(STEPS):
        assert same_bits(run.observed.losses[k], run.baseline.losses[k]), f"loss differs at step {k}"
        for name, grad in run.baseline.grads[k].items():
            assert same_bits(run.observed.grads[k][name], grad), f"{name}.grad differs at step {k}"
    for name, value in run.baseline.states[-1].items():
        assert same_bits(run.observed.states[-1][name], value), f"final {name} differs"

    # (2) no hook failed, one record per step, and the rows are right
    assert run.stats.hook_errors == 0, run.close_error
    assert run.close_error is None
    assert run.warned == []
    assert [record.step for record in run.records] == list(range(STEPS))
    assert run.stats.records_received == STEPS
    assert_param_rows(run)
    run.case.check(run)


def test_update_tap_with_no_selected_parameters() -> None:
    """select= picking only parameterless modules, with an optimizer: the update tap has nothing to do
    (it used to call torch._foreach_sub([], []), which raises)."""
    model = mlp(nn.ReLU())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    records = sw.sinks.collect()
    with sw.observe(model, optimizer, select=nn.ReLU, sinks=[records], every=1) as watch:
        for k in range(2):
            optimizer.zero_grad()
            fit(model, x8(k))
            optimizer.step()
            watch.step()
    assert watch.statistics().hook_errors == 0
    for record in records.items:
        assert {(key.layer, key.kind) for key in record.keys} == {("1", "activation"), ("1", "output_grad")}


def test_nan_is_neither_zero_nor_dead() -> None:
    records = sw.sinks.collect()
    model = nn.Identity()
    with sw.observe(model, sinks=[records], every=1) as watch:
        model(torch.tensor([[math.nan, 1.0], [math.nan, 2.0]]))  # no zero element; unit 0 all NaN
        watch.step()
    got = row(records.items[0], act(""))
    assert got["nonfinite"] == 1
    # torch.sign(NaN) is 0 on CPU: a NaN must not pass for a zero, nor an all-NaN unit for a dead one.
    # With a NaN present both are unknown (NaN), never wrong.
    assert math.isnan(got["zeros"])
    assert math.isnan(got["dead"])


def test_keyword_tensor_inputs_are_tapped_by_name() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * scale

    model = Scaled()
    x, scale = torch.randn(4, 3), torch.full((4, 3), 2.0)
    recs = sw.sinks.collect()
    with sw.observe(model, select=Scaled, taps=("input",), sinks=[recs], every=1) as watch:
        model(x, scale=scale)
        watch.step()
    (record,) = recs.items
    for name, tensor in (("0", x), ("scale", scale)):
        got = row(record, SeriesKey("train", "", "input", name))
        assert got["count"] == tensor.numel()
        scale_of_sum = float(tensor.double().abs().sum())  # float32 sums cancel: tolerance scales with Σ|x|
        assert got["sum"] == pytest.approx(float(tensor.double().sum()), abs=1e-6 * scale_of_sum)
        assert got["sumsq"] == pytest.approx(float(tensor.double().pow(2).sum()), rel=1e-6)
