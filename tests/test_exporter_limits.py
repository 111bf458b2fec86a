"""The /metrics server's limits, over real sockets on 127.0.0.1: half-open and slow connections hold no
thread and are closed after the timeout, ``close()`` leaves no thread and no file descriptor behind, a
scrape storm costs one render, methods other than GET/HEAD get 405, unknown paths 404; the host argument
is checked (``""``, unresolvable and foreign hosts are clear errors); and ``promtool check metrics``
accepts what a real training run serves.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import socket
import subprocess
import threading
import urllib.error
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

import streamwatch as sw
from tests.promserver import REQUIRE_ENV
from tests.rawhttp import raw_request
from tests.threads import JOIN_S, spawn
from tests.training import Train

HALF_OPEN = 200


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=JOIN_S) as resp:
        body: bytes = resp.read()
    return body


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _threads() -> set[threading.Thread]:
    return set(threading.enumerate())


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server closed this connection (EOF or reset) within JOIN_S."""
    sock.settimeout(JOIN_S)
    try:
        while sock.recv(4096):  # a 408 or 400 may come first
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def _warm_up(train: Train) -> None:
    """One full observe/expose/scrape/close cycle first, so lazily opened files (torch, the kernel
    library, urllib) are open before a test counts file descriptors."""
    model, opt = _model()
    with sw.observe(model, opt, every=1) as watch:
        exporter = watch.expose(port=0)
        train(model, opt, watch, 1, shape=(16, 6), seed=0, flush=True)
        _get(exporter.url)


def test_half_open_connections_hold_no_thread_and_close_releases_every_thread_and_fd(train: Train) -> None:
    _warm_up(train)
    threads_before, fds_before = _threads(), _fds()
    model, opt = _model()
    clients: list[socket.socket] = []
    try:
        with sw.observe(model, opt, every=1) as watch:
            exporter = watch.expose(port=0)
            train(model, opt, watch, 2, shape=(16, 6), seed=0, flush=True)
            serving = _threads()  # the watch's worker and the server's own threads
            assert len([t for t in serving - threads_before if t.name.startswith("streamwatch-metrics")]) <= 2
            for i in range(HALF_OPEN):  # half send nothing, half a partial request line
                sock = socket.create_connection(("127.0.0.1", exporter.port), timeout=JOIN_S)
                clients.append(sock)
                if i % 2:
                    sock.sendall(b"GET /metr")
            body = _get(exporter.url)  # still served, with 200 connections hanging
            assert b"streamwatch_steps_total" in body
            during = _threads() - serving
            assert not during, sorted(t.name for t in during)  # no thread per connection
        # watch.close() closed the exporter: every thread joined, every server-side socket closed
        assert not {t for t in _threads() - threads_before if t.is_alive()}, _threads() - threads_before
        assert all(_closed_by_peer(sock) for sock in clients)
    finally:
        for sock in clients:
            sock.close()
    assert _fds() <= fds_before, sorted(_fds() - fds_before)


def test_a_connection_that_sends_no_request_is_closed_after_the_timeout() -> None:
    model, _ = _model()
    with sw.observe(model, every=1) as watch:
        exporter = watch.expose(port=0, timeout=0.2)
        with (
            socket.create_connection(("127.0.0.1", exporter.port), timeout=JOIN_S) as silent,
            socket.create_connection(("127.0.0.1", exporter.port), timeout=JOIN_S) as slow,
        ):
            slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # headers never finished
            assert _closed_by_peer(silent)
            assert _closed_by_peer(slow)
        assert b"streamwatch_info" in _get(exporter.url)  # and the server goes on serving
    with sw.observe(model, every=1) as watch, pytest.raises(ValueError, match="`timeout`"):
        watch.expose(port=0, timeout=0)


def test_a_scrape_storm_costs_one_render_per_snapshot_and_fresh_values_after_a_step(
    monkeypatch: pytest.MonkeyPatch, train: Train
) -> None:
    model, opt = _model()
    with sw.observe(model, opt, every=1) as watch:
        exporter = watch.expose(port=0)
        train(model, opt, watch, 2, shape=(16, 6), seed=0, flush=True)
        renders = []
        render = exporter.collector.render

        def counted() -> bytes:
            renders.append(1)
            return render()

        monkeypatch.setattr(exporter.collector, "render", counted)
        scrapers = [spawn(lambda: [_get(exporter.url) for _ in range(5)]) for _ in range(20)]
        bodies = {body for scraper in scrapers for body in scraper.finish()}
        assert len(bodies) == 1  # every scraper saw the same snapshot ...
        assert len(renders) == 1  # ... rendered once
        # a new record: the next scrape renders again
        train(model, opt, watch, 1, shape=(16, 6), seed=0, flush=True)
        step = [
            s.value
            for f in text_string_to_metric_families(_get(exporter.url).decode())
            if f.name == "streamwatch_step"
            for s in f.samples
        ]
        assert step == [2.0]  # the third step's
        assert len(renders) == 2


def test_methods_other_than_get_and_head_get_405_and_unknown_paths_404(train: Train) -> None:
    model, opt = _model()
    with sw.observe(model, opt, every=1) as watch:
        exporter = watch.expose(port=0)
        train(model, opt, watch, 1, shape=(16, 6), seed=0, flush=True)
        port = exporter.port
        status, headers, body = raw_request(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200
        assert headers["content-type"].startswith("text/plain")
        assert int(headers["content-length"]) == len(body) > 0
        status, headers, head_body = raw_request(port, b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (status, head_body) == (200, b"")
        assert int(headers["content-length"]) > 0
        assert raw_request(port, b"GET /metrics?x=1 HTTP/1.0\r\n\r\n")[0] == 200  # a query string is ignored
        for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"):
            request = f"{method} /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc".encode()
            status, headers, _ = raw_request(port, request)
            assert (status, headers.get("allow")) == (405, "GET, HEAD"), method
        for path in ("/", "/favicon.ico", "/metrics/x", "/metricsx"):
            assert raw_request(port, f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())[0] == 404, path
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(exporter.url.removesuffix("/metrics") + "/nope", timeout=JOIN_S)
        info.value.close()
        assert info.value.code == 404
        with socket.create_connection(("127.0.0.1", port), timeout=JOIN_S) as half_closed:
            half_closed.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            half_closed.shutdown(socket.SHUT_WR)  # as `printf ... | nc` does: still answered
            with half_closed.makefile("rb") as reader:
                assert reader.read().startswith(b"HTTP/1.1 200 OK\r\n")
        assert raw_request(port, b"NONSENSE\r\n\r\n")[0] == 400
        assert raw_request(port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20_000 + b"\r\n\r\n")[0] == 431
        assert b"streamwatch_info" in _get(exporter.url)


def test_a_failing_render_is_a_500_and_the_server_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, train: Train
) -> None:
    model, opt = _model()
    with sw.observe(model, opt, every=1) as watch:
        exporter = watch.expose(port=0)
        train(model, opt, watch, 1, shape=(16, 6), seed=0, flush=True)
        render = exporter.collector.render

        def broken() -> bytes:
            raise RuntimeError("boom")

        monkeypatch.setattr(exporter.collector, "render", broken)
        with caplog.at_level(logging.WARNING, logger="streamwatch"):
            assert raw_request(exporter.port, b"GET /metrics HTTP/1.0\r\n\r\n")[0] == 500
        assert any("rendering /metrics failed" in r.getMessage() for r in caplog.records)
        monkeypatch.setattr(exporter.collector, "render", render)
        assert b"streamwatch_info" in _get(exporter.url)


def test_an_empty_host_is_refused_not_bound_to_every_interface() -> None:
    model, _ = _model()
    with sw.observe(model, every=1) as watch:
        with pytest.raises(ValueError, match=r"host='' binds every interface; pass '0\.0\.0\.0' explicitly"):
            watch.expose(port=0, host="")
        with pytest.raises(ValueError, match="`host`"):
            watch.expose(port=0, host=None)  # type: ignore[arg-type]
        assert watch.expose(port=0).url.startswith("http://127.0.0.1:")  # nothing left registered


def test_unresolvable_and_foreign_hosts_are_clear_errors() -> None:
    model, _ = _model()
    with sw.observe(model, every=1) as watch:
        with pytest.raises(OSError, match=r"cannot resolve host 'no-such-host\.invalid'.*127\.0\.0\.1"):
            watch.expose(port=0, host="no-such-host.invalid")
        with pytest.raises(OSError, match=r"'192\.0\.2\.1' is not an address of this machine") as info:
            watch.expose(port=0, host="192.0.2.1")  # TEST-NET-1: documentation only, never local
        assert info.value.errno == errno.EADDRNOTAVAIL
        exporter = watch.expose(port=0, host="localhost")
        assert b"streamwatch_info" in _get(exporter.url)


def test_promtool_accepts_what_a_real_training_run_serves(train: Train) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail("needs promtool (the Debian package prometheus)")
        pytest.skip("needs promtool (the Debian package prometheus)")
    model, opt = _model()
    metrics = [*sw.DEFAULT_METRICS, sw.metrics.Histogram(kinds=("param_grad",))]
    with sw.observe(model, opt, metrics=metrics, every=1) as watch:
        exporter = watch.expose(port=0)
        train(model, opt, watch, 3, shape=(16, 6), seed=0, flush=True)
        body = _get(exporter.url)
    families = {f.name for f in text_string_to_metric_families(body.decode())}
    assert {"streamwatch_loss", "streamwatch_accuracy", "streamwatch_tensor_values"} <= families
    check = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, timeout=60, check=False
    )
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
    assert not check.stdout.strip(), check.stdout.decode()
    assert not check.stderr.strip(), check.stderr.decode()
    assert "streamwatch_predictions" in families  # the accuracy's denominator, a gauge
    assert "streamwatch_total" not in families
