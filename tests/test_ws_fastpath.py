"""The callback fast path on the wire, against a real server and real clients.

The frame reader itself is checked against websockets in test_ws_frames.py; these tests
check what the server does with what it reads: fragments and control frames in the
middle of audio, protocol errors with their close codes, and reading held back while a
session's input is paused. Each runs over the fast path and over uvicorn's own ASGI
path (the fallback), which must behave the same.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets

from tests.native_client import signal

FRAME_BYTES = 7680
WS_IMPLS = ["fast", "websockets-sansio"]


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


@pytest.mark.parametrize("ws_impl", WS_IMPLS)
def test_fragments_and_pings_between_audio_are_served_in_order(server_factory, ws_impl):
    server = server_factory("--ws", ws_impl)
    audio = signal(6, seed=3).tobytes()

    async def main() -> tuple[list[bytes], dict]:
        async with websockets.connect(server.ws(), compression=None) as ws:
            created = json.loads(await ws.recv())
            await ws.send(audio[:FRAME_BYTES])  # one whole frame
            # One message in three fragments, a ping answered in the middle of it.
            await ws.send([audio[FRAME_BYTES : 2 * FRAME_BYTES], audio[2 * FRAME_BYTES : 4 * FRAME_BYTES - 8],
                           audio[4 * FRAME_BYTES - 8 : 5 * FRAME_BYTES]])
            await asyncio.wait_for(await ws.ping(b"between"), 5)
            await ws.send(audio[5 * FRAME_BYTES :])
            await ws.send(json.dumps({"type": "input.end"}))
            frames = []
            async for message in ws:
                if isinstance(message, bytes):
                    frames.append(message)
                elif json.loads(message)["type"] == "session.closed":
                    return frames, created
        raise AssertionError("no session.closed")

    frames, created = run(main())
    assert created["type"] == "session.created"
    assert b"".join(frames) == audio


@pytest.mark.parametrize("ws_impl", WS_IMPLS)
def test_invalid_utf8_in_a_text_message_closes_1007(server_factory, ws_impl):
    server = server_factory("--ws", ws_impl)

    async def main() -> int | None:
        async with websockets.connect(server.ws(), compression=None) as ws:
            await ws.recv()
            await ws.send(b'{"type": "ping", "id": "\xff"}', text=True)  # not UTF-8
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    await asyncio.wait_for(ws.recv(), 10)
            return ws.close_code

    assert run(main()) == 1007
    assert server.proc.poll() is None


@pytest.mark.parametrize("ws_impl", WS_IMPLS)
def test_a_frame_over_the_hard_limit_closes_1009(server_factory, ws_impl):
    server = server_factory("--ws", ws_impl, "--max-message-bytes", "20000")

    async def main() -> int | None:
        async with websockets.connect(server.ws(), compression=None) as ws:
            await ws.recv()
            await ws.send(b"\0" * 60000)  # past uvicorn's ws_max_size (2 x 20000 + 1024)
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    await asyncio.wait_for(ws.recv(), 10)
            return ws.close_code

    assert run(main()) == 1009


@pytest.mark.parametrize("ws_impl", WS_IMPLS)
def test_a_client_sending_faster_than_the_engine_is_held_back_by_tcp(server_factory, ws_impl):
    """With the engine at 10 steps a second, reading pauses once 64 frames wait: the
    client's sends block long before 30 MB are out, and what was sent comes back whole."""
    server = server_factory("--ws", ws_impl, "--step-base-ms", "100", "--max-pending-frames", "64")
    frame = signal(1, seed=5).tobytes()

    async def main() -> tuple[int, int]:
        async with websockets.connect(server.ws(), compression=None, max_size=None) as ws:
            await ws.recv()
            sent = 0
            try:
                for _ in range(4000):  # 30 MB: more than loopback's socket buffers hold
                    await asyncio.wait_for(ws.send(frame), 3)
                    sent += 1
            except TimeoutError:
                pass
            received = 0
            while received < 20:  # the session is alive and answering what it took
                message = await asyncio.wait_for(ws.recv(), 10)
                received += isinstance(message, bytes)
            return sent, received

    sent, received = run(main())
    assert sent < 4000, "the server read everything: no backpressure"
    assert received == 20
