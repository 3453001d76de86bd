"""Hostile clients at the WebSocket transport: one connection never stalls the server and
costs no more than its budgets (server/transports/websocket/budgets.py, Session's bound on replies).

Each attack runs from a bare socket in a thread (raw_ws: nothing a library would refuse
to send), while three honest duplex/1 sessions stream at real time beside it; their
frames must come back exact and each at most a second after it was sent, and ``/health``
must answer within 1.5 s throughout. Before the budgets and the slices, one connection
sending pings or tiny messages held the loop for seconds per read (``/health`` 10 s),
and one that read nothing grew the server by 2 GB in 8 s. scripts/test.sh runs this
file again over the ASGI fallback (``DUPLEXSERVE_WS=websockets-sansio``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import threading
import time

import httpx
import pytest
import websockets.asyncio.client

from tests import raw_ws
from tests.conftest import ServerProcess
from tests.native_client import signal as noise

KEY = "hostile-test-key"
FRAME_BYTES = 7680
HONEST_FRAMES = 40  # 3.2 s at real time
MAX_LATE_S = 1.0
MAX_HEALTH_S = 1.5


class Flood:
    """Sends ``blob`` over and over from a thread until the server drops the connection;
    another thread reads whatever comes back, so that replies never hold the sender back."""

    def __init__(self, sock: socket.socket, rest: bytes, blob: bytes) -> None:
        self.sock, self.blob, self.received = sock, blob, [rest]
        self.sent = 0
        self.started = self.ended = 0.0
        self.dropped = False  # by the server, before ``stop``
        self._threads = (threading.Thread(target=self._send, daemon=True),
                         threading.Thread(target=self._read, daemon=True))  # fmt: skip

    def start(self) -> Flood:
        self.started = time.monotonic()
        for thread in self._threads:
            thread.start()
        return self

    def _send(self) -> None:
        try:
            while True:
                self.sock.sendall(self.blob)
                self.sent += len(self.blob)
        except OSError:  # the server closed or reset the connection
            self.ended = time.monotonic()

    def _read(self) -> None:
        try:
            while chunk := self.sock.recv(1 << 16):
                self.received.append(chunk)
        except OSError:
            pass

    def stop(self, wait_s: float = 15.0) -> None:
        """Wait for the server to drop it (at most ``wait_s``), then close our end."""
        for thread in self._threads:
            thread.join(wait_s)
        self.dropped = bool(self.ended)
        with contextlib.suppress(OSError):  # not connected: the server closed it
            self.sock.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join()
        self.sock.close()

    def close_code(self) -> int | None:
        """The close code the server sent, if its close frame came."""

        class Done:
            @staticmethod
            def recv(_: int) -> bytes:
                return b""

        return raw_ws.Reader(Done(), b"".join(self.received)).until_close()[1]  # type: ignore[arg-type]


def connect(server: ServerProcess, path: str) -> tuple[socket.socket, bytes]:
    sock, rest = raw_ws.connect(server.port, path)
    sock.settimeout(None)
    return sock, rest


def text_frames(message: str | dict, count: int) -> bytes:
    payload = (json.dumps(message) if isinstance(message, dict) else message).encode()
    return b"".join(raw_ws.frame(0x81, payload) for _ in range(count))


async def paced_session(url: str, seed: int) -> float:
    """One honest duplex/1 session at real time: its echo must be exact; returns how late
    its latest frame came back (receive time minus send time)."""
    audio = noise(HONEST_FRAMES, seed=seed).tobytes()
    loop = asyncio.get_running_loop()
    async with websockets.asyncio.client.connect(url, compression=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        got: list[tuple[bytes, float]] = []

        async def read() -> None:
            async for message in ws:
                if isinstance(message, bytes):
                    got.append((message, loop.time()))

        reader = asyncio.create_task(read())
        sent_at = []
        start = loop.time()
        for i in range(HONEST_FRAMES):
            await asyncio.sleep(max(0.0, start + 0.08 * i - loop.time()))
            sent_at.append(loop.time())
            await ws.send(audio[i * FRAME_BYTES : (i + 1) * FRAME_BYTES])
        await ws.send(json.dumps({"type": "input.end"}))
        await asyncio.wait_for(reader, 30)
    assert b"".join(frame for frame, _ in got) == audio, f"session {seed}: frames lost or altered"
    return max(at - sent for (_, at), sent in zip(got, sent_at, strict=True))


async def slowest_health(url: str, done: asyncio.Event) -> float:
    worst = 0.0
    async with httpx.AsyncClient() as client:
        while not done.is_set():
            began = time.monotonic()
            assert (await client.get(url + "/health", timeout=60)).status_code == 200
            worst = max(worst, time.monotonic() - began)
            await asyncio.sleep(0.1)
    return worst


def beside(server: ServerProcess, flood: Flood) -> tuple[float, float]:
    """Start ``flood``, stream three honest sessions beside it while probing /health;
    returns (the latest honest frame, the slowest /health) in seconds."""

    async def main() -> tuple[float, float]:
        flood.start()
        await asyncio.sleep(0.2)  # in full swing
        done = asyncio.Event()
        health = asyncio.create_task(slowest_health(server.http, done))
        url = server.ws("/v1/duplex", f"token={KEY}")
        late = await asyncio.gather(*(paced_session(url, seed) for seed in (1, 2, 3)))
        done.set()
        return max(late), await health

    return asyncio.run(main())


def over_budget(server: ServerProcess, budget: str) -> float:
    return server.metrics().get(f'duplexserve_connections_over_budget_total{{budget="{budget}"}}', 0.0)


def assert_served_beside(server: ServerProcess, flood: Flood, wait_s: float = 15.0) -> None:
    late, health = beside(server, flood)
    flood.stop(wait_s)
    assert health < MAX_HEALTH_S, f"/health took {health:.2f} s during the flood"
    assert late < MAX_LATE_S, f"an honest frame came back {late:.2f} s after it was sent"


# ------------------------------------------------------------------------- pings
@pytest.mark.parametrize("path", ["/v1/duplex", "/v1/twilio"])
def test_a_ping_flood_without_a_key_stalls_nothing_and_is_dropped(server_factory, path):
    """No key, then pings as fast as the socket takes them: on /v1/duplex the connection is
    refused (1008) and the pings go on past the close frame; on /v1/twilio the key would
    come in ``start``, which never comes. Over --ws-max-control-frames-per-s the
    connection is closed, or dropped at once where its close frame was sent already."""
    server = server_factory("--api-keys", KEY)
    sock, rest = connect(server, path)
    peer = "{}:{}".format(*sock.getsockname())
    flood = Flood(sock, rest, raw_ws.frame(0x89, b"") * 20_000)
    assert_served_beside(server, flood)
    assert flood.ended and flood.ended - flood.started < 5, "the flood was read on for seconds"
    assert over_budget(server, "control_frames_per_s") == 1
    (line,) = [line for line in server.log().splitlines() if "control_frames_per_s" in line]
    assert peer in line


# ------------------------------------------------------------- tiny messages
def _twilio_start() -> bytes:
    sid = "MZ" + "0" * 32
    start = {
        "event": "start", "sequenceNumber": "1", "streamSid": sid,
        "start": {"streamSid": sid, "callSid": "CA" + "0" * 32, "tracks": ["inbound"],
                  "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
                  "customParameters": {"token": KEY}},
    }  # fmt: skip
    connected = {"event": "connected", "protocol": "Call", "version": "1.0.0"}
    return text_frames(connected, 1) + text_frames(start, 1)


TINY = {  # path: (what the socket sends before the flood, one flood message as a frame)
    "/v1/duplex": (b"", raw_ws.frame(0x81, b'{"type":"x"}')),  # unknown_event, each answered
    "/v1/realtime": (b"", raw_ws.frame(0x81, b'{"type":"x"}')),  # an error event each
    "/api/chat": (b"", raw_ws.frame(0x82, b"\x06")),  # Moshi's ping kind: ignored
    "/v1/twilio": (_twilio_start(), raw_ws.frame(0x81, b'{"event":"mark","mark":{"name":"frames-0"}}')),
}


@pytest.mark.parametrize("path", list(TINY))
def test_tiny_messages_from_an_authenticated_client_stall_nothing_and_are_cut(server_factory, path):
    """Tiny messages as fast as the socket takes them on an authenticated connection (each
    parsed, most answered): one slice of them a wake-up, and past a budget the connection is
    closed 1008: text (JSON) past --ws-max-parse-ms-per-s, the loop's time handling it, long
    before its frames' budget; binary past --ws-max-frames-per-s (with its burst)."""
    server = server_factory("--api-keys", KEY)
    sock, rest = connect(server, f"{path}?token={KEY}")
    first, message = TINY[path]
    sock.sendall(first)
    flood = Flood(sock, rest, message * 20_000)
    assert_served_beside(server, flood)
    assert flood.ended and flood.ended - flood.started < 10, "the flood was served for seconds"
    assert flood.close_code() == 1008
    budget = "parse_ms_per_s" if message[0] == 0x81 else "frames_per_s"
    assert over_budget(server, budget) == 1
    assert server.log().count(f"over its {budget} budget: closed 1008") == 1
    # Its session ended with it: not kept for a resume (on /v1/duplex), no slot held.
    deadline = time.monotonic() + 5
    while (active := server.metrics()["duplexserve_sessions_active"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert active == 0 and server.metrics()["duplexserve_sessions_detached"] == 0


def test_a_flood_within_its_budgets_delays_others_by_slices_only(server_factory):
    """With no budget at all (0: off) a flood of tiny messages goes on for as long as the
    honest sessions stream: each wake-up parses one slice of it, so their frames and
    /health are no later than with the budgets."""
    off = ("--ws-max-frames-per-s", "0", "--ws-max-control-frames-per-s", "0", "--ws-max-bytes-per-s", "0",
           "--ws-max-parse-ms-per-s", "0", "--overload-parse-share", "0")  # fmt: skip
    server = server_factory("--api-keys", KEY, *off)
    sock, rest = connect(server, f"/v1/duplex?token={KEY}")
    flood = Flood(sock, rest, raw_ws.frame(0x81, b'{"type":"x"}') * 20_000)
    assert_served_beside(server, flood, wait_s=0)
    assert not flood.dropped, "the flood was cut: no budget was meant to act"
    assert flood.sent > 5_000_000


# ------------------------------------------------------------- never reading
def _rss_mb(server: ServerProcess) -> float:
    with open(f"/proc/{server.proc.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_a_client_that_reads_no_replies_is_closed_slow_consumer(server_factory):
    """Pings with 64 KB ids and nothing read (the bytes and parse budgets off, so that only
    this bound acts): past --max-output-event-bytes of replies waiting, the session is closed
    slow_consumer (1008), counted and logged once, and the server's memory stays flat
    (the replies piled up without end before: 2 GB in 8 s)."""
    server = server_factory("--ws-max-bytes-per-s", "0", "--ws-max-parse-ms-per-s", "0")
    sock, rest = connect(server, "/v1/duplex")
    ping = text_frames({"type": "ping", "id": "i" * 65536}, 1)
    before = _rss_mb(server)
    sock.settimeout(10)

    async def main() -> float:
        async def pings() -> float:
            peak = 0.0
            for i in range(3000):  # 200 MB
                await asyncio.to_thread(sock.sendall, ping)
                if i % 100 == 0:
                    peak = max(peak, _rss_mb(server))
            return peak

        flooding = asyncio.create_task(pings())
        await paced_session(server.ws(), seed=4)
        return await flooding

    peak = asyncio.run(main())
    assert peak - before < 60, f"the server grew from {before:.0f} to {peak:.0f} MB"
    frames, code = raw_ws.Reader(sock, rest).until_close()  # what waited for it, then the close
    sock.close()
    closed = json.loads(frames[-1][1])
    assert (closed["type"], closed["reason"], code) == ("session.closed", "slow_consumer", 1008)
    assert [json.loads(p)["type"] for _, p in frames[1:-1]] == ["pong"] * (len(frames) - 2)
    deadline = time.monotonic() + 10  # counted as the connection ends
    while over_budget(server, "slow_consumer") < 1:
        assert time.monotonic() < deadline, "not counted"
        time.sleep(0.1)
    assert server.log().count("closed slow_consumer") == 1


# ---------------------------------------------------------- the slicer, alone
def test_the_fallback_cuts_a_stream_after_whole_frames_and_counts_control_frames():
    """fallback.FrameCounter, which slices reads for uvicorn's protocol: fed the stream
    in pieces of any size, it cuts only after whole frames (or, for a frame still coming,
    after what came), never after more than it was allowed, and counts what it saw."""
    import random

    from duplexserve.server.transports.websocket.fallback import FrameCounter

    rng = random.Random(5)
    frames = [raw_ws.frame(rng.choice((0x81, 0x82, 0x89, 0x8A, 0x01, 0x80)), bytes(n))
              for n in rng.choices((0, 1, 125, 126, 127, 65535, 65536, 70000), k=200)]  # fmt: skip
    ends = set(itertools.accumulate(len(f) for f in frames))
    stream = b"".join(frames)
    counter, backlog, at, begun, controls = FrameCounter(), b"", 0, 0, 0
    pieces = iter(lambda: stream[at : at + rng.randint(1, 100_000)], b"")
    for piece in pieces:
        at += len(piece)
        backlog += piece
        more = True
        while more:
            cut, n, c, more = counter.cut(backlog, 3, 1 << 18)
            assert n <= 3
            backlog, begun, controls = backlog[cut:], begun + n, controls + c
            done = at - len(backlog)
            assert done in ends or not backlog or done == at, "cut inside a frame with its rest here"
    assert (begun, controls, backlog) == (len(frames), sum(f[0] & 0x08 != 0 for f in frames), b"")
