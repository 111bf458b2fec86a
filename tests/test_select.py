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


def _wrapped(how: str) -> nn.Module:
    """``model()`` with its two blocks wrapped as torchtitan and FSDP users wrap them, or the whole of it
    compiled."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped = model()
    if how == "whole model compiled":
        return torch.compile(wrapped, backend="eager")
    if how == "DataParallel":  # (DDP keeps the model under `module` the same way; it needs a process group)
        return nn.DataParallel(wrapped)
    for i in (0, 1):
        block = wrapped[i]
        if how == "blocks compiled":
            wrapped[i] = torch.compile(block, backend="eager")
        elif how == "blocks checkpoint-wrapped":
            wrapped[i] = checkpoint_wrapper(block)
        else:  # both, as torchtitan does: compile(checkpoint_wrapper(block))
            wrapped[i] = torch.compile(checkpoint_wrapper(block), backend="eager")
    return wrapped


# (dynamo reads the .grad of a compiled block's non-leaf input as it takes it in, observed or not: a
# warning that pytest's settings turn into an error inside dynamo; a training script sees nothing)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
@pytest.mark.parametrize(
    "how",
    ["blocks compiled", "blocks checkpoint-wrapped", "both", "whole model compiled", "DataParallel"],
)
def test_torchs_module_wrappers_leave_the_layer_names_as_they_were(how: str) -> None:
    """``torch.compile``'s ``OptimizedModule`` and ``checkpoint_wrapper`` keep the wrapped module under
    ``_orig_mod`` and ``_checkpoint_wrapped_module``, ``DataParallel`` and DDP under ``module``: the layers
    keep their names (``0.0``, not ``0._orig_mod.0``), as ``torch.distributed.checkpoint`` names
    parameters, so a run's series and a
    user's globs do not change with how the model was wrapped; depth is counted on the clean names and
    a wrapper is not a layer of its own. The records hold the same keys and values as the plain model's."""
    plain, wrapped = model(), _wrapped(how)
    for select in (sw.Select(), sw.Select(names=("1.*",)), sw.Select(depth=1), sw.Select(types=(nn.Linear,))):
        picked = [name for name, _ in select.modules(wrapped)]
        assert picked == [name for name, _ in select.modules(plain)]
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    keys, sums = [], []
    for net in (plain, wrapped):
        records = sw.sinks.collect()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        with sw.observe(net, optimizer, every=1, sinks=[records]) as watch:
            net(x).square().mean().backward()
            optimizer.step()
            watch.step()
        (record,) = records.items
        keys.append({(k.layer, k.kind, k.name) for k in record.keys if k.kind != "output_grad"})
        column = zip(record.keys, record.column("sum"), strict=True)
        sums.append({k.layer: v for k, v in column if k.kind == "activation"})
    assert keys[1] == keys[0]
    assert ("0.0", "param", "weight") in keys[0]
    assert sums[1] == pytest.approx(sums[0], rel=1e-5)
