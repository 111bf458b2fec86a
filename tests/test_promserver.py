"""Tests of the Prometheus test harness (tests/promserver.py) against a real Prometheus server.

The scrape target is a real HTTP endpoint served in the test by ``prometheus_client`` from its own
registry, exposing one gauge with a known value.

Prometheus 2.x hands static targets to its scrape loop only on a 5 s tick (the discovery manager's
throttle, not configurable), so the first scrape comes about 5 s after start whatever the scrape
interval. The tests that read scraped data therefore share one module-scoped server (its work dir from
``tmp_path_factory``), configured up front with the live target, a dead target, a recording rule and an
alerting rule; the tests of the lifecycle (start, stop, reload, bad configs) each start their own server
in ``tmp_path`` and need no scrape.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from tests import promserver
from tests.promserver import PrometheusServer, free_port, require_prometheus

GAUGE = "promserver_test_value"
VALUE = 21.5


def _write_rules(path: Path, rules: str) -> Path:
    """Write a rule file with one group ``t`` holding ``rules`` (YAML list items, indented 6)."""
    path.write_text(f"groups:\n  - name: t\n    rules:\n{rules}", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def target() -> Iterator[str]:
    """A real ``/metrics`` endpoint on 127.0.0.1 exposing ``promserver_test_value 21.5``; yields host:port."""
    registry = CollectorRegistry()
    Gauge(GAUGE, "A gauge with a known value.", registry=registry).set(VALUE)
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def dead_target() -> str:
    """host:port of 127.0.0.1 where nothing listens."""
    return f"127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def prom(
    tmp_path_factory: pytest.TempPathFactory, target: str, dead_target: str
) -> Iterator[PrometheusServer]:
    """A server scraping ``target`` (job streamwatch) and ``dead_target`` (job dead) every second, with a
    recording rule ``test:doubled`` and an alert ``GaugeHigh``; started once, ready and scraped."""
    require_prometheus()
    workdir = tmp_path_factory.mktemp("prom")
    rules = _write_rules(
        workdir / "rules.yml",
        f'      - record: "test:doubled"\n        expr: "{GAUGE} * 2"\n'
        f'      - alert: "GaugeHigh"\n        expr: "{GAUGE} > 10"\n        for: 0s\n'
        '        labels: {severity: "page"}\n',
    )
    extra = f"""
        - job_name: "dead"
          static_configs:
            - targets: ["{dead_target}"]
    """
    with PrometheusServer(workdir, [target], rule_files=[rules], extra_scrape_configs=extra) as server:
        yield server


# -- reading scraped data (shared server) ----------------------------------------------------------------


def test_server_starts_and_is_ready(prom: PrometheusServer) -> None:
    assert prom.url == f"http://127.0.0.1:{prom.port}"
    assert prom.running
    with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=5) as resp:
        assert resp.status == 200
    assert prom.config_path == prom.workdir / "prometheus.yml"
    assert prom.config_path.read_text(encoding="utf-8") == prom.config_text()
    assert prom.data_dir == prom.workdir / "data"
    assert prom.data_dir.is_dir()
    assert prom.log_path.is_file()


def test_target_is_scraped_and_up(prom: PrometheusServer, target: str) -> None:
    (up,) = prom.wait_for('up{job="streamwatch"} == 1')
    assert up["metric"]["instance"] == target
    prom.wait_for(
        'up{job="streamwatch"}',
        lambda _: any(t["labels"]["job"] == "streamwatch" and t["health"] == "up" for t in prom.targets()),
    )
    (active,) = (t for t in prom.targets() if t["labels"]["job"] == "streamwatch")
    assert active["scrapeUrl"] == f"http://{target}/metrics"
    assert active["lastError"] == ""


def test_query_returns_the_gauge_value(prom: PrometheusServer, target: str) -> None:
    (sample,) = prom.wait_for(GAUGE)
    assert float(sample["value"][1]) == VALUE
    assert sample["metric"] == {"__name__": GAUGE, "instance": target, "job": "streamwatch"}
    (doubled,) = prom.query(f"{GAUGE} * 2", time=time.time())
    assert float(doubled["value"][1]) == 2 * VALUE
    assert prom.query(GAUGE, time=time.time() - 3600) == []  # before the first scrape


def test_query_error_raises_assertion(prom: PrometheusServer) -> None:
    with pytest.raises(AssertionError, match="bad_data"):
        prom.query("sum(")


def test_query_range_returns_points(prom: PrometheusServer) -> None:
    prom.wait_for(f"count_over_time({GAUGE}[1m]) >= 2", timeout=15)
    end = time.time()
    (series,) = prom.query_range(GAUGE, end - 5, end, step="1s")
    assert series["metric"]["job"] == "streamwatch"
    assert len(series["values"]) >= 2
    assert {float(v) for _, v in series["values"]} == {VALUE}
    stamps = [t for t, _ in series["values"]]
    assert stamps == sorted(stamps)


def test_label_values_and_series(prom: PrometheusServer, target: str) -> None:
    prom.wait_for(GAUGE)
    prom.wait_for('up{job="dead"}')
    assert {"streamwatch", "dead"} <= set(prom.label_values("job"))  # the extra scrape config is live
    assert prom.label_values("job", match=GAUGE) == ["streamwatch"]
    assert prom.label_values("instance", match=GAUGE) == [target]
    assert prom.label_values("job", match='{job="nope"}') == []
    (labels,) = prom.series(GAUGE)
    assert labels == {"__name__": GAUGE, "instance": target, "job": "streamwatch"}


def test_recording_rule_is_evaluated(prom: PrometheusServer, target: str) -> None:
    (sample,) = prom.wait_for("test:doubled")
    assert float(sample["value"][1]) == 2 * VALUE
    assert sample["metric"] == {"__name__": "test:doubled", "instance": target, "job": "streamwatch"}


def test_alerting_rule_fires(prom: PrometheusServer) -> None:
    prom.wait_for('ALERTS{alertname="GaugeHigh", alertstate="firing"}')
    (alert,) = prom.alerts()
    assert alert["state"] == "firing"
    assert alert["labels"]["alertname"] == "GaugeHigh"
    assert alert["labels"]["severity"] == "page"
    assert float(alert["value"]) == VALUE


def test_wait_for_timeout_reports_targets(prom: PrometheusServer, dead_target: str) -> None:
    prom.wait_for('up{job="dead"} == 0')
    with pytest.raises(AssertionError, match="timed out") as info:
        prom.wait_for('up{job="dead"} == 1', timeout=0.5)
    message = str(info.value)
    assert "last result: []" in message
    assert f"http://{dead_target}/metrics: health=down" in message
    assert "connection refused" in message


def test_start_twice_raises(prom: PrometheusServer) -> None:
    with pytest.raises(RuntimeError, match="already started"):
        prom.start()


# -- lifecycle (a server per test, no scrape needed) -----------------------------------------------------


def test_reload_picks_up_changed_rules(tmp_path: Path) -> None:
    require_prometheus()
    rules = _write_rules(tmp_path / "rules.yml", '      - record: "test:before"\n        expr: "vector(1)"\n')
    with PrometheusServer(tmp_path, rule_files=[rules]) as prom:
        prom.wait_for("test:before")
        _write_rules(rules, '      - record: "test:after"\n        expr: "vector(2)"\n')
        prom.reload()
        (sample,) = prom.wait_for("test:after")
        assert float(sample["value"][1]) == 2


def test_reload_of_a_broken_config_raises(tmp_path: Path) -> None:
    require_prometheus()
    with PrometheusServer(tmp_path) as prom:
        prom.config_path.write_text("global: [\n", encoding="utf-8")
        with pytest.raises(AssertionError, match="HTTP 500"):
            prom.reload()
        assert prom.running  # the old config stays in force


def test_wait_for_timeout_without_targets(tmp_path: Path) -> None:
    require_prometheus()
    with PrometheusServer(tmp_path) as prom, pytest.raises(AssertionError, match=r"(?s)'up'.*\(none\)"):
        prom.wait_for("up", timeout=0.3)


def test_stop_ends_the_process_and_is_idempotent(tmp_path: Path) -> None:
    require_prometheus()
    prom = PrometheusServer(tmp_path).start()
    proc = prom.proc
    assert proc is not None
    assert proc.poll() is None
    prom.stop()
    assert proc.poll() is not None
    assert not prom.running
    prom.stop()  # idempotent
    prom.stop()
    assert proc.poll() is not None


def test_context_manager_stops_on_error(tmp_path: Path) -> None:
    require_prometheus()
    prom = PrometheusServer(tmp_path)
    seen: list[subprocess.Popen[bytes]] = []

    def crash() -> None:
        with prom:
            assert prom.proc is not None
            assert prom.proc.poll() is None
            seen.append(prom.proc)
            raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        crash()
    (proc,) = seen
    assert proc.poll() is not None
    assert prom.proc is None


def test_bad_config_raises_with_log_tail(tmp_path: Path) -> None:
    require_prometheus()
    bad = """
        - job_name: "broken"
          scrape_interval: "not-a-duration"
    """
    prom = PrometheusServer(tmp_path, extra_scrape_configs=bad)
    with pytest.raises(RuntimeError, match="exited before it was ready") as info:
        prom.start(timeout=20)
    assert "not-a-duration" in str(info.value)  # the log tail names the offending value
    assert prom.proc is None


def test_bad_rule_file_raises_with_log_tail(tmp_path: Path) -> None:
    require_prometheus()
    rules = _write_rules(tmp_path / "rules.yml", '      - record: "test:broken"\n        expr: "sum("\n')
    prom = PrometheusServer(tmp_path, rule_files=[rules])
    with pytest.raises(RuntimeError, match="log tail") as info:
        prom.start(timeout=20)
    assert "rules.yml" in str(info.value)
    assert prom.proc is None


# -- require_prometheus ----------------------------------------------------------------------------------


def test_require_prometheus_returns_the_binary() -> None:
    binary = require_prometheus()
    assert binary == shutil.which("prometheus")
    assert Path(binary).is_file()


def test_require_prometheus_skips_when_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda *args, **kwargs: None)
    monkeypatch.delenv(promserver.REQUIRE_ENV, raising=False)
    assert promserver.prometheus_binary() is None
    with pytest.raises(pytest.skip.Exception, match="apt-get install -y --no-install-recommends prometheus"):
        require_prometheus()
    monkeypatch.setenv(promserver.REQUIRE_ENV, "0")
    with pytest.raises(pytest.skip.Exception):
        require_prometheus()


def test_require_prometheus_fails_when_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(promserver, "prometheus_binary", lambda: None)
    monkeypatch.setenv(promserver.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="needs the Debian package prometheus"):
        require_prometheus()


def test_start_without_binary_fails_when_required(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(shutil, "which", lambda *args, **kwargs: None)
    monkeypatch.setenv(promserver.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception):
        PrometheusServer(tmp_path).start()
    assert not (tmp_path / "prometheus.yml").exists()
