"""``streamwatch stack``: a real Prometheus started by the command, scraping a real exporter with the
shipped rules loaded, stopped cleanly by SIGTERM or Ctrl-C (SIGINT) — its child gone, its port closed,
its temporary data directory removed. Skipped without the ``prometheus`` binary, except under
``STREAMWATCH_REQUIRE_PROMETHEUS=1`` (CI)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

import streamwatch as sw
from streamwatch._stack import Stack, config_text, find_rules
from tests.promserver import require_prometheus

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "dashboards" / "rules" / "streamwatch.rules.yml"
RULE_COUNT = sum(RULES.read_text(encoding="utf-8").count(kind) for kind in ("- alert: ", "- record: "))
"""The rules the shipped file holds (alerts and recording rules), as promtool counts them."""


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)


def _wait(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def _up(url: str) -> bool:
    try:
        result = _get(f"{url}/api/v1/query?query=up%7Bjob%3D%22streamwatch%22%7D")["data"]["result"]
    except (urllib.error.URLError, OSError):
        return False
    return bool(result) and result[0]["value"][1] == "1"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop_with", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_stack_starts_prometheus_scraping_the_ranks_with_the_rules_and_stops_cleanly(
    stop_with: signal.Signals,
) -> None:
    require_prometheus()
    model = torch.nn.Linear(4, 2)
    with sw.observe(model, every=1) as watch:
        exporter = watch.expose(port=0, run="stack")
        model(torch.randn(3, 4)).sum().backward()
        watch.step(loss=1.0)
        assert watch.flush()
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "streamwatch",
                "stack",
                "--port",
                str(exporter.port),
                "--web-port",
                "0",
                "--scrape-interval",
                "1s",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        try:
            assert proc.stdout is not None
            first, second = proc.stdout.readline(), proc.stdout.readline()
            match = re.fullmatch(r"Prometheus: (http://127\.0\.0\.1:(\d+))\n", first)
            assert match, (first, second, proc.stderr.read() if proc.poll() is not None else "")
            url = match[1]
            assert f"scraping 127.0.0.1:{exporter.port} every 1s as job streamwatch" in second
            data_dir = Path(re.search(r"data in (\S+) \(removed at exit\)", second)[1])  # type: ignore[index]
            assert data_dir.is_dir()
            _wait(lambda: _up(url))
            # the shipped rules are loaded and evaluate without error over the scraped series
            groups = _get(f"{url}/api/v1/rules")["data"]["groups"]
            assert {g["name"] for g in groups} == {
                "streamwatch:recording",
                "streamwatch:alerts",
                "streamwatch:detectors",
            }
            assert {g["file"] for g in groups} == {str(RULES)}
            steps = _get(f"{url}/api/v1/query?query=streamwatch_steps_total")["data"]["result"]
            assert steps[0]["metric"]["run"] == "stack"
            proc.send_signal(stop_with)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, err
    assert "streamwatch stack: Prometheus stopped (exit status 0)" in out
    assert not data_dir.exists()
    with pytest.raises((urllib.error.URLError, OSError)):  # the port is closed: Prometheus is gone
        urllib.request.urlopen(f"{url}/-/ready", timeout=2)


def test_a_missing_prometheus_binary_is_one_line_and_status_2(tmp_path: Path) -> None:
    missing = tmp_path / "no-prometheus"
    result = subprocess.run(
        [sys.executable, "-m", "streamwatch", "stack", "--prometheus", str(missing)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 2
    assert re.fullmatch(
        r"streamwatch stack: error: .*no-prometheus: the prometheus binary is not on PATH; "
        r"install it .*--prometheus PATH\n",
        result.stderr,
    ), result.stderr


def test_a_prometheus_that_cannot_start_is_reported_with_its_log(tmp_path: Path) -> None:
    binary = require_prometheus()
    broken = tmp_path / "broken.rules.yml"
    broken.write_text("groups:\n  - name: g\n    rules:\n      - record: r\n        expr: 'sum(('\n")
    stack = Stack(base_port=16400, ranks=1, web_port=0, rules=broken, binary=binary)
    with pytest.raises(RuntimeError, match=r"^prometheus exited; its log says:\n(.|\n)*broken\.rules\.yml"):
        stack.start()
    assert not stack.running()
    assert not stack.workdir.exists()  # its temporary directory went with it


def test_a_web_port_in_use_is_a_clear_error() -> None:
    binary = require_prometheus()
    with Stack(base_port=16400, ranks=1, web_port=0, binary=binary) as running:
        second = Stack(base_port=16400, ranks=1, web_port=running.web_port, binary=binary)
        with pytest.raises(
            OSError, match=rf"^\[Errno \d+\] port {running.web_port} on 127.0.0.1 is already in use"
        ):
            second.start()
        assert second.proc is None
        assert not second.workdir.exists()
    assert not running.workdir.exists()


def test_the_config_scrapes_every_local_rank_and_promtool_accepts_it(tmp_path: Path) -> None:
    binary = require_prometheus()
    stack = Stack(base_port=16400, ranks=4, web_port=9999, data_dir=tmp_path, binary=binary)
    assert stack.targets == [f"127.0.0.1:{16400 + r}" for r in range(4)]
    assert stack.rules == RULES == find_rules()
    config = tmp_path / "prometheus.yml"
    config.write_text(config_text(stack.targets, "5s", stack.rules), encoding="utf-8")
    promtool = Path(binary).with_name("promtool")
    check = subprocess.run(
        [str(promtool), "check", "config", str(config)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {RULE_COUNT} rules found" in check.stdout + check.stderr


def test_rules_are_found_by_option_then_environment_then_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STREAMWATCH_RULES", raising=False)
    assert find_rules() == RULES
    mine = tmp_path / "mine.yml"
    mine.write_text("groups: []\n", encoding="utf-8")
    monkeypatch.setenv("STREAMWATCH_RULES", str(mine))
    assert find_rules() == mine
    assert find_rules(RULES) == RULES
    with pytest.raises(FileNotFoundError, match="the rules file --rules names does not exist"):
        find_rules(tmp_path / "absent.yml")
    monkeypatch.setenv("STREAMWATCH_RULES", str(tmp_path / "absent.yml"))
    with pytest.raises(FileNotFoundError, match=r"the rules file \$STREAMWATCH_RULES names does not exist"):
        find_rules()


# -- the docker compose stack -------------------------------------------------------------------------------

COMPOSE = ROOT / "dashboards" / "compose"


def test_the_compose_prometheus_config_passes_promtool_with_the_rules() -> None:
    binary = require_prometheus()
    promtool = Path(binary).with_name("promtool")
    check = subprocess.run(
        [str(promtool), "check", "config", str(COMPOSE / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {RULE_COUNT} rules found" in check.stdout + check.stderr  # the shipped rules, resolved


def test_the_compose_file_mounts_what_exists_and_wires_grafana_to_prometheus() -> None:
    import yaml

    compose = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text(encoding="utf-8"))
    services = compose["services"]
    assert set(services) == {"prometheus", "grafana"}
    for name, service in services.items():
        for volume in service["volumes"]:
            source, _target, *_ = volume.split(":")
            assert (COMPOSE / source).exists(), (name, source)
    prometheus, grafana = services["prometheus"], services["grafana"]
    # prometheus.yml's relative rule path, resolved in the container, is where the rules are mounted
    config = yaml.safe_load((COMPOSE / "prometheus.yml").read_text(encoding="utf-8"))
    mounted = dict(v.split(":")[:2] for v in prometheus["volumes"])
    assert mounted["./prometheus.yml"] == "/etc/prometheus/prometheus.yml"
    (rules,) = config["rule_files"]
    assert (
        os.path.normpath(os.path.join("/etc/prometheus", rules))
        == f"{mounted['../rules']}/streamwatch.rules.yml"
    )
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "streamwatch"
    targets = job["static_configs"][0]["targets"]
    assert targets == [f"host.docker.internal:{16400 + r}" for r in range(8)]
    # Grafana: every dashboard provisioned where the provider reads, the data source is this Prometheus
    provider = yaml.safe_load((ROOT / "dashboards/provisioning/dashboards.yaml").read_text(encoding="utf-8"))
    folder = provider["providers"][0]["options"]["path"]
    dashboards = {
        Path(t).name for s, t, *_ in (v.split(":") for v in grafana["volumes"]) if t.startswith(folder)
    }
    assert dashboards == {p.name for p in (ROOT / "dashboards").glob("*.json")}
    source = yaml.safe_load((ROOT / "dashboards/provisioning/datasources.yaml").read_text(encoding="utf-8"))
    (datasource,) = source["datasources"]
    assert datasource["url"] == "http://prometheus:9090"
    assert (
        datasource["jsonData"]["timeInterval"]
        == config["global"]["scrape_interval"]
        == job["scrape_interval"]
    )
