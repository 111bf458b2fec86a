"""The /metrics HTTP server: two threads whatever the load, bounded connections, cached bodies.

:class:`MetricsServer` serves ``GET``/``HEAD /metrics`` from a ``render()`` callable over one listening
socket made by :func:`listen`. It knows nothing of Prometheus families: the exporter
(:mod:`streamwatch.sinks._prometheus`) and ``streamwatch replay`` hand it what to render.

One thread multiplexes every connection over non-blocking sockets: a client that connects and sends
nothing, half a request or reads slowly holds a buffer, never a thread, and is closed after ``timeout``
seconds; at most 64 connections are open (a new one evicts the oldest still sending its request); only
``GET``/``HEAD /metrics`` are served (other methods 405 with ``Allow``, other paths 404, a bad request
line 400, oversized headers 431). The other thread answers the waiting requests in batches, at most 4 a
second, with one body per version of the values (rendered at most once however many scrapers ask, and
at most 2 % of the time). ``close()`` joins both threads and closes every connection.

**Content negotiation.** Two formats: the Prometheus text format 0.0.4 (:data:`CONTENT_TYPE`) and, when
the server is given a ``render_openmetrics`` callable (the exporter and replay give one), OpenMetrics
1.0.0 (:data:`OPENMETRICS_CONTENT_TYPE`). OpenMetrics is served when ``application/openmetrics-text`` (or
``application/*``, or ``*/*``: the most specific matching range decides) weighs more than the text
format's range, or the text format is refused: Prometheus asks ``application/openmetrics-text;
version=1.0.0,...,text/plain;version=0.0.4;q=0.5,*/*;q=0.1`` and gets OpenMetrics. The text format is
served whenever the client accepts ``text/plain``, ``text/*`` or ``*/*`` at least as much (media-type
parameters are not compared), or sends no (or no parsable) ``Accept``; a header that excludes both gets
406 Not Acceptable, with a short body naming the formats served.

**Compression.** ``Accept-Encoding`` is parsed as RFC 9110 says (comma-separated codings, any case,
``q`` weights, ``q=0`` refuses, ``*`` stands for the codings not named, several header lines make one
list): the body is gzipped when ``gzip`` (or ``x-gzip``) is acceptable and weighs at least as much as
the identity, so Prometheus, which always asks for gzip, gets a body some 16 times smaller (about 96 KB
instead of 1.6 MB at 10 k series). No header, an empty one or gzip refused: the identity. Every
``/metrics`` response says ``Vary: Accept, Accept-Encoding``. The gzip body is made once per version
of the values on the render thread, and only once some client asked for it; HEAD gets the headers
(``Content-Length`` included) of the GET it stands for.
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable

__all__ = ["CONTENT_TYPE", "OPENMETRICS_CONTENT_TYPE", "MetricsServer", "listen"]

log = logging.getLogger("streamwatch")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The Prometheus text exposition format, version 0.0.4."""
OPENMETRICS_CONTENT_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"
"""OpenMetrics 1.0.0, for a client whose ``Accept`` prefers it (Prometheus does)."""

_JOIN_S = 10.0  # bound on joining the server's threads at close()

GZIP_LEVEL = 1
"""zlib's fastest level. On a 10 k-series body (1.56 MB) level 1 takes 4.1 ms and gives 96 KB, level 6
(zlib's default) 12 ms and 82 KB, level 9 34 ms and 74 KB (measured on this project's 2-core VM; the
1 k-series body: 0.7 ms / 13.8 KB against 1.9 ms / 11.8 KB): level 1 already removes 94 % of the
bytes, and the compression runs beside the training loop, within the render thread's time share, so
3 times the CPU time for 15 % fewer bytes is not worth it."""

_VARY = "Vary: Accept, Accept-Encoding\r\n"
_GZIP = "Content-Encoding: gzip\r\n"


class _Conn:
    """One client connection, owned by the server's I/O thread.

    ``state``: ``read`` (until the request's headers are in), ``wait`` (for the render thread's body),
    ``write`` (the response, non-blocking), ``drain`` (written; reading what the client still sends
    until it closes, so unread request bytes do not turn the close into a reset that loses the response).
    """

    __slots__ = (
        "buffer",
        "closed",
        "deadline",
        "events",
        "gzip",
        "head",
        "linger",
        "openmetrics",
        "out",
        "sock",
        "state",
    )

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.state = "read"
        self.buffer = bytearray()
        self.out = memoryview(b"")
        self.deadline: float | None = deadline
        self.head = False  # a HEAD request: the headers only
        self.gzip = False  # the client accepts (and prefers) gzip
        self.openmetrics = False  # the client prefers OpenMetrics (and the server renders it)
        self.linger = False
        self.closed = False
        self.events = 0  # what the selector watches for (0: not registered)


class _Cached:
    """One version of the values: the rendered body and the full responses to GET and HEAD, plain and
    (once some client asked for it: :meth:`compress`, on the render thread) gzipped."""

    __slots__ = ("content_type", "get", "gzip_get", "gzip_head", "head", "version")

    def __init__(self, version: object, body: bytes, content_type: str = CONTENT_TYPE) -> None:
        self.version = version
        self.content_type = content_type
        self.head = _response_head("200 OK", content_type, len(body), _VARY)
        self.get = self.head + body
        self.gzip_head: bytes | None = None
        self.gzip_get: bytes | None = None

    def compress(self) -> None:
        """Make the gzip responses (the body is read in place, not copied)."""
        body = zlib.compress(memoryview(self.get)[len(self.head) :], GZIP_LEVEL, wbits=31)  # 31: gzip
        self.gzip_head = _response_head("200 OK", self.content_type, len(body), _GZIP + _VARY)
        self.gzip_get = self.gzip_head + body

    def response(self, head: bool, gzip: bool) -> bytes:
        if gzip and self.gzip_head is not None and self.gzip_get is not None:
            return self.gzip_head if head else self.gzip_get
        return self.head if head else self.get


def _response_head(status: str, content_type: str, length: int, extra: str = "") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {length}\r\n{extra}"
        "Connection: close\r\n\r\n"
    ).encode("latin-1")


def _plain(status: str, text: str, extra: str = "") -> bytes:
    body = text.encode()
    return _response_head(status, "text/plain; charset=utf-8", len(body), extra) + body


_NOT_ALLOWED = _plain("405 Method Not Allowed", "Only GET and HEAD are served.\n", "Allow: GET, HEAD\r\n")
_NOT_FOUND = _plain("404 Not Found", "Not found: streamwatch serves /metrics only.\n")
_BAD_REQUEST = _plain("400 Bad Request", "Bad request.\n")
_TOO_LARGE = _plain("431 Request Header Fields Too Large", "Request headers too large.\n")
_BUSY = _plain("503 Service Unavailable", "Too many connections; retry.\n", "Retry-After: 1\r\n")
_NOT_ACCEPTABLE = _plain(
    "406 Not Acceptable",
    f"Not acceptable: streamwatch serves the Prometheus text format 0.0.4 only ({CONTENT_TYPE}).\n",
    _VARY,
)
_NOT_ACCEPTABLE_OM = _plain(
    "406 Not Acceptable",
    f"Not acceptable: streamwatch serves the Prometheus text format 0.0.4 ({CONTENT_TYPE}) and "
    f"OpenMetrics 1.0.0 ({OPENMETRICS_CONTENT_TYPE}).\n",
    _VARY,
)
_FAILED = _plain("500 Internal Server Error", "Rendering failed; see the log.\n")


def _head_only(response: bytes) -> bytes:
    """The status line and headers of ``response``: what HEAD gets."""
    return response[: response.index(b"\r\n\r\n") + 4]


_NOT_FOUND_HEAD = _head_only(_NOT_FOUND)
_NOT_ACCEPTABLE_HEAD = _head_only(_NOT_ACCEPTABLE)
_NOT_ACCEPTABLE_OM_HEAD = _head_only(_NOT_ACCEPTABLE_OM)
_FAILED_HEAD = _head_only(_FAILED)


# -- content negotiation (RFC 9110 12.5.1, 12.5.3) --------------------------------------------------------


def _weighted(value: str) -> list[tuple[str, float]]:
    """The elements of an ``Accept``-style list, lower-cased without their parameters, each with its
    weight (``q``, 1 if absent). An element with a malformed weight (not a number from 0 to 1) is left
    out, as are empty ones."""
    elements = []
    for element in value.split(","):
        name, *params = element.split(";")
        name = name.strip().lower()
        if not name:
            continue
        q: float | None = 1.0
        for param in params:
            key, _, raw = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(raw.strip())
                except ValueError:
                    q = None
                if q is not None and not 0.0 <= q <= 1.0:  # (NaN fails the test too)
                    q = None
                break  # what follows ``q`` is accept-ext, not media-type parameters
        if q is not None:
            elements.append((name, q))
    return elements


def _wants_gzip(accept_encoding: str | None) -> bool:
    """Whether to gzip for this ``Accept-Encoding``: gzip acceptable (``q > 0``, by name or through ``*``)
    and weighing at least as much as the identity. No header: no preference, so the identity (a client
    that sends none, such as curl without ``--compressed``, may not decompress anything)."""
    if accept_encoding is None:
        return False
    named: dict[str, float] = {}
    for coding, q in _weighted(accept_encoding):
        coding = "gzip" if coding == "x-gzip" else coding
        named[coding] = max(q, named.get(coding, 0.0))
    star = named.get("*")
    gzip = named.get("gzip", star if star is not None else 0.0)
    identity = named.get("identity", star)  # None: acceptable, but below any coding the client named
    return gzip > 0 and (identity is None or gzip >= identity)


def _negotiate(accept: str | None, openmetrics: bool) -> str | None:
    """The format to serve for this ``Accept``: ``"text"``, ``"openmetrics"`` (only if the server renders
    it) or None (406). Each format's weight is that of the most specific range the header lists for it
    (``text/plain``, ``text/*``, ``*/*``; ``application/openmetrics-text``, ``application/*``, ``*/*``);
    OpenMetrics wins only by weighing more, so ``*/*`` alone gets the text format. No header, or none
    parsable: the text format."""
    if accept is None:
        return "text"
    ranges = [(media.replace(" ", ""), q) for media, q in _weighted(accept) if media.count("/") == 1]
    if not ranges:
        return "text"

    def weight(*specific: str) -> float:
        for media in specific:
            weights = [q for name, q in ranges if name == media]
            if weights:
                return max(weights)
        return 0.0

    text = weight("text/plain", "text/*", "*/*")
    om = weight("application/openmetrics-text", "application/*", "*/*") if openmetrics else 0.0
    if om > text:
        return "openmetrics"
    return "text" if text > 0 else None


def _fields(lines: list[str]) -> dict[str, str]:
    """The ``Accept`` and ``Accept-Encoding`` fields of the request's header lines (names in any case;
    several lines of one field make one comma-separated list; obsolete line folding is joined)."""
    fields: dict[str, str] = {}
    last = ""
    for line in lines:
        if line[:1] in (" ", "\t"):  # obs-fold: continues the previous line
            if last:
                fields[last] += " " + line.strip()
            continue
        name, sep, value = line.partition(":")
        name = name.strip().lower()
        last = name if sep and name in ("accept", "accept-encoding") else ""
        if last:
            fields[last] = f"{fields[last]},{value.strip()}" if last in fields else value.strip()
    return fields


class MetricsServer:
    """``GET /metrics`` over one listening socket, with two threads whatever the load.

    The I/O thread multiplexes every connection with a selector (non-blocking sockets: a connection that
    sends nothing, half a request line or reads its response slowly holds a few bytes of buffer, never a
    thread), closes each one whose request or response is not through within ``timeout`` seconds, keeps
    at most :attr:`max_connections` (a new one evicts the oldest still sending its request), and answers
    anything but ``GET``/``HEAD`` with 405 and paths other than ``/metrics`` with 404 itself.

    The render thread answers the requests for ``/metrics`` in batches: every request waiting when a
    batch starts gets the same body, rendered then (values at least as new as the request) unless
    ``version()`` is unchanged since the cached body was rendered, so a scrape storm costs one render per
    change of the values. Batches are spaced: at least :attr:`min_interval` seconds apart, and renders
    take at most :attr:`render_share` of the time, so scrapers cannot keep the process busy beside the
    training loop (requests wait for the next batch instead; Prometheus' default scrape timeout is 10 s).

    ``close()`` stops both threads, joins them and closes every socket, the selector and the wake pipe.
    """

    backlog = 64
    """Connections the kernel queues before they are accepted."""
    max_connections = 64
    """Connections open at once; past it a new one evicts the oldest still sending its request."""
    max_request_bytes = 8192
    """The largest request head (request line and headers); past it: 431."""
    min_interval = 0.25
    """Seconds between two batches of responses (requests meanwhile wait for the next batch): at most
    ``max_connections / min_interval`` responses a second, whatever the clients do."""
    render_share = 0.02
    """The largest fraction of the time spent rendering: after a render of ``d`` seconds, the next batch
    waits at least ``d * (1 / render_share - 1)`` (up to :attr:`max_interval`)."""
    max_interval = 2.0
    """The longest wait between batches however slow renders are (a caller's registry of 10 k series
    renders in about 0.4 s): well inside Prometheus' default scrape timeout of 10 s."""

    def __init__(
        self,
        sock: socket.socket,
        render: Callable[[], bytes],
        version: Callable[[], object] | None,
        *,
        timeout: float,
        name: str = "streamwatch-metrics",
        render_openmetrics: Callable[[], bytes] | None = None,
    ) -> None:
        self._listener = sock
        self._renderers = {False: render, True: render_openmetrics}  # by "OpenMetrics?"
        self._version = version
        self.timeout = timeout
        self._conns: dict[socket.socket, _Conn] = {}  # in accept order: the first is the oldest
        self._cond = threading.Condition()
        self._pending: list[_Conn] = []  # requests for /metrics, waiting for a body (under _cond)
        # bodies for the I/O thread, by "OpenMetrics?"
        self._done: deque[tuple[list[_Conn], dict[bool, _Cached | None]]] = deque()
        self._stopping = False
        self._cache: dict[bool, _Cached] = {}  # the last body of each format
        self._next_batch = 0.0
        self._render_errors = 0
        self.renders = 0
        """Bodies rendered (one per version of the values that some client asked for)."""
        self.compressions = 0
        """Bodies gzipped (at most one per render: only once some client asked for gzip)."""
        self.openmetrics_responses = 0
        """Responses in OpenMetrics (a scraper that prefers it, as Prometheus does)."""
        sock.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._threads = [
            threading.Thread(target=self._serve_io, name=name, daemon=True),
            threading.Thread(target=self._serve_renders, name=f"{name}-render", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # -- the I/O thread ------------------------------------------------------------------------------

    def _serve_io(self) -> None:
        selector = self._selector
        try:
            while not self._stopping:
                deadlines = [c.deadline for c in self._conns.values() if c.deadline is not None]
                wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
                for key, mask in selector.select(wait):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._drain_wake()
                    else:
                        conn: _Conn = key.data
                        if mask & selectors.EVENT_WRITE and not conn.closed:
                            self._send(conn)
                        if mask & selectors.EVENT_READ and not conn.closed:
                            self._read(conn)
                self._deliver()
                self._expire()
        except Exception:  # pragma: no cover - a bug here must not pass silently
            log.exception("streamwatch: the /metrics server stopped")
        finally:  # (the wake pair and the selector are closed by close(), after both threads ended)
            for conn in list(self._conns.values()):
                self._close(conn)
            self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:  # out of file descriptors, ...: try again at the next event
                log.debug("streamwatch: /metrics accept failed: %s", err)
                return
            sock.setblocking(False)
            if len(self._conns) >= self.max_connections:
                oldest = next((c for c in self._conns.values() if c.state in ("read", "drain")), None)
                if oldest is None:  # every slot has a request in progress: refuse this one
                    try:
                        sock.send(_BUSY)
                    except OSError:
                        pass
                    sock.close()
                    continue
                self._close(oldest)
            conn = _Conn(sock, time.monotonic() + self.timeout)
            self._conns[sock] = conn
            self._watch(conn, selectors.EVENT_READ)

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not data:
            if conn.state == "wait":  # a half-close after the request (printf ... | nc): still answered
                self._watch(conn, 0)
            else:  # the client closed or gave up
                self._close(conn)
            return
        if conn.state != "read":  # a body, a pipelined request, or bytes after the response: dropped
            conn.linger = True
            if len(data) + len(conn.buffer) > 16 * self.max_request_bytes:
                self._close(conn)  # a client streaming at us: not worth reading
            return
        conn.buffer += data
        end = conn.buffer.find(b"\r\n\r\n")
        if end < 0:
            end = conn.buffer.find(b"\n\n")
        if end < 0:
            if len(conn.buffer) > self.max_request_bytes:
                conn.linger = True
                self._respond(conn, _TOO_LARGE)
            return
        if end > self.max_request_bytes:
            conn.linger = True
            self._respond(conn, _TOO_LARGE)
            return
        tail = len(conn.buffer) - end - (4 if conn.buffer[end : end + 2] == b"\r\n" else 2)
        line, *lines = bytes(conn.buffer[:end]).decode("latin-1").split("\n")
        line = line.strip()
        conn.buffer = bytearray()  # what follows is dropped; nothing more is parsed
        conn.linger = tail > 0
        parts = line.split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            conn.linger = True
            self._respond(conn, _BAD_REQUEST)
            return
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            conn.linger = True  # a body may follow
            self._respond(conn, _NOT_ALLOWED)
            return
        if "://" in target:  # an absolute URI (as proxies send)
            target = "/" + target.split("://", 1)[1].partition("/")[2]
        conn.head = method == "HEAD"
        if target.split("?", 1)[0] != "/metrics":
            self._respond(conn, _NOT_FOUND_HEAD if conn.head else _NOT_FOUND)
            return
        fields = _fields([raw.rstrip("\r") for raw in lines])
        openmetrics = self._renderers[True] is not None
        chosen = _negotiate(fields.get("accept"), openmetrics)
        if chosen is None:
            if openmetrics:
                self._respond(conn, _NOT_ACCEPTABLE_OM_HEAD if conn.head else _NOT_ACCEPTABLE_OM)
            else:
                self._respond(conn, _NOT_ACCEPTABLE_HEAD if conn.head else _NOT_ACCEPTABLE)
            return
        conn.openmetrics = chosen == "openmetrics"
        conn.gzip = _wants_gzip(fields.get("accept-encoding"))
        conn.state = "wait"
        conn.deadline = None  # the render thread's spacing bounds the wait
        with self._cond:
            self._pending.append(conn)
            self._cond.notify()

    def _respond(self, conn: _Conn, response: bytes) -> None:
        conn.state = "write"
        conn.out = memoryview(response)
        conn.deadline = time.monotonic() + self.timeout
        self._send(conn)
        if not conn.closed and conn.state == "write":
            self._watch(conn, selectors.EVENT_WRITE)

    def _send(self, conn: _Conn) -> None:
        if conn.state != "write":
            return
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        conn.out = conn.out[sent:]
        if conn.out:
            return
        if not conn.linger:
            self._close(conn)
            return
        try:  # lingering close: our side is done; read (and drop) until the client closes
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(conn)
            return
        conn.state = "drain"
        conn.deadline = time.monotonic() + min(self.timeout, 2.0)
        self._watch(conn, selectors.EVENT_READ)

    def _deliver(self) -> None:
        while self._done:
            conns, bodies = self._done.popleft()
            for conn in conns:
                if conn.closed:
                    continue
                cached = bodies.get(conn.openmetrics)
                self.openmetrics_responses += conn.openmetrics and cached is not None
                if cached is None:
                    self._respond(conn, _FAILED_HEAD if conn.head else _FAILED)
                else:
                    self._respond(conn, cached.response(conn.head, conn.gzip))

    def _expire(self) -> None:
        now = time.monotonic()
        for conn in [c for c in self._conns.values() if c.deadline is not None and c.deadline <= now]:
            self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        conn.out = memoryview(b"")
        self._conns.pop(conn.sock, None)
        self._watch(conn, 0)
        conn.sock.close()

    def _watch(self, conn: _Conn, events: int) -> None:
        """Have the selector watch ``conn`` for ``events`` (0: not at all)."""
        if events == conn.events:
            return
        if not events:
            self._selector.unregister(conn.sock)
        elif not conn.events:
            self._selector.register(conn.sock, events, conn)
        else:
            self._selector.modify(conn.sock, events, conn)
        conn.events = events

    # -- the render thread ---------------------------------------------------------------------------

    def _serve_renders(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                delay = self._next_batch - time.monotonic()
                if delay > 0:  # too soon after the last batch: this one waits (and grows) until then
                    self._cond.wait_for(lambda: self._stopping, timeout=delay)
                    continue
                batch, self._pending = self._pending, []
            start = time.monotonic()
            try:
                version = self._version() if self._version is not None else None
            except Exception:  # a broken version: render every time
                version = None
            bodies: dict[bool, _Cached | None] = {}
            for openmetrics in sorted({c.openmetrics for c in batch}):  # each format asked for, once
                cached = self._cache.get(openmetrics)
                if cached is None or version is None or version != cached.version:
                    cached = self._render_once(version, openmetrics)
                if (
                    cached is not None
                    and cached.gzip_get is None
                    and any(c.gzip for c in batch if c.openmetrics == openmetrics)
                ):
                    try:  # once per version, counted in the render's share of the time
                        cached.compress()
                        self.compressions += 1
                    except Exception:  # (out of memory): the identity, which every client accepts
                        log.debug("streamwatch: compressing /metrics failed", exc_info=True)
                bodies[openmetrics] = cached
            end = time.monotonic()
            spacing = min(self.max_interval, (end - start) * (1 / self.render_share - 1))
            self._next_batch = end + max(self.min_interval, spacing)
            self._done.append((batch, bodies))
            try:
                self._wake_w.send(b"\0")
            except (BlockingIOError, InterruptedError):
                pass  # the pipe is full: the I/O thread is already woken

    def _render_once(self, version: object, openmetrics: bool) -> _Cached | None:
        render = self._renderers[openmetrics]
        assert render is not None  # (negotiated only when there is one)
        try:
            body = render()
        except Exception:
            self._render_errors += 1
            if self._render_errors == 1:
                log.warning(
                    "streamwatch: rendering /metrics failed (500); further failures at DEBUG", exc_info=True
                )
            else:
                log.debug("streamwatch: rendering /metrics failed", exc_info=True)
            return None
        self.renders += 1
        cached = self._cache[openmetrics] = _Cached(
            version, body, OPENMETRICS_CONTENT_TYPE if openmetrics else CONTENT_TYPE
        )
        return cached

    def close(self) -> None:
        """Stop both threads, join them and close every socket. Idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        for thread in self._threads:
            thread.join(timeout=_JOIN_S)
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:  # pragma: no cover - a render stuck in a collector of the caller's registry
            log.warning("streamwatch: %s did not stop within %s s", ", ".join(stuck), _JOIN_S)
            return
        self._wake_r.close()
        self._wake_w.close()
        self._selector.close()


def listen(host: str, port: int, backlog: int) -> socket.socket:
    """A listening socket on ``host:port``, or an error that says what is wrong and what to do."""
    if not isinstance(host, str):
        raise ValueError(f"Expected `host` to be a str (an address of this machine), got {host!r}")
    if host == "":
        raise ValueError(
            "streamwatch: host='' binds every interface; pass '0.0.0.0' explicitly if that is what you "
            "want, or leave the default '127.0.0.1' (this machine only)"
        )
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise socket.gaierror(
            err.errno,
            f"streamwatch: cannot resolve host {host!r} ({err.strerror}); pass an address of this "
            "machine: '127.0.0.1' (the default, this machine only), '0.0.0.0' (every interface) or the "
            "address of one interface",
        ) from err
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        if os.name == "posix":  # rebind over TIME_WAIT after a restart; never over a live listener
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise OSError(
                errno.EADDRINUSE,
                f"streamwatch: port {port} on {host} is already in use (this process's /metrics port is "
                f"the base port + LOCAL_RANK = {port}); pass expose(port=...) another base port, or stop "
                "the process that holds it",
            ) from err
        if err.errno == errno.EADDRNOTAVAIL:
            shown = host if host == address[0] else f"{host} ({address[0]})"
            raise OSError(
                errno.EADDRNOTAVAIL,
                f"streamwatch: host {shown!r} is not an address of this machine, so /metrics cannot "
                "listen there; pass '127.0.0.1' (the default, this machine only), '0.0.0.0' (every "
                "interface) or the address of one of this machine's interfaces",
            ) from err
        if err.errno == errno.EACCES:
            raise OSError(
                errno.EACCES,
                f"streamwatch: not allowed to listen on port {port} of {host} (ports below 1024 need "
                "privileges); pass expose(port=...) a port of 1024 or more, such as the default 16400",
            ) from err
        raise OSError(err.errno, f"streamwatch: cannot listen on {host} port {port}: {err.strerror}") from err
    return sock
