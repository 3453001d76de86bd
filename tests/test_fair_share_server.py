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
import json
import time

import httpx
import pytest
import websockets.asyncio.client
import websockets.exceptions

from duplexserve.bench.attacks import ForwardedFlood, ParseFlood, forwarded_ws
from tests.test_hostile_transport import KEY, paced_session

PROXY = ("--forwarded-allow-ips", "127.0.0.1")


def honest_requests(server, client: str, count: int = 24) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    """``count`` requests each of /v1/models and /health as forwarded ``client``, 2 a second."""
    codes: dict[str, list[int]] = {"/v1/models": [], "/health": []}
    headers = {"x-forwarded-for": client}
    with httpx.Client(timeout=20) as http:
        for _ in range(count):
            for path in codes:
                codes[path].append(http.get(f"{server.http}{path}?token={KEY}", headers=headers).status_code)
            time.sleep(0.5)
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
    with ForwardedFlood(server.port, attackers, connections, f"/v1/models?token={KEY}"):
        time.sleep(1.0)
        codes = honest_requests(server, "192.0.2.77")
    print(f"honest {codes}")
    refused = {path: [c for c in got if c != 200] for path, got in codes.items()}
    assert refused == {"/v1/models": [], "/health": []}, refused
    metrics = server.metrics()
    assert metrics['duplexserve_fair_share_cut_total{work="http_request"}'] > 0


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
    socks = [forwarded_ws(server.port, "203.0.113.9", f"/v1/duplex?token={KEY}") for _ in range(40)]

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
