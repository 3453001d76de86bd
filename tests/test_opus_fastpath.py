"""Opus through a codec worker on the fast path: no task per frame, order and errors kept.

The server runs in this process (its own thread and uvloop loop) so that the test can
count the tasks its loop creates; the clients are real WebSocket clients on loopback and
the answers are checked byte for byte against the server's own codecs replayed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time

import pytest
import uvicorn
import uvloop
import websockets.asyncio.client

from duplexserve.codecs import MODEL_RATE, AudioFormat, make_encoder
from duplexserve.codecs.procpool import FAILED, OK, CodecProcesses
from duplexserve.config import ServerConfig
from duplexserve.server.app import create_app
from duplexserve.server.run import uvicorn_config
from tests.conftest import free_port
from tests.native_client import converse
from tests.test_formats_server import expected_answer, query, speechlike, wire_messages

OPUS = AudioFormat("opus")


class InProcessServer:
    """A duplexserve server on a thread of this process, counting its loop's tasks."""

    def __init__(self, **settings) -> None:
        self.port = free_port()
        config = ServerConfig(port=self.port, host="127.0.0.1", log_level="warning", **settings)
        self.app = create_app(config)
        self.server = uvicorn.Server(uvicorn_config(config, self.app))
        self.tasks: list[str] = []  # the qualified name of each task's coroutine
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _factory(self, loop, coro, **kwargs):
        self.tasks.append(getattr(coro, "__qualname__", type(coro).__name__))
        return asyncio.Task(coro, loop=loop, **kwargs)

    def _run(self) -> None:
        loop = uvloop.new_event_loop()
        loop.set_task_factory(self._factory)
        try:
            loop.run_until_complete(self.server.serve())
        finally:
            loop.close()

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    def ws(self, path: str = "/v1/duplex", query: str = "") -> str:
        return f"ws://127.0.0.1:{self.port}{path}" + (f"?{query}" if query else "")


async def kyutai_session(url: str, messages: list[bytes]) -> tuple[list[bytes], list[str], int | None]:
    """Kyutai's client at /api/chat: the handshake, then ``0x01`` + pages, all at once."""
    audio, errors = [], []
    async with websockets.asyncio.client.connect(url, compression=None) as ws:
        assert (await asyncio.wait_for(ws.recv(), 10))[0] == 0x00
        for m in messages:
            await ws.send(b"\x01" + m)
        with contextlib.suppress(websockets.ConnectionClosed, TimeoutError):
            while len(audio) < len(messages) or errors:  # after an error: until the close
                msg = await asyncio.wait_for(ws.recv(), 10)
                if msg[0] == 0x01:
                    audio.append(msg[1:])
                elif msg[0] == 0x05:
                    errors.append(msg[1:].decode())
    return audio, errors, ws.close_code


@pytest.mark.parametrize("batch_ms", ["0", "2"])
def test_opus_frames_take_no_task_and_come_back_exact_and_in_order(batch_ms):
    sessions, seconds = 4, 2.0
    inputs = [wire_messages(speechlike(MODEL_RATE, seed=20 + i, seconds=seconds), OPUS, 80)
              for i in range(sessions)]
    expected = [expected_answer(m, OPUS, OPUS) for m in inputs]
    with InProcessServer(codec_processes=1, codec_batch_ms=float(batch_ms)) as server:
        # Warm up: the codec worker starts, every lazily created task of the server exists.
        asyncio.run(converse(server.ws(query=query(OPUS, OPUS)), inputs[0][:3]))
        before = len(server.tasks)

        async def both():
            # Every message at once: most of them queue up behind a decode in the worker.
            native = [converse(server.ws(query=query(OPUS, OPUS)), m) for m in inputs]
            kyutai = [kyutai_session(server.ws("/api/chat"), m) for m in inputs]
            return await asyncio.gather(*native, *kyutai)

        results = asyncio.run(both())
        created = server.tasks[before:]
    for res, want in zip(results[:sessions], expected, strict=True):
        assert res.closed is not None and res.closed["reason"] == "completed", res.events
        assert res.frames == want  # byte for byte, in order
    for (audio, errors, _), want in zip(results[sessions:], expected, strict=True):
        assert not errors and audio == want
    waits = 2 * 2 * sum(len(w) for w in expected)  # both protocols; a decode and an encode a frame
    # Those of the connections (uvicorn's ASGI run, the close handshake), none per frame;
    # before the callbacks each codec wait took a task (``run_eager``).
    per_connection = len(created) / (2 * sessions)
    assert per_connection <= 4 and len(created) < waits // 4, created


def test_bad_ogg_ends_only_its_session_on_a_shared_worker():
    good = wire_messages(speechlike(MODEL_RATE, seed=31, seconds=1.2), OPUS, 80)
    bad = wire_messages(speechlike(MODEL_RATE, seed=32, seconds=1.2), OPUS, 80)
    bad = [*bad[:4], b"not an Ogg page: the reader loses the page boundary", *bad[4:]]
    with InProcessServer(codec_processes=1) as server:  # both sessions' codecs in one worker

        async def both():
            url = server.ws(query=query(OPUS, OPUS))
            return await asyncio.gather(converse(url, good), converse(url, bad),
                                        kyutai_session(server.ws("/api/chat"), bad))

        ok, broken, kyutai = asyncio.run(both())
    assert ok.closed is not None and ok.closed["reason"] == "completed"
    assert ok.frames == expected_answer(good, OPUS, OPUS)
    errors = broken.of_type("error")
    assert errors and errors[0]["code"] == "invalid_audio" and broken.close_code == 1003
    before = expected_answer(bad[:4], OPUS, OPUS)  # what came before it, exact (a prefix:
    assert broken.frames == before[: len(broken.frames)]  # the close may overtake the echo)
    audio, kyutai_errors, code = kyutai
    assert kyutai_errors and code == 1003 and audio == before[: len(audio)]


def test_worker_replies_go_to_their_callbacks_in_order_and_a_dead_worker_fails_them():
    frames = [speechlike(MODEL_RATE, seed=50 + i, seconds=0.08)[:1920] for i in range(3)]

    async def main():
        procs = CodecProcesses(1, batch_ms=1.0)
        try:
            encs = [procs.opus_encoder() for _ in frames]
            got: list[tuple[int, int, bytes]] = []
            done = asyncio.get_running_loop().create_future()

            def reply(i):
                def on_reply(status, body):
                    got.append((i, status, bytes(body)))
                    if len(got) == 2 * len(frames):
                        done.set_result(None)
                return on_reply

            for _ in range(2):
                for i, (enc, f) in enumerate(zip(encs, frames, strict=True)):
                    enc.submit(f, reply(i))
            await asyncio.wait_for(done, 20)
            worker = encs[0]._worker
            failed: list[int] = []
            worker.proc.kill()
            worker.proc.wait()
            for enc, f in zip(encs, frames, strict=True):
                enc.submit(f, lambda status, body: failed.append(status))
            for _ in range(200):
                if len(failed) == len(frames):
                    break
                await asyncio.sleep(0.02)
            return got, failed
        finally:
            procs.close()

    got, failed = asyncio.run(main())
    refs = [make_encoder(OPUS) for _ in frames]
    want = [(i, OK, refs[i].encode(f)) for _ in range(2) for i, f in enumerate(frames)]
    assert got == want  # each callback got its own session's pages, in the order asked
    assert failed == [FAILED] * len(frames)


@pytest.mark.parametrize("path", ["native", "moshi"])
def test_reading_pauses_while_decoded_frames_wait_for_a_slow_engine(path):
    """Each message is decoded before the next comes (a 15 ms gap), so none queues up
    behind a decode; still, once 64 decoded frames wait for the engine (10 steps a second)
    reading pauses, and the frames waiting stay bounded."""
    first, *rest = wire_messages(speechlike(MODEL_RATE, seed=60, seconds=0.4), OPUS, 80)
    prefix = b"\x01" if path == "moshi" else b""
    count = 300
    with InProcessServer(codec_processes=1, codec_batch_ms=0.0, step_base_ms=100.0,
                         max_pending_frames=64) as server:
        most = 0
        stop = threading.Event()

        def watch() -> None:  # the waiting frames of every session, seen from another thread
            nonlocal most
            while not stop.is_set():
                for session in list(server.app.orchestrator._by_slot):
                    if session is not None:
                        most = max(most, len(session._pending))
                time.sleep(0.002)

        async def main() -> int:
            url = server.ws("/api/chat") if path == "moshi" else server.ws(query=query(OPUS, OPUS))
            async with websockets.asyncio.client.connect(url, compression=None, max_size=None) as ws:
                await ws.recv()  # session.created, or the handshake byte
                for k in range(count):  # the reader takes any page after the headers
                    await ws.send(prefix + (first if k == 0 else rest[k % len(rest)]))
                    await asyncio.sleep(0.015)
                received = 0
                while received < 20:  # the session is alive and answering what it took
                    message = await asyncio.wait_for(ws.recv(), 10)
                    received += isinstance(message, bytes) and message[:1] != b"\x02"
                return received

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            received = asyncio.run(main())
        finally:
            stop.set()
            watcher.join()
    assert received == 20
    assert 64 <= most <= 64 + 8, most  # without the pause: hundreds


def test_opus_cost_bench_runs_each_protocol_and_the_pcm_reference(tmp_path):
    """`bench opus-cost` at CI size: every session of every protocol passes its guards (each
    PCM answer the very frame sent), and the loop process's cost per frame is read for each."""
    out = tmp_path / "opus-cost.json"
    proc = subprocess.run(
        [sys.executable, "-m", "duplexserve", "bench", "opus-cost", "--sessions", "3", "--seconds", "1.5",
         "--protocol", "pcm,native,moshi", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    levels = json.loads(out.read_text())["levels"]
    assert [r["protocol"] for r in levels] == ["pcm", "native", "moshi"]
    for r in levels:
        assert r["guards_ok"], r["failures"]
        assert r["frames"] == levels[0]["frames"] >= 3 * 18 and r["loop_process_us"] > 0
    pcm, native = levels[0], levels[1]
    assert pcm["workers_us"] == 0 and native["workers_us"] > 0  # no codec work for the reference
