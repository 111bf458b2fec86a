"""The series store: what everything after the channel reads. It keeps the latest values of a real run
(equal to ``snapshot()``), runs the worker-side metrics chosen in ``observe(metrics=...)`` (checked
against plain torch), carries histogram edges from the records (and the run file), stops only a metric
that fails, and is read through a public protocol that a test double can implement."""

from __future__ import annotations

import ast
import math
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString
from torch import nn

import streamwatch as sw
from streamwatch import Sample, SeriesKey, SeriesStore, StepRecord, WatchStatistics, testing
from streamwatch._summary import COLUMNS
from streamwatch.metrics._derived import DERIVED
from streamwatch.sinks import RunFile, read_run
from streamwatch.sinks._prometheus import format_float
from tests.training import layer_mean_reference

PACKAGE = Path(sw.__file__).parent


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(
    watch: sw.Watch, model: nn.Module, opt: torch.optim.Optimizer, steps: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Train ``steps`` steps; returns each parameter's (weights after, update) of the last step."""
    g = torch.Generator().manual_seed(0)
    last: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for _ in range(steps):
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        watch.step(loss=loss)
        last = {name: (p.detach().clone(), p.detach() - before[name]) for name, p in model.named_parameters()}
    assert watch.flush()
    return last


def test_a_store_fed_the_records_serves_what_snapshot_serves() -> None:
    model, opt = _model()
    records = sw.sinks.collect()
    # detectors=(): the store alone runs no detector (streamwatch.detectors.pipelines adds them)
    with sw.observe(
        model, opt, sinks=[records], cadence={"param": 1, "update": 1}, detectors=(), every=1
    ) as watch:
        _train(watch, model, opt, 3)
        snapshot = watch.snapshot()
    store = SeriesStore()
    for record in records.items:
        store.send(record)

    def keyed(samples: list[Sample]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}

    assert keyed(store.samples()) == keyed(snapshot)
    assert store.step == watch.store.step == 2
    table, keys = store.table()
    assert keys == list(records.items[-1].keys)
    np.testing.assert_array_equal(table, records.items[-1].table)


def test_update_ratio_and_layer_mean_match_plain_torch() -> None:
    model, opt = _model()
    with sw.observe(model, opt, cadence={"param": 1, "update": 1}, every=1) as watch:
        last = _train(watch, model, opt, 2)
        samples = watch.store.samples()
    ratios = {
        (s.labels["layer"], s.labels["param"]): s.value
        for s in samples
        if s.name == "streamwatch_tensor" and s.labels["stat"] == "update_ratio"
    }
    assert len(ratios) == 4
    for name, (weights, update) in last.items():
        layer, param = name.split(".")
        want = float(update.double().norm() / weights.double().norm())
        assert ratios[(layer, param)] == pytest.approx(want, rel=1e-4)
    means = {
        (s.labels["kind"], s.labels["stat"]): s.value for s in samples if s.name == "streamwatch_layer_mean"
    }
    by_layer: dict[str, list[torch.Tensor]] = {}
    for name, (weights, _) in last.items():  # a layer's weight and bias are one layer's parameters
        by_layer.setdefault(name.split(".")[0], []).append(weights.double().flatten())
    assert len(by_layer) == 2
    assert all(len(tensors) == 2 for tensors in by_layer.values())
    for stat, value in layer_mean_reference([torch.cat(tensors) for tensors in by_layer.values()]).items():
        assert means[("param", stat)] == pytest.approx(value, rel=1e-6), stat


@pytest.mark.parametrize(
    ("metrics", "present", "absent"),
    [
        ((), set(), {"update_ratio", "layer_mean"}),
        (("layer_mean",), {"layer_mean"}, {"update_ratio"}),
        (("update_ratio",), {"update_ratio"}, {"layer_mean"}),
    ],
    ids=["none", "layer_mean", "update_ratio"],
)
def test_the_store_runs_only_the_metrics_selected(
    metrics: tuple[str, ...], present: set[str], absent: set[str]
) -> None:
    model, opt = _model()
    with sw.observe(model, opt, metrics=metrics, cadence={"param": 1, "update": 1}, every=1) as watch:
        _train(watch, model, opt, 1)
        samples = watch.snapshot()
    assert watch.store.metrics == metrics
    found = {"layer_mean" for s in samples if s.name == "streamwatch_layer_mean"} | {
        "update_ratio" for s in samples if s.labels.get("stat") == "update_ratio"
    }
    assert present <= found
    assert not absent & found


def test_an_unknown_metric_name_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"^Unknown metric 'ratio': the names are \['layer_mean', 'update_ratio'\]$"
    ):
        SeriesStore(metrics=["ratio"])


def _train_then_one_more(watch: sw.Watch, model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    """``steps`` steps (ending with ``flush()``), then one more: what the worker met is surfaced by then."""
    _train(watch, model, opt, steps)
    _train(watch, model, opt, 1)


def test_a_failing_metric_stops_only_itself_and_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(record: StepRecord) -> list[Sample]:
        raise ZeroDivisionError("boom")

    monkeypatch.setitem(DERIVED, "boom", boom)
    model, opt = _model()
    watch = sw.observe(model, opt, metrics=["boom", "layer_mean"], every=1)
    try:
        # warned once, at a step after the worker met the failure: at the latest the step after flush()
        with pytest.warns(RuntimeWarning, match="boom"):
            _train_then_one_more(watch, model, opt, 3)
        assert watch.statistics().pipeline_failures == 1
        samples = watch.snapshot()
        assert any(s.name == "streamwatch_layer_mean" for s in samples)  # the other metric goes on
        assert watch.store.step == 3  # the values go on
    finally:
        with pytest.raises(sw.PipelineError, match="boom"):
            watch.close()


def _layout_record(step: int, layers: tuple[str, ...], rng: np.random.Generator) -> StepRecord:
    """A record whose rows are ``layers``' weights and updates (so both metrics have work), random values."""
    kinds = ("param", "update")
    keys = tuple(SeriesKey("train", layer, kind, "weight") for layer in layers for kind in kinds)
    random = {name: rng.uniform(0.5, 2.0, len(keys)) for name in COLUMNS}  # every column random ...
    table = testing.table(**{**random, "count": rng.integers(1, 50, len(keys))})  # ... counts whole
    return StepRecord(step, 0.0, 0, keys, table, {"loss": float(step)})


@pytest.mark.parametrize("layouts", [2, 11], ids=["few", "more-than-held"])
def test_reading_later_sees_what_applying_every_record_at_once_would(layouts: int) -> None:
    # Layouts that overlap and come back: the latest row of a key wins, whichever layout brought it;
    # the metrics' values are those of each group's latest record. Reference: plain dicts, each record
    # applied in turn, the metrics called on it directly.
    rng = np.random.default_rng(0)
    layers = [f"l{i}" for i in range(layouts + 1)]
    shapes = [(layers[i % layouts], layers[(i % layouts) + 1]) for i in range(3 * layouts + 1)]
    records = [_layout_record(step, shape, rng) for step, shape in enumerate(shapes)]
    store = SeriesStore()
    rows: dict[SeriesKey, np.ndarray] = {}
    derived: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for i, record in enumerate(records):
        store.send(record)
        for key, row in zip(record.keys, record.table, strict=True):
            rows[key] = row
        for metric in (DERIVED["update_ratio"], DERIVED["layer_mean"]):
            for sample in metric(record):
                derived[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        if i % 4 == 3:  # read now and then, as a scrape does
            table, keys = store.table()
            assert {k: tuple(r) for k, r in zip(keys, table, strict=True)} == {
                k: tuple(r) for k, r in rows.items()
            }
    table, keys = store.table()
    assert {k: tuple(r) for k, r in zip(keys, table, strict=True)} == {k: tuple(r) for k, r in rows.items()}
    served = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for s in store.samples(table_rows=False)
        if s.name == "streamwatch_layer_mean" or s.labels.get("stat") == "update_ratio"
    }
    assert served == derived
    assert len(derived) > 6  # both metrics, several groups and parameters
    assert store.records == len(records)
    assert store.step == len(records) - 1


def test_reading_the_store_does_not_change_its_version() -> None:
    # the exporter re-renders only when the version changes: applying the metrics on a read must not
    store = SeriesStore()
    store.send(_layout_record(0, ("a", "b"), np.random.default_rng(1)))
    version = store.version()
    assert store.samples()
    assert store.table()[1]
    assert store.version() == version
    store.send(_layout_record(1, ("a", "b"), np.random.default_rng(2)))
    assert store.version() != version


def test_a_state_handed_over_is_published_once_when_the_store_is_read() -> None:
    made: list[int] = []

    def publish(n: int) -> list[Sample]:
        made.append(n)
        return [Sample("streamwatch_seen", {"by": "count"}, float(n))]

    store = SeriesStore(metrics=())
    before = store.version()
    for n in range(1, 6):
        assert store.later("seen", publish, n)
    assert store.version() != before  # readers see a change ...
    assert made == []  # ... but nothing was made yet: only the latest state is kept
    assert [s.value for s in store.samples() if s.name == "streamwatch_seen"] == [5.0]
    assert made == [5]
    store.samples()
    assert made == [5]  # nothing new: nothing made again, the value stays
    assert [s.value for s in store.samples() if s.name == "streamwatch_seen"] == [5.0]


def test_a_publisher_that_raises_is_stopped_listed_once_and_the_rest_go_on() -> None:
    def broken(state: int) -> list[Sample]:
        raise ValueError(f"bad state {state}")

    store = SeriesStore(metrics=())
    assert store.later("broken", broken, 1)
    assert store.later("fine", lambda n: [Sample("streamwatch_fine", {}, float(n))], 2)
    assert [s.value for s in store.samples() if s.name == "streamwatch_fine"] == [2.0]
    assert [(where, str(exc)) for where, exc in store.failures] == [
        ("SeriesStore publishing 'broken'", "bad state 1")
    ]
    assert not store.later("broken", broken, 2)  # refused from now on
    store.samples()
    assert len(store.failures) == 1


def test_records_and_the_run_file_carry_histogram_edges(tmp_path: Path) -> None:
    model, opt = _model()
    buckets = sw.metrics.Buckets(lo=-3, hi=1, per_decade=1)
    metric = sw.metrics.Histogram(kinds=("activation", "param_grad"), buckets=buckets)
    records = sw.sinks.collect()
    path = tmp_path / "run.jsonl"
    with sw.observe(model, opt, metrics=[metric], sinks=[records, RunFile(path)], every=1) as watch:
        _train(watch, model, opt, 2)
    bounds = tuple(buckets.upper_bounds())
    assert all(dict(r.edges) == {"activation": bounds, "param_grad": bounds} for r in records.items)
    assert dict(watch.store.edges) == {"activation": bounds, "param_grad": bounds}
    run = read_run(path)
    assert [dict(r.edges) for r in run.records] == [dict(r.edges) for r in records.items]
    assert set(run.header["edges"]) == {"activation", "param_grad"}
    store = SeriesStore()
    for record in run.records:
        store.send(record)
    assert store.edges == watch.store.edges


def test_appending_a_run_with_other_buckets_declares_the_new_edges(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    key = SeriesKey("train", "fc", "activation", "")
    row = testing.table(count=2, sumsq=2, min=-1, max=1, fill=0.0)
    first = {"activation": (-1.0, 0.0, 1.0, math.inf)}
    second = {"activation": (-10.0, 0.0, 10.0, math.inf)}
    sink = RunFile(path)
    sink.send(StepRecord(0, 0.0, 0, (key,), row, edges=first))
    sink.close()
    sink = RunFile(path)
    sink.send(StepRecord(1, 0.0, 0, (key,), row, edges=second))
    sink.send(StepRecord(2, 0.0, 0, (key,), row, edges=second))
    sink.close()
    assert sum('{"edges"' in line for line in path.read_text().splitlines()) == 1
    assert [dict(r.edges) for r in read_run(path).records] == [first, second, second]


class _Fixed:
    """A test double of the read protocol: one layer's row, fixed forever."""

    def __init__(self) -> None:
        self.key = SeriesKey("train", "fc", "activation", "")

    @property
    def step(self) -> int | None:
        return 7

    @property
    def edges(self) -> dict[str, tuple[float, ...]]:
        return {}

    def samples(self, table_rows: bool = True) -> list[Sample]:
        out = [Sample("streamwatch_loss", {"phase": "train"}, 0.5), Sample("streamwatch_step", {}, 7.0)]
        if table_rows:
            out.append(Sample("streamwatch_tensor", {**self.key.labels(), "stat": "max"}, 2.0))
        return out

    def table(self) -> tuple[np.ndarray, list[SeriesKey]]:
        return testing.table(count=4, sum=2.0, sumsq=6.0, min=-1.0, max=2.0, zeros=1, fill=0.0), [self.key]

    def version(self) -> object:
        return 1


def test_the_exporter_serves_anything_with_the_read_protocol() -> None:
    source = _Fixed()
    assert isinstance(source, sw.SeriesSource)
    exporter = sw.sinks.Exporter(source, lambda: WatchStatistics.replayed(1), port=0, run="double")
    try:
        body = urllib.request.urlopen(exporter.url, timeout=10).read().decode()
    finally:
        exporter.close()
    samples = {
        s.name: s.value
        for f in text_string_to_metric_families(body)
        for s in f.samples
        if s.labels.get("run") == "double"
    }
    assert samples["streamwatch_tensor_max"] == 2.0  # one family per statistic
    assert samples["streamwatch_tensor_l2"] == math.sqrt(6.0)
    assert samples["streamwatch_loss"] == 0.5
    assert samples["streamwatch_step"] == 7.0
    assert samples["streamwatch_records_total"] == 1.0


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_nothing_after_the_channel_reads_a_watch_or_prometheus_client_internals() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    for path in modules:
        imports = _imports(path)
        private = sorted(
            name
            for name in imports
            if name.startswith("prometheus_client")
            and (
                any(part.startswith("_") for part in name.split("."))
                or name.startswith("prometheus_client.utils")
            )
        )
        assert private == [], f"{path.name} imports prometheus_client internals: {private}"
        if path.name != "_observe.py":
            tree = ast.parse(path.read_text())
            reads = [
                node.attr
                for node in ast.walk(tree)
                if isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in ("watch", "_watch")
            ]
            assert reads == [], f"{path.name} reads a Watch's private attributes: {reads}"
    exporter = _imports(PACKAGE / "sinks" / "_prometheus.py")
    assert not {name for name in exporter if name.startswith("streamwatch._observe")}  # no import cycle
    replay = _imports(PACKAGE / "_replay.py")
    assert not {name for name in replay if name.startswith("streamwatch._observe")}


@pytest.mark.parametrize(
    "value",
    [
        0.0,
        -0.0,
        1.0,
        3.0,
        0.1,
        -2.5e-7,
        1e22,
        12345678.0,
        1234567.0,
        123456.7,
        5e-324,
        -5e-324,
        2.0**53,
        -1e300,
    ],
)
def test_floats_are_written_as_prometheus_client_writes_them(value: float) -> None:
    assert format_float(value) == floatToGoString(value)
    assert float(format_float(value)) == value


def test_non_finite_floats_are_written_as_go_writes_them() -> None:
    assert [format_float(v) for v in (math.inf, -math.inf, math.nan)] == ["+Inf", "-Inf", "NaN"]
