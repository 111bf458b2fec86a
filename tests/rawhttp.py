"""A raw HTTP/1.1 exchange over a socket, for tests of the /metrics server's edge cases."""

from __future__ import annotations

import socket

from tests.threads import JOIN_S


def raw_request(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``request`` as is to 127.0.0.1:``port``; return the status, the headers (lower-case names) and
    the body, read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=JOIN_S) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body
