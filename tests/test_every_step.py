"""Every step's values reach the sinks that keep every step (the run file, TensorBoard), sampled or not,
and ``watch.log()`` records your own values with them.

Unsampled steps keep their step-level values (loss, learning rates, step time, throughput, logged values)
in the outbox's step log; the next record carries them (``StepRecord.steps``) and ``close()`` ships the
rest. Each test compares what comes back with the values the loop itself saw.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import streamwatch as sw
from streamwatch._logbook import LOG_CAP
from streamwatch._plot import series
from streamwatch._report import report
from streamwatch.sinks import read_run

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> torch.Tensor:
    x, y = _batch(step)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def test_a_300_step_governed_loop_reads_back_every_step_with_its_loss(tmp_path: Path) -> None:
    """The first hour's loop: ``observe(model, opt)`` defaults (the overhead governor) and a run file, 300
    steps; the run file has every step once, each with the loss the loop computed, and ``report`` says
    300 steps."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    with sw.observe(model, opt, sinks=[sw.sinks.RunFile(tmp_path / "run.jsonl")]) as watch:
        for step in range(300):
            loss = _train_step(model, opt, step)
            losses.append(loss.item())
            watch.step(loss=loss, batch_size=8)
        stats = watch.statistics()
    assert stats.sampled < 300  # (the governor sampled some steps only)
    run = read_run(tmp_path)
    assert [r.step for r in run.records] == list(range(300))
    assert [r.scalars["loss"] for r in run.records] == losses  # (float32 values, read exactly)
    assert all(r.scalars["batch_size"] == 8.0 and r.scalars["lr/0"] == 0.05 for r in run.records)
    with_rows = [r.step for r in run.records if r.keys]
    assert with_rows[0] == 0
    assert len(with_rows) == stats.sampled
    text = report(run)
    assert f"steps recorded: 300 (steps 0..299, rank 0; {stats.sampled} with layer statistics)" in text
    assert f"last loss: {losses[-1]:.6g} (step 299)" in text
    s = series(run)
    assert s["steps"] == list(range(300))
    assert s["loss"] == losses


@pytest.mark.parametrize("tensor_lr", [False, True])
def test_each_step_keeps_its_own_learning_rate_step_time_and_throughput(tensor_lr: bool) -> None:
    """A scheduler changes the learning rate every step: each unsampled step carries the rate at its own
    end, not the next record's; step time and throughput are its own too. A tensor rate (the compiled
    optimizer recipe's ``lr=torch.tensor(0.1)``, which the scheduler updates in place) is read at each
    step's end: kept as the tensor, the unsampled steps read the rate at the next record."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1) if tensor_lr else 0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    records = sw.sinks.collect()
    rates = []
    with sw.observe(model, opt, every=7, sinks=[records]) as watch:
        for step in range(20):
            _train_step(model, opt, step)
            schedule.step()
            rates.append(float(opt.param_groups[0]["lr"]))
            watch.step(loss=0.5, batch_size=8)
    steps = [s for r in records.items for s in r.every_step()]
    assert [s.step for s in steps] == list(range(20))
    assert [s.scalars["lr/0"] for s in steps] == rates
    for s in steps:
        assert s.scalars["step_seconds"] > 0
        assert s.scalars["samples_per_second"] == pytest.approx(8 / s.scalars["step_seconds"], rel=1e-12)
    # the sampled steps 0, 7, 14 are records of their own, the rest ride with the next; close() ships
    # the last ones (15..19) as a record of step 19 carrying 15..18
    assert [(r.step, [s.step for s in r.steps]) for r in records.items] == [
        (0, []),
        (7, [1, 2, 3, 4, 5, 6]),
        (14, [8, 9, 10, 11, 12, 13]),
        (19, [15, 16, 17, 18]),
    ]
    assert not records.items[-1].keys  # (the final record: scalars only)


def test_a_full_step_log_sends_a_record_and_loses_nothing() -> None:
    model = _model()
    records = sw.sinks.collect()
    with sw.observe(model, every=1000, sinks=[records]) as watch:
        watch._boundary._outbox.steps.capacity = 5  # (4096 in use: a thousand steps a second never fill it)
        for step in range(23):
            watch.step(loss=float(step))
    steps = [s for r in records.items for s in r.every_step()]
    assert [(s.step, s.scalars["loss"]) for s in steps] == [(i, float(i)) for i in range(23)]
    assert all(len(r.steps) <= 5 for r in records.items)
    assert len(records.items) >= 23 // 6


def test_tensorboard_gets_every_steps_loss(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    with sw.observe(model, opt, every=5, sinks=[sw.sinks.TensorBoard(tmp_path / "tb")]) as watch:
        for step in range(12):
            losses.append(_train_step(model, opt, step).item())
            watch.step(loss=losses[-1])
    reader = event_accumulator.EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    reader.Reload()
    got = sorted((e.step, e.value) for e in reader.Scalars("loss"))
    assert [step for step, _ in got] == list(range(12))
    assert [value for _, value in got] == pytest.approx(losses, rel=1e-6)  # (TensorBoard keeps float32)


# -- watch.log() --------------------------------------------------------------------------------------


def test_logged_values_reach_the_run_file_report_plot_and_metrics(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    val = {}
    with sw.observe(model, opt, every=4, sinks=[sw.sinks.RunFile(tmp_path / "run.jsonl")]) as watch:
        for step in range(10):
            loss = _train_step(model, opt, step)
            if step % 3 == 0:  # a validation loss every third step, a tensor; a custom value every step
                with torch.no_grad():
                    x, y = _batch(1000 + step)
                    val[step] = nn.functional.cross_entropy(model(x), y)
                watch.log(val_loss=val[step])
            watch.log({"grad/clip fraction": step / 10})
            watch.step(loss=loss)
        watch.flush()
        served = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in watch.snapshot()}
    run = read_run(tmp_path)
    assert [r.step for r in run.records] == list(range(10))
    for r in run.records:
        assert r.scalars["log/grad/clip fraction"] == r.step / 10
        if r.step in val:
            assert r.scalars["log/val_loss"] == val[r.step].item()
        else:
            assert "log/val_loss" not in r.scalars  # (a step without a value has none: no carry-over)
    assert served[("streamwatch_logged_val_loss", ())] == pytest.approx(val[9].item(), rel=1e-7)
    assert served[("streamwatch_logged_grad_clip_fraction", ())] == 0.9
    text = report(run)
    assert f"last val_loss: {val[9].item():.6g} (step 9)" in text
    assert "last grad/clip fraction: 0.9 (step 9)" in text
    s = series(run)
    assert s["logged"]["val_loss"][9] == val[9].item()
    assert math.isnan(s["logged"]["val_loss"][8])


def test_a_trainers_well_known_name_keeps_its_family() -> None:
    with sw.observe(_model(), every=1) as watch:
        watch.log(eval_loss=0.25)
        watch.step(loss=0.5)
        watch.flush()
        samples = {(s.name, s.labels.get("phase")): s.value for s in watch.snapshot()}
    assert samples[("streamwatch_loss", "eval")] == 0.25
    assert samples[("streamwatch_loss", "train")] == 0.5


@pytest.mark.parametrize(
    ("values", "error", "match"),
    [
        ({"tokens_total": 1.0}, ValueError, "metric names.*'tokens_total'"),
        ({"": 1.0}, ValueError, "metric names"),
        ({"a": "high"}, TypeError, "'a' to be a real number.*'high'"),
        ({"a": None}, TypeError, "'a' to be a real number"),
        ({"a": torch.ones(2)}, ValueError, r"'a'.*shape \[2\]"),
        ({"a": torch.tensor(1 + 2j)}, ValueError, "'a'.*complex"),
    ],
)
def test_a_bad_name_or_value_is_refused_with_a_clear_error(
    values: dict[str, object], error: type[Exception], match: str
) -> None:
    records = sw.sinks.collect()
    with sw.observe(_model(), every=1, sinks=[records]) as watch:
        with pytest.raises(error, match=match):
            watch.log(values)
        watch.step(loss=0.5)  # (training goes on; nothing of the refused call is recorded)
    assert not [name for r in records.items for name in r.scalars if name.startswith("log/")]


def test_a_non_string_name_is_a_type_error() -> None:
    with sw.observe(_model(), every=1) as watch, pytest.raises(TypeError, match="metric names"):
        watch.log({3: 1.0})


def test_non_finite_values_are_recorded_as_they_are() -> None:
    records = sw.sinks.collect()
    with sw.observe(_model(), every=1, sinks=[records]) as watch:
        watch.log(a=math.nan, b=torch.tensor(math.inf))
        watch.step(loss=0.5)
    (first, *_) = records.items
    assert math.isnan(first.scalars["log/a"])
    assert first.scalars["log/b"] == math.inf


def test_past_the_cap_new_names_are_refused_counted_and_warned_once() -> None:
    records = sw.sinks.collect()
    with sw.observe(_model(), every=1, sinks=[records]) as watch:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            watch.log({f"v{i}": float(i) for i in range(LOG_CAP + 3)})
            watch.step(loss=0.5)
            watch.log(v0=1.0, extra=2.0)  # a known name is kept; a new one is refused, not warned again
            watch.step(loss=0.5)
        told = [str(w.message) for w in caught if "distinct names" in str(w.message)]
        assert len(told) == 1
        assert f"at most {LOG_CAP} distinct names" in told[0]
        assert watch.statistics().log_refused == 4
    first, second = records.items[:2]
    assert sorted(n for n in first.scalars if n.startswith("log/")) == sorted(
        f"log/v{i}" for i in range(LOG_CAP)
    )
    assert second.scalars["log/v0"] == 1.0
    assert "log/extra" not in second.scalars


def test_values_logged_after_the_last_step_are_warned_about_at_close() -> None:
    watch = sw.observe(_model(), every=1)
    watch.step(loss=0.5)
    watch.log(late=1.0)
    with pytest.warns(RuntimeWarning, match=r"\['late'\] were given after the last watch.step"):
        watch.close()


def test_a_later_value_of_a_name_in_one_step_replaces_the_earlier() -> None:
    records = sw.sinks.collect()
    with sw.observe(_model(), every=1, sinks=[records]) as watch:
        watch.log(a=1.0)
        watch.log(a=2.0)
        watch.step(loss=0.5)
    assert records.items[0].scalars["log/a"] == 2.0


# -- detectors ------------------------------------------------------------------------------------------


def _spikes(every: int, losses: list[float]) -> dict[str, float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with sw.observe(_model(), every=every, overflow="block") as watch:  # (a fast loop: drop nothing)
            for value in losses:
                watch.step(loss=value)
    # after close(): the last steps ride with its final record (until then they wait in the step log)
    wanted = ("streamwatch_loss_zscore", "streamwatch_loss_spikes")
    return {s.name: s.value for s in watch.snapshot() if s.name in wanted}


def test_the_loss_spike_detector_judges_every_step_sampled_or_not() -> None:
    """A spike on an unsampled step is seen: the detector folds the steps a record carries, so its
    z-score and count at ``every=25`` are those of ``every=1`` on the same losses."""
    g = torch.Generator().manual_seed(0)
    losses = (2.0 + 0.01 * torch.randn(120, generator=g, dtype=torch.float64)).tolist()
    losses[61] = 5.0  # not a sampled step at every=25
    every_step = _spikes(1, losses)
    sparse = _spikes(25, losses)
    assert every_step["streamwatch_loss_spikes"] == 1.0
    assert sparse == every_step
