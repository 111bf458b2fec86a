"""How long one ``/metrics`` render takes for 1 k and 10 k series (budget: ≤ 40 ms at 10 k), against the
same series as plain ``prometheus_client`` ``Gauge.labels(...).set(...)`` objects in the same run.

Run::

    python -m pytest benchmarks/bench_exporter.py -o python_files='bench_*.py' -p no:cacheprovider \
        --benchmark-only

The streamwatch side is the real thing: a Watch over a model with enough layers that its
``streamwatch_tensor_*`` families have the wanted number of series (about 36 statistics per tapped tensor),
its worker's latest values, and the work a scrape does: ``Exporter.collector.render()`` behind
``watch.expose()``'s endpoint, and ``generate_latest`` when the collector sits in a caller's registry.
The baseline registers one labelled ``Gauge`` with the same label sets and values, already set (what
people write by hand; its cost on the training thread, one ``.set()`` per series per step, is not counted).

``test_training_under_a_scrape_storm``: training speed (steps/s) of a small real model under
``observe`` + ``expose`` while 20 scrapers fetch ``/metrics`` in a loop as fast as they are answered,
against the same monitored run unscraped and an unmonitored run, in the same process and run (target:
the storm within 10 % of the unscraped run). The scrapers are 20 threads of a separate process (plain
sockets, standard library only): Prometheus scrapes from outside the training process, and scraper
threads inside it would measure their own GIL use, not the exporter's. ``torch.set_num_threads(1)``
leaves the VM's second core to that process. The three variants run round-robin in every cycle (the
order rotating), ``STORM_STEPS`` steps each; a variant's speed is the median over the cycles, and the
headline ratio the median over the cycles of storm / unscraped within the cycle (drift cancels).
The scraper process starts once and idles between storms (it scrapes only during the storm rounds).

``/metrics gzip``: the bytes a scrape moves and the time the server takes per scrape (a raw-socket GET
over 127.0.0.1 until the server closes, values unchanged so the cached body is served), without and with
``Accept-Encoding: gzip`` (Prometheus always asks for it, with the ``Accept`` header Prometheus sends);
the time to gzip a rendered body at zlib levels 1 (what the server uses) and 6, with prometheus_client's
own gzipped body (``generate_latest``, ``gzip.compress`` at level 9, as its WSGI app does) as the bytes
to compare; and render + compress, the render thread's work per version of the values for a gzip scrape.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import resource
import socket
import statistics
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from torch import nn

import streamwatch as sw
from streamwatch.sinks._http import GZIP_LEVEL, _Cached

STATS_PER_ROW = 36  # streamwatch_tensor_* series per tapped tensor (COLUMNS + derived + update_ratio)


def _watch(series: int) -> tuple[sw.Watch, Any]:
    width = max(
        1, series // (STATS_PER_ROW * 3)
    )  # 3 tapped tensors per Linear: activation, output/param grads
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(width)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = sw.observe(model, opt, metrics=(), every=1)
    exporter = watch.expose(port=0, series_budget=10**6)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    watch.step()
    assert watch.flush()
    return watch, exporter


def _tensor_series(body: bytes) -> int:
    """Samples of the per-statistic families (``streamwatch_tensor_<statistic>``; the histogram aside)."""
    return len(re.findall(rb"^streamwatch_tensor_(?!values_)\w+\{", body, re.MULTILINE))


@pytest.mark.parametrize("path", ["expose", "registry"])
@pytest.mark.parametrize("series", [1_000, 10_000])
@pytest.mark.benchmark(group="/metrics render")
def test_streamwatch_collector(benchmark: Any, series: int, path: str, bench_report: list[str]) -> None:
    """``expose``: the render ``watch.expose()``'s endpoint runs (cached label strings); ``registry``:
    ``generate_latest`` over the same collector in a registry (prometheus_client's formatter)."""
    watch, exporter = _watch(series)
    try:
        exported = sum(1 for s in watch.snapshot() if s.name == "streamwatch_tensor")
        render = exporter.collector.render if path == "expose" else lambda: generate_latest(exporter.registry)
        body = benchmark(render)
        assert _tensor_series(body) == exported
        benchmark.extra_info["series"] = exported
        if not benchmark.disabled:
            bench_report.append(
                f"/metrics render, streamwatch ({path}): {exported} series, "
                f"median {benchmark.stats.stats.median * 1e3:.1f} ms (budget ≤ 40 ms at 10 k)"
            )
    finally:
        watch.close()


@pytest.mark.parametrize("series", [1_000, 10_000])
@pytest.mark.benchmark(group="/metrics render")
def test_plain_gauges(benchmark: Any, series: int, bench_report: list[str]) -> None:
    watch, _ = _watch(series)
    try:
        samples = [s for s in watch.snapshot() if s.name == "streamwatch_tensor"]
    finally:
        watch.close()
    registry = CollectorRegistry()
    names = list(samples[0].labels)
    gauge = Gauge("streamwatch_tensor", "the same series by hand", names, registry=registry)
    for s in samples:
        gauge.labels(*(s.labels[n] for n in names)).set(s.value)
    body = benchmark(generate_latest, registry)
    assert body.count(b"streamwatch_tensor{") == len(samples)
    if not benchmark.disabled:
        bench_report.append(
            f"/metrics render, plain Gauge.labels: {len(samples)} series, "
            f"median {benchmark.stats.stats.median * 1e3:.1f} ms"
        )


# -- over the series budget: a model with 2 001 leaf modules -------------------------------------------------

WIDE_BLOCKS = 1000  # (Linear(16, 16), ReLU) blocks, and a head: 2 001 leaf modules
WIDE_STEPS = 22  # every step sampled: GradientSpike's warm-up (20) over, every detector family served
WIDE_ROUNDS = 15
PER_LAYER = (  # the samples of the families the budget bounds (streamwatch_tensor_*: statistics and buckets)
    "streamwatch_tensor_",
    "streamwatch_grad_norm_ratio{",
    "streamwatch_grad_norm_spikes_total{",
    "streamwatch_layer_update_ratio{",
    "streamwatch_update_ratio_out_of_band{",
)


def _wide() -> tuple[sw.Watch, Any, Callable[[], None]]:
    """The 2 001-module model observed with every step sampled, ``expose()`` with the default budget, and
    a function that trains one more step and waits for the worker."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(WIDE_BLOCKS):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    watch = sw.observe(model, opt, every=1)
    exporter = watch.expose(port=0)
    g = torch.Generator().manual_seed(0)

    def step() -> None:
        loss = model(torch.randn(8, 16, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        watch.step(loss=loss)
        assert watch.flush()

    for _ in range(WIDE_STEPS):
        step()
    return watch, exporter, step


@pytest.mark.parametrize("values", ["unchanged", "fresh"])
@pytest.mark.benchmark(group="/metrics render over the series budget")
def test_render_over_the_budget(benchmark: Any, values: str, bench_report: list[str]) -> None:
    """``render()`` of the 2 001-module model under the default ``series_budget=5000`` (~169 k per-layer
    series wanted, ~5 000 served): ``unchanged``, the same values again (what a render costs beyond
    reading the store); ``fresh``, a training step before each render (untimed), so the render also
    brings the store up to date (the worker-side metrics and the detectors' samples of the new record),
    as the endpoint's render after each step does. Budget: <= 40 ms median."""
    watch, exporter, step = _wide()
    try:
        render = exporter.collector.render
        render()  # the first render over the budget warns, and builds the layout and label strings
        setup = step if values == "fresh" else None
        text = benchmark.pedantic(render, setup=setup, rounds=WIDE_ROUNDS, warmup_rounds=1).decode()
        served = sum(1 for line in text.splitlines() if line.startswith(PER_LAYER))
        series, wanted = (
            int(float(line.rsplit(" ", 1)[1]))
            for name in ("streamwatch_series{", "streamwatch_series_wanted{")
            for line in text.splitlines()
            if line.startswith(name)
        )
        assert served == series <= 5000 < wanted
        median = benchmark.stats.stats.median if not benchmark.disabled else math.nan
        benchmark.extra_info.update({"series": series, "wanted": wanted, "median_ms": round(median * 1e3, 2)})
        if not benchmark.disabled:
            bench_report.append(
                f"/metrics render over the budget ({values} values): 2 001 modules, {series} of {wanted} "
                f"per-layer series, median {median * 1e3:.1f} ms (budget <= 40 ms)"
            )
    finally:
        exporter.close()
        watch.close()


# -- bytes and time per scrape, with and without gzip ----------------------------------------------------

PROMETHEUS_ACCEPT = (  # what Prometheus 2.x sends with every scrape, beside Accept-Encoding: gzip
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


SCRAPE_ROUNDS = 100

# One scrape per stdin line, over a fresh connection, read until the server closes it; answers the bytes
# read. A separate process, so that the client's reading is neither in the server's CPU time nor
# competing with the server's threads for the GIL.
SCRAPE_ONE = r"""
import json, socket, sys
port, request = int(sys.argv[1]), json.loads(sys.argv[2]).encode("latin-1")
for _ in sys.stdin:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        n = 0
        while chunk := sock.recv(1 << 16):
            n += len(chunk)
    print(n, flush=True)
"""


def _scrape(port: int, request: bytes) -> bytes:
    """One GET over a fresh connection, read until the server closes it: the whole response."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(1 << 16):
            chunks.append(chunk)
    return b"".join(chunks)


def _cpu_s() -> float:
    """This process's CPU time (every thread, user and system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@pytest.mark.parametrize("encoding", ["identity", "gzip"])
@pytest.mark.parametrize("series", [1_000, 10_000])
@pytest.mark.benchmark(group="/metrics gzip: per scrape")
def test_bytes_per_scrape(benchmark: Any, series: int, encoding: str, bench_report: list[str]) -> None:
    """One scrape of an unchanged body (no render: the cached response is sent) through
    ``watch.expose()``'s real server, from a client in another process: the time until the client has
    read the whole response (each scrape once the server's batch spacing has passed, so that the time is
    the serving's, not the rate limit's), the server's CPU time, and the bytes sent."""
    watch, exporter = _watch(series)
    try:
        server = exporter._server
        assert server is not None
        server.min_interval = 0.0
        headers = f"Accept: {PROMETHEUS_ACCEPT}\r\nAccept-Encoding: gzip\r\n" if encoding == "gzip" else ""
        request = f"GET /metrics HTTP/1.1\r\nHost: bench\r\n{headers}\r\n"
        response = _scrape(exporter.port, request.encode())  # renders (and compresses) once
        renders, compressions = server.renders, server.compressions
        client = subprocess.Popen(
            [sys.executable, "-c", SCRAPE_ONE, str(exporter.port), json.dumps(request)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert client.stdin is not None
        assert client.stdout is not None
        stdin, stdout = client.stdin, client.stdout
        cpu, scrapes = [0.0], [0]

        def scrape() -> int:
            start = _cpu_s()
            stdin.write("\n")
            stdin.flush()
            size = int(stdout.readline())
            cpu[0] += _cpu_s() - start
            scrapes[0] += 1
            return size

        def after_the_spacing() -> None:
            time.sleep(max(0.0, server._next_batch - time.monotonic()))

        try:
            size = benchmark.pedantic(scrape, setup=after_the_spacing, rounds=SCRAPE_ROUNDS, warmup_rounds=3)
        finally:
            client.communicate(timeout=60)  # closes its stdin (it exits) and its stdout
        assert size == len(response)
        assert (server.renders, server.compressions) == (renders, compressions)  # served from the cache
        assert compressions == (1 if encoding == "gzip" else 0)
        head, _, body = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        plain = gzip.decompress(body) if encoding == "gzip" else body
        exported = _tensor_series(plain)
        info = {
            "series": exported,
            "encoding": encoding,
            "body_bytes": len(body),
            "response_bytes": len(response),
            "plain_body_bytes": len(plain),
            "compression_ratio": round(len(plain) / len(body), 2),
            "server_cpu_ms_per_scrape": round(cpu[0] / scrapes[0] * 1e3, 3),
        }
        benchmark.extra_info.update(info)
        if not benchmark.disabled:
            bench_report.append(
                f"/metrics scrape, {encoding}: {exported} series, {len(body):,} body bytes "
                f"({len(plain):,} plain, ratio {info['compression_ratio']}), "
                f"median {benchmark.stats.stats.median * 1e3:.2f} ms per scrape (cached body), "
                f"server CPU {info['server_cpu_ms_per_scrape']} ms per scrape"
            )
    finally:
        watch.close()


@pytest.mark.parametrize("level", [1, 6])
@pytest.mark.parametrize("series", [1_000, 10_000])
@pytest.mark.benchmark(group="/metrics gzip: compress")
def test_gzip_level(benchmark: Any, series: int, level: int, bench_report: list[str]) -> None:
    """gzip of one rendered body at zlib level 1 (the server's) and 6 (zlib's default)."""
    watch, exporter = _watch(series)
    try:
        body = exporter.collector.render()
        reference = gzip.compress(generate_latest(exporter.registry))  # prometheus_client's app: level 9
    finally:
        watch.close()
    packed = benchmark(zlib.compress, body, level, wbits=31)
    assert gzip.decompress(packed) == body
    exported = _tensor_series(body)
    benchmark.extra_info.update(
        {
            "series": exported,
            "level": level,
            "server_level": GZIP_LEVEL,
            "plain_bytes": len(body),
            "gzip_bytes": len(packed),
            "prometheus_client_gzip_bytes": len(reference),
        }
    )
    if not benchmark.disabled:
        bench_report.append(
            f"gzip level {level}: {exported} series, {len(body):,} -> {len(packed):,} bytes "
            f"(prometheus_client's app: {len(reference):,}), median "
            f"{benchmark.stats.stats.median * 1e3:.2f} ms"
        )


@pytest.mark.parametrize("series", [1_000, 10_000])
@pytest.mark.benchmark(group="/metrics gzip: render + compress")
def test_render_and_gzip(benchmark: Any, series: int, bench_report: list[str]) -> None:
    """The render thread's work for one version of the values when a scraper asks for gzip: render,
    the cached responses, and their gzip (at the server's level)."""
    watch, exporter = _watch(series)
    try:
        render = exporter.collector.render

        def render_and_compress() -> _Cached:
            cached = _Cached(None, render())
            cached.compress()
            return cached

        cached = benchmark(render_and_compress)
        assert cached.gzip_get is not None
        exported = cached.get.count(b"streamwatch_tensor{")
        gzip_bytes = len(cached.gzip_get) - len(cached.gzip_head or b"")
        benchmark.extra_info.update({"series": exported, "level": GZIP_LEVEL, "gzip_bytes": gzip_bytes})
        if not benchmark.disabled:
            bench_report.append(
                f"render + gzip (level {GZIP_LEVEL}): {exported} series, "
                f"median {benchmark.stats.stats.median * 1e3:.1f} ms"
            )
    finally:
        watch.close()


# -- training under a scrape storm ------------------------------------------------------------------------

SCRAPERS = 20
STORM_STEPS = 200  # steps per variant per cycle (short rounds, many cycles: the 2-core VM drifts)
STORM_ROUNDS = 30
STORM_TARGET = 0.90  # storm steps/s over unscraped steps/s

# One process, SCRAPERS threads; stdin lines: "go" (scrape in a loop, each thread as soon as its last
# response is in; answers "ready"), "pause" (finish the scrapes in flight; answers the counts since "go").
SCRAPER = r"""
import json, socket, sys, threading
port, n = int(sys.argv[1]), int(sys.argv[2])
go, quit = threading.Event(), threading.Event()
ok, failed, idle = [0] * n, [0] * n, [threading.Event() for _ in range(n)]
def scrape():
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: bench\r\n\r\n")
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    return data.split(b" ", 2)[1:2] == [b"200"] and b"streamwatch_steps_total" in data
def loop(i):
    while not quit.is_set():
        idle[i].set()
        go.wait(0.1)
        if not go.is_set():
            continue
        idle[i].clear()
        try:
            if scrape():
                ok[i] += 1
            else:
                failed[i] += 1
        except OSError:
            failed[i] += 1
threads = [threading.Thread(target=loop, args=(i,)) for i in range(n)]
for t in threads:
    t.start()
for line in sys.stdin:
    if line.strip() == "go":
        ok[:], failed[:] = [0] * n, [0] * n
        go.set()
        print("ready", flush=True)
    elif line.strip() == "pause":
        go.clear()
        for e in idle:
            e.wait()
        print(json.dumps({"ok": sum(ok), "failed": sum(failed)}), flush=True)
quit.set()
for t in threads:
    t.join()
"""


def _storm_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, watch: sw.Watch | None, n: int) -> float:
    """Train ``n`` steps; return steps per second."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    start = time.perf_counter()
    for _ in range(n):
        out = model(x)
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if watch is not None:
            watch.step(loss=loss, outputs=out, targets=y, batch_size=32)
    return n / (time.perf_counter() - start)


class _Scrapers:
    """The scraper process: :meth:`go` starts the storm, :meth:`pause` ends it and returns the counts."""

    def __init__(self, port: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SCRAPER, str(port), str(SCRAPERS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def _ask(self, command: str) -> str:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def go(self) -> None:
        assert self._ask("go") == "ready"

    def pause(self) -> dict[str, int]:
        counts: dict[str, int] = json.loads(self._ask("pause"))
        return counts

    def close(self) -> None:
        self.proc.communicate(timeout=60)


@pytest.mark.benchmark(group="scrape storm")
def test_training_under_a_scrape_storm(benchmark: Any, bench_report: list[str]) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    plain_model, plain_opt = _storm_model()
    model, opt = _storm_model()
    watch = sw.observe(model, opt, every=1)
    speeds: dict[str, list[float]] = {"unmonitored": [], "monitored": [], "storm": []}
    scrapes: list[float] = []
    paired: list[float] = []  # storm over monitored, within each cycle
    failed = 0
    try:
        exporter = watch.expose(port=0, run="storm")
        assert watch.flush()
        scrapers = _Scrapers(exporter.port)

        def storm() -> float:
            nonlocal failed
            scrapers.go()
            try:
                start = time.perf_counter()
                speed = _steps(model, opt, watch, STORM_STEPS)
                elapsed = time.perf_counter() - start
            finally:
                counts = scrapers.pause()
            scrapes.append(counts["ok"] / elapsed)  # (an upper bound: the scrapes in flight at the end)
            failed += counts["failed"]
            return speed

        variants: dict[str, Callable[[], float]] = {
            "unmonitored": lambda: _steps(plain_model, plain_opt, None, STORM_STEPS),
            "monitored": lambda: _steps(model, opt, watch, STORM_STEPS),
            "storm": storm,
        }
        cycle_index = [0]

        def cycle() -> None:
            names = list(variants)
            k = cycle_index[0] % len(names)
            cycle_index[0] += 1
            for name in names[k:] + names[:k]:
                speed = variants[name]()
                if cycle_index[0] > 1:  # the first cycle warms up
                    speeds[name].append(speed)
                assert watch.flush(timeout=60)  # no variant pays for another's backlog
            if cycle_index[0] > 1:
                paired.append(speeds["storm"][-1] / speeds["monitored"][-1])

        try:
            benchmark.pedantic(cycle, rounds=STORM_ROUNDS, iterations=1, warmup_rounds=1)
        finally:
            scrapers.close()
        stats = watch.statistics()
        assert stats.hook_errors == 0
        assert stats.pipeline_failures == 0
        server = exporter._server
        renders = server.renders if server is not None else 0
    finally:
        watch.close()
        torch.set_num_threads(threads)
    median = {name: statistics.median(v) for name, v in speeds.items()}
    ratio = statistics.median(paired)
    info = {
        "unmonitored_steps_per_s": round(median["unmonitored"], 1),
        "monitored_steps_per_s": round(median["monitored"], 1),
        "storm_steps_per_s": round(median["storm"], 1),
        "storm_over_monitored": round(ratio, 4),  # the median of the cycles' ratios
        "storm_over_monitored_of_medians": round(median["storm"] / median["monitored"], 4),
        "storm_over_monitored_q1_q3": [round(q, 4) for q in statistics.quantiles(paired, n=4)[::2]],
        "monitored_over_unmonitored": round(median["monitored"] / median["unmonitored"], 4),
        "storm_over_unmonitored": round(median["storm"] / median["unmonitored"], 4),
        "scrapes_per_s": round(statistics.median(scrapes), 1),
        "failed_scrapes": failed,
        "renders": renders,
        "scrapers": SCRAPERS,
        "target_met": ratio >= STORM_TARGET,
    }
    benchmark.extra_info.update(info)
    assert failed == 0
    if not benchmark.disabled:
        bench_report.append(
            f"training under a {SCRAPERS}-scraper storm: {median['storm']:.0f} steps/s vs "
            f"{median['monitored']:.0f} unscraped (ratio {ratio:.3f}, quartiles "
            f"{info['storm_over_monitored_q1_q3']}; target >= {STORM_TARGET}), "
            f"{median['unmonitored']:.0f} unmonitored; "
            f"{info['scrapes_per_s']} scrapes/s served, {renders} renders, {failed} failed"
        )
