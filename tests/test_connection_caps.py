"""The connection layer under a keyless attacker (issue 73): every request head has a deadline,
connections are capped per client and in all below RLIMIT_NOFILE, every per-client count keys
clients by ``--client-ipv6-prefix``, and a WebSocket upgrade is charged by need, never refused
for the HTTP budget a neighbour behind the same address spent.

Distinct client addresses other than loopback come from a network namespace of the test's own
(tests/netns.py, which needs root: skipped otherwise) whose ``lo`` holds documentation addresses
(RFC 5737, RFC 3849); the server listens on all of them.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import subprocess
import time
from collections.abc import Callable, Iterator

import httpx
import websockets.asyncio.client

from duplexserve.bench.attacks import Threads
from duplexserve.bench.http_flood import Pipeliner
from tests import netns
from tests.conftest import ServerProcess
from tests.test_hostile_admission import echoed, over_budget, run

SERVER_V4, ATTACKER_V4, HONEST_V4 = "192.0.2.1", "192.0.2.2", "198.51.100.7"
SERVER_V6, ATTACKER_V6, NEIGHBOUR_V6 = "2001:db8::1", "2001:db8:1:2::a", "2001:db8:1:2::b"
HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"


def wait_for(condition: Callable[[], bool], timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes ``sock`` (EOF or reset) within ``timeout`` seconds."""
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 16):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


@contextlib.contextmanager
def documentation_addresses() -> Iterator[None]:
    """This thread (and the servers it starts) in a namespace whose ``lo`` has the addresses above."""
    with netns.loopback_only():
        for address in (SERVER_V4, ATTACKER_V4, HONEST_V4):
            subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", "lo"], check=True)
        for address in (SERVER_V6, ATTACKER_V6, NEIGHBOUR_V6):
            subprocess.run(["ip", "-6", "addr", "add", f"{address}/128", "dev", "lo", "nodad"], check=True)
        yield


async def session_from(server: ServerProcess, host: str, source: str) -> bool:
    """An honest duplex/1 session from ``source`` to ``host``: created, and echoed exactly."""
    url = f"ws://{'[' + host + ']' if ':' in host else host}:{server.port}/v1/duplex"
    ws = await websockets.asyncio.client.connect(url, compression=None, max_size=None, local_addr=(source, 0))
    first = await ws.recv()
    return '"session.created"' in first and await echoed(ws, seed=5)


# ------------------------------------------------------------------------- head deadline
def test_a_second_head_that_never_ends_is_closed_after_the_deadline(server_factory):
    """The finding: a kept-alive connection's second head had no deadline (the handshake timer
    ended at the first head, uvicorn's keep-alive timer at the next request's first byte):
    4,000 such connections were all held after 20 s. Now each later head, blank lines before
    it included, has the head deadline (here 1 s) and the connection is closed, counted."""
    server = server_factory("--handshake-timeout-s", "1")
    held = []
    for tail in [b"GET /health HTTP/1.1\r\nx-slow: "] * 6 + [b"\r\n", b"GET /heal"]:
        sock = socket.create_connection(("127.0.0.1", server.port))
        sock.sendall(HEALTH)
        assert sock.recv(1 << 16).startswith(b"HTTP/1.1 200")
        sock.sendall(tail)
        held.append(sock)
    closed = [closed_by_server(sock, 30.0) for sock in held]
    for sock in held:
        sock.close()
    assert closed == [True] * len(held), closed
    assert over_budget(server, "request_head_time") == len(held)
    assert httpx.get(server.http + "/health", timeout=10).status_code == 200


# ------------------------------------------------------------------------- connection caps
def test_one_client_at_its_cap_leaves_health_and_other_clients_served(server_factory):
    """The finding: 1,008 connections from one address under a 1,024-descriptor limit left the
    server answering no one. Under a limit of 256 (reserve 64: 192 in all, 24 a client) one
    address opens 300: past 24 each is closed unread and counted, and /health and an honest
    session from another address are served while it holds the rest; once all are gone, none
    is still counted."""
    with documentation_addresses():
        old = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, old[1]))  # the soft limit: inherited
        try:
            server = server_factory("--host", "0.0.0.0", "--handshake-timeout-s", "120")
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, old)
        attack = []
        try:
            for _ in range(300):
                sock = socket.socket()
                sock.bind((ATTACKER_V4, 0))
                sock.settimeout(10)
                sock.connect((SERVER_V4, server.port))
                with contextlib.suppress(OSError):  # closed at once past the cap
                    sock.sendall(b"GET /health HTTP/1.1\r\nx-slow: ")  # a head that never ends
                attack.append(sock)
            assert wait_for(lambda: over_budget(server, "connections_per_client") >= 300 - 24)
            health = httpx.get(f"http://{SERVER_V4}:{server.port}/health", timeout=10)
            honest = run(session_from(server, SERVER_V4, HONEST_V4))
            held = sum(not closed_by_server(sock, 0.2) for sock in attack)
        finally:
            for sock in attack:
                sock.close()
        assert health.status_code == 200 and honest
        assert held == 24
        assert over_budget(server, "connections_per_client") == 300 - 24
        # every count released, the WebSocket's by the protocol that took it over: the scrape's own
        assert wait_for(lambda: server.metrics()["duplexserve_connections_open"] == 1)


# ------------------------------------------------------------------ IPv6 prefix, upgrades
class Flood(Threads):
    """Threads pipelining 8 requests a write (within the pipelining budget) from ``source``."""

    def __init__(self, host: str, port: int, source: str, threads: int = 3) -> None:
        super().__init__(threads)
        self.host, self.port, self.source = host, port, source

    def _run(self, i: int) -> None:
        while not self._stop.is_set():
            with (
                contextlib.suppress(OSError),
                socket.create_connection((self.host, self.port), 5, (self.source, 0)) as sock,
            ):
                sock.sendall(HEALTH * 8)
                while not self._stop.is_set() and sock.recv(1 << 16):  # answers: 8 more
                    sock.sendall(HEALTH * 8)
            time.sleep(0.01)


def statuses(url: str, source: str, count: int) -> list[int]:
    """``count`` GETs of ``url``, each on a new connection from ``source``."""
    got = []
    for _ in range(count):
        with httpx.Client(transport=httpx.HTTPTransport(local_address=source)) as client:
            got.append(client.get(url, timeout=10).status_code)
    return got


def test_the_ipv6_prefix_keys_the_http_budget(server_factory):
    """The finding: ``--client-ipv6-prefix 128`` never reached the HTTP budgets: a neighbour in
    the same /64 spending its own address's budget locked out 17 of 32 opens. Now it does."""
    with documentation_addresses():
        server = server_factory("--host", "::", "--client-ipv6-prefix", "128", "--overload-lag-ms", "5000")
        url = f"http://[{SERVER_V6}]:{server.port}/health"
        with Flood(SERVER_V6, server.port, ATTACKER_V6):
            assert wait_for(lambda: over_budget(server, "http_address_requests_per_s") > 0)
            neighbour = statuses(url, NEIGHBOUR_V6, 20)
        assert neighbour == [200] * 20


def test_an_upgrade_is_not_refused_for_the_http_budget_its_address_spent(server_factory):
    """The finding: once an address was over its HTTP budget its new connections were closed
    unread, WebSocket upgrades included: 24-30 of 40 honest opens behind one NAT failed. Now the
    head is read first and an upgrade charged to the address's upgrades alone; plain requests
    from it get 429 with Retry-After. (127.0.0.2: loopback, but an HTTP budget of its own.)"""
    server = server_factory("--overload-lag-ms", "5000")

    async def opens(count: int) -> list[bool]:
        results = []
        for _ in range(count):
            ws = await websockets.asyncio.client.connect(
                server.ws(), compression=None, max_size=None, local_addr=("127.0.0.2", 0)
            )
            first = await ws.recv()
            results.append('"session.created"' in first and await echoed(ws, seed=6, frames=2))
        return results

    with Pipeliner(server.port, "127.0.0.2", connections=3):
        assert wait_for(lambda: over_budget(server, "http_address_requests_per_s") > 0)
        opened = run(opens(10))
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2")) as client:
            answers = [client.get(server.http + "/health", timeout=10) for _ in range(10)]
    assert opened == [True] * 10
    refused = [a for a in answers if a.status_code == 429]
    assert refused and all(a.headers.get("retry-after") == "1" for a in refused)


def test_the_ipv6_prefix_keys_the_parse_budget():
    """The parse budgets' address (transports/websocket/budgets.py) is keyed by the same function:
    before, it was every address's /64 whatever ``--client-ipv6-prefix`` said."""
    from duplexserve.server.transports.websocket.budgets import ParseLimits, ParseMeter

    each, grouped = (ParseMeter(ParseLimits(), [], prefix) for prefix in (128, 64))
    a, b = (ATTACKER_V6, 1), (NEIGHBOUR_V6, 1)
    assert each.address(a) != each.address(b) and grouped.address(a) == grouped.address(b)
    assert each.take_address(each.address(a), 0.0, 0.1)  # a's budget (100 ms) spent ...
    assert not each.address_has(each.address(a), 0.0, 0.01)
    assert each.address_has(each.address(b), 0.0, 0.01)  # ... not its neighbour's
