"""Launch budgets per tap kind that do not grow per tensor: 4 layers against 32, on the torch path.

Each count is of the aten ops one sampled step adds on the training thread (``STREAMWATCH_KERNEL=torch``,
``every=1``, one kind tapped at cadence 1, the sentinel off), minus the same step of an unobserved twin
(``benchmarks/count_ops.py``'s counter; ``_torchpath.FEW_LAUNCHES_ON_CPU`` makes CPU tensors take the
ops CUDA tensors take). ``tests/test_launches.py`` holds a whole step of every kind to its budget; here
each kind is held to how its cost scales with the number of tensors.

The budgets:

- :data:`BOUNDARY`: what a sampled step costs whatever it samples: the loss read (a CPU loss here, one
  ``_local_scalar_dense``; a device loss rides in the record's copy instead), and the step boundary's
  ``cat``s, one ``stack``, one ``index_select`` and a few views (measured 9 for the parameter kinds, 11
  for the per-tensor kinds: one ``cat`` more for the per-unit counts).
- :data:`PER_PACK`: the parameter kinds (weights, gradients, updates) are summarised in packs of at most
  ``_torchpath.GROUP_ELEMENTS`` (4 M) elements, each pack a fixed number of ops whatever the number of
  tensors in it: one ``_foreach_copy_`` into the pack, ``pow``, ``sign``, one ``bmm``, one
  ``segment_reduce``, two ``_foreach_max`` and two ``_foreach_neg`` and two views (11); an update two
  more (``_foreach_mul_``, ``_foreach_add_``: Δ in place). A step costs at most ``BOUNDARY + PER_PACK ·
  packs``: the same for 4 layers as for 32, one pack more costs one pack's ops and its place in the
  boundary's ``cat``.
- :data:`SUMMARY` and :data:`UNIT`: activations and output gradients are summarised one tensor at a
  time: four ops each (``pow``, ``sign``, ``mm``, ``aminmax``), and per-unit activity (dead units, on by
  default) one ``vector_norm`` more for a 2-D tensor, two for one with positions (a conv's
  ``[N, C, H, W]``). Those are kernels; an activation that requires a gradient is detached first
  (:data:`DETACH`: a view, no kernel; a gradient needs none).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

import streamwatch as sw
from benchmarks import count_ops
from streamwatch import _torchpath

BOUNDARY = 12
"""Ops a sampled step may add whatever it samples (measured 9 and 11: the module docstring)."""
PER_PACK = {"param": 11, "param_grad": 11, "update": 13}
"""Ops per pack of parameters, gradients or updates (measured: these)."""
SUMMARY = 4
"""Kernels per activation or output gradient, per-unit activity aside."""
UNIT = {"mlp": 1, "cnn": 2}
"""Kernels per-unit activity adds to a tensor: one ``vector_norm``, two with positions."""
DETACH = {"activation": 1, "output_grad": 0}
"""Views per tensor besides: an activation's ``detach``."""

Model = Callable[[int], tuple[nn.Module, torch.Tensor]]


def mlp(layers: int, width: int = 32) -> tuple[nn.Module, torch.Tensor]:
    """``layers`` × (Linear(width, width), ReLU), a Linear head; a batch of 16."""
    torch.manual_seed(0)
    body = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(*body, nn.Linear(width, 10)), torch.randn(16, width)


def cnn(layers: int) -> tuple[nn.Module, torch.Tensor]:
    """``layers`` × (Conv2d(4, 4, 3), ReLU) on 4×4 images, a Linear head; a batch of 4."""
    torch.manual_seed(0)
    body = [m for _ in range(layers) for m in (nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())]
    return nn.Sequential(*body, nn.Flatten(), nn.Linear(64, 10)), torch.randn(4, 4, 4, 4)


MODELS: dict[str, Model] = {"mlp": mlp, "cnn": cnn}


@pytest.fixture(autouse=True)
def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path (set before ``observe``), CPU tensors taking the ops CUDA tensors take."""
    monkeypatch.setenv("STREAMWATCH_KERNEL", "torch")
    monkeypatch.setattr(_torchpath, "FEW_LAUNCHES_ON_CPU", True)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, watch: sw.Watch | None) -> None:
    loss = nn.functional.cross_entropy(model(x), torch.arange(x.shape[0]) % 10)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if watch is not None:
        watch.step(loss=loss)


def added(make: Callable[[], tuple[nn.Module, torch.Tensor]], kind: str) -> tuple[int, int, int]:
    """``(ops, kernels, rows)``: what one sampled step tapping only ``kind`` adds to the same step of an
    unobserved twin, and the rows of its record."""
    model, x = make()
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.01, momentum=0.9)
    records = sw.sinks.collect()
    with sw.observe(
        model, opt, every=1, taps=(kind,), cadence={kind: 1}, sinks=[records], sentinel=()
    ) as watch:
        for _ in range(2):  # (scratch, packs and views are made once: shapes repeat every step)
            _step(twin, twin_opt, x, None)
            _step(model, opt, x, watch)
        with count_ops.OpCounter() as plain:
            _step(twin, twin_opt, x, None)
        with count_ops.OpCounter() as observed:
            _step(model, opt, x, watch)
        watch.flush()
    rows = len(records.items[-1].keys)
    return observed.count.total - plain.count.total, observed.count.kernels - plain.count.kernels, rows


@pytest.mark.parametrize("kind", list(PER_PACK))
def test_a_parameter_kind_costs_the_same_for_4_and_32_layers(kind: str) -> None:
    """10 tensors or 66 (one pack either way): the same ops, within one pack's budget."""
    few, _, few_rows = added(lambda: mlp(4), kind)
    many, _, many_rows = added(lambda: mlp(32), kind)
    assert (few_rows, many_rows) == (10, 66)  # (every tensor summarised)
    assert many == few
    assert few <= BOUNDARY + PER_PACK[kind]


@pytest.mark.parametrize("kind", list(PER_PACK))
def test_a_parameter_kind_grows_per_pack_not_per_tensor(kind: str) -> None:
    """66 tensors of 32 layers 384 wide (4.7 M elements: two packs) against 66 of 32 layers 32 wide
    (one pack): one pack's ops more, and its place in the boundary's ``cat``."""
    model, _ = mlp(32, width=384)
    packs = len(_torchpath.batches([p.numel() for p in model.parameters()]))
    assert packs == 2
    narrow, _, _ = added(lambda: mlp(32), kind)
    wide, _, rows = added(lambda: mlp(32, width=384), kind)
    assert rows == 66
    assert wide - narrow <= PER_PACK[kind] + 1
    assert wide <= BOUNDARY + PER_PACK[kind] * packs + 1


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("kind", list(DETACH))
def test_a_per_tensor_kind_costs_four_kernels_per_tensor_and_one_or_two_for_units(
    kind: str, model: str
) -> None:
    """What each tensor more costs, from 4 layers to 32 (56 tensors more): at most four kernels and the
    per-unit ones (:data:`UNIT`), and the activation's ``detach``; the rest is the boundary's."""
    make = MODELS[model]
    few, few_kernels, few_rows = added(lambda: make(4), kind)
    many, many_kernels, many_rows = added(lambda: make(32), kind)
    more = many_rows - few_rows
    assert more == 56
    per_tensor, kernels_per_tensor = (many - few) / more, (many_kernels - few_kernels) / more
    assert kernels_per_tensor <= SUMMARY + UNIT[model]
    assert per_tensor <= SUMMARY + UNIT[model] + DETACH[kind]
    assert few - per_tensor * few_rows <= BOUNDARY
