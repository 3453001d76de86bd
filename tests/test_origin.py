"""The same-origin check (issue 67 item 7): a page of this server's host on another port is
another origin, and may not drive the server unless ``--allowed-origins`` names it. Before, only
host names were compared, so any page of the same host (another app on another port) could."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import websockets.asyncio.client

from duplexserve.server.auth import OriginRefusals
from tests.test_reliability import open_close_code


def test_a_page_of_the_same_host_on_another_port_is_another_origin(server_factory):
    server = server_factory()
    own, other = f"http://127.0.0.1:{server.port}", f"http://127.0.0.1:{server.port + 1}"
    first, code = asyncio.run(open_close_code(server.ws(), origin=other))
    assert code == 1008 and first["code"] == "origin_not_allowed"

    async def created() -> str:
        async with websockets.asyncio.client.connect(server.ws(), origin=own) as ws:
            return json.loads(await ws.recv())["type"]

    assert asyncio.run(created()) == "session.created"
    secrets = server.http + "/v1/realtime/client_secrets"
    assert httpx.post(secrets, headers={"Origin": other}).status_code == 403
    assert httpx.post(secrets, headers={"Origin": own}).status_code == 200
    allowed = server_factory("--allowed-origins", other)
    assert httpx.post(allowed.http + "/v1/realtime/client_secrets", headers={"Origin": other}).is_success


def test_a_refused_origin_is_logged_once_a_burst_naming_the_host_and_the_fix(server_factory):
    """Issue 72: a page behind a proxy that passes the upstream's Host is refused, and only its
    close says so; the server's log names the Origin, the Host and the fix, once for a burst."""
    server = server_factory()
    proxied, other = "https://talk.example.com", "https://evil.example.net"

    async def refused(origin: str, times: int) -> None:
        for _ in range(times):
            first, code = await open_close_code(server.ws(), origin=origin)
            assert code == 1008 and first["code"] == "origin_not_allowed"

    asyncio.run(refused(proxied, 5))
    lines = [line for line in server.log().splitlines() if "origin_not_allowed" in line]
    assert len(lines) == 1, lines
    line = lines[0]
    assert "WARNING" in line and repr(proxied) in line and f"'127.0.0.1:{server.port}'" in line
    assert f"--allowed-origins {proxied}" in line and "proxy_set_header Host $host;" in line
    assert "/v1/duplex" in line
    asyncio.run(refused(other, 3))
    lines = [line for line in server.log().splitlines() if "origin_not_allowed" in line]
    assert len(lines) == 2 and repr(other) in lines[1], lines
    assert httpx.get(server.http + "/v1/voices", headers={"Origin": other}).status_code == 403
    assert len([line for line in server.log().splitlines() if "origin_not_allowed" in line]) == 2


def test_origin_refusals_are_rate_limited_per_origin_in_bounded_memory(caplog):
    """Made-up Origins, one per refusal: the table stays at its bound and the log at one line
    per Origin it holds plus one for all the others, per interval."""
    refusals = OriginRefusals(every_s=10.0, most=8)
    with caplog.at_level(logging.WARNING, logger="duplexserve"):
        for i in range(1000):
            refusals(f"https://{i}.example.net", "upstream:8998", "/api/chat", now=i * 0.001)
        assert len(refusals._last) == 8 and len(caplog.records) == 9
        assert "one of more Origins than the 8" in caplog.records[-1].getMessage()
        refusals("https://x.example.net", "upstream:8998", "/api/chat", now=9.0)
        assert len(caplog.records) == 9 and refusals._others == 992  # counted for the next such line
        refusals("https://0.example.net", "upstream:8998", "/api/chat", now=5.0)
        assert len(caplog.records) == 9  # still within its interval
        refusals("https://0.example.net", "upstream:8998", "/api/chat", now=10.5)
        assert len(caplog.records) == 10 and "1 more since" in caplog.records[-1].getMessage()
        assert len(refusals._last) <= 8
