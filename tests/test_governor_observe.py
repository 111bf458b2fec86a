"""``observe(..., overhead=x)``: the overhead governor wired into a real Watch on real torch training.

Two sorts of test. The deterministic ones replace the governor's clock
(``streamwatch._observe._governor_clock``, the documented seam) with a :class:`FakeClock` advanced by
made-up step times, and drive a reference :class:`Governor` with the same times: the Watch must sample
exactly the steps the reference samples. The others run on the real clock and assert structure only
(which steps have records, what they hold, that the statistics are consistent), never speed: the
machine is noisy.
"""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from torch import nn

import streamwatch as sw
from streamwatch import _allowance, _boundary, _observe
from streamwatch._governor import Governor
from streamwatch._live import LiveView, format_percent
from streamwatch.testing import FakeClock
from tests.promtool import check_metrics

BUDGET = 0.05
PLAIN = 0.010  # fake seconds per plain step
COST = 0.5  # a sampled step takes 1 + COST plain steps: the governor settles at ceil(COST / BUDGET) = 10


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))


def _batches(n: int, seed: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> tuple:
    out = model(x)
    loss = F.cross_entropy(out, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss, out


def _kinds(record: sw.StepRecord) -> set[str]:
    return {key.kind for key in record.keys}


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    clock = FakeClock()
    monkeypatch.setattr(_observe, "_governor_clock", clock)
    return clock


# -- deterministic: the fake clock -------------------------------------------------------------------------


def test_the_watch_samples_exactly_the_steps_its_governor_chooses(fake_clock: FakeClock) -> None:
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    reference_clock = FakeClock()
    reference = Governor(BUDGET, clock=reference_clock)
    records = sw.sinks.collect()
    chosen: list[int] = []
    steps = 400
    with sw.observe(model, opt, overhead=BUDGET, sinks=[records]) as watch:
        for step, (x, y) in enumerate(_batches(steps)):
            sampled = reference.sampling
            if sampled:
                chosen.append(step)
            loss, out = _train_step(model, opt, x, y)
            seconds = PLAIN * (1 + COST) if sampled else PLAIN
            fake_clock.advance(seconds)
            reference_clock.advance(seconds)
            watch.step(loss=loss, outputs=out, targets=y, batch_size=12)
            reference.tick()
        assert watch.flush()
        stats = watch.statistics()
    # records arrive for the sampled steps only, and for every one of them (then close()'s final record)
    assert [r.step for r in records.items] == [*chosen, steps - 1]
    assert stats.steps == steps
    assert stats.sampled == len(chosen) == stats.records_received
    assert chosen[:3] == [0, 3, 6]  # the first step, then the calibration interval of 3
    # the statistics are the governor's: settled at ceil(COST / BUDGET), measured cost on budget
    assert stats.sampling_interval == reference.interval == math.ceil(COST / BUDGET)
    assert stats.overhead_ratio == reference.overhead_ratio
    assert stats.overhead_ratio == pytest.approx(BUDGET)
    assert stats.overhead_budget == BUDGET
    assert len(chosen) >= 30
    # the cadence counts sampled steps: weights and updates on every 10th sampled step, the rest on each
    assert not records.items[-1].keys  # close()'s final record: the last step's scalars
    for k, record in enumerate(records.items[:-1]):
        heavy = k % 10 == 0
        assert _kinds(record) == {"activation", "output_grad", "param_grad"} | (
            {"param", "update"} if heavy else set()
        ), (k, record.step)
        assert record.scalars["loss"] > 0
        assert record.scalars["batch_size"] == 12


def test_a_custom_cadence_and_opt_in_metrics_count_sampled_steps(fake_clock: FakeClock) -> None:
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    records = sw.sinks.collect()
    pnorm = sw.metrics.PNorm(p=1.0, kinds=("param_grad",), every=3)
    with sw.observe(
        model,
        opt,
        overhead=BUDGET,
        cadence={"param": 2, "output_grad": 4},
        metrics=[*sw.DEFAULT_METRICS, pnorm],
        sinks=[records],
    ) as watch:
        for x, y in _batches(200):
            sampled = watch._governor is not None and watch._governor.sampling
            loss, _out = _train_step(model, opt, x, y)
            fake_clock.advance(PLAIN * (1 + COST) if sampled else PLAIN)
            watch.step(loss=loss)
    assert len(records.items) >= 15
    assert not records.items[-1].keys  # close()'s final record: the last step's scalars
    for k, record in enumerate(records.items[:-1]):
        kinds = _kinds(record)
        assert ("param" in kinds) == (k % 2 == 0), k
        assert ("output_grad" in kinds) == (k % 4 == 0), k
        assert ("update" in kinds) == (k % 10 == 0), k
        norms = [value for (key, stat), value in record.extras.items() if stat == "norm_p1"]
        assert bool(norms) == (k % 3 == 0), k


def test_a_failed_step_still_ticks_the_governor(fake_clock: FakeClock) -> None:
    model = _model()
    with sw.observe(model, overhead=BUDGET) as watch:
        for i, (x, _) in enumerate(_batches(20)):
            model(x).sum().backward()
            fake_clock.advance(PLAIN)
            if i == 7:
                with pytest.raises(ValueError, match="batch_size"):
                    watch.step(batch_size=-1)
            else:
                watch.step()
        governor = watch._governor
        assert governor is not None
        assert governor.statistics().steps == watch.statistics().steps == 20
        assert watch.statistics().failed_steps == 1


# -- real clock: structure only ----------------------------------------------------------------------------


def test_real_training_under_a_budget() -> None:
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    records = sw.sinks.collect()
    chosen: list[int] = []
    with sw.observe(model, opt, overhead=BUDGET, sinks=[records]) as watch:
        governor = watch._governor
        assert governor is not None
        for step, (x, y) in enumerate(_batches(300)):
            if governor.sampling:
                chosen.append(step)
            loss, out = _train_step(model, opt, x, y)
            watch.step(loss=loss, outputs=out, targets=y, batch_size=12)
        assert watch.flush()
        stats = watch.statistics()
        assert stats.sampling_interval == governor.interval >= 1
        assert stats.overhead_ratio is not None
        assert math.isfinite(stats.overhead_ratio)
        assert stats.overhead_ratio >= 0
        assert stats.overhead_ratio == governor.overhead_ratio
    # (a slow machine adds scalar records, without rows, between sampled steps: SCALAR_SECONDS)
    assert [r.step for r in records.items if r.keys] == chosen
    assert chosen[0] == 0
    assert stats.sampled == len(chosen) == stats.records_received - stats.scalar_records
    assert stats.hook_errors == 0
    assert stats.pipeline_failures == 0
    for k, record in enumerate(r for r in records.items if r.keys):
        assert ("param" in _kinds(record)) == (k % 10 == 0), k
    assert "overhead=0.05" in repr(watch)


def test_training_is_bit_identical_with_and_without_a_governor() -> None:
    def train(overhead: float | None) -> list[torch.Tensor]:
        torch.manual_seed(0)  # dropout and the data draw from the global generator
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        watch = sw.observe(model, opt, overhead=overhead) if overhead is not None else None
        for _ in range(120):
            x, y = torch.randn(12, 6), torch.randint(0, 3, (12,))
            loss, out = _train_step(model, opt, x, y)
            if watch is not None:
                watch.step(loss=loss, outputs=out, targets=y)
        if watch is not None:
            assert watch.statistics().sampled >= 2
            watch.close()
        return [p.detach().clone() for p in model.parameters()]

    plain, governed = train(None), train(BUDGET)
    assert all(torch.equal(a, b) for a, b in zip(plain, governed, strict=True))


def test_metrics_serve_both_gauges_and_promtool_accepts_them() -> None:
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with sw.observe(model, opt, overhead=BUDGET) as watch:
        exporter = watch.expose(port=0, run="governed")
        for x, y in _batches(150):
            loss, _ = _train_step(model, opt, x, y)
            watch.step(loss=loss)
        assert watch.flush()
        stats = watch.statistics()
        body = urllib.request.urlopen(exporter.url, timeout=10).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(body)}
    for name in ("streamwatch_sampling_interval", "streamwatch_overhead_ratio"):
        assert families[name].type == "gauge"
        (sample,) = families[name].samples
        assert sample.labels["run"] == "governed"
    assert families["streamwatch_sampling_interval"].samples[0].value == stats.sampling_interval
    assert stats.overhead_ratio is not None
    assert families["streamwatch_overhead_ratio"].samples[0].value == pytest.approx(stats.overhead_ratio)
    check_metrics(body)


def test_a_fixed_interval_serves_it_and_no_overhead_ratio() -> None:
    model = _model()
    with sw.observe(model, every=4) as watch:
        exporter = watch.expose(port=0)
        for x, _ in _batches(9):
            model(x).sum().backward()
            watch.step()
        assert watch.flush()
        stats = watch.statistics()
        body = urllib.request.urlopen(exporter.url, timeout=10).read().decode()
    assert (stats.sampling_interval, stats.overhead_ratio, stats.overhead_budget) == (4, None, None)
    assert stats.sampled == 3  # steps 0, 4, 8
    families = {f.name: f for f in text_string_to_metric_families(body)}
    assert families["streamwatch_sampling_interval"].samples[0].value == 4
    assert "streamwatch_overhead_ratio" not in families


def test_the_live_view_shows_the_interval_and_the_measured_overhead(fake_clock: FakeClock) -> None:
    model = _model()
    with sw.observe(model, overhead=BUDGET) as watch:
        for x, _ in _batches(3):  # too few steps to measure: the ratio is still unknown
            model(x).sum().backward()
            fake_clock.advance(PLAIN)
            watch.step()
        console = Console(width=120, record=True, force_terminal=False)
        console.print(LiveView(watch, total_steps=10).render(3))
        early = console.export_text()
        for x, _ in _batches(300):
            sampled = watch._governor is not None and watch._governor.sampling
            model(x).sum().backward()
            fake_clock.advance(PLAIN * (1 + COST) if sampled else PLAIN)
            watch.step()
        stats = watch.statistics()
        console = Console(width=120, record=True, force_terminal=False)
        console.print(LiveView(watch, total_steps=303).render(303))
        late = console.export_text()
    assert "sampled 1 step in 3 (measured overhead —, budget 5.0%)" in early
    assert stats.overhead_ratio is not None
    assert (
        f"sampled 1 step in {stats.sampling_interval} "
        f"(measured overhead {format_percent(stats.overhead_ratio)}, budget 5.0%)"
    ) in late
    with sw.observe(_model(), every=7) as watch:
        console = Console(width=120, record=True, force_terminal=False)
        console.print(LiveView(watch, total_steps=10).render(0))
    text = console.export_text()
    assert "sampled 1 step in 7" in text
    assert "budget" not in text


# -- what observe() refuses ----------------------------------------------------------------------------------


def test_every_and_overhead_together_are_refused_naming_both() -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"`every`.*`overhead`.*pass one: every= fixes the interval"):
        sw.observe(model, every=10, overhead=BUDGET)
    with pytest.raises(ValueError, match=r"`every`.*`overhead`"):
        sw.observe(model, every=1, overhead=BUDGET)
    sw.observe(model, overhead=BUDGET).close()  # nothing was attached: the model can be observed


@pytest.mark.parametrize("overhead", [0, 1, 1.5, -0.01, math.nan, math.inf, True, "0.05", [0.05]])
def test_a_bad_overhead_is_refused_naming_it(overhead: object) -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"Expected `overhead` to be a number in \(0, 1\)"):
        sw.observe(model, overhead=overhead)  # type: ignore[arg-type]
    sw.observe(model, every=1).close()


def test_a_metric_that_prepares_the_step_before_is_refused_under_a_governor() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for metric in (sw.metrics.GradientCosine(), sw.metrics.GradientCosine(of="update", every=2)):
        with pytest.raises(
            ValueError, match=r"GradientCosine\(every=\d\).*Pass every=N \(a fixed interval\)"
        ):
            sw.observe(model, opt, overhead=BUDGET, metrics=[*sw.DEFAULT_METRICS, metric])
        assert metric.binding is None
    # with a fixed interval it is fine, and the model was left free
    with sw.observe(model, opt, every=2, metrics=[sw.metrics.GradientCosine()]) as watch:
        for x, y in _batches(4):
            loss, _ = _train_step(model, opt, x, y)
            watch.step(loss=loss)


# -- the default, and the scalar records between sampled steps ---------------------------------------------


def test_the_default_is_the_governor_at_two_percent_and_every_turns_it_off() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    assert sw.DEFAULT_OVERHEAD == 0.02
    with sw.observe(model, opt) as watch:
        stats = watch.statistics()
        assert stats.overhead_budget == sw.DEFAULT_OVERHEAD
        assert stats.sampling_interval == 3  # calibrating: sampled, its shadow, a clean step
    with sw.observe(model, opt, every=1) as watch:
        assert watch.statistics().overhead_budget is None
        assert watch.statistics().sampling_interval == 1
    with pytest.raises(ValueError, match=r"GradientCosine.*observe\(\)'s default.*Pass every=N"):
        sw.observe(model, opt, metrics=[*sw.DEFAULT_METRICS, sw.metrics.GradientCosine()])


def test_unsampled_steps_send_scalar_records_with_the_cheap_values(
    fake_clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``SCALAR_SECONDS`` at 0 every unsampled step sends a scalar record: no rows, and the loss,
    learning rate, step time, throughput and accuracy of that step, each checked against torch."""
    monkeypatch.setattr(_boundary, "SCALAR_SECONDS", 0.0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    records = sw.sinks.collect()
    expected: list[tuple[float, float, int]] = []
    with sw.observe(model, opt, overhead=BUDGET, sinks=[records]) as watch:
        governor = watch._governor
        assert governor is not None
        for x, y in _batches(40):
            fake_clock.advance(PLAIN * (1 + COST) if governor.sampling else PLAIN)
            loss, out = _train_step(model, opt, x, y)
            correct = int((out.argmax(1) == y).sum())
            expected.append((loss.item(), correct, len(y)))
            watch.step(loss=loss, outputs=out, targets=y, batch_size=len(y))
        watch.flush()
        stats = watch.statistics()
    assert [r.step for r in records.items] == list(range(40))  # a record for every step
    scalar = [r for r in records.items if not r.keys]
    full = [r for r in records.items if r.keys]
    assert len(full) == stats.sampled
    assert len(scalar) == 40 - stats.sampled > 0
    for record in records.items:
        loss, correct, n = expected[record.step]
        assert record.scalars["loss"] == pytest.approx(loss, rel=1e-6)
        assert record.scalars["lr/0"] == 0.05
        assert record.scalars["batch_size"] == n
        assert record.scalars["correct"] == correct
        assert record.scalars["total"] == n
        assert record.scalars["samples_per_second"] == pytest.approx(n / record.scalars["step_seconds"])
        assert record.scalars["step_seconds"] > 0
    for record in scalar:  # the step's parts are timed on sampled steps only
        assert not any(name.startswith("part/") for name in record.scalars)


def test_a_scalar_record_leaves_the_layer_series_and_updates_the_loss(
    fake_clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    records = sw.sinks.collect()
    with sw.observe(model, opt, overhead=BUDGET, sinks=[records]) as watch:
        for x, y in _batches(2):  # step 0 sampled, step 1 not (and no scalar record: < 1 s)
            fake_clock.advance(PLAIN)
            loss, _ = _train_step(model, opt, x, y)
            watch.step(loss=loss)
        watch.flush()
        before = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in watch.snapshot()}
        assert not watch._boundary._sampling_now
        monkeypatch.setattr(_boundary, "SCALAR_SECONDS", 0.0)
        x, y = next(_batches(1, seed=7))
        loss, _ = _train_step(model, opt, x, y)
        watch.step(loss=loss)  # unsampled: a scalar record
        watch.flush()
        after = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in watch.snapshot()}
    layer = {key: value for key, value in before.items() if "layer" in dict(key[1])}
    assert layer
    assert all(after[key] == value or math.isnan(value) for key, value in layer.items())
    losses = [value for (name, _), value in after.items() if name == "streamwatch_loss"]

    assert losses == [pytest.approx(loss.item(), rel=1e-6)]


def test_escalated_steps_are_forced_samples_the_governor_does_not_measure(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A non-finite loss escalates: the next ``escalate`` steps are sampled in full whatever the governor
    said. Each of those steps ends with ``tick(forced=True)`` (their times measure nothing: the
    governor's own tests show what that keeps), and every other step with ``forced=False``."""
    seen: list[bool] = []
    tick = Governor.tick

    def spy(self: Governor, own: float = 0.0, forced: bool = False, at: float | None = None) -> bool:
        seen.append(forced)
        return tick(self, own, forced, at)

    monkeypatch.setattr(Governor, "tick", spy)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with sw.observe(model, opt, escalate=3, on_nonfinite="warn") as watch:
        for step, (x, y) in enumerate(_batches(12)):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            watch.step(loss=loss * math.nan if step == 5 else loss)
    assert watch.statistics().escalations == 1
    assert "for the next 3 steps" in caplog.text
    assert [i for i, forced in enumerate(seen) if forced] == [6, 7, 8]  # the steps after the trip


def test_evaluation_passes_between_sampled_steps_spend_their_share_of_the_budget(
    fake_clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loop with evaluation passes on every step (a reinforcement-learning loop generating with its
    policy) paid for all of them on every step, which the governor could not sample away. Under the
    governor each pass between sampled steps is granted on its own while the allowance
    (``_allowance``) is not spent, and charged what it took: here the allowance holds almost nothing
    (``WINDOW_SECONDS`` made tiny) and refills by 10 µs a step on the fake clock (a 0.2 % budget's half of
    a 10 ms step), so an unsampled step summarises its first pass at most and skips the others, each
    counted. A sampled step's hooks are in: its four passes are summarised. Every evaluation row equals
    torch's reference of the passes it covers."""
    monkeypatch.setattr(_allowance, "WINDOW_SECONDS", 1e-6)
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    records = sw.sinks.collect()
    outputs: dict[int, list[torch.Tensor]] = {}  # layer 0's output of each evaluation pass, by step
    steps, budget = 400, 0.002
    reference_clock = FakeClock()
    reference = Governor(budget, clock=reference_clock)  # (which steps the watch samples)
    with sw.observe(model, opt, overhead=budget, sinks=[records]) as watch:
        for step, (x, y) in enumerate(_batches(steps)):
            seconds = PLAIN * (1 + COST) if reference.sampling else PLAIN
            model.eval()
            with torch.no_grad():
                outputs[step] = [F.linear(x + j, model[0].weight, model[0].bias) for j in range(4)]
                for j in range(4):
                    model(x + j)
            model.train()
            loss, _ = _train_step(model, opt, x, y)
            fake_clock.advance(seconds)
            reference_clock.advance(seconds)
            watch.step(loss=loss)
            reference.tick()
        assert watch.flush()
        stats = watch.statistics()
    key = sw.SeriesKey("eval", "0", "activation", "")
    covered = {}  # step -> (passes its record covers, whether it was sampled)
    for record in records.items:
        if key in record.keys:
            row, per_pass = record.keys.index(key), outputs[record.step][0].numel()
            passes = int(record.column("count")[row]) // per_pass
            reference_rows = torch.cat(outputs[record.step][:passes]).double()  # (the first ones)
            assert record.column("count")[row] == passes * per_pass
            assert record.column("sum")[row] == pytest.approx(float(reference_rows.sum()), rel=1e-6)
            assert record.column("max")[row] == pytest.approx(float(reference_rows.max()), rel=1e-6)
            covered[record.step] = (passes, bool(record.rows(phase="train")))
    sampled = [step for step, (_, train) in covered.items() if train]
    granted = [step for step, (_, train) in covered.items() if not train]
    assert sampled, covered
    assert all(covered[step][0] == 4 for step in sampled), covered
    assert len(granted) >= 2, covered  # (the first unsampled step, and after refills)
    assert all(covered[step][0] == 1 for step in granted), covered
    # every step's passes: recorded, skipped (each counted), or run in a dark pair (no hook: each counted)
    skipped_steps = steps - len(covered) - stats.dark_steps
    assert skipped_steps > 0, (covered, stats.dark_steps)  # (10 µs a step refills less than a pass)
    assert stats.dark_steps > 0
    assert stats.skipped == {
        "eval_budget": 3 * len(granted) + 4 * skipped_steps,
        "dark_step": 4 * stats.dark_steps,
    }
