"""An engine restart never silently resets a live conversation (docs/protocol.md, "What is guaranteed").

Every session whose model state was lost (every slot of the engine that raised, died or
stalled, whatever batch its frame was in) ends with ``engine_error`` and 1011 in its
protocol's terms; the next new session is served exactly. Real server processes, real
clients of each protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from dataclasses import dataclass, field

import httpx
import websockets.asyncio.client

from duplexserve.engine_bridge.process_engine import ENGINE_NAME, SPARE_NAME
from tests.native_client import signal as noise
from tests.test_reliability import POISON, echo_ok, frames_of, run, wait_for

ENGINE_ERROR = 1011


@dataclass
class Ending:
    """How a session ended, as its client saw it."""

    close_code: int | None = None
    errors: list[str] = field(default_factory=list)  # error codes (native, Realtime) or texts (Moshi)
    closed: dict | None = None  # native session.closed
    frames: int = 0  # audio messages received


async def read_to_close(ws, ending: Ending, parse) -> Ending:
    with contextlib.suppress(websockets.ConnectionClosed):
        async for msg in ws:
            parse(msg, ending)
    ending.close_code = ws.close_code
    return ending


def parse_native(msg, ending: Ending) -> None:
    if isinstance(msg, bytes):
        ending.frames += 1
        return
    event = json.loads(msg)
    if event["type"] == "error":
        ending.errors.append(event["code"])
    elif event["type"] == "session.closed":
        ending.closed = event


def parse_moshi(msg, ending: Ending) -> None:
    if msg[:1] == b"\x01":
        ending.frames += 1
    elif msg[:1] == b"\x05":
        ending.errors.append(msg[1:].decode())


def parse_realtime(msg, ending: Ending) -> None:
    event = json.loads(msg)
    if event["type"] == "error":
        ending.errors.append(event["error"]["code"])


async def native(url: str, frames: int, stream_until: asyncio.Event | None = None, seed: int = 0) -> Ending:
    """A native session: ``frames`` frames, then (with ``stream_until``) one frame every
    40 ms until the event is set or the server ends it; then it reads until the close."""
    ending = Ending()
    chunks = frames_of(noise(frames + 400, seed=seed))
    async with websockets.asyncio.client.connect(url, compression=None, max_size=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        reader = asyncio.create_task(read_to_close(ws, ending, parse_native))
        with contextlib.suppress(websockets.ConnectionClosed):
            for chunk in chunks[:frames]:
                await ws.send(chunk)
            i = frames
            while stream_until is not None and not stream_until.is_set() and not reader.done():
                await ws.send(chunks[i])
                i += 1
                await asyncio.sleep(0.04)
        return await asyncio.wait_for(reader, 30)


async def moshi_idle(url: str) -> Ending:
    async with websockets.asyncio.client.connect(url, compression=None) as ws:
        assert (await ws.recv())[:1] == b"\x00"  # the handshake
        return await asyncio.wait_for(read_to_close(ws, Ending(), parse_moshi), 30)


async def realtime_idle(url: str) -> Ending:
    async with websockets.asyncio.client.connect(url, compression=None) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
        return await asyncio.wait_for(read_to_close(ws, Ending(), parse_realtime), 30)


def assert_engine_error(ending: Ending, what: str, error: str = "engine_error") -> None:
    assert ending.close_code == ENGINE_ERROR, (what, ending)
    assert ending.errors and error in ending.errors[0], (what, ending)


def assert_native_engine_error(ending: Ending, what: str) -> None:
    assert_engine_error(ending, what)
    closed = ending.closed
    assert closed is not None and closed["reason"] == "engine_error", (what, closed)
    assert closed["frames_out"] + closed["frames_dropped"] == closed["frames_in"], (what, closed)
    assert ending.frames == closed["frames_out"], (what, ending)


def ended(server, cause: str) -> float:
    return server.metrics()[f'duplexserve_engine_restart_sessions_ended_total{{cause="{cause}"}}']


def assert_served_again(server) -> None:
    wait_for(lambda: httpx.get(server.http + "/ready").status_code == 200, what="/ready after the restart")
    assert run(echo_ok(server.ws(), seed=9))  # the next new session, exact


async def open_beside(server) -> tuple[list[asyncio.Task], asyncio.Event]:
    """Sessions beside the failing one, on every protocol: one streaming, one native idle
    between frames, one Moshi and one Realtime idle since they opened."""
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(native(server.ws(), 4, stop, seed=3)),
        asyncio.create_task(native(server.ws(), 3, seed=4)),  # sends 3 frames, then waits
        asyncio.create_task(moshi_idle(server.ws("/api/chat"))),
        asyncio.create_task(realtime_idle(server.ws("/v1/realtime"))),
    ]
    await asyncio.to_thread(
        wait_for, lambda: server.metrics()["duplexserve_sessions_active"] == 4, 15, "four sessions"
    )
    await asyncio.sleep(0.3)  # the idle native session's three frames are answered
    return tasks, stop


def check_beside(endings: list[Ending]) -> None:
    streaming, idle, moshi, realtime = endings
    assert_native_engine_error(streaming, "streaming beside")
    assert_native_engine_error(idle, "native idle between frames")
    assert idle.closed["frames_in"] == 3 and idle.closed["frames_out"] == 3
    assert_engine_error(moshi, "Moshi idle", "model state is lost")  # kind 0x05 carries the text
    assert_engine_error(realtime, "Realtime idle")


def test_a_step_that_raises_ends_every_session_of_the_engine(server_factory):
    server = server_factory("--synthetic-faults", "--max-sessions", "8")
    poison = noise(3, seed=2)
    poison[1920] = POISON  # its second frame makes the step raise

    async def go() -> tuple[Ending, list[Ending]]:
        tasks, stop = await open_beside(server)
        failing = await native_frames(server.ws(), frames_of(poison))
        stop.set()
        return failing, list(await asyncio.gather(*tasks))

    failing, beside = run(go())
    assert_native_engine_error(failing, "the session whose frame raised")
    assert not any("Traceback" in e or "RuntimeError" in e for e in failing.errors)  # no internals
    check_beside(beside)
    text = server.log()
    assert "engine restart (cause: step_failed): 5 sessions" in text
    assert ended(server, "step_failed") == 5
    assert_served_again(server)


def spawned_children(server_pid: int) -> dict[int, str]:
    """The server's multiprocessing children (not its resource tracker): pid -> process name."""
    found = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if ppid == server_pid and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            found[int(pid)] = name
    return found


def engine_child(server_pid: int) -> int:
    """The engine process the server spawned (not its spare, nor multiprocessing's resource tracker)."""
    for pid, name in spawned_children(server_pid).items():
        if name == ENGINE_NAME:
            return pid
    raise AssertionError("no engine process found")


def test_the_engine_process_killed_ends_every_session_of_the_engine(server_factory):
    """SIGKILL of the engine process while sessions stream (their frames in the step or
    beside it) and others idle: all end with engine_error, none goes on on a new state."""
    server = server_factory(
        "--engine-process", "--max-sessions", "8", "--step-base-ms", "30", "--resume-grace-s", "30"
    )

    async def go() -> list[Ending]:
        tasks, stop = await open_beside(server)
        in_batch = asyncio.create_task(native(server.ws(), 2, stop, seed=5))
        await asyncio.sleep(0.5)
        os.kill(engine_child(server.proc.pid), signal.SIGKILL)
        endings = await asyncio.gather(in_batch, *tasks)
        stop.set()
        return list(endings)

    in_batch, *beside = run(go())
    assert_native_engine_error(in_batch, "streaming when the process died")
    check_beside(beside)
    assert ended(server, "engine_died") == 5
    assert "engine restart (cause: engine_died): 5 sessions" in server.log()
    assert_served_again(server)


def test_a_spare_engine_process_takes_over_and_none_outlives_the_server(server_factory):
    """The restart takes the spare (spawned, its imports done) and a new spare is spawned;
    with --engine-spare off there is none; a stopped server leaves no engine process."""
    server = server_factory("--engine-process", "--max-sessions", "4", "--log-level", "info")
    wait_for(lambda: sorted(spawned_children(server.proc.pid).values()) == [ENGINE_NAME, SPARE_NAME],
             what="the engine process and its spare")  # fmt: skip
    first = spawned_children(server.proc.pid)
    os.kill(engine_child(server.proc.pid), signal.SIGKILL)
    assert_served_again(server)
    assert "engine process ready in" in server.log() and "(a spare, imported before)" in server.log()
    wait_for(lambda: sorted(spawned_children(server.proc.pid).values()) == [ENGINE_NAME, SPARE_NAME],
             what="the spare as the engine, and a new spare")  # fmt: skip
    now = spawned_children(server.proc.pid)
    spare = next(pid for pid, name in first.items() if name == SPARE_NAME)
    assert now[spare] == ENGINE_NAME  # the old spare is the engine now
    children = list(now)
    assert server.stop() == 0
    assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")]

    plain = server_factory(
        "--engine-process", "--engine-spare", "off", "--max-sessions", "4", "--log-level", "info"
    )
    assert list(spawned_children(plain.proc.pid).values()) == [ENGINE_NAME]
    os.kill(engine_child(plain.proc.pid), signal.SIGKILL)
    assert_served_again(plain)
    assert "(spawn and imports" in plain.log().split("engine restart")[1]
    assert list(spawned_children(plain.proc.pid).values()) == [ENGINE_NAME]


def test_a_stalled_engine_is_replaced_and_every_session_of_it_ends(server_factory):
    server = server_factory("--synthetic-faults", "--engine-stall-s", "1", "--max-sessions", "8")
    hang = noise(2, seed=3)
    hang[0] = -POISON

    async def go() -> tuple[Ending, list[Ending]]:
        tasks, stop = await open_beside(server)
        hung = await asyncio.wait_for(native_frames(server.ws(), frames_of(hang)), 20)
        stop.set()
        return hung, list(await asyncio.gather(*tasks))

    hung, beside = run(go())
    assert_native_engine_error(hung, "the session whose frame hung")
    assert hung.closed["frames_dropped"] == 2
    check_beside(beside)
    assert ended(server, "stalled") == 5
    assert server.metrics()["duplexserve_engine_restarts_total"] == 1
    assert_served_again(server)
    assert server.proc.poll() is None


async def native_frames(url: str, chunks: list[bytes]) -> Ending:
    ending = Ending()
    async with websockets.asyncio.client.connect(url, compression=None) as ws:
        await ws.recv()
        reader = asyncio.create_task(read_to_close(ws, ending, parse_native))
        for chunk in chunks:
            with contextlib.suppress(websockets.ConnectionClosed):
                await ws.send(chunk)
        return await asyncio.wait_for(reader, 30)

