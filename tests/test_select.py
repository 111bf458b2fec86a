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
    with sw.observe(net, select=shorthand, taps=("activation",), sinks=[recs], every=1) as watch:
        net(torch.randn(3, 4))
        watch.step()
    (record,) = recs.items
    assert {key.layer for key in record.keys} == layers


def test_a_selected_container_is_summarised_as_a_whole_output() -> None:
    net = model()
    recs = sw.sinks.collect()
    captured = {}
    net[1].register_forward_hook(lambda m, a, out: captured.__setitem__("out", out.detach().clone()))
    with sw.observe(net, select=sw.Select(depth=1), taps=("activation",), sinks=[recs], every=1) as watch:
        net(torch.randn(3, 4))
        watch.step()
    (record,) = recs.items
    row = record.keys.index(sw.SeriesKey("train", "1", "activation", ""))
    out = captured["out"].double()
    assert record.column("count")[row] == out.numel()
    assert record.column("sumsq")[row] == pytest.approx(float(out.pow(2).sum()), rel=1e-6)


@pytest.mark.parametrize(
    ("single", "tupled"),
    [
        (sw.Select(names="1.*"), sw.Select(names=("1.*",))),
        (sw.Select(types=nn.Tanh), sw.Select(types=(nn.Tanh,))),
        (sw.Select(indices=3), sw.Select(indices=(3,))),
        (sw.Select(names=["0", "2"]), sw.Select(names=("0", "2"))),
    ],
    ids=["glob", "class", "index", "list"],
)
def test_a_single_criterion_reads_as_a_one_element_tuple(single: sw.Select, tupled: sw.Select) -> None:
    # before: names="1.*" was read character by character (globs "1", "." and "*": every module)
    net = model()
    assert single == tupled
    assert single.modules(net) == tupled.modules(net)
    assert single.modules(net)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"types": (int,)}, "types"),
        ({"types": (nn.Linear, "Conv2d")}, "types"),
        ({"names": (1,)}, "names"),
        ({"names": None}, "names"),
        ({"indices": (-1,)}, "indices"),
        ({"indices": (True,)}, "indices"),
        ({"indices": 1.5}, "indices"),
        ({"depth": "1"}, "depth"),
        ({"depth": -1}, "depth"),
        ({"depth": True}, "depth"),
        ({"leaves": "yes"}, "leaves"),
    ],
    ids=lambda v: str(v) if isinstance(v, str) else None,
)
def test_a_criterion_of_the_wrong_type_is_refused_naming_the_field(
    kwargs: dict[str, object], field: str
) -> None:
    with pytest.raises(TypeError, match=rf"^Expected `Select\.{field}` to be "):
        sw.Select(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("select", [[], (), "nothing.*", sw.Select(names=("x",)), nn.Conv2d])
def test_a_select_that_matches_no_module_is_refused_before_anything_is_attached(select: object) -> None:
    net = model()
    with pytest.raises((ValueError, TypeError), match=r"`select`") as info:
        sw.observe(net, select=select, every=1)
    if isinstance(info.value, ValueError):  # matched nothing: says what select was, lists module names
        message = str(info.value)
        assert repr(select) in message
        assert "'0.0'" in message
        assert "'1.1'" in message
    assert not any(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.modules())
    with sw.observe(net, every=1):
        pass
