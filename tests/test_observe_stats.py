"""observe(): every statistic of every step record against plain torch/numpy references.

Real training on tiny models (no mocks). Reference tensors are captured by the test's own hooks,
registered *after* observe()'s, so both see the very same tensors; each module is called once per
forward (calling it a second time would merge a second row into the step).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import streamwatch as sw
from streamwatch import _tapstate
from streamwatch._summary import COLUMNS, DERIVED
from streamwatch._taps import KINDS
from tests.training import Step, Train

# Every test runs with the fused CPU kernel and with the eager torch summaries.
pytestmark = pytest.mark.usefixtures("summary_kernel")

EVERY_STEP = {"param": 1, "update": 1}
PARAM_KINDS = ("param", "param_grad", "update")

# -- the reference ------------------------------------------------------------------------------------


def reference(tensors: list[torch.Tensor], unit_dim: int | None, counted: bool) -> dict[str, float]:
    """Every column and derived statistic of the concatenation of ``tensors``, in float64.

    A unit is dead if it is exactly zero in every element of every tensor (monitorch's definition,
    merged across repeated calls within a step).
    """
    flat = np.concatenate([t.detach().double().flatten().numpy() for t in tensors])
    units = dead = math.nan
    if unit_dim is not None:
        active = None
        for t in tensors:
            moved = t.detach().double().movedim(unit_dim, 0).reshape(t.shape[unit_dim], -1)
            a = (moved != 0).any(dim=1).numpy()
            active = a if active is None else active | a
        assert active is not None
        units, dead = float(active.size), float((~active).sum())
    nonfinite = float((~np.isfinite(flat)).sum())
    out = {
        "count": float(flat.size),
        "sum": float(flat.sum()),
        "sumsq": float((flat * flat).sum()),
        "min": float(flat.min()),
        "max": float(flat.max()),
        "zeros": float((flat == 0).sum()),
        "nonfinite": nonfinite if counted else float(nonfinite > 0),
        "units": units,
        "dead": dead,
        "abs_sum": float(np.abs(flat).sum()),
        "sumabs": float(np.abs(flat).sum()),
        "sumcube": float((flat**3).sum()),
        "sumfourth": float((flat**4).sum()),
        "abs_cube_sum": float((np.abs(flat) ** 3).sum()),
    }
    centred = flat - flat.mean()
    with np.errstate(invalid="ignore", divide="ignore"):
        m2 = np.mean(centred**2)  # (numpy floats: a zero spread gives NaN, not an exception)
        out |= {
            "mean_abs": float(np.abs(flat).mean()),
            "skewness": float(np.mean(centred**3) / m2**1.5),  # the central moments, two-pass
            "kurtosis": float(np.mean(centred**4) / m2**2),
            "spread": float(np.sqrt(m2) / np.abs(flat.mean())),  # std / |mean|
        }
    out |= {
        "mean": float(flat.mean()),
        "var": float(flat.var()),  # population variance, like the library
        "std": float(flat.std()),
        "l2": float(np.sqrt(out["sumsq"])),
        "rms": float(np.sqrt(out["sumsq"] / flat.size)),
        "absmax": float(np.abs(flat).max()),
        "zero_fraction": out["zeros"] / flat.size,
        "dead_fraction": dead / units,
    }
    return out


def assert_row(record: sw.StepRecord, key: sw.SeriesKey, ref: dict[str, float]) -> None:
    """Every column and derived statistic of ``record``'s row ``key`` equals the reference."""
    i = record.keys.index(key)
    got = {name: float(record.stat(name)[i]) for name in (*COLUMNS, *DERIVED)}
    msg = f"step {record.step} {key}"
    exact = ("count", "min", "max", "zeros", "nonfinite", "units", "dead", "absmax")
    for name in exact:
        np.testing.assert_equal(got[name], ref[name], err_msg=f"{msg}: {name}")
    for name in ("zero_fraction", "dead_fraction"):
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-12, err_msg=f"{msg}: {name}")
    # Sums are accumulated in float32: the rounding error scales with sum(|x|), not with the (possibly
    # cancelling) sum itself, so the absolute tolerance is relative to sum(|x|).
    abs_sum = ref["abs_sum"]
    np.testing.assert_allclose(got["sum"], ref["sum"], rtol=1e-5, atol=1e-6 * abs_sum, err_msg=msg)
    np.testing.assert_allclose(
        got["mean"], ref["mean"], rtol=1e-5, atol=1e-6 * abs_sum / ref["count"], err_msg=msg
    )
    for name in ("sumsq", "l2", "rms"):
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, err_msg=f"{msg}: {name}")
    # var = sumsq/count - mean² from float32 sums: its absolute error scales with sumsq/count
    # (= rms² >= mean²), not with var, so var gets an absolute tolerance of 1e-5·rms², and std
    # (= √var) the matching |Δvar| / std (at most √|Δvar|).
    var_atol = 1e-5 * ref["rms"] ** 2
    np.testing.assert_allclose(got["var"], ref["var"], rtol=1e-5, atol=var_atol, err_msg=f"{msg}: var")
    std_atol = math.sqrt(var_atol) if ref["std"] == 0 else min(math.sqrt(var_atol), var_atol / ref["std"])
    np.testing.assert_allclose(got["std"], ref["std"], rtol=1e-5, atol=std_atol, err_msg=f"{msg}: std")
    for name in ("sumabs", "sumfourth", "mean_abs"):  # sums of non-negative terms
        np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, err_msg=f"{msg}: {name}")
    cube_atol = 1e-6 * ref["abs_cube_sum"]
    np.testing.assert_allclose(
        got["sumcube"], ref["sumcube"], rtol=1e-5, atol=cube_atol, err_msg=f"{msg}: sumcube"
    )
    assert_shape(got, ref, msg)


def assert_shape(got: dict[str, float], ref: dict[str, float], msg: str) -> None:
    """Skewness and kurtosis equal the two-pass central moments' where reported; unknown (NaN) only where
    the raw sums cannot give them: no spread (constant values, one element), or |mean| several times
    the standard deviation (the cancellation the library guards against, _summary._shape)."""
    for name in ("skewness", "kurtosis", "excess_kurtosis"):
        if math.isnan(got[name]):
            assert not ref["spread"] > 0.25, f"{msg}: {name} unknown with std/|mean| = {ref['spread']}"
    if math.isnan(got["kurtosis"]):
        return
    np.testing.assert_allclose(got["kurtosis"], ref["kurtosis"], rtol=1e-3, err_msg=f"{msg}: kurtosis")
    np.testing.assert_allclose(
        got["excess_kurtosis"], ref["kurtosis"] - 3.0, atol=1e-3 * ref["kurtosis"], err_msg=f"{msg}: excess"
    )
    if not math.isnan(got["skewness"]):
        atol = 1e-3 * (1.0 + abs(ref["skewness"]))
        np.testing.assert_allclose(got["skewness"], ref["skewness"], atol=atol, err_msg=f"{msg}: skewness")


# -- capturing reference tensors ------------------------------------------------------------------------


def leaves(value: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Tensor leaves of a module output, named like the documented ``index`` label."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, tuple | list):
        for i, item in enumerate(value):
            yield from leaves(item, f"{prefix}.{i}" if prefix else str(i))
    elif isinstance(value, dict):
        for k, item in value.items():
            yield from leaves(item, f"{prefix}.{k}" if prefix else str(k))


@dataclass
class Expected:
    """Reference tensors of one step, keyed like the record."""

    tensors: dict[sw.SeriesKey, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    unit_dims: dict[sw.SeriesKey, int | None] = field(default_factory=dict)

    def add(self, key: sw.SeriesKey, tensor: torch.Tensor, unit_dim: int | None) -> None:
        self.tensors[key].append(tensor.detach().clone())
        self.unit_dims[key] = unit_dim

    def put(self, key: sw.SeriesKey, tensor: torch.Tensor) -> None:
        """Last write wins (parameters, their gradients, updates)."""
        self.tensors[key] = [tensor.detach().clone()]
        self.unit_dims[key] = None


class Recorder:
    """Our own forward/tensor hooks on ``modules`` (registered after observe's): the reference tensors."""

    def __init__(self, modules: dict[str, nn.Module], unit_dim: Callable[[str, torch.Tensor], int]) -> None:
        self.steps: list[Expected] = []
        self.current = Expected()
        self.unit_dim = unit_dim
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in modules.items()]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            train = module.training and torch.is_grad_enabled()
            phase = "train" if train else "eval"
            for leaf_name, leaf in leaves(output):
                dim = self.unit_dim(name, leaf) if leaf.dim() >= 2 else None
                self.current.add(sw.SeriesKey(phase, name, "activation", leaf_name), leaf, dim)
                if train and leaf.requires_grad:
                    key = sw.SeriesKey("train", name, "output_grad", leaf_name)
                    leaf.register_hook(lambda g, key=key, dim=dim: self.current.add(key, g, dim))

        return hook

    def params(self, model: nn.Module, kind: str, values: dict[str, torch.Tensor]) -> None:
        for qualified, value in values.items():
            layer, _, pname = qualified.rpartition(".")
            self.current.put(sw.SeriesKey("train", layer, kind, pname), value)

    def end_step(self) -> None:
        self.steps.append(self.current)
        self.current = Expected()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def optimizer_step(model: nn.Module, opt: torch.optim.Optimizer, rec: Recorder) -> None:
    """``opt.step()``, recording param grads before it and weights and updates around it."""
    named = dict(model.named_parameters())
    rec.params(model, "param_grad", {n: p.grad for n, p in named.items() if p.grad is not None})
    before = {n: p.detach().clone() for n, p in named.items()}
    opt.step()
    rec.params(model, "param", named)
    # Δ in the parameter's dtype, as the optimizer applied it (float32 subtraction is what "w_after -
    # w_before" means for a float32 weight).
    rec.params(model, "update", {n: p.detach() - before[n] for n, p in named.items()})


def check_records(records: list[sw.StepRecord], steps: list[Expected], counted: bool = False) -> None:
    assert [r.step for r in records] == list(range(len(steps)))
    for record, expected in zip(records, steps, strict=True):
        assert set(record.keys) == set(expected.tensors), f"step {record.step}"
        assert len(set(record.keys)) == len(record.keys)
        for key, tensors in expected.tensors.items():
            assert_row(record, key, reference(tensors, expected.unit_dims[key], counted))


# -- the cases ---------------------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.attn(x, x, x)


@dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    inputs: Callable[[], torch.Tensor]
    unit_dim: int  # where the reference puts units (written out per case, not taken from the library)
    channel_last: bool | None = None
    select: object = None
    tapped: tuple[str, ...] = ("0",)  # modules whose forward runs and is observed


def _loss(output: Any) -> torch.Tensor:
    # Every tensor leaf contributes (so every leaf gets an output gradient); pow(2) keeps it non-trivial.
    return sum((leaf.float().pow(2).mean() for _, leaf in leaves(output)), torch.zeros(()))


CASES = {
    "linear": Case(lambda: nn.Sequential(nn.Linear(6, 5)), lambda: torch.randn(8, 6), unit_dim=-1),
    "linear_channel_last_seq": Case(
        lambda: nn.Sequential(nn.Linear(6, 5)), lambda: torch.randn(4, 3, 6), unit_dim=-1
    ),
    "linear_forced_channel_first": Case(
        lambda: nn.Sequential(nn.Linear(6, 5)), lambda: torch.randn(4, 3, 6), unit_dim=1, channel_last=False
    ),
    "conv2d_nchw": Case(
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1)), lambda: torch.randn(4, 2, 5, 7), unit_dim=1
    ),
    "conv2d_forced_channel_last": Case(
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1)),
        lambda: torch.randn(4, 2, 5, 7),
        unit_dim=-1,
        channel_last=True,
    ),
    "conv2d_forced_channel_first": Case(
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1)),
        lambda: torch.randn(4, 2, 5, 7),
        unit_dim=1,
        channel_last=False,
    ),
    "layernorm": Case(lambda: nn.Sequential(nn.LayerNorm(6)), lambda: torch.randn(4, 3, 6), unit_dim=-1),
    "embedding": Case(
        lambda: nn.Sequential(nn.Embedding(10, 4)), lambda: torch.randint(0, 10, (4, 5)), unit_dim=-1
    ),
    "multihead_attention": Case(
        Attention,
        lambda: torch.randn(2, 5, 8),
        unit_dim=-1,
        select=["attn", "attn.out_proj"],
        tapped=("attn",),
    ),
}


@pytest.mark.parametrize("counted", [False, True], ids=["nonfinite_flag", "nonfinite_counted"])
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_every_column_and_derived_stat_matches_a_float64_reference(case: Case, counted: bool) -> None:
    torch.manual_seed(0)
    model = case.make()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    recs = sw.sinks.collect()
    stats = ("dead", "nonfinite") if counted else ("dead",)
    watch = sw.observe(
        model,
        opt,
        select=case.select,
        cadence=EVERY_STEP,
        stats=stats,
        channel_last=case.channel_last,
        sinks=[recs],
        every=1,
    )
    modules = dict(model.named_modules())
    rec = Recorder({name: modules[name] for name in case.tapped}, lambda name, t: case.unit_dim % t.dim())
    with watch:
        for _ in range(3):
            loss = _loss(model(case.inputs()))
            opt.zero_grad()
            loss.backward()
            optimizer_step(model, opt, rec)
            watch.step(loss=loss)
            rec.end_step()
    check_records(recs.items, rec.steps, counted)
    kinds = {k.kind for k in recs.items[-1].keys}
    assert kinds == {"activation", "output_grad", "param", "param_grad", "update"}


def test_multihead_attention_tuple_output_leaves_are_named_by_position() -> None:
    torch.manual_seed(0)
    model = Attention()
    recs = sw.sinks.collect()
    with sw.observe(model, select=nn.MultiheadAttention, sinks=[recs], every=1) as watch:
        attn_output, _ = model(torch.randn(2, 5, 8))
        attn_output.pow(2).mean().backward()  # the attention weights get no gradient
        watch.step()
    (record,) = recs.items
    forward = {(k.kind, k.name) for k in record.keys if k.kind in ("activation", "output_grad")}
    assert forward == {("activation", "0"), ("activation", "1"), ("output_grad", "0")}
    i = record.keys.index(sw.SeriesKey("train", "attn", "activation", "1"))
    assert record.column("count")[i] == 2 * 5 * 5  # averaged over heads: [batch, target, source]
    assert record.column("units")[i] == 5


# -- dead units --------------------------------------------------------------------------------------


def _kill(layer: nn.Linear | nn.Conv2d, units: list[int]) -> None:
    with torch.no_grad():
        layer.bias[units] = -1e3  # pre-activation far below 0 for every input: ReLU output exactly 0


@pytest.mark.parametrize(
    ("make", "inputs", "dead_units", "units", "channel_last"),
    [
        pytest.param(
            lambda: nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)),
            lambda: torch.randn(16, 4),
            [1, 4],
            6,
            None,  # features last, the default for Linear and ReLU
            id="linear_relu",
        ),
        pytest.param(
            lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 3 * 3, 2)),
            lambda: torch.randn(8, 2, 5, 5),
            [2],
            4,
            False,  # channels (dim 1) for every module, the ReLU included
            id="conv_relu_channels",
        ),
    ],
)
def test_units_forced_dead_are_counted_exactly(
    make: Callable[[], nn.Module],
    inputs: Callable[[], torch.Tensor],
    dead_units: list[int],
    units: int,
    channel_last: bool | None,
) -> None:
    torch.manual_seed(0)
    model = make()
    _kill(model[0], dead_units)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    recs = sw.sinks.collect()
    modules = {n: m for n, m in model.named_modules() if n}
    unit_dim = 1 if channel_last is False else -1
    with sw.observe(
        model, opt, cadence=EVERY_STEP, channel_last=channel_last, sinks=[recs], every=1
    ) as watch:
        rec = Recorder(modules, lambda name, t: unit_dim % t.dim())
        for _ in range(3):
            loss = model(inputs()).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            optimizer_step(model, opt, rec)
            watch.step(loss=loss)
            rec.end_step()
    check_records(recs.items, rec.steps)
    for record in recs.items:
        relu = record.keys.index(sw.SeriesKey("train", "1", "activation", ""))
        assert record.column("dead")[relu] == len(dead_units)
        assert record.column("units")[relu] == units
        assert record.stat("dead_fraction")[relu] == len(dead_units) / units
        # no gradient flows back into a dead unit: it is dead in the layer's output gradient too
        grad = record.keys.index(sw.SeriesKey("train", "0", "output_grad", ""))
        assert record.column("dead")[grad] >= len(dead_units)


def test_relu_after_conv_counts_dead_channels_by_default() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU())
    _kill(model[0], [2])
    recs = sw.sinks.collect()
    with sw.observe(model, sinks=[recs], every=1) as watch:
        model(torch.randn(8, 2, 5, 5)).sum().backward()
        watch.step()
    (record,) = recs.items
    conv = record.keys.index(sw.SeriesKey("train", "0", "activation", ""))
    relu = record.keys.index(sw.SeriesKey("train", "1", "activation", ""))
    assert (record.column("units")[conv], record.column("dead")[conv]) == (4, 0)  # conv: channels
    assert (record.column("units")[relu], record.column("dead")[relu]) == (4, 1)  # its ReLU: channels too
    # a 4-D activation is NCHW whatever module made it, unless channel_last is given explicitly


# monitorch (seeds/001): "a neuron or a channel is activated if the output is non-zero ... If neuron is
# not activated for all samples in a batch, we say it is dead. Death rate is a proportion of dead
# neurons against layer size." Activation rate: the fraction of non-zero outputs.
KNOWN = {
    "4x3_middle_column_zero": (
        [[1.0, 0.0, 2.0], [0.0, 0.0, 3.0], [-1.0, 0.0, 0.0], [2.0, 0.0, 5.0]],
        None,
        1 / 3,
        6 / 12,
    ),
    "4x3_no_zero": ([[1.0, 2.0, 3.0]] * 4, None, 0.0, 1.0),
    "4x3_all_zero": ([[0.0, 0.0, 0.0]] * 4, None, 1.0, 0.0),
    "4x3_zeros_scattered_no_dead_unit": (
        [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [0.0, 0.0, 0.0]],
        None,
        0.0,
        3 / 12,
    ),
    "batch_seq_features_two_of_four_dead": (
        [[[1.0, 0.0, 2.0, 0.0], [0.0, 0.0, 3.0, 0.0]], [[4.0, 0.0, 0.0, 0.0], [5.0, 0.0, 6.0, 0.0]]],
        None,
        2 / 4,
        6 / 16,
    ),
    "nchw_channel_0_dead": (
        [
            [[[0.0, 0.0], [0.0, 0.0]], [[1.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 2.0]]],
            [[[0.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]], [[3.0, 4.0], [5.0, 6.0]]],
        ],
        False,
        1 / 3,
        6 / 24,
    ),
}


@pytest.mark.parametrize(
    ("values", "channel_last", "death_rate", "activation_rate"), KNOWN.values(), ids=KNOWN
)
def test_death_and_activation_rates_of_known_inputs_follow_monitorch(
    values: list[Any], channel_last: bool | None, death_rate: float, activation_rate: float
) -> None:
    model = nn.Sequential(nn.Identity())  # the activation is exactly the input
    recs = sw.sinks.collect()
    with sw.observe(model, channel_last=channel_last, sinks=[recs], every=1) as watch:
        model(torch.tensor(values))
        watch.step()
    (record,) = recs.items
    i = record.keys.index(sw.SeriesKey("train", "0", "activation", ""))
    assert record.stat("dead_fraction")[i] == pytest.approx(death_rate, abs=1e-12)
    assert 1 - record.stat("zero_fraction")[i] == pytest.approx(activation_rate, abs=1e-12)
    by_stat = {s.labels["stat"]: s.value for s in watch.snapshot() if s.name == "streamwatch_tensor"}
    assert by_stat["dead_fraction"] == pytest.approx(death_rate, abs=1e-12)


class Fixed(nn.Module):
    """Returns a fixed output whatever the input (monitorch's test ``DumbModule``)."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__()
        self.output = output

    def forward(self, _: torch.Tensor) -> torch.Tensor:
        return self.output


# monitorch's own published known-input cases (its tests/test_preprocessor/test_output_activation.py,
# test_output_single_activation): the layer's activation rate for each module and input. Sigmoid shows the
# saturation rule: an output at a bound (isclose to 0 or 1) is inactive, so 7 of these 13 are active.
def column(*values: float) -> torch.Tensor:
    """A ``[n, 1]`` batch: n samples of one unit."""
    return torch.tensor(values, dtype=torch.float32).reshape(-1, 1)


PUBLISHED = {
    "fixed_zeros": (Fixed(torch.zeros(10, 10)), torch.rand(1, 10, 10), 0.0),
    "fixed_ones": (Fixed(torch.ones(10, 10)), torch.rand(1, 10, 10), 1.0),
    "relu_shifted_uniform": (
        nn.ReLU(),
        column(0.6934, 0.4656, 0.6557, 0.7697, 0.2359, 0.2468, 0.5747, 0.5834, 0.6392, 0.8261) - 0.5,
        0.7,
    ),
    "relu_ten": (
        nn.ReLU(),
        column(-0.978, 1.534, 5.978, -1.841, -1.345, 0.291, -0.549, 3.051, -0.890, -0.496),
        0.4,
    ),
    "relu_thirty": (
        nn.ReLU(),
        column(
            -1.216,
            -2.504,
            0.206,
            1.330,
            6.213,
            0.053,
            -0.570,
            1.486,
            -8.944,
            -0.194,
            3.314,
            -0.777,
            -0.264,
            2.458,
            0.432,
            -0.051,
            7.436,
            -0.196,
            5.129,
            -0.180,
            -3.384,
            -0.802,
            -7.045,
            -5.363,
            -1.730,
            0.168,
            1.602,
            2.740,
            1.893,
            -13.469,
        ),
        0.4666666666666667,
    ),
    "sigmoid_saturates": (
        nn.Sigmoid(),
        column(-1000, -500, -100, -10, -5, -1, 0, 1, 5, 10, 100, 500, 1000),
        0.5384615384615384,
    ),
}


@pytest.mark.parametrize(("module", "x", "activation_rate"), PUBLISHED.values(), ids=PUBLISHED)
def test_monitorchs_published_activation_rates_reproduce(
    module: nn.Module, x: torch.Tensor, activation_rate: float
) -> None:
    model = nn.Sequential(module)
    recs = sw.sinks.collect()
    with sw.observe(model, sinks=[recs], every=1) as watch:
        model(x)
        watch.step()
    (record,) = recs.items
    i = record.keys.index(sw.SeriesKey("train", "0", "activation", ""))
    assert record.stat("activation_rate")[i] == pytest.approx(activation_rate, abs=1e-12)


@pytest.mark.parametrize(
    ("module", "make_active"),
    [
        (nn.ReLU(), lambda y: y > 0),
        (nn.ReLU6(), lambda y: (y > 0) & (y < 6)),
        (nn.Tanh(), lambda y: ~torch.isclose(y, torch.tensor(-1.0)) & ~torch.isclose(y, torch.tensor(1.0))),
    ],
    ids=["relu", "relu6", "tanh"],
)
@pytest.mark.parametrize("shape", [(100, 100), (100, 10, 10), (100, 10, 2, 10)], ids=["2d", "3d", "4d"])
def test_epoch_death_and_activation_rates_match_monitorchs_reference_computation(
    module: nn.Module, make_active: Any, shape: tuple[int, ...]
) -> None:
    # monitorch's test_output_epoch_death_activation, step by step: a (sample, unit) pair is active if the
    # unit is active anywhere in its positions; a unit's rate is its mean over the batch; dead = rate 0.
    model = nn.Sequential(module)
    recs = sw.sinks.collect()
    expected = []
    gen = torch.Generator().manual_seed(0)
    with sw.observe(model, channel_last=False, sinks=[recs], every=1) as watch:
        for _ in range(5):
            x = torch.empty(shape).cauchy_(generator=gen)
            y = model(x)
            active = make_active(y)
            if active.dim() > 2:
                active = active.flatten(2, -1).any(dim=-1)
            rates = active.double().mean(dim=0)
            expected.append((float((rates == 0).double().mean()), float(rates.mean())))
            watch.step()
    got = []
    for record in recs.items:
        i = record.keys.index(sw.SeriesKey("train", "0", "activation", ""))
        got.append((float(record.stat("dead_fraction")[i]), float(record.stat("activation_rate")[i])))
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


# -- non-finite values --------------------------------------------------------------------------------


class Poison(nn.Module):
    """Passes its input through, with chosen elements replaced by NaN/Inf (outside the loss's reach)."""

    def __init__(self, where: dict[tuple[int, int], float]) -> None:
        super().__init__()
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros_like(x, dtype=torch.bool)
        fill = torch.zeros_like(x)
        for (r, c), v in self.where.items():
            mask[r, c] = True
            fill[r, c] = v
        return torch.where(mask, fill, x)


NONFINITE = {
    "nan": {(0, 0): math.nan},
    "inf": {(0, 0): math.inf, (0, 2): -math.inf},
    "nan_and_inf": {(0, 0): math.nan, (0, 1): math.inf, (0, 3): math.nan},
}


@pytest.mark.parametrize("counted", [False, True], ids=["flag", "exact_count"])
@pytest.mark.parametrize("where", NONFINITE.values(), ids=NONFINITE)
def test_nonfinite_activations_are_flagged_or_counted_and_training_goes_on(
    where: dict[tuple[int, int], float], counted: bool, train: Train
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), Poison(where))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recs = sw.sinks.collect()
    stats = ("dead", "nonfinite") if counted else ("dead",)
    with sw.observe(model, opt, stats=stats, sinks=[recs], every=1) as watch:
        # row 0 holds the non-finite values: the loss leaves it out
        train(model, opt, watch, 3, shape=(5, 3), classes=None, loss=lambda out, _: out[1:].pow(2).mean())
        assert watch.statistics().hook_errors == 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert [r.step for r in recs.items] == [0, 1, 2]
    for record in recs.items:
        poisoned = record.keys.index(sw.SeriesKey("train", "1", "activation", ""))
        clean = record.keys.index(sw.SeriesKey("train", "0", "activation", ""))
        assert record.column("nonfinite")[poisoned] == (len(where) if counted else 1.0)
        assert record.column("nonfinite")[clean] == 0.0
        grad = record.keys.index(sw.SeriesKey("train", "1", "output_grad", ""))
        assert record.column("nonfinite")[grad] == 0.0


def test_nan_makes_zeros_and_dead_units_unknown_never_wrong() -> None:
    # torch.sign(NaN) is 0 on CPU: counting through it would call NaN elements zeros and the NaN-only
    # column 0 a dead unit. With a NaN present both are unknown: NaN in the record, absent from snapshot.
    model = nn.Sequential(nn.Identity())
    recs = sw.sinks.collect()
    x = torch.tensor([[math.nan, 1.0], [math.nan, 2.0], [0.0, 3.0]])
    with sw.observe(model, stats=("dead", "nonfinite"), sinks=[recs], every=1) as watch:
        model(x)
        watch.step()
    (record,) = recs.items
    assert math.isnan(record.column("zeros")[0])
    assert math.isnan(record.column("dead")[0])
    assert record.column("nonfinite")[0] == 2
    assert record.column("units")[0] == 2
    assert record.column("count")[0] == 6
    stats = {s.labels["stat"] for s in watch.snapshot() if s.name == "streamwatch_tensor"}
    assert not stats & {"zeros", "dead", "zero_fraction", "dead_fraction"}
    assert {"count", "nonfinite", "units"} <= stats


def test_nonfinite_flag_stays_a_flag_when_a_module_runs_twice_in_a_step() -> None:
    model = nn.Sequential(Poison({(0, 0): math.nan}))
    recs = sw.sinks.collect()
    with sw.observe(model, sinks=[recs], every=1) as watch:
        model(torch.randn(3, 4))
        model(torch.randn(3, 4))
        watch.step()
    (record,) = recs.items
    assert record.column("count")[0] == 24
    assert record.column("nonfinite")[0] == 1.0  # a presence flag is "any", not a sum


def test_exact_nonfinite_counts_add_up_when_a_module_runs_twice_in_a_step() -> None:
    model = nn.Sequential(Poison({(0, 0): math.nan, (1, 1): math.inf}))
    recs = sw.sinks.collect()
    with sw.observe(model, stats=("dead", "nonfinite"), sinks=[recs], every=1) as watch:
        model(torch.randn(3, 4))
        model(torch.randn(3, 4))
        watch.step()
    (record,) = recs.items
    assert record.column("nonfinite")[0] == 4


class Transposed(nn.Module):
    """Returns a transposed float16 tensor on its first call in a forward and a float32 one on the
    second: on CPU one row takes the torch path (half precision), the other the fused kernel, under one
    key."""

    def forward(self, x: torch.Tensor, strided: bool) -> torch.Tensor:
        return (x * 2).t().half() if strided else x * 2


def test_fused_and_torch_rows_of_one_step_and_one_key_merge_exactly() -> None:
    torch.manual_seed(4)
    model = nn.ModuleDict({"lin": nn.Linear(5, 6), "tr": Transposed(), "low": nn.Linear(6, 3).half()})
    recs = sw.sinks.collect()
    with sw.observe(model, stats=("dead", "nonfinite"), sinks=[recs], every=1) as watch:
        h = model["lin"](torch.randn(4, 5))
        a, b = model["tr"](h, True), model["tr"](h, False)  # a: 6x4 float16, b: 4x6 float32
        out = model["low"](b.detach().half())
        watch.step()
    (record,) = recs.items
    counted = True
    assert_row(record, sw.SeriesKey("train", "lin", "activation", ""), reference([h], 1, counted))
    # a module run twice on differently shaped outputs: the rows merge; per-unit activity is not
    # comparable across the two shapes, so it comes from the first call (as documented in finalize)
    merged = reference([a, b], None, counted) | {
        name: reference([a], 1, counted)[name] for name in ("units", "dead", "dead_fraction")
    }
    assert_row(record, sw.SeriesKey("train", "tr", "activation", ""), merged)
    i = record.keys.index(sw.SeriesKey("train", "low", "activation", ""))  # float16: the torch path
    np.testing.assert_allclose(record.column("sum")[i], out.double().sum().item(), rtol=1e-3)
    assert record.column("count")[i] == out.numel()


class BatchFirst(nn.Module):
    """A ``batch_first`` block's output: ``[N, S, E]`` laid out in memory as ``[S, N, E]`` (a strided
    view, as ``nn.MultiheadAttention`` hands to the next module), with unit 2 dead everywhere."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.relu(x.transpose(0, 1).contiguous())
        z[..., 2] = 0.0
        self.made = z.transpose(0, 1).clone()  # (before any forward hook sees the output)
        return z.transpose(0, 1)


def test_a_strided_cpu_view_is_summarised_exactly_and_left_as_it_was(
    summary_kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the fused path a strided CPU view is read from one contiguous copy (never through the torch
    path's reductions); its row, per-unit activity included, matches the reference on both paths, and
    the view the model computes with is untouched."""
    torch.manual_seed(5)
    model = nn.Sequential(BatchFirst())
    torch_rows: list[tuple[int, ...]] = []
    summarize = _tapstate.summarize

    def counted(x: torch.Tensor, **kwargs: Any) -> Any:
        torch_rows.append(tuple(x.shape))
        return summarize(x, **kwargs)

    monkeypatch.setattr(_tapstate, "summarize", counted)
    recs = sw.sinks.collect()
    seen: list[torch.Tensor] = []
    with sw.observe(model, stats=("dead", "nonfinite"), sinks=[recs], every=1, channel_last=True) as watch:
        model[0].register_forward_hook(lambda m, a, out: seen.append(out))
        out = model(torch.randn(3, 4, 5))
        watch.step()
    (record,) = recs.items
    assert seen[0] is out
    assert not out.is_contiguous()
    assert out.stride() == (5, 15, 1)
    assert torch.equal(out, model[0].made)
    ref = reference([out], 2, True)
    assert ref["dead"] == 1.0
    assert ref["units"] == 5.0
    assert_row(record, sw.SeriesKey("train", "0", "activation", ""), ref)
    assert torch_rows == ([] if summary_kernel == "fused" else [(3, 4, 5)])


# -- phases, accumulation, sampling -------------------------------------------------------------------


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


EVAL_MODES = {
    "eval_and_no_grad": (True, True),
    "no_grad_only": (False, True),
    "eval_only": (True, False),
}


@pytest.mark.parametrize(("use_eval", "use_no_grad"), EVAL_MODES.values(), ids=EVAL_MODES)
def test_eval_forwards_give_eval_rows_and_leave_train_rows_alone(use_eval: bool, use_no_grad: bool) -> None:
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recs = sw.sinks.collect()
    with sw.observe(model, opt, cadence=EVERY_STEP, sinks=[recs], every=1) as watch:
        rec = Recorder({n: m for n, m in model.named_modules() if n}, lambda name, t: t.dim() - 1)
        for _ in range(3):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            optimizer_step(model, opt, rec)
            if use_eval:
                model.eval()
            with torch.set_grad_enabled(not use_no_grad):
                model(torch.randn(5, 4) * 3)
            model.train()
            watch.step(loss=loss)
            rec.end_step()
    check_records(recs.items, rec.steps)
    for record in recs.items:
        eval_rows = {(k.layer, k.kind) for k in record.keys if k.phase == "eval"}
        assert eval_rows == {("0", "activation"), ("1", "activation"), ("2", "activation")}


def test_eval_forward_on_an_unsampled_step_still_gives_a_record_of_eval_rows() -> None:
    torch.manual_seed(0)
    model = _mlp()
    recs = sw.sinks.collect()
    with sw.observe(model, every=2, sinks=[recs]) as watch:
        for _ in range(3):
            model(torch.randn(8, 4)).pow(2).mean().backward()
            with torch.no_grad():
                model(torch.randn(2, 4))
            watch.step()
    assert [r.step for r in recs.items] == [0, 1, 2]
    assert {k.phase for k in recs.items[1].keys} == {"eval"}
    assert {"train", "eval"} == {k.phase for k in recs.items[2].keys}


def test_gradient_accumulation_merges_activations_and_keeps_the_final_gradient() -> None:
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recs = sw.sinks.collect()
    with sw.observe(model, opt, cadence=EVERY_STEP, sinks=[recs], every=1) as watch:
        rec = Recorder({n: m for n, m in model.named_modules() if n}, lambda name, t: t.dim() - 1)
        for _ in range(3):
            opt.zero_grad()
            for _ in range(2):  # two micro-batches per optimizer step
                (model(torch.randn(8, 4)).pow(2).mean() / 2).backward()
            optimizer_step(model, opt, rec)  # param_grad reference: the accumulated .grad
            watch.step()
            rec.end_step()
    check_records(recs.items, rec.steps)
    for record, expected in zip(recs.items, rec.steps, strict=True):
        for layer, width in (("0", 6), ("1", 6), ("2", 3)):
            key = sw.SeriesKey("train", layer, "activation", "")
            i = record.keys.index(key)
            micro = [t.double() for t in expected.tensors[key]]
            assert len(micro) == 2
            assert record.column("count")[i] == 2 * 8 * width
            assert record.column("min")[i] == min(float(m.min()) for m in micro)
            assert record.column("max")[i] == max(float(m.max()) for m in micro)
            np.testing.assert_allclose(record.column("sum")[i], sum(float(m.sum()) for m in micro), rtol=1e-5)


@pytest.mark.parametrize(
    ("every", "cadence", "steps", "sampled", "param_steps", "update_steps"),
    [
        pytest.param(3, None, 7, [0, 3, 6], [0], [0], id="every_3_default_cadence"),
        pytest.param(1, None, 21, list(range(21)), [0, 10, 20], [0, 10, 20], id="every_1_default_cadence"),
        pytest.param(
            2, {"param": 2, "update": 3}, 13, [0, 2, 4, 6, 8, 10, 12], [0, 4, 8, 12], [0, 6, 12], id="custom"
        ),
        pytest.param(2, {"param_grad": 2}, 5, [0, 2, 4], [0], [0], id="param_grad_coarser"),
    ],
)
def test_every_and_cadence_pick_the_sampled_steps(
    every: int,
    cadence: dict[str, int] | None,
    steps: int,
    sampled: list[int],
    param_steps: list[int],
    update_steps: list[int],
    train: Train,
) -> None:
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recs = sw.sinks.collect()
    with sw.observe(model, opt, every=every, cadence=cadence, sinks=[recs]) as watch:
        train(model, opt, watch, steps, shape=(4, 4), classes=None)  # loss: the outputs' mean square
        assert watch.statistics().steps == steps
        assert watch.statistics().sampled == len(sampled)
    assert [r.step for r in recs.items] == sampled
    by_kind = {kind: [r.step for r in recs.items if r.rows(kind)] for kind in KINDS}
    assert by_kind["param"] == param_steps
    assert by_kind["update"] == update_steps
    assert by_kind["activation"] == sampled
    grad_every = every * (cadence or {}).get("param_grad", 1)
    assert by_kind["param_grad"] == [s for s in sampled if s % grad_every == 0]
    assert by_kind["input"] == by_kind["input_grad"] == []


# -- step scalars -------------------------------------------------------------------------------------


def test_loss_accuracy_learning_rates_and_throughput_match_references(train: Train) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    opt = torch.optim.SGD([{"params": [model[0].weight], "lr": 0.1}, {"params": [model[0].bias], "lr": 0.01}])
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    recs = sw.sinks.collect()
    expected = []
    lrs: list[float] = []

    def learning_rates(_: Step) -> None:  # the ones opt.step() just used
        lrs[:] = [g["lr"] for g in opt.param_groups]

    def reference(step: Step) -> None:
        correct = int((step.outputs.argmax(-1) == step.targets).sum())
        expected.append((step.loss.item(), correct, list(lrs)))
        schedule.step()  # after watch.step(): the next step's learning rates

    with sw.observe(model, opt, sinks=[recs], every=1) as watch:
        train(model, opt, watch, 4, shape=(16, 4), after_opt_step=learning_rates, after_watch_step=reference)
    for record, (loss, correct, lrs) in zip(recs.items, expected, strict=True):
        s = record.scalars
        assert s["loss"] == pytest.approx(loss, rel=1e-7)
        assert s["correct"] == correct
        assert s["total"] == 16
        assert s["accuracy"] == pytest.approx(correct / 16)
        assert s["lr/0"] == pytest.approx(lrs[0], rel=1e-12)
        assert s["lr/1"] == pytest.approx(lrs[1], rel=1e-12)
        assert s["lr/0"] == pytest.approx(10 * s["lr/1"])
        assert s["batch_size"] == 16
        assert s["step_seconds"] > 0
        assert s["samples_per_second"] == pytest.approx(16 / s["step_seconds"], rel=1e-9)
    assert recs.items[1].scalars["lr/0"] == pytest.approx(0.05)


@pytest.mark.parametrize(
    ("outputs", "targets", "correct"),
    [
        pytest.param([2.0, -1.0, 0.5, -3.0], [1.0, 0.0, 0.0, 1.0], 2, id="binary_scores_float_labels"),
        pytest.param([2.0, -1.0, 0.5, -3.0], [1, 0, 1, 0], 4, id="binary_scores_int_labels"),
        pytest.param([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]], [1, 1, 1], 2, id="logits_class_indices"),
    ],
)
def test_accuracy_of_known_outputs(outputs: list[Any], targets: list[Any], correct: int) -> None:
    model = nn.Sequential(nn.Identity())
    recs = sw.sinks.collect()
    with sw.observe(model, sinks=[recs], every=1) as watch:
        watch.step(loss=0.25, outputs=torch.tensor(outputs), targets=torch.tensor(targets))
    (record,) = recs.items
    assert record.scalars["loss"] == 0.25
    assert record.scalars["correct"] == correct
    assert record.scalars["accuracy"] == pytest.approx(correct / len(targets))


# -- snapshot -----------------------------------------------------------------------------------------


def test_snapshot_equals_the_last_record_and_never_holds_nan(train: Train) -> None:
    torch.manual_seed(0)
    model = _mlp()
    with torch.no_grad():
        model[0].bias[2] = -1e3  # one dead ReLU unit: dead counts are non-zero somewhere
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recs = sw.sinks.collect()
    # metrics=(): the summaries alone (update_ratio's values are tested in test_metrics.py)
    with sw.observe(model, opt, cadence=EVERY_STEP, sinks=[recs], metrics=(), detectors=(), every=1) as watch:
        train(model, opt, watch, 3)  # batches of 8 samples, 4 features, 3 classes
    samples = watch.snapshot()
    last = recs.items[-1]
    assert not any(math.isnan(s.value) for s in samples)

    tensor = {tuple(sorted(s.labels.items())): s.value for s in samples if s.name == "streamwatch_tensor"}
    assert len(tensor) == sum(1 for s in samples if s.name == "streamwatch_tensor")  # no duplicates
    expected: dict[tuple[tuple[str, str], ...], float] = {}
    for i, key in enumerate(last.keys):
        is_param = key.kind in PARAM_KINDS
        labels = {
            "phase": key.phase,
            "layer": key.layer,
            "kind": key.kind,
            "param": key.name if is_param else "",
            "index": "" if is_param else key.name,
        }
        for stat in (*COLUMNS, *DERIVED):
            value = float(last.stat(stat)[i])
            if not math.isnan(value):
                expected[tuple(sorted({**labels, "stat": stat}.items()))] = value
    assert tensor == expected

    relu_dead = {**dict.fromkeys(("param", "index"), ""), "phase": "train", "layer": "1", "stat": "dead"}
    assert tensor[tuple(sorted({**relu_dead, "kind": "activation"}.items()))] >= 1  # unit 2 at least
    weight_stats = {dict(k)["stat"] for k in tensor if ("param", "weight") in k and ("kind", "param") in k}
    per_unit = {"units", "dead", "dead_fraction", "samples", "active", "activation_rate"}
    assert weight_stats == set(COLUMNS + DERIVED) - per_unit

    scalars = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for s in samples if s.name != "streamwatch_tensor"
    }
    train = (("phase", "train"),)
    assert scalars == {
        ("streamwatch_loss", train): last.scalars["loss"],
        ("streamwatch_correct", train): last.scalars["correct"],
        ("streamwatch_predictions", train): 8.0,
        ("streamwatch_accuracy", train): last.scalars["accuracy"],
        ("streamwatch_learning_rate", (("group", "0"),)): 0.1,
        ("streamwatch_batch_size", ()): 8.0,
        ("streamwatch_last_step_seconds", ()): last.scalars["step_seconds"],
        ("streamwatch_last_step_samples_per_second", ()): last.scalars["samples_per_second"],
        ("streamwatch_step", ()): 2.0,
        **{
            ("streamwatch_step_phase_seconds", (("part", part),)): last.scalars[f"part/{part}"]
            for part in ("data_wait", "forward", "backward", "optimizer")
        },
    }


def test_snapshot_keeps_the_latest_row_of_series_missing_from_the_last_record() -> None:
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recs = sw.sinks.collect()
    with sw.observe(model, opt, sinks=[recs], every=1) as watch:  # weights sampled at step 0 only
        for _ in range(3):
            model(torch.randn(4, 4)).pow(2).mean().backward()
            opt.step()
            watch.step()
    first = recs.items[0]
    i = first.keys.index(sw.SeriesKey("train", "0", "param", "weight"))
    l2 = [
        s.value
        for s in watch.snapshot()
        if s.name == "streamwatch_tensor"
        and (s.labels["kind"], s.labels["layer"], s.labels["param"], s.labels["stat"])
        == ("param", "0", "weight", "l2")
    ]
    assert l2 == [float(first.stat("l2")[i])]
    assert not recs.items[-1].rows("param")


def test_without_an_optimizer_weights_are_summarised_at_the_step_boundary() -> None:
    torch.manual_seed(0)
    model = _mlp()
    recs = sw.sinks.collect()
    weights = []
    with sw.observe(model, cadence={"param": 1}, sinks=[recs], every=1) as watch:
        for _ in range(2):
            model(torch.randn(4, 4)).pow(2).mean().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad  # a hand-written update, no optimizer to hook
                    p.grad = None
            weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
            watch.step()
    for record, named in zip(recs.items, weights, strict=True):
        assert not record.rows("update")
        for qualified, value in named.items():
            layer, _, pname = qualified.rpartition(".")
            assert_row(record, sw.SeriesKey("train", layer, "param", pname), reference([value], None, False))


def test_a_tensor_learning_rate_is_reported_like_a_float_one() -> None:
    model = nn.Sequential(nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    recs = sw.sinks.collect()
    with sw.observe(model, opt, sinks=[recs], every=1) as watch:
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        watch.step()
    assert recs.items[0].scalars["lr/0"] == pytest.approx(0.01, rel=1e-7)


def test_a_loss_or_outputs_that_cannot_be_used_are_refused_and_the_step_counted_as_failed() -> None:
    # (never silently dropped: tests/test_observe_faults.py covers every refused argument)
    model = nn.Sequential(nn.Identity())
    recs = sw.sinks.collect()
    with sw.observe(model, sinks=[recs], every=1) as watch:
        with pytest.raises(ValueError, match=r"^Expected `loss` to be a scalar"):
            watch.step(loss=torch.ones(3))
        refused = r"^Cannot score train accuracy from `outputs` of shape \[4, 2\]"
        with pytest.raises(ValueError, match=refused):
            watch.step(outputs=torch.zeros(4, 2), targets=torch.zeros(3, dtype=torch.long))
        assert watch.statistics().failed_steps == 2
        assert watch.statistics().skipped == {}
    assert recs.items == []
