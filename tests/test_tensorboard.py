"""The TensorBoard sink on a real training run, read back with TensorBoard's own event reader."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import streamwatch as sw
from streamwatch import SeriesKey
from tests.training import Train

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def test_scalars_and_histograms_reach_tensorboard(tmp_path: Path, train: Train) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    buckets = sw.metrics.Buckets(lo=-4, hi=2, per_decade=2)
    board = sw.sinks.TensorBoard(tmp_path / "tb", buckets=buckets)
    records = sw.sinks.collect()
    metrics = [*sw.DEFAULT_METRICS, sw.metrics.Histogram(kinds=("activation",), buckets=buckets)]
    with sw.observe(model, opt, metrics=metrics, sinks=[board, records], every=1) as watch:
        train(model, opt, watch, 3, shape=(16, 6), seed=1)
    reader = event_accumulator.EventAccumulator(
        str(tmp_path / "tb"), size_guidance={"scalars": 0, "histograms": 0}
    )
    reader.Reload()
    tags = reader.Tags()
    loss = [(e.step, e.value) for e in reader.Scalars("loss")]
    assert loss == [(r.step, pytest.approx(r.scalars["loss"], rel=1e-6)) for r in records.items]
    last = records.items[-1]
    row = last.keys.index(SeriesKey("train", "2", "param_grad", "weight"))
    l2 = reader.Scalars("train/param_grad/2.weight/l2")[-1]
    assert l2.step == 2
    assert l2.value == pytest.approx(float(last.stat("l2")[row]), rel=1e-6)
    histogram = reader.Histograms("train/activation/1/values")[-1]
    counts = last.extras[(SeriesKey("train", "1", "activation", ""), "histogram")]
    assert histogram.histogram_value.num == pytest.approx(float(counts[1:].sum()))
    assert sum(histogram.histogram_value.bucket) == pytest.approx(float(counts[1:].sum()))
    assert not [t for t in tags["scalars"] if "nan" in t.lower()]
    assert all(math.isfinite(e.value) for t in tags["scalars"] for e in reader.Scalars(t))


def test_it_refuses_what_is_not_a_step_record(tmp_path: Path) -> None:
    board = sw.sinks.TensorBoard(tmp_path / "tb")
    with pytest.raises(TypeError, match="takes StepRecords"):
        board.send(1.0)
    board.close()
    board.close()  # idempotent


def test_a_nan_loss_and_nan_statistics_are_written_as_nan(tmp_path: Path) -> None:
    """A NaN loss (the run's worst news) and the statistics of a tensor holding NaN were skipped as
    values unknown: TensorBoard showed the step as if nothing had been recorded, /metrics served NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    board = sw.sinks.TensorBoard(tmp_path / "tb", stats=("mean", "l2", "dead_fraction", "activation_rate"))
    records = sw.sinks.collect()
    with sw.observe(model, sinks=[board, records], every=1, on_nonfinite=lambda first: None) as watch:
        for step in range(3):
            x = torch.randn(4, 6)
            if step == 1:
                x[0, 0] = math.nan
            loss = model(x).square().mean()
            loss.backward()
            watch.step(loss=loss)
    reader = event_accumulator.EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    reader.Reload()
    loss_events = {e.step: e.value for e in reader.Scalars("loss")}
    assert sorted(loss_events) == [0, 1, 2]
    assert math.isnan(loss_events[1])
    assert math.isfinite(loss_events[0])
    means = {e.step: e.value for e in reader.Scalars("train/activation/0/mean")}
    assert sorted(means) == [0, 1, 2]
    assert math.isnan(means[1])
    want = records.items[2]
    row = want.keys.index(SeriesKey("train", "0", "activation", ""))
    assert means[2] == pytest.approx(float(want.stat("mean")[row]), rel=1e-6)
    # a statistic that has no value for a kind is left out, NaN rows or not (gradients have no units)
    tags = reader.Tags()["scalars"]
    assert "train/activation/1/dead_fraction" in tags
    assert not [t for t in tags if "param_grad" in t and t.endswith(("dead_fraction", "activation_rate"))]
