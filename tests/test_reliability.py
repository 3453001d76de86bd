"""Faults and attacks against a real server process: it keeps serving and loses nothing silently."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import socket
import time

import httpx
import numpy as np
import websockets.asyncio.client

from tests.native_client import converse
from tests.native_client import signal as noise

FRAME_BYTES = 1920 * 4
POISON = np.float32(1000.0)  # the synthetic engine's FAIL_MARK


def run(coro):
    return asyncio.run(coro)


def frames_of(audio: np.ndarray) -> list[bytes]:
    data = audio.tobytes()
    return [data[i : i + FRAME_BYTES] for i in range(0, len(data), FRAME_BYTES)]


def wait_for(predicate, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def open_close_code(url: str, **kwargs) -> tuple[dict | None, int | None]:
    """Connect, read the first message and then until the close; return (first, close code)."""
    async with websockets.asyncio.client.connect(url, compression=None, **kwargs) as ws:
        first = json.loads(await ws.recv())
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                await ws.recv()
        return first, ws.close_code


async def echo_ok(url: str, seed: int = 1, **kwargs) -> bool:
    audio = noise(4, seed=seed).tobytes()
    async with websockets.asyncio.client.connect(url, compression=None, **kwargs) as ws:
        await ws.recv()
        await ws.send(audio)
        await ws.send(json.dumps({"type": "input.end"}))
        got = [m async for m in ws if isinstance(m, bytes)]
    return b"".join(got) == audio


# ----------------------------------------------------------------------- slow and gone
def test_a_client_that_stops_reading_is_closed_and_others_are_served(server_factory):
    server = server_factory("--max-output-frames", "16", "--max-pending-frames", "16")

    async def scenario():
        # max_queue=1 and a tiny read buffer: this client stops reading almost at once.
        stuck = await websockets.asyncio.client.connect(server.ws(), compression=None, max_queue=1)
        await stuck.recv()
        audio = noise(400, seed=4).tobytes()

        async def flood():  # until the server gives up on it: kernel buffers hold megabytes
            with contextlib.suppress(Exception):
                while True:
                    for i in range(0, len(audio), FRAME_BYTES):
                        await asyncio.wait_for(stuck.send(audio[i : i + FRAME_BYTES]), 5)

        flooding = asyncio.create_task(flood())
        bystander = await converse(server.ws(), frames_of(noise(30, seed=5)), gap=0.02)
        # The stuck session lost its slot although its TCP connection may still be open.
        for _ in range(600):
            if server.metrics()["duplexserve_sessions_active"] == 0:
                break
            await asyncio.sleep(0.05)
        active = server.metrics()["duplexserve_sessions_active"]
        flooding.cancel()
        stuck.transport.abort()
        return bystander, active

    bystander, active = run(scenario())
    assert len(bystander.frames) == 30 and bystander.closed["reason"] == "completed"
    assert active == 0


def test_disconnect_storm_leaks_no_session(server_factory):
    # Cut connections detach their sessions for a resume: a short grace lets them expire.
    server = server_factory("--max-sessions", "300", "--resume-grace-s", "2")
    rng = random.Random(7)

    async def victim(i: int) -> None:
        how = rng.choice(["handshake", "after_created", "mid_stream", "mid_message", "queue_full"])
        if how == "handshake":
            _, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /v1/duplex HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n")
            await writer.drain()
            writer.transport.abort()
            return
        ws = await websockets.asyncio.client.connect(server.ws(), compression=None, max_queue=1)
        await ws.recv()
        if how == "mid_stream":
            for f in frames_of(noise(rng.randint(1, 20), seed=i)):
                await ws.send(f)
        elif how == "mid_message":
            # A frame header announcing 7680 bytes, then only part of them.
            ws.transport.write(b"\x82\xfe\x1e\x00\x00\x00\x00\x00" + b"\x00" * 1000)
        elif how == "queue_full":
            for f in frames_of(noise(60, seed=i)):
                await ws.send(f)
            await asyncio.sleep(0.05)
        ws.transport.abort()

    async def storm():
        await asyncio.gather(*(victim(i) for i in range(300)), return_exceptions=True)

    run(storm())
    wait_for(lambda: server.metrics()["duplexserve_sessions_active"] == 0, what="all sessions freed")
    assert run(echo_ok(server.ws()))
    assert server.proc.poll() is None


# ---------------------------------------------------------------------------- overload
def test_overload_is_refused_at_once_while_sessions_in_keep_going(server_factory):
    server = server_factory("--max-sessions", "4")

    async def scenario():
        inside = [asyncio.create_task(converse(server.ws(), frames_of(noise(25, seed=10 + i)), gap=0.02))
                  for i in range(4)]
        await asyncio.sleep(0.3)
        refused = await asyncio.gather(*(open_close_code(server.ws()) for _ in range(20)))
        return await asyncio.gather(*inside), refused

    inside, refused = run(scenario())
    assert all(len(r.frames) == 25 and r.closed["reason"] == "completed" for r in inside)
    assert all(code == 1013 and first["code"] == "server_unavailable" for first, code in refused)


def test_sessions_per_client_address_are_limited(server_factory):
    server = server_factory("--max-sessions-per-client", "2")

    async def scenario():
        a = await websockets.asyncio.client.connect(server.ws(), compression=None)
        b = await websockets.asyncio.client.connect(server.ws(), compression=None)
        await a.recv(), await b.recv()
        third = await open_close_code(server.ws())
        for ws in (a, b):  # session.close: a bare WebSocket close would detach them for a resume
            await ws.send(json.dumps({"type": "session.close"}))
        await a.close(), await b.close()
        await asyncio.sleep(0.2)
        return third, await echo_ok(server.ws())

    (first, code), ok_after = run(scenario())
    assert code == 1008 and first["code"] == "too_many_sessions"
    assert ok_after


def test_a_handshake_that_never_completes_is_dropped(server_factory):
    server = server_factory("--handshake-timeout-s", "1")
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /v1/duplex HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        started = time.monotonic()
        assert s.recv(100) == b""  # the server hung up
        assert time.monotonic() - started < 9
    assert run(echo_ok(server.ws()))


def test_a_request_head_past_the_limit_gets_431(server_factory):
    """A header that never ends: answered 431 once the head passes MAX_HEAD_BYTES, long
    before the handshake timeout; requests with ordinary heads, kept alive, go on."""
    server = server_factory()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /v1/duplex HTTP/1.1\r\nHost: x\r\nX-Big: ")
        answer = b""
        with contextlib.suppress(ConnectionError):
            for _ in range(64):  # 4 MiB at most: the answer comes after the first 64 KiB
                s.sendall(b"a" * (64 << 10))
                s.settimeout(0.05)
                with contextlib.suppress(TimeoutError):
                    answer += s.recv(200)
                if answer:
                    break
        s.settimeout(10)
        with contextlib.suppress(ConnectionError):
            answer += s.recv(200)
    assert answer.startswith(b"HTTP/1.1 431 ")
    assert server.metrics()['duplexserve_connections_over_budget_total{budget="request_head"}'] == 1
    with httpx.Client() as client:  # one kept-alive connection, heads under the limit
        for _ in range(3):
            assert client.get(server.http + "/health", headers={"x-pad": "p" * 30_000}).status_code == 200
    assert run(echo_ok(server.ws()))


# ------------------------------------------------------------------------------- drain
def test_sigterm_drains_finishes_sessions_then_exits(server_factory):
    server = server_factory("--drain-grace-s", "20")

    async def scenario():
        sessions = [asyncio.create_task(converse(server.ws(), frames_of(noise(25, seed=20 + i)), gap=0.04))
                    for i in range(3)]
        await asyncio.sleep(0.3)
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        ready = httpx.get(server.http + "/ready").status_code
        refused = await open_close_code(server.ws())
        return await asyncio.gather(*sessions), ready, refused

    results, ready, (first, code) = run(scenario())
    assert ready == 503
    assert code == 1013 and first["code"] == "server_unavailable"
    for r in results:
        assert len(r.frames) == 25 and r.closed["reason"] == "completed" and r.close_code == 1000
    assert server.proc.wait(20) == 0


def test_sigterm_closes_what_outlives_the_grace_period_with_counts(server_factory):
    server = server_factory("--drain-grace-s", "1")

    async def scenario():
        long = asyncio.create_task(converse(server.ws(), frames_of(noise(200, seed=30)), gap=0.04))
        await asyncio.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        return await long

    res = run(scenario())
    closed = res.closed
    assert closed["reason"] == "server_shutdown" and res.close_code == 1001
    assert closed["frames_out"] == len(res.frames)
    assert closed["frames_in"] == closed["frames_out"] + closed["frames_dropped"]
    assert server.proc.wait(20) == 0


# -------------------------------------------------------------------------------- auth
def test_api_keys_accepted_and_refused_in_each_form(server_factory):
    server = server_factory("--api-keys", "k-one,k-two", "--log-level", "info")

    async def scenario():
        refused = [
            await open_close_code(server.ws()),
            await open_close_code(server.ws(query="token=wrong")),
            await open_close_code(server.ws(), additional_headers={"Authorization": "Bearer nope"}),
        ]
        accepted = [
            await echo_ok(server.ws(query="token=k-one")),
            await echo_ok(server.ws(), additional_headers={"Authorization": "Bearer k-two"}),
        ]
        return refused, accepted

    refused, accepted = run(scenario())
    assert all(code == 1008 and first["code"] == "unauthorized" for first, code in refused)
    assert all(accepted)
    time.sleep(0.2)
    assert "k-one" not in server.log() and "wrong" not in server.log()


def test_origin_allow_list(server_factory):
    server = server_factory("--allowed-origins", "https://talk.example")

    async def scenario():
        bad = await open_close_code(server.ws(), origin="https://evil.example")
        good = await echo_ok(server.ws(), origin="https://talk.example")
        return bad, good

    (first, code), good = run(scenario())
    assert code == 1008 and first["code"] == "origin_not_allowed"
    assert good
