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
import struct

import pytest
import websockets.asyncio.client

from tests import raw_ws
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
        async with websockets.asyncio.client.connect(server.ws(), compression=None) as ws:
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
        async with websockets.asyncio.client.connect(server.ws(), compression=None) as ws:
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
    """The fast path refuses it from its header, with the protocol's error event; uvicorn's
    path lets websockets refuse it at its ``max_size``, with the close code alone."""
    server = server_factory("--ws", ws_impl, "--max-message-bytes", "20000")

    async def main() -> tuple[list[dict], int | None]:
        events = []
        async with websockets.asyncio.client.connect(server.ws(), compression=None) as ws:
            await ws.recv()
            await ws.send(b"\0" * 60000)  # past uvicorn's ws_max_size (2 x 20000 + 1024)
            with pytest.raises(websockets.ConnectionClosed):
                while True:
                    message = await asyncio.wait_for(ws.recv(), 10)
                    if isinstance(message, str):
                        events.append(json.loads(message))
            return events, ws.close_code

    events, code = run(main())
    assert code == 1009
    if ws_impl == "fast":
        assert [e.get("code", e["type"]) for e in events] == ["message_too_big", "session.closed"]
        assert "60000 bytes" in events[0]["message"]


def test_a_client_still_sending_after_a_protocol_error_reads_its_close_code(server_factory):
    """A fragmented message grows past websockets' limit while the client sends 3 MB more:
    the server reads on (and drops) until the client has read the close frame, instead of
    closing a socket with bytes unread, which resets the connection and loses the code."""
    server = server_factory("--max-message-bytes", "20000")
    sock, rest = raw_ws.connect(server.port)
    chunk = b"\0" * 65536
    sock.sendall(b"".join(raw_ws.frame(0x02 if i == 0 else 0x00, chunk) for i in range(48)))
    frames, code = raw_ws.Reader(sock, rest).until_close()
    sock.close()
    assert code == 1009
    assert json.loads(frames[0][1])["type"] == "session.created"


def test_pings_from_a_client_that_reads_nothing_do_not_pile_up(server_factory):
    """20 MB of pings, nothing read: past the transport's high-water mark the server keeps
    only the latest pong (RFC 6455 5.5.3) instead of buffering all of them; that one comes
    once the client reads. (The frame budgets, off here, would close it long before:
    tests/test_hostile_transport.py.)"""
    server = server_factory("--ws-max-frames-per-s", "0", "--ws-max-control-frames-per-s", "0")
    sock, rest = raw_ws.connect(server.port)
    pings = 150_000
    pad = b"p" * 121
    sock.sendall(b"".join(raw_ws.frame(0x89, struct.pack("!I", i) + pad) for i in range(pings)))
    reader = raw_ws.Reader(sock, rest)
    pongs = 0
    while True:
        item = reader.next()
        assert item is not None, "the server closed the connection"
        opcode, payload = item
        if opcode == 10:
            pongs += 1
            if struct.unpack("!I", payload[:4])[0] == pings - 1:
                break
    sock.close()
    assert pongs < pings // 2, f"{pongs} pongs for {pings} pings: every one was buffered"


@pytest.mark.parametrize("ws_impl", WS_IMPLS)
def test_a_client_sending_faster_than_the_engine_is_held_back_by_tcp(server_factory, ws_impl):
    """With the engine at 10 steps a second, reading pauses once 64 frames wait: the
    client's sends block long before 30 MB are out, and what was sent comes back whole."""
    server = server_factory("--ws", ws_impl, "--step-base-ms", "100", "--max-pending-frames", "64")
    frame = signal(1, seed=5).tobytes()

    async def main() -> tuple[int, int]:
        async with websockets.asyncio.client.connect(server.ws(), compression=None, max_size=None) as ws:
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


def test_the_fast_path_runs_where_the_libraries_have_what_it_reads(caplog, monkeypatch):
    """The installed uvicorn and websockets have every internal the fast path reads (the
    lowest versions pyproject admits too: scripts/test-lowest.sh); where one is missing the
    server serves on uvicorn's own protocol and says why, once."""
    from duplexserve.server import run as run_module
    from duplexserve.server.transports.websocket.fallback import SansIOFallback
    from duplexserve.server.transports.websocket.protocol import (
        FastWebSocketProtocol,
        fallback_problem,
        fast_path_problem,
    )

    assert fast_path_problem() is None and fallback_problem() is None
    assert issubclass(run_module.websocket_protocol("fast"), FastWebSocketProtocol)
    assert issubclass(run_module.websocket_protocol("websockets-sansio"), SansIOFallback)
    assert run_module.websocket_protocol("websockets-sansio", None) == "websockets-sansio"  # echo floors
    missing = "uvicorn 0.35.0, websockets 13.0 lack uvicorn close_timer"
    monkeypatch.setattr(run_module, "fast_path_problem", lambda: missing)
    with caplog.at_level("WARNING", logger="duplexserve"):
        assert issubclass(run_module.websocket_protocol("fast"), SansIOFallback)
    (record,) = [r for r in caplog.records if "fast path off" in r.getMessage()]
    assert missing in record.getMessage() and "uvicorn>=0.53" in record.getMessage()
    monkeypatch.setattr(run_module, "fallback_problem", lambda: missing)
    with caplog.at_level("WARNING", logger="duplexserve"):
        assert run_module.websocket_protocol("websockets-sansio") == "websockets-sansio"
    assert any("without per-connection budgets" in r.getMessage() for r in caplog.records)
