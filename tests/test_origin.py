"""The same-origin check (issue 67 item 7): a page of this server's host on another port is
another origin, and may not drive the server unless ``--allowed-origins`` names it. Before, only
host names were compared, so any page of the same host (another app on another port) could."""

from __future__ import annotations

import asyncio
import json

import httpx
import websockets.asyncio.client

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
