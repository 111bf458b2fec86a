"""The CUDA path: side-stream copy into pinned slots, zero host syncs on the training thread.

Skipped without a GPU (marked ``cuda``). Run on a GPU machine with ``make test PYTEST_ARGS="-m cuda"``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import streamwatch as sw

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).cuda()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, watch: sw.Watch, x, y) -> torch.Tensor:
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    watch.step(loss=loss, outputs=logits, targets=y, batch_size=x.shape[0])
    return loss


def test_a_monitored_training_step_makes_no_host_sync() -> None:
    model, opt = make()
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    records = sw.sinks.collect()
    watch = sw.observe(model, opt, sinks=[records], cadence={"param": 1, "update": 1}, every=1)
    train_step(model, opt, watch, x, y)  # warm-up: lazy CUDA init, stream and pinned slots
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            train_step(model, opt, watch, x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    watch.close()
    assert watch.statistics().hook_errors == 0
    assert [r.step for r in records.items] == [0, 1, 2, 3]
    kinds = {key.kind for key in records.items[-1].keys}
    assert {"activation", "output_grad", "param", "param_grad", "update"} <= kinds


def test_values_copied_off_the_device_match_a_reference() -> None:
    model, opt = make()
    captured: dict[str, torch.Tensor] = {}
    model[0].register_forward_hook(lambda m, a, out: captured.__setitem__("h", out.detach().clone()))
    records = sw.sinks.collect()
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    with sw.observe(model, opt, sinks=[records], every=1) as watch:
        train_step(model, opt, watch, x, y)
    record = records.items[0]
    row = record.keys.index(sw.SeriesKey("train", "0", "activation", ""))
    h = captured["h"].double().cpu().numpy()
    expected = [h.size, h.sum(), (h * h).sum(), h.min(), h.max(), np.sum(h == 0)]
    np.testing.assert_allclose(record.table[row, :6], expected, rtol=1e-5)


def test_slots_are_reused_only_after_the_worker_released_them() -> None:
    model, opt = make()
    release = threading.Event()
    seen = sw.sinks.collect()
    x = torch.randn(8, 64, device="cuda")
    y = torch.randint(0, 10, (8,), device="cuda")
    watch = sw.observe(model, opt, capacity=1, overflow="drop_newest", sinks=[seen], every=1)
    watch.pipe(sw.source() | sw.ops.map(lambda r: release.wait(10) and r) | sw.sinks.collect())
    for _ in range(8):
        train_step(model, opt, watch, x, y)
    stats = watch.statistics()
    release.set()
    watch.close()
    # capacity 1 + 2 spare pinned slots: later steps are dropped and counted, never overwrite a slot in use
    assert stats.slots_exhausted + stats.dropped_newest > 0
    assert len(seen.items) + watch.statistics().dropped_newest + watch.statistics().slots_exhausted == 8


def test_opt_in_tensor_metrics_make_no_host_sync_and_reach_the_worker() -> None:
    model, opt = make()
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    records = sw.sinks.collect()
    metrics = [
        sw.metrics.GradientCosine(),
        sw.metrics.GradientCosine(of="update"),
        sw.metrics.SpectralNorm(),
        sw.metrics.Histogram(kinds=("activation", "param_grad")),
        sw.metrics.PNorm(p=1, kinds=("param_grad",)),
    ]
    watch = sw.observe(model, opt, sinks=[records], metrics=[*sw.DEFAULT_METRICS, *metrics], every=1)
    train_step(model, opt, watch, x, y)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            train_step(model, opt, watch, x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    watch.close()
    assert watch.statistics().hook_errors == 0
    last = records.items[-1]
    stats = {stat for _, stat in last.extras}
    assert stats == {"cosine", "spectral_norm", "histogram", "norm_p1"}
    weight = model[2].weight.detach()
    spectral = last.extras[(sw.SeriesKey("train", "2", "param", "weight"), "spectral_norm")][0]
    assert spectral == pytest.approx(float(torch.linalg.matrix_norm(weight, ord=2)), rel=1e-2)
    histogram = last.extras[(sw.SeriesKey("train", "1", "activation", ""), "histogram")]
    assert histogram.sum() == 32 * 128


def test_the_nonfinite_sentinel_makes_no_host_sync_and_reports_the_step_later() -> None:
    """The loss of step 3 is NaN on the device: the sentinel's flag is copied without blocking into a
    pinned slot and read once its event completed, so the trip (and the escalation) is known a few steps
    later, on a training thread that never waited for the device."""
    model, opt = make()
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")
    watch = sw.observe(model, opt, every=50, escalate=4, on_nonfinite=lambda value: None)
    train_step(model, opt, watch, x, y)  # warm-up: lazy CUDA init, the sentinel's pinned ring and events
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 6):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits, y) * (float("nan") if step == 3 else 1.0)
            watch.step(loss=loss)  # no backward: the weights stay finite
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    logits = model(x)
    watch.step(loss=torch.nn.functional.cross_entropy(logits, y))  # the copies are done: read them
    stats = watch.statistics()
    watch.close()
    assert stats.sentinel_trips == 1
    assert stats.escalations == 1
    assert stats.hook_errors == 0
