"""The server's WebSocket keepalive pings never close a connection whose answers are late: a live client
the server throttles (its backlog full, its connection not read) has its pongs queued behind its own
audio. A raw client that never answers the pings stands in for it: pings keep coming, no close."""

from __future__ import annotations

import base64
import os
import socket
import struct
import time

import pytest
from server_proc import ServerProcess

PING_S = 0.3
SILENT_S = 3.0  # ten ping intervals without an answer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with ServerProcess(tmp_path_factory.mktemp("keepalive") / "serve.log", "--ws-ping-interval", str(PING_S)) as srv:
        yield srv


def handshake(port: int, path: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def frames(data: bytes) -> list[tuple[int, bytes]]:
    """(opcode, payload) of each whole unmasked frame the server sent."""
    out, i = [], 0
    while i + 2 <= len(data):
        opcode, n = data[i] & 0x0F, data[i + 1] & 0x7F
        i += 2
        if n == 126:
            n, i = struct.unpack(">H", data[i:i + 2])[0], i + 2
        elif n == 127:
            n, i = struct.unpack(">Q", data[i:i + 8])[0], i + 8
        if i + n > len(data):
            break
        out.append((opcode, data[i:i + n]))
        i += n
    return out


def masked_close(code: int) -> bytes:
    mask = os.urandom(4)
    payload = struct.pack(">H", code)
    return bytes([0x88, 0x80 | len(payload)]) + mask + bytes(b ^ mask[k % 4] for k, b in enumerate(payload))


def read_all(sock: socket.socket, seconds: float) -> bytes:
    """What the server sends within ``seconds`` (pings keep coming, so read for a while, not until quiet)."""
    data, end = b"", time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/stream", "/v1/realtime"])
def test_unanswered_pings_never_close_a_live_connection(server, path: str) -> None:
    with handshake(server.port, path) as sock:
        time.sleep(SILENT_S)  # the server pings every PING_S; nothing is read or answered here
        got = frames(read_all(sock, 0.5))
        pings = [p for op, p in got if op == 0x9]
        closes = [p for op, p in got if op == 0x8]
        assert len(pings) >= SILENT_S / PING_S / 2, got  # the keepalive runs...
        assert not closes, f"the server closed the connection: {closes}"  # ...and never closes for a late pong
        sock.sendall(masked_close(1000))  # the connection still works: a close is answered
        answer = [p for op, p in frames(read_all(sock, 2.0)) if op == 0x8]
        assert answer and struct.unpack(">H", answer[0][:2])[0] == 1000, answer
