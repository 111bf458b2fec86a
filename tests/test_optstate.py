"""``metrics.OptimizerState`` (streamwatch/metrics/_optstate.py): Adam's moment estimates after the step,
checked against the optimizer's own state read with plain torch in float64, and training untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import streamwatch as sw


def adam_run(every: int | None, fused: bool | None, steps: int = 12) -> tuple[list, dict[int, dict]]:
    """An AdamW run under a watch with the metric; returns the records and, per step, the reference
    values computed from ``opt.state`` after ``opt.step()``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused)
    records = sw.sinks.collect()
    expected: dict[int, dict] = {}
    names = {p: (layer, name) for layer, m in model.named_children() for name, p in m.named_parameters()}
    with sw.observe(model, opt, every=every, metrics=[sw.metrics.OptimizerState()], sinks=[records]) as watch:
        for step in range(steps):
            x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ref = {}
            for p, (layer, name) in names.items():
                for moment in ("exp_avg", "exp_avg_sq"):
                    v = opt.state[p][moment].double()
                    ref[(layer, name, f"{moment}_norm")] = float(torch.linalg.vector_norm(v))
                    ref[(layer, name, f"{moment}_max")] = float(v.abs().max())
            expected[step] = ref
            watch.step(loss=loss)
    return records.items, expected


@pytest.mark.parametrize(
    ("every", "fused"), [(1, None), (3, False), (None, True)], ids=["every1", "every3", "gov"]
)
def test_moments_equal_the_optimizers_state(every: int | None, fused: bool | None) -> None:
    items, expected = adam_run(every, fused)
    checked = 0
    for r in items:
        got = {(k.layer, k.name, stat): float(np.asarray(v).item()) for (k, stat), v in r.extras.items()}
        if not got:
            continue
        assert all(k.kind == "param" and k.phase == "train" for (k, _stat) in r.extras)
        assert got.keys() == expected[r.step].keys()
        for key, want in expected[r.step].items():
            assert got[key] == pytest.approx(want, rel=1e-6, abs=1e-12), (r.step, key)
        checked += 1
    assert checked >= 1
    if every == 1:
        assert checked == 12


def test_without_moments_nothing_is_written_and_the_state_is_not_touched() -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: no state
    records = sw.sinks.collect()
    with sw.observe(model, opt, every=1, metrics=[sw.metrics.OptimizerState()], sinks=[records]) as watch:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 3)).sum().backward()
            opt.step()
            watch.step()
    assert all(not r.extras for r in records.items)
    assert all(not s for s in opt.state.values())


def test_it_needs_an_optimizer() -> None:
    with pytest.raises(ValueError, match="OptimizerState"):
        sw.observe(nn.Linear(2, 2), metrics=[sw.metrics.OptimizerState()])
