"""The /metrics server's content negotiation, over real sockets on 127.0.0.1: a real
:class:`~streamwatch.sinks._http.MetricsServer` serving a known multi-KB Prometheus text body.

``Accept-Encoding``: gzip when the client accepts it (tokens, q-values, ``q=0`` refuses, ``*``, any case),
the identity otherwise, ``Vary`` always; HEAD gets GET's headers; the body is compressed once per version
of the values however many clients ask. ``Accept``: the text format 0.0.4 whenever ``text/plain`` or
``*/*`` is acceptable (Prometheus' own header included), 406 otherwise. And a real Prometheus server
(which always asks for gzip) scrapes it and ingests every sample.
"""

from __future__ import annotations

import gzip
import http.client
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from streamwatch.sinks._http import CONTENT_TYPE, MetricsServer, listen
from tests.promserver import PrometheusServer, require_prometheus
from tests.rawhttp import raw_request
from tests.threads import JOIN_S, spawn

SERIES = 400
PROMETHEUS_ACCEPT = (  # what Prometheus 2.x sends with every scrape
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def _body(version: int = 0) -> bytes:
    lines = [
        "# HELP sw_test_value A gauge for the /metrics server's tests.",
        "# TYPE sw_test_value gauge",
        *(
            f'sw_test_value{{layer="layer_{i // 8:03d}",stat="stat_{i % 8}"}} {i * 0.25 + version}'
            for i in range(SERIES)
        ),
        "# HELP sw_test_version The version of the values.",
        "# TYPE sw_test_version gauge",
        f"sw_test_version {version}",
    ]
    return ("\n".join(lines) + "\n").encode()


class _Source:
    """A render callable that counts its calls, and the version of its values."""

    def __init__(self) -> None:
        self.version = 0
        self.renders = 0
        self.lock = threading.Lock()

    def render(self) -> bytes:
        with self.lock:
            self.renders += 1
            return _body(self.version)

    def current(self) -> object:
        return self.version


@pytest.fixture
def source() -> _Source:
    return _Source()


@pytest.fixture
def server(source: _Source) -> Iterator[MetricsServer]:
    server = MetricsServer(listen("127.0.0.1", 0, 64), source.render, source.current, timeout=5.0)
    server.min_interval = 0.0  # no spacing between batches: the tests scrape back to back
    try:
        yield server
    finally:
        server.close()


def _port(server: MetricsServer) -> int:
    return int(server._listener.getsockname()[1])


def _request(
    port: int, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One request through http.client (which adds no Accept-Encoding of its own when told not to)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=JOIN_S)
    try:
        conn.putrequest(method, "/metrics", skip_accept_encoding=True)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        conn.endheaders()
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body
    finally:
        conn.close()


def _vary(headers: dict[str, str]) -> set[str]:
    return {token.strip().lower() for token in headers.get("vary", "").split(",")}


def test_gzip_when_asked_decompresses_to_exactly_the_plain_body(server: MetricsServer) -> None:
    port = _port(server)
    status, headers, plain = _request(port)
    assert status == 200
    assert plain == _body()
    assert "content-encoding" not in headers
    assert "accept-encoding" in _vary(headers)
    assert len(plain) > 10_000  # multi-KB: worth compressing

    status, headers, packed = _request(port, headers={"Accept-Encoding": "gzip"})
    assert status == 200
    assert headers["content-encoding"] == "gzip"
    assert "accept-encoding" in _vary(headers)
    assert headers["content-type"] == CONTENT_TYPE
    assert int(headers["content-length"]) == len(packed)
    assert gzip.decompress(packed) == plain
    assert len(packed) * 5 < len(plain)


@pytest.mark.parametrize(
    ("accept_encoding", "gzipped"),
    [
        (None, False),  # no header: no preference, the identity (what curl without --compressed reads)
        ("", False),  # empty: the identity only
        ("gzip", True),
        ("GZip", True),  # codings are case-insensitive
        ("x-gzip", True),
        ("gzip, deflate, br", True),  # a browser
        ("deflate, gzip;q=0.5", True),  # gzip acceptable, at a lower weight than deflate (not served)
        ("gzip;q=0.5", True),  # the identity is acceptable but unlisted: gzip, listed, is preferred
        ("gzip;q=0", False),  # q=0: refused
        ("gzip; Q=0.000", False),
        ("GZIP ; q = 0", False),
        ("gzip;q=0, *", False),  # refused by name, even though * accepts the rest
        ("*", True),
        ("*;q=0.3", True),
        ("*;q=0", False),  # nothing acceptable: the identity anyway (RFC 9110 12.5.3)
        ("*;q=0, gzip", True),
        ("identity", False),
        ("identity;q=0, gzip;q=0.1", True),
        ("gzip;q=0.5, identity", False),  # the client prefers the identity
        ("gzip;q=0.5, *", False),  # ... through *
        ("br, deflate", False),
        ("gzip;q=nonsense", False),  # a malformed weight: the element is ignored
        ("gzip;q=2", False),
    ],
)
def test_accept_encoding_is_parsed_with_tokens_and_q_values(
    server: MetricsServer, accept_encoding: str | None, gzipped: bool
) -> None:
    headers = {} if accept_encoding is None else {"Accept-Encoding": accept_encoding}
    status, got, body = _request(_port(server), headers=headers)
    assert status == 200
    assert "accept-encoding" in _vary(got)
    if gzipped:
        assert got["content-encoding"] == "gzip"
        assert gzip.decompress(body) == _body()
    else:
        assert "content-encoding" not in got
        assert body == _body()
    assert int(got["content-length"]) == len(body)


def test_accept_encoding_over_several_header_lines_is_one_list(server: MetricsServer) -> None:
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\naccept-encoding: br\r\nACCEPT-ENCODING: gzip\r\n\r\n"
    status, headers, body = raw_request(_port(server), request)
    assert (status, headers["content-encoding"]) == (200, "gzip")
    assert gzip.decompress(body) == _body()
    request = b"GET /metrics HTTP/1.0\nAccept-Encoding: gzip\n\n"  # bare LFs, HTTP/1.0
    status, headers, body = raw_request(_port(server), request)
    assert (status, headers["content-encoding"]) == (200, "gzip")


@pytest.mark.parametrize("accept_encoding", [None, "gzip"])
def test_head_gets_the_headers_of_get_and_no_body(server: MetricsServer, accept_encoding: str | None) -> None:
    port = _port(server)
    headers = {} if accept_encoding is None else {"Accept-Encoding": accept_encoding}
    get_status, get_headers, get_body = _request(port, "GET", headers)
    line = "" if accept_encoding is None else f"Accept-Encoding: {accept_encoding}\r\n"
    head_status, head_headers, head_body = raw_request(
        port, f"HEAD /metrics HTTP/1.1\r\nHost: x\r\n{line}\r\n".encode()
    )
    assert (get_status, head_status, head_body) == (200, 200, b"")
    assert head_headers == get_headers
    assert int(head_headers["content-length"]) == len(get_body)
    assert head_headers.get("content-encoding") == accept_encoding


def test_urllib_with_gzip_reads_the_same_values(server: MetricsServer) -> None:
    request = urllib.request.Request(
        f"http://127.0.0.1:{_port(server)}/metrics", headers={"Accept-Encoding": "gzip"}
    )
    with urllib.request.urlopen(request, timeout=JOIN_S) as resp:
        assert resp.headers["Content-Encoding"] == "gzip"
        assert gzip.decompress(resp.read()) == _body()


@pytest.mark.parametrize(
    "accept",
    [
        None,
        PROMETHEUS_ACCEPT,
        "text/plain",
        "text/plain;version=0.0.4",
        "TEXT/Plain; charset=utf-8",
        "text/*",
        "*/*",
        "application/json, */*;q=0.01",
        "application/openmetrics-text;version=1.0.0, text/plain;q=0.1",
        "",  # empty: as good as absent
        "not a media range",  # nothing parsable: as good as absent
    ],
)
def test_the_text_format_is_served_whenever_it_is_acceptable(
    server: MetricsServer, accept: str | None
) -> None:
    headers = {} if accept is None else {"Accept": accept}
    status, got, body = _request(_port(server), headers={**headers, "Accept-Encoding": "gzip"})
    assert status == 200
    assert got["content-type"] == CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"
    assert gzip.decompress(body) == _body()


@pytest.mark.parametrize(
    "accept",
    [
        "application/json",
        "application/openmetrics-text;version=1.0.0",
        "application/openmetrics-text; version=1.0.0, application/json;q=0.5",
        "text/plain;q=0, */*",  # refused by name: the more specific range wins
        "text/*;q=0, application/json",
        "*/*;q=0",
        "text/html, image/*",
    ],
)
def test_406_when_the_accept_header_excludes_the_text_format(server: MetricsServer, accept: str) -> None:
    port = _port(server)
    status, headers, body = _request(port, headers={"Accept": accept, "Accept-Encoding": "gzip"})
    assert status == 406
    assert "content-encoding" not in headers  # the short explanation is not compressed
    assert CONTENT_TYPE.encode() in body  # it names the format served
    assert int(headers["content-length"]) == len(body)
    status, head_headers, head_body = raw_request(
        port, f"HEAD /metrics HTTP/1.1\r\nAccept: {accept}\r\n\r\n".encode()
    )
    assert (status, head_body, head_headers) == (406, b"", headers)


def test_compression_happens_once_per_version_however_many_clients_ask(
    server: MetricsServer, source: _Source
) -> None:
    port = _port(server)
    for _ in range(3):  # the identity only: nothing is compressed
        assert _request(port)[0] == 200
    assert (source.renders, server.renders, server.compressions) == (1, 1, 0)

    def scrapes() -> list[bytes]:
        return [_request(port, headers={"Accept-Encoding": "gzip"})[2] for _ in range(10)]

    scrapers = [spawn(scrapes) for _ in range(8)]  # concurrent gzip scrapes of one version
    bodies = {body for scraper in scrapers for body in scraper.finish()}
    assert len(bodies) == 1
    assert gzip.decompress(bodies.pop()) == _body(0)
    assert (source.renders, server.renders, server.compressions) == (1, 1, 1)
    assert _request(port)[2] == _body(0)  # the plain body is still there

    source.version = 1  # new values: one more render and, once asked for, one more compression
    assert _request(port)[2] == _body(1)
    assert (source.renders, server.compressions) == (2, 1)
    for _ in range(5):
        assert gzip.decompress(_request(port, headers={"Accept-Encoding": "gzip"})[2]) == _body(1)
    assert (source.renders, server.renders, server.compressions) == (2, 2, 2)


def test_a_real_prometheus_scrapes_the_gzip_body(tmp_path: Path, server: MetricsServer) -> None:
    require_prometheus()
    with PrometheusServer(tmp_path, [f"127.0.0.1:{_port(server)}"]) as prom:
        prom.wait_for('up{job="streamwatch"}', lambda r: bool(r) and r[0]["value"][1] == "1")
        count = prom.wait_for("count(sw_test_value)", lambda r: bool(r) and r[0]["value"][1] == str(SERIES))
        assert count[0]["value"][1] == str(SERIES)
        value = prom.query('sw_test_value{layer="layer_049",stat="stat_7"}')
        assert float(value[0]["value"][1]) == 399 * 0.25
        (target,) = prom.targets()
        assert (target["health"], target["lastError"]) == ("up", "")
    assert server.compressions >= 1  # Prometheus asked for gzip, and read what it got


# -- OpenMetrics, when the server is given a renderer for it ---------------------------------------------

_OM_BODY = (
    b"# HELP sw_test_version The version of the values.\n# TYPE sw_test_version gauge\n"
    b"sw_test_version 0\n# EOF\n"
)


@pytest.fixture
def om_server(source: _Source) -> Iterator[tuple[MetricsServer, list[int]]]:
    """A server that renders both formats; the list counts the OpenMetrics renders."""
    om_renders = [0]

    def render_om() -> bytes:
        om_renders[0] += 1
        return _OM_BODY

    server = MetricsServer(
        listen("127.0.0.1", 0, 64), source.render, source.current, timeout=5.0, render_openmetrics=render_om
    )
    server.min_interval = 0.0
    try:
        yield server, om_renders
    finally:
        server.close()


@pytest.mark.parametrize(
    ("accept", "expected"),
    [
        (PROMETHEUS_ACCEPT, "openmetrics"),  # what Prometheus asks: OpenMetrics first
        ("application/openmetrics-text;version=1.0.0", "openmetrics"),
        ("application/openmetrics-text; version=1.0.0, application/json;q=0.5", "openmetrics"),
        ("application/openmetrics-text;version=1.0.0, text/plain;q=0.1", "openmetrics"),
        ("text/plain;q=0, */*", "openmetrics"),  # the text format refused by name
        ("application/*, text/plain;q=0.9", "openmetrics"),
        (None, "text"),
        ("*/*", "text"),  # a tie: the text format
        ("text/plain", "text"),
        ("text/plain, application/openmetrics-text;q=0.5", "text"),
        ("application/openmetrics-text;q=0, */*", "text"),
        ("", "text"),
    ],
)
def test_openmetrics_is_served_when_the_client_prefers_it(
    om_server: tuple[MetricsServer, list[int]], accept: str | None, expected: str
) -> None:
    server, _ = om_server
    headers = {} if accept is None else {"Accept": accept}
    status, got, body = _request(_port(server), headers={**headers, "Accept-Encoding": "gzip"})
    assert status == 200
    assert "accept" in _vary(got)
    if expected == "openmetrics":
        assert got["content-type"] == "application/openmetrics-text; version=1.0.0; charset=utf-8"
        assert gzip.decompress(body) == _OM_BODY
    else:
        assert got["content-type"] == CONTENT_TYPE
        assert gzip.decompress(body) == _body()


def test_each_format_is_rendered_once_per_version(
    om_server: tuple[MetricsServer, list[int]], source: _Source
) -> None:
    server, om_renders = om_server
    port = _port(server)
    for _ in range(3):
        assert _request(port, headers={"Accept": PROMETHEUS_ACCEPT})[0] == 200
        assert _request(port)[0] == 200
    assert (source.renders, om_renders[0], server.renders) == (1, 1, 2)
    source.version += 1
    assert _request(port, headers={"Accept": PROMETHEUS_ACCEPT})[2] == _OM_BODY
    assert (source.renders, om_renders[0]) == (1, 2)  # the text format was not asked for: not rendered


@pytest.mark.parametrize("accept", ["application/json", "text/plain;q=0, application/openmetrics-text;q=0"])
def test_406_names_both_formats_when_neither_is_acceptable(
    om_server: tuple[MetricsServer, list[int]], accept: str
) -> None:
    status, _, body = _request(_port(om_server[0]), headers={"Accept": accept})
    assert status == 406
    assert CONTENT_TYPE.encode() in body
    assert b"application/openmetrics-text; version=1.0.0" in body
