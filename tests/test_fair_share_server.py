"""A fair share of the loop on a real server (issue 73): overload falls on whoever causes it.

Clients are told apart behind a trusted proxy (``--forwarded-allow-ips 127.0.0.1``): each
connection names its client in ``X-Forwarded-For``, as the shipped compose's proxy does.
Before: 30 forwarded clients (or one) filled the global HTTP ceiling and an honest client's
``/v1/models`` got 503; one key holder's 40 connections, each under its parse budget, made
the overload manager refuse every honest newcomer 1013. Outcomes and counts are asserted,
never latencies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
import websockets.asyncio.client
import websockets.exceptions

from tests import raw_ws
from tests.test_hostile_transport import KEY, paced_session

PROXY = ("--forwarded-allow-ips", "127.0.0.1")


class ForwardedFlood:
    """``connections`` threads, each pipelining ``GET path`` 32 a write as forwarded client
    ``clients[i % len(clients)]``, reconnecting whenever closed."""

    def __init__(self, port: int, clients: list[str], connections: int, path: str = "/v1/models") -> None:
        self.port, self.clients, self.path = port, clients, path
        self.requests = 0
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(connections)
        ]

    def __enter__(self) -> ForwardedFlood:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)

    def _run(self, i: int) -> None:
        client = self.clients[i % len(self.clients)]
        head = f"GET {self.path}?token={KEY} HTTP/1.1\r\nhost: x\r\nx-forwarded-for: {client}\r\n\r\n"
        blob = head.encode() * 32
        while not self._stop.is_set():
            sock = socket.socket()
            try:
                sock.connect(("127.0.0.1", self.port))
                threading.Thread(target=_drain, args=(sock,), daemon=True).start()
                while not self._stop.is_set():
                    sock.sendall(blob)
                    self.requests += 32
            except OSError:
                time.sleep(0.005)
            finally:
                sock.close()


def _drain(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while sock.recv(1 << 16):
            pass


def honest_requests(server, client: str, count: int = 48) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    """``count`` requests each of /v1/models and /health as forwarded ``client``, 20 a second."""
    codes: dict[str, list[int]] = {"/v1/models": [], "/health": []}
    headers = {"x-forwarded-for": client}
    with httpx.Client(timeout=20) as http:
        for _ in range(count):
            for path in codes:
                codes[path].append(http.get(f"{server.http}{path}?token={KEY}", headers=headers).status_code)
            time.sleep(0.05)
    return codes


@pytest.mark.parametrize(
    ("clients", "connections"),
    [(30, 30), (1, 8)],
    ids=["thirty-forwarded-clients", "one-forwarded-client"],
)
def test_a_flood_cannot_fill_the_http_ceiling_for_an_honest_client(server_factory, clients, connections):
    """(a) 30 forwarded clients, or (b) one, pipelining /v1/models behind the trusted proxy,
    over the 1,000 a second ceiling: the honest client's /v1/models and /health are all
    served, and the flood's requests are refused as over their share (429)."""
    server = server_factory("--api-keys", KEY, *PROXY)
    baseline = honest_requests(server, "192.0.2.77", 8)
    assert all(code == 200 for codes in baseline.values() for code in codes), baseline
    attackers = [f"10.2.0.{c}" for c in range(clients)]
    with ForwardedFlood(server.port, attackers, connections):
        time.sleep(1.0)
        codes = honest_requests(server, "192.0.2.77")
    print(f"honest {codes}")
    refused = {path: [c for c in got if c != 200] for path, got in codes.items()}
    assert refused == {"/v1/models": [], "/health": []}, refused
    metrics = server.metrics()
    assert metrics['duplexserve_fair_share_cut_total{work="http_request"}'] > 0


def forwarded_ws(port: int, client: str) -> socket.socket:
    """A WebSocket upgraded as forwarded ``client``, its session.created read."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    sock.sendall(
        f"GET /v1/duplex?token={KEY} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        f"X-Forwarded-For: {client}\r\n\r\n".encode()
    )
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed during the handshake")
        data += chunk
    assert b" 101 " in data.split(b"\r\n")[0], data[:200]
    return sock


class ParseFlood:
    """One key holder's connections, each sending a large JSON text message (about 2-4 ms of
    the loop's handling) ``per_s`` times a second: under its 25 ms/s parse budget each, far
    over the loop's capacity together."""

    def __init__(self, socks: list[socket.socket], per_s: float = 10.0) -> None:
        message = json.dumps({"type": "x", "pad": list(range(30_000))}).encode()
        self.blob, self.period = raw_ws.frame(0x81, message), 1.0 / per_s
        self.socks = socks
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(s,), daemon=True) for s in socks]

    def __enter__(self) -> ParseFlood:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)
        for sock in self.socks:
            sock.close()

    def _run(self, sock: socket.socket) -> None:
        threading.Thread(target=_drain, args=(sock,), daemon=True).start()
        with contextlib.suppress(OSError):  # closed by the server
            while not self._stop.wait(self.period):
                sock.sendall(self.blob)


async def open_session(url: str, client: str) -> int | None:
    """Open a session as forwarded ``client``: None if created, else the close code."""
    try:
        async with websockets.asyncio.client.connect(
            url, compression=None, additional_headers={"x-forwarded-for": client}, open_timeout=30
        ) as ws:
            event = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if event["type"] == "session.created":
                return None
            await ws.recv()
    except websockets.exceptions.ConnectionClosed as closed:
        return closed.rcvd.code if closed.rcvd is not None else 1006
    return 1006


def test_a_heavy_client_over_its_share_is_cut_and_an_honest_newcomer_admitted(server_factory):
    """(c) Behind the trusted proxy, one key holder's 40 connections send large JSON each under
    its per-connection parse budget, loading the loop: honest newcomers' sessions (other
    forwarded clients) are all admitted, and the heavy client's connections are closed for
    its fair share (before: 20 of 20 honest opens refused 1013)."""
    server = server_factory(
        "--api-keys", KEY, *PROXY, "--max-sessions", "64", "--max-sessions-per-client", "64"
    )
    url = server.ws("/v1/duplex", f"token={KEY}")
    assert asyncio.run(open_session(url, "192.0.2.1")) is None  # baseline: admitted
    socks = [forwarded_ws(server.port, "203.0.113.9") for _ in range(40)]

    async def newcomers() -> list[int | None]:
        live = asyncio.create_task(paced_session(url, 5))  # a live session through it all: exact echo
        outcomes = []
        for i in range(10):
            await asyncio.sleep(0.3)
            outcomes.append(await open_session(url, f"198.51.100.{i + 1}"))
        await live
        return outcomes

    with ParseFlood(socks):
        time.sleep(1.0)
        outcomes = asyncio.run(newcomers())
    metrics = server.metrics()
    print(f"newcomers {outcomes}")
    print({k: v for k, v in metrics.items() if any(w in k for w in ("overload", "fair", "budget"))})
    assert outcomes == [None] * 10, outcomes
    assert metrics['duplexserve_fair_share_cut_total{work="connection"}'] > 0
    assert metrics['duplexserve_connections_over_budget_total{budget="fair_share"}'] > 0
