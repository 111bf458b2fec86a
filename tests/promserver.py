"""A real Prometheus server for tests: started by the test, on 127.0.0.1, with its own config and data dir.

Unit tests of the exporter check the text exposition format; this harness checks what a real Prometheus
server makes of it: that the target is scraped (``up == 1``), that PromQL over the exported series
returns the expected values, and that recording and alerting rules written against them evaluate.

Each :class:`PrometheusServer` writes its own ``prometheus.yml`` into a work dir (a test's ``tmp_path``),
launches the ``prometheus`` binary as a child process on a free port of 127.0.0.1 with its TSDB under
``<workdir>/data`` and its output in ``<workdir>/prometheus.log``, waits until ``/-/ready`` answers, and
stops the process by its PID when the test is done. No system service is started or used. Typical use::

    binary = require_prometheus()
    with PrometheusServer(tmp_path, ["127.0.0.1:9100"]) as prom:
        prom.wait_for('up{job="streamwatch"} == 1')
        value = float(prom.query("my_gauge")[0]["value"][1])

:func:`require_prometheus` skips a test when the binary is missing (the Debian package ``prometheus``),
unless ``STREAMWATCH_REQUIRE_PROMETHEUS=1`` is set (CI sets it), in which case it fails the test, so a
missing server never silently skips there. Only the standard library and pytest are used; every HTTP
call has a timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

MISSING_MESSAGE = (
    "needs the Debian package prometheus (apt-get install -y --no-install-recommends prometheus)"
)
REQUIRE_ENV = "STREAMWATCH_REQUIRE_PROMETHEUS"
HTTP_TIMEOUT_S = 10.0  # bound on every HTTP call to the server
STOP_TIMEOUT_S = 10.0  # SIGTERM, then SIGKILL after this long
POLL_S = 0.2  # wait_for's polling period
_PORT_ATTEMPTS = 3  # free_port() races with other processes: retry on "address already in use"


def free_port() -> int:
    """Return a TCP port of 127.0.0.1 that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prometheus_binary() -> str | None:
    """The path of the ``prometheus`` binary on PATH, or None."""
    return shutil.which("prometheus")


def require_prometheus() -> str:
    """Return the ``prometheus`` binary; skip the test without one, or fail it if CI requires one."""
    binary = prometheus_binary()
    if binary is None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(MISSING_MESSAGE)
        pytest.skip(MISSING_MESSAGE)
    return binary


def _yaml_list(items: Sequence[str]) -> str:
    """A flow-style YAML list of strings (JSON is valid YAML and quotes everything safely)."""
    return json.dumps([str(item) for item in items])


class PrometheusServer:
    """A Prometheus server started by a test on 127.0.0.1 with its own config and data dir; stopped by PID.

    ``targets`` are ``host:port`` strings scraped under the job ``job``; ``rule_files`` are loaded with
    the given ``evaluation_interval``; ``extra_scrape_configs`` is YAML for more ``scrape_configs`` list
    items (``- job_name: ...``), appended verbatim after dedenting; ``remote_write`` URLs receive every
    sample (scraped and recorded) within about a second.
    """

    def __init__(
        self,
        workdir: Path,
        targets: Sequence[str] = (),
        *,
        scrape_interval: str = "1s",
        evaluation_interval: str = "1s",
        rule_files: Sequence[Path] = (),
        job: str = "streamwatch",
        extra_scrape_configs: str = "",
        remote_write: Sequence[str] = (),
    ) -> None:
        self.workdir = Path(workdir)
        self.targets_list = [str(t) for t in targets]
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval
        self.rule_files = [Path(p).resolve() for p in rule_files]
        self.job = job
        self.extra_scrape_configs = extra_scrape_configs
        self.remote_write = [str(url) for url in remote_write]
        self.config_path = self.workdir / "prometheus.yml"
        self.data_dir = self.workdir / "data"
        self.log_path = self.workdir / "prometheus.log"
        self.port = 0
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------

    def config_text(self) -> str:
        """The ``prometheus.yml`` that :meth:`start` writes."""
        lines = [
            "global:",
            f"  scrape_interval: {json.dumps(self.scrape_interval)}",
            f"  evaluation_interval: {json.dumps(self.evaluation_interval)}",
            f"rule_files: {_yaml_list([str(p) for p in self.rule_files])}",
            "scrape_configs:",
            f"  - job_name: {json.dumps(self.job)}",
            "    static_configs:",
            f"      - targets: {_yaml_list(self.targets_list)}",
        ]
        if self.remote_write:  # sent within a second, so a test sees the written data soon
            lines.insert(4, "remote_write:")
            for i, url in enumerate(self.remote_write):
                entry = [f"  - url: {json.dumps(url)}", "    queue_config: {batch_send_deadline: 1s}"]
                lines[5 + 2 * i : 5 + 2 * i] = entry
        text = "\n".join(lines) + "\n"
        extra = textwrap.dedent(self.extra_scrape_configs).strip("\n")
        if extra:
            text += textwrap.indent(extra, "  ") + "\n"
        return text

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        """Write the config, launch ``prometheus`` on a free port and wait until ``/-/ready`` is 200.

        Raises RuntimeError, with the tail of the server's log, if it exits or is not ready in ``timeout``
        seconds; the process is stopped before raising.
        """
        if self.proc is not None:
            raise RuntimeError(f"Prometheus already started at {self.url}")
        binary = require_prometheus()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.config_text(), encoding="utf-8")
        deadline = time.monotonic() + timeout
        for attempt in range(_PORT_ATTEMPTS):
            self._launch(binary)
            try:
                if self._wait_ready(deadline):
                    return self
            except BaseException:
                self.stop()
                raise
            # exited early: retry on a port race, otherwise report
            self.stop()
            log = self.log_tail()
            if "address already in use" not in log or attempt == _PORT_ATTEMPTS - 1:
                raise RuntimeError(f"Prometheus exited before it was ready; log tail:\n{log}")
        raise AssertionError("unreachable")  # pragma: no cover

    def _launch(self, binary: str) -> None:
        """Start the child process on a fresh free port, its output appended to the log file."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        with self.log_path.open("ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={self.config_path}",
                    f"--storage.tsdb.path={self.data_dir}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--web.enable-lifecycle",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
            )

    def _wait_ready(self, deadline: float) -> bool:
        """True once ``/-/ready`` answers 200; False if the process exited; RuntimeError at ``deadline``."""
        assert self.proc is not None
        while True:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1.0) as resp:
                    if resp.status == 200:
                        return True
            except urllib.error.HTTPError as err:  # 503 while the TSDB is starting
                err.close()
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Prometheus at {self.url} was not ready in time; log tail:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        """Terminate the process by PID (SIGTERM), wait, SIGKILL after 10 s; a no-op once stopped."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=STOP_TIMEOUT_S)
        finally:
            if proc.poll() is None:  # pragma: no cover - SIGKILL did not take
                proc.kill()
                proc.wait()

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> PrometheusServer:
        if self.proc is None:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's log ("" if there is none yet)."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    # -- HTTP API ----------------------------------------------------------------------------------------

    def _api(self, path: str, params: Sequence[tuple[str, str]] = ()) -> Any:
        """GET ``/api/v1/<path>``; return ``data``, or raise AssertionError with the server's error."""
        if not self.url:
            raise RuntimeError("Prometheus server not started")
        url = f"{self.url}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(list(params))
        try:
            with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as resp:
                body = resp.read()
        except urllib.error.HTTPError as err:  # 400/422/503 carry a JSON error body
            with err:
                body = err.read()
        try:
            payload = json.loads(body)
        except ValueError as exc:
            raise AssertionError(f"GET {url}: not JSON: {body[:500]!r}") from exc
        if payload.get("status") != "success":
            raise AssertionError(
                f"GET {url}: {payload.get('status')}: {payload.get('errorType')}: {payload.get('error')}"
            )
        return payload["data"]

    def query(self, promql: str, time: float | None = None) -> list[dict[str, Any]]:
        """Instant query at ``time`` (default: now); returns ``data.result``.

        For a vector: ``[{"metric": {...}, "value": [t, "v"]}]``.
        """
        params = [("query", promql)]
        if time is not None:
            params.append(("time", repr(float(time))))
        return list(self._api("query", params)["result"])

    def query_range(self, promql: str, start: float, end: float, step: str = "1s") -> list[dict[str, Any]]:
        """Range query; returns ``data.result`` (``[{"metric": {...}, "values": [[t, "v"], ...]}]``)."""
        params = [("query", promql), ("start", repr(float(start))), ("end", repr(float(end))), ("step", step)]
        return list(self._api("query_range", params)["result"])

    def label_values(self, label: str, match: str | None = None) -> list[str]:
        """The values of ``label`` over all series, or over those selected by ``match``."""
        params = [] if match is None else [("match[]", match)]
        return list(self._api(f"label/{urllib.parse.quote(label, safe='')}/values", params))

    def series(self, match: str) -> list[dict[str, str]]:
        """The label sets of the series selected by ``match``."""
        return list(self._api("series", [("match[]", match)]))

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets (``health``, ``lastError``, ``scrapeUrl``, ``labels``, ...)."""
        return list(self._api("targets", [("state", "active")])["activeTargets"])

    def alerts(self) -> list[dict[str, Any]]:
        """The pending and firing alerts (``labels``, ``state``, ``value``, ...)."""
        return list(self._api("alerts")["alerts"])

    def wait_for(
        self,
        promql: str,
        predicate: Callable[[list[dict[str, Any]]], bool] = bool,
        timeout: float = 30.0,
    ) -> list[dict[str, Any]]:
        """Poll ``query(promql)`` every 0.2 s until ``predicate(result)``; return that result.

        On timeout raises AssertionError with the last result and every target's health and last error.
        """
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(promql)
            if predicate(result):
                return result
            if time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        try:
            health = "\n".join(
                f"  {t.get('scrapeUrl')}: health={t.get('health')} lastError={t.get('lastError')!r}"
                for t in self.targets()
            )
        except (AssertionError, OSError) as exc:
            health = f"  (targets unavailable: {exc})"
        raise AssertionError(
            f"timed out after {timeout} s waiting for {promql!r}; last result: {result!r}\n"
            f"targets:\n{health or '  (none)'}"
        )

    def reload(self) -> None:
        """Reload the config and rule files (POST ``/-/reload``); AssertionError if the server refuses."""
        if not self.url:
            raise RuntimeError("Prometheus server not started")
        request = urllib.request.Request(f"{self.url}/-/reload", method="POST", data=b"")
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as resp:
                resp.read()
        except urllib.error.HTTPError as err:
            with err:
                detail = err.read().decode("utf-8", errors="replace")
            raise AssertionError(f"POST /-/reload: HTTP {err.code}: {detail.strip()}") from None


# -- VictoriaMetrics ----------------------------------------------------------------------------------------

VM_MISSING_MESSAGE = (
    "needs the Debian package victoria-metrics (apt-get install -y --no-install-recommends victoria-metrics)"
)


def require_victoria_metrics() -> str:
    """Return the ``victoria-metrics`` binary; skip without one, or fail if CI requires the servers."""
    binary = shutil.which("victoria-metrics")
    if binary is None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(VM_MISSING_MESSAGE)
        pytest.skip(VM_MISSING_MESSAGE)
    return binary


class VictoriaMetricsServer(PrometheusServer):
    """A VictoriaMetrics single node started by a test on 127.0.0.1, its data under ``<workdir>/data``,
    stopped by PID: a remote-write target (``write_url``) with Prometheus' query API (``query``,
    ``label_values``, ``series`` of :class:`PrometheusServer`, which it inherits).

    Flags: no latency offset and no rollup cache, so an instant query sees every sample written up to its
    time (VictoriaMetrics hides the last 30 s by default, as possibly incomplete).
    """

    def __init__(self, workdir: Path) -> None:
        super().__init__(workdir)

    @property
    def write_url(self) -> str:
        """Prometheus' ``remote_write`` URL of this server."""
        return f"{self.url}/api/v1/write"

    def start(self, timeout: float = 30.0) -> VictoriaMetricsServer:
        """Launch ``victoria-metrics`` on a free port and wait until ``/health`` answers ``OK``."""
        if self.proc is not None:
            raise RuntimeError(f"VictoriaMetrics already started at {self.url}")
        binary = require_victoria_metrics()
        self.workdir.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + timeout
        for attempt in range(_PORT_ATTEMPTS):
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            with self.log_path.open("ab") as log:
                self.proc = subprocess.Popen(
                    [
                        binary,
                        f"-storageDataPath={self.data_dir}",
                        f"-httpListenAddr=127.0.0.1:{self.port}",
                        "-search.latencyOffset=0s",
                        "-search.disableCache",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.workdir,
                )
            while self.proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"{self.url}/health", timeout=1.0) as resp:
                        if resp.read().strip() == b"OK":
                            return self
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"VictoriaMetrics not ready in time; log tail:\n{self.log_tail()}")
                time.sleep(0.05)
            self.stop()
            if "address already in use" not in self.log_tail() or attempt == _PORT_ATTEMPTS - 1:
                raise RuntimeError(f"VictoriaMetrics exited before it was ready; log:\n{self.log_tail()}")
        raise AssertionError("unreachable")  # pragma: no cover

    def __enter__(self) -> VictoriaMetricsServer:
        if self.proc is None:
            self.start()
        return self
