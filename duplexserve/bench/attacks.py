"""Attacks on the loop's fair share, each from threads of bare sockets (issue 73).

Used by ``duplexserve bench under-attack`` and tests/test_fair_share_server.py. Clients are
told apart as a trusted proxy names them (``X-Forwarded-For``; the server runs with
``--forwarded-allow-ips 127.0.0.1``), the way the shipped compose's proxy does.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import socket
import threading
import time

#: A large JSON text message: about 2-4 ms of the loop's ``json.loads`` and handling.
_PAD = 30_000


def _drain(sock: socket.socket) -> None:
    """Read the answers, so that they never hold the sender back."""
    with contextlib.suppress(OSError):
        while sock.recv(1 << 16):
            pass


def _frame(payload: bytes) -> bytes:
    """One masked text frame (a zero mask: the payload as it is)."""
    n = len(payload)
    if n < 126:
        head = bytes((0x81, 0x80 | n))
    elif n < 1 << 16:
        head = bytes((0x81, 0x80 | 126)) + n.to_bytes(2, "big")
    else:
        head = bytes((0x81, 0x80 | 127)) + n.to_bytes(8, "big")
    return head + b"\0\0\0\0" + payload


class Threads:
    """Threads that run until the ``with`` block ends."""

    def __init__(self, count: int) -> None:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]

    def __enter__(self) -> Threads:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)

    def _run(self, i: int) -> None:
        raise NotImplementedError


class ForwardedFlood(Threads):
    """``connections`` threads, each pipelining ``GET path`` 32 a write as forwarded client
    ``clients[i % len(clients)]``, reconnecting whenever closed."""

    def __init__(self, port: int, clients: list[str], connections: int, path: str = "/v1/models") -> None:
        super().__init__(connections)
        self.port, self.clients, self.path = port, clients, path

    def _run(self, i: int) -> None:
        client = self.clients[i % len(self.clients)]
        head = f"GET {self.path} HTTP/1.1\r\nhost: x\r\nx-forwarded-for: {client}\r\n\r\n"
        blob = head.encode() * 32
        while not self._stop.is_set():
            sock = socket.socket()
            try:
                sock.connect(("127.0.0.1", self.port))
                threading.Thread(target=_drain, args=(sock,), daemon=True).start()
                while not self._stop.is_set():
                    sock.sendall(blob)
            except OSError:
                time.sleep(0.005)  # refused or reset: connect again
            finally:
                sock.close()


def upgrade(port: int, path: str, headers: str = "", timeout: float = 20) -> tuple[socket.socket, bytes]:
    """A WebSocket on ``path`` upgraded on a bare socket (``headers``: more header lines, each
    ending in CRLF); returns the socket and any bytes that came after the 101."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{headers}\r\n".encode()
    )
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed during the handshake")
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    if b" 101 " not in head.split(b"\r\n")[0]:
        raise ConnectionError(head[:200].decode("latin-1"))
    return sock, rest


def forwarded_ws(port: int, client: str, path: str) -> socket.socket:
    """A WebSocket on ``path`` upgraded as forwarded ``client``."""
    sock, _ = upgrade(port, path, f"X-Forwarded-For: {client}\r\n")
    sock.settimeout(None)
    return sock


class ParseFlood(Threads):
    """One key holder's connections, each sending a large JSON text message ``per_s`` times a
    second: under its 25 ms/s parse budget each, over the loop's capacity together."""

    def __init__(self, socks: list[socket.socket], per_s: float = 10.0) -> None:
        super().__init__(len(socks))
        self.socks, self.period = socks, 1.0 / per_s
        self.blob = _frame(json.dumps({"type": "x", "pad": list(range(_PAD))}).encode())

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for sock in self.socks:
            sock.close()

    def _run(self, i: int) -> None:
        sock = self.socks[i]
        threading.Thread(target=_drain, args=(sock,), daemon=True).start()
        with contextlib.suppress(OSError):  # closed by the server
            while not self._stop.wait(self.period):
                sock.sendall(self.blob)


class SlowHeads(Threads):
    """Keep-alive slowloris: ``connections`` connections from forwarded-looking peers, each
    sending a request head a byte every ``every_s``, reconnecting whenever closed."""

    def __init__(self, port: int, connections: int, every_s: float = 0.5) -> None:
        super().__init__(connections)
        self.port, self.every_s = port, every_s

    def _run(self, i: int) -> None:
        head = b"GET /health HTTP/1.1\r\nhost: x\r\nx-padding: " + b"a" * 4096
        while not self._stop.is_set():
            sock = socket.socket()
            try:
                sock.connect(("127.0.0.1", self.port))
                for byte in head:
                    if self._stop.wait(self.every_s):
                        break
                    sock.sendall(bytes((byte,)))
            except OSError:
                self._stop.wait(0.1)
            finally:
                sock.close()
