"""``duplexserve_sessions_ended_total{reason}``: how sessions end, as a real server exports it.
The alerts (deploy/kubernetes/base/prometheusrule.yaml, DuplexserveSessionsEndingInError) watch
the share that ended in error, so the error reasons are there at 0 before any session ends."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from typing import Any

import httpx
import pytest
import websockets.asyncio.client

from tests.conftest import ServerProcess, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Any:
    server = start_server(str(tmp_path_factory.mktemp("ends")), "--max-sessions", "2")
    yield server
    server.stop()


def ended(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(server.http + "/metrics", timeout=10).text
    line = re.compile(r'^duplexserve_sessions_ended_total\{reason="([a-z_]+)"\} (\S+)$', re.M)
    return {m.group(1): float(m.group(2)) for m in line.finditer(text)}


def test_end_reasons_are_counted(server: ServerProcess) -> None:
    assert ended(server) == {"completed": 0, "engine_error": 0, "internal_error": 0}

    async def one_call() -> None:
        async with websockets.asyncio.client.connect(server.ws("/v1/duplex")) as ws:
            await ws.recv()  # session.created
            for _ in range(2):
                await ws.send(bytes(1920 * 4))
            await ws.send('{"type": "input.end"}')
            with contextlib.suppress(websockets.ConnectionClosed):
                while True:
                    await asyncio.wait_for(ws.recv(), 30)

    asyncio.run(one_call())
    deadline = time.monotonic() + 30
    while ended(server)["completed"] != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ended(server) == {"completed": 1, "engine_error": 0, "internal_error": 0}
