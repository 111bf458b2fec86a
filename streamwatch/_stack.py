"""``streamwatch stack``: a real Prometheus for a laptop or one node, in one command.

:class:`Stack` writes a Prometheus configuration that scrapes the local ranks' ``/metrics``
(``127.0.0.1:<base port + local rank>``, the ports ``watch.expose()`` takes by default) and loads the
shipped alerting and recording rules, starts the ``prometheus`` binary found on ``PATH`` on
``127.0.0.1:<web port>`` with its data in a temporary directory (or ``data_dir``), waits until it is
ready and stops it by its PID: SIGTERM, then SIGKILL if it has not exited after :data:`STOP_TIMEOUT`
seconds. Nothing else is started and nothing outside the work directory is written.

The rules are ``dashboards/rules/streamwatch.rules.yml`` of a source checkout; an installed package has no
``dashboards/`` directory, so they are found, in order, at ``rules=``, ``$STREAMWATCH_RULES``, or beside
the package in the checkout it was installed from (:func:`find_rules`); without them Prometheus runs
without rules and :attr:`Stack.rules` is None.

Example:
    >>> print(config_text(["127.0.0.1:16400"], "5s", None).splitlines()[4])
    scrape_configs:
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

__all__ = ["DEFAULT_WEB_PORT", "RULES_ENV", "STOP_TIMEOUT", "Stack", "config_text", "find_rules"]

DEFAULT_WEB_PORT = 9090
"""Prometheus' own default port for its web UI and API."""
RULES_ENV = "STREAMWATCH_RULES"
"""The environment variable naming the rules file, when ``rules=`` does not."""
STOP_TIMEOUT = 10.0
"""Seconds Prometheus has to exit after SIGTERM before it is killed."""
_READY_TIMEOUT = 30.0


def find_rules(rules: Path | None = None) -> Path | None:
    """The alerting and recording rules to load: ``rules`` (which must exist), else ``$STREAMWATCH_RULES``
    (which must exist), else ``dashboards/rules/streamwatch.rules.yml`` of the source checkout the package
    runs from, else None.

    Raises:
        FileNotFoundError: ``rules`` or ``$STREAMWATCH_RULES`` names a file that does not exist.
    """
    for given, what in ((rules, "--rules"), (os.environ.get(RULES_ENV) or None, f"${RULES_ENV}")):
        if given is not None:
            path = Path(given)
            if not path.is_file():
                raise FileNotFoundError(2, f"the rules file {what} names does not exist", str(path))
            return path.resolve()
    checkout = Path(__file__).resolve().parents[1] / "dashboards" / "rules" / "streamwatch.rules.yml"
    return checkout if checkout.is_file() else None


def config_text(targets: Sequence[str], scrape_interval: str, rules: Path | None) -> str:
    """A ``prometheus.yml`` scraping ``targets`` as the job ``streamwatch`` (what the rules and dashboards
    select), evaluating ``rules`` at the scrape interval. JSON for every value (JSON is YAML)."""
    lines = [
        "global:",
        f"  scrape_interval: {json.dumps(scrape_interval)}",
        f"  evaluation_interval: {json.dumps(scrape_interval)}",
        f"rule_files: {json.dumps([] if rules is None else [str(rules)])}",
        "scrape_configs:",
        '  - job_name: "streamwatch"',
        "    static_configs:",
        f"      - targets: {json.dumps(list(targets))}",
    ]
    return "\n".join(lines) + "\n"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Stack:
    """A Prometheus started on ``127.0.0.1:web_port`` scraping ``ranks`` local ranks from ``base_port``.

    Args:
        base_port: the ranks' base ``/metrics`` port (rank ``r`` on ``base_port + r``).
        ranks: how many local ranks to scrape.
        web_port: Prometheus' port (0: any free one).
        scrape_interval: Prometheus' scrape and rule evaluation interval (``"5s"``).
        rules: the rules file (:func:`find_rules` is applied to it).
        data_dir: where Prometheus keeps its data (kept); None: a temporary directory, removed at
            :meth:`stop`.
        binary: the ``prometheus`` executable (None: the one on ``PATH``).

    Raises:
        FileNotFoundError: no ``prometheus`` binary, or a rules file that does not exist.
    """

    def __init__(
        self,
        *,
        base_port: int,
        ranks: int,
        web_port: int = DEFAULT_WEB_PORT,
        scrape_interval: str = "5s",
        rules: Path | None = None,
        data_dir: Path | None = None,
        binary: str | None = None,
    ) -> None:
        found = binary or shutil.which("prometheus")
        if found is None or not Path(found).is_file():
            raise FileNotFoundError(
                2,
                "the prometheus binary is not on PATH; install it (Debian/Ubuntu: apt-get install "
                "prometheus, or a release from prometheus.io) or pass --prometheus PATH",
                binary or "prometheus",
            )
        self.binary = found
        self.targets = [f"127.0.0.1:{base_port + rank}" for rank in range(ranks)]
        self.web_port = web_port or _free_port()
        self.scrape_interval = scrape_interval
        self.rules = find_rules(rules)
        self._own_dir = data_dir is None
        self.workdir = Path(tempfile.mkdtemp(prefix="streamwatch-stack-")) if data_dir is None else data_dir
        self.url = f"http://127.0.0.1:{self.web_port}"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        """Prometheus' own output."""
        return self.workdir / "prometheus.log"

    def start(self, timeout: float = _READY_TIMEOUT) -> Stack:
        """Write the config, start Prometheus and wait until ``/-/ready`` answers.

        Raises:
            OSError: the web port is in use.
            RuntimeError: Prometheus exited or was not ready in ``timeout`` seconds (the message ends with
                its log's error lines, or its last lines); it is stopped first.
        """
        with socket.socket() as probe:  # (a Prometheus already there would answer our readiness check)
            try:
                probe.bind(("127.0.0.1", self.web_port))
            except OSError as err:
                self.stop()
                raise OSError(
                    err.errno,
                    f"port {self.web_port} on 127.0.0.1 is already in use (another Prometheus?); pass "
                    "--web-port another port, or 0 for any free one",
                ) from err
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(config_text(self.targets, self.scrape_interval, self.rules), encoding="utf-8")
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.web_port}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
            )
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_tail()
                why = "exited" if self.proc.poll() is not None else f"was not ready in {timeout:g} s"
                self.stop()
                raise RuntimeError(f"prometheus {why}; its log says:\n{tail}")
            time.sleep(0.1)
        return self

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1.0) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def running(self) -> bool:
        """Whether Prometheus is still running."""
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 8) -> str:
        """The last lines of Prometheus' output, its error lines (``level=error``) if it has any."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        errors = [line for line in text if "level=error" in line]
        return "\n".join((errors or text)[-lines:])

    def stop(self) -> int | None:
        """Stop Prometheus by its PID (SIGTERM, then SIGKILL after :data:`STOP_TIMEOUT` s), remove a
        temporary data directory; its exit status (None if it was not started). Idempotent."""
        proc, self.proc = self.proc, None
        status = None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            status = proc.returncode
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return status

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
