"""Ended connections free themselves without the cyclic collector, and its pauses are measured.

In process (the collector's garbage is only visible from inside): the real app on
uvicorn with the fast WebSocket protocol, on a loopback port, real clients.
"""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import uvicorn
import websockets.asyncio.client

from duplexserve.config import ServerConfig
from duplexserve.server.app import create_app
from duplexserve.server.run import uvicorn_config
from tests.conftest import free_port

OURS = {"Session", "NativeConnection", "MoshiConnection", "FastWebSocketProtocol", "F32Passthrough"}


async def _sessions(port: int, count: int) -> None:
    frame = np.zeros(1920, np.float32).tobytes()

    async def one() -> None:
        async with websockets.asyncio.client.connect(f"ws://127.0.0.1:{port}/v1/duplex") as ws:
            await ws.recv()  # session.created
            await ws.send(frame * 2)
            await ws.send('{"type": "input.end"}')
            async for _ in ws:
                pass

    await asyncio.gather(*(one() for _ in range(count)))


def test_ended_sessions_leave_no_reference_cycles_and_gc_pauses_are_exported():
    port = free_port()
    app = create_app(ServerConfig(port=port, log_level="warning"))
    server = uvicorn.Server(uvicorn_config(ServerConfig(port=port, log_level="warning"), app))

    async def main() -> tuple[set[str], str]:
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        await _sessions(port, 4)  # warm: first-use caches and imports are not garbage
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            await _sessions(port, 8)
            await asyncio.sleep(0.3)  # the server side of each connection finishes
            gc.collect()
            left = {type(o).__qualname__ for o in gc.garbage}
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        metrics = (await reader.read()).decode()
        writer.close()
        server.should_exit = True
        await task
        return left, metrics

    left, metrics = asyncio.run(main())
    assert not (left & OURS), f"left to the cyclic collector: {sorted(left & OURS)}"
    assert 'duplexserve_gc_pause_seconds_count{generation="2"}' in metrics
