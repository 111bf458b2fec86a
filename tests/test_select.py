"""Module selection: by type, name glob, depth and index (torchfunc's `types`/`indices`), and shorthands."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import streamwatch as sw


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(4, 8), nn.ReLU()),  # "0", "0.0", "0.1"
        nn.Sequential(nn.Linear(8, 8), nn.Tanh()),  # "1", "1.0", "1.1"
        nn.Linear(8, 2),  # "2"
    )


@pytest.mark.parametrize(
    ("select", "names"),
    [
        (sw.Select(), ["0.0", "0.1", "1.0", "1.1", "2"]),
        (sw.Select(types=(nn.Linear,)), ["0.0", "1.0", "2"]),
        (sw.Select(names=("1.*",)), ["1.0", "1.1"]),
        (sw.Select(names=("0", "2")), ["0", "2"]),
        (sw.Select(depth=1), ["0", "1", "2"]),
        (sw.Select(depth=0), [""]),
        (sw.Select(indices=(0, 3)), ["", "0.1"]),
        (sw.Select(types=(nn.Linear,), depth=2), ["0.0", "1.0"]),
        (sw.Select(depth=1, leaves=True), ["2"]),
    ],
    ids=[
        "leaves",
        "types",
        "glob",
        "names",
        "depth1",
        "depth0",
        "indices",
        "types-and-depth",
        "depth-leaves",
    ],
)
def test_select_criteria_all_hold(select: sw.Select, names: list[str]) -> None:
    assert [name for name, _ in select.modules(model())] == names


@pytest.mark.parametrize(
    ("shorthand", "layers"),
    [
        (None, {"0.0", "0.1", "1.0", "1.1", "2"}),
        ("*.0", {"0.0", "1.0"}),
        (nn.Tanh, {"1.1"}),
        ((nn.ReLU, nn.Tanh), {"0.1", "1.1"}),
        (["2", "0.1"], {"2", "0.1"}),
    ],
    ids=["none", "glob", "class", "classes", "globs"],
)
def test_observe_taps_exactly_the_selected_modules(shorthand: object, layers: set[str]) -> None:
    net = model()
    recs = sw.sinks.collect()
    with sw.observe(net, select=shorthand, taps=("activation",), sinks=[recs]) as watch:
        net(torch.randn(3, 4))
        watch.step()
    (record,) = recs.items
    assert {key.layer for key in record.keys} == layers


def test_a_selected_container_is_summarised_as_a_whole_output() -> None:
    net = model()
    recs = sw.sinks.collect()
    captured = {}
    net[1].register_forward_hook(lambda m, a, out: captured.__setitem__("out", out.detach().clone()))
    with sw.observe(net, select=sw.Select(depth=1), taps=("activation",), sinks=[recs]) as watch:
        net(torch.randn(3, 4))
        watch.step()
    (record,) = recs.items
    row = record.keys.index(sw.SeriesKey("train", "1", "activation", ""))
    out = captured["out"].double()
    assert record.column("count")[row] == out.numel()
    assert record.column("sumsq")[row] == pytest.approx(float(out.pow(2).sum()), rel=1e-6)
