"""Live migration on drain (issue 76; server/peer_move.py): real replicas on loopback.

A replica told to drain moves each duplex/1 session to a peer of ``--peers``, and its client,
told by ``session.moved`` and close 1012, resumes there with the new token: every output frame
arrives exactly once and equals what an unmoved echo answers. A peer that dies mid-move leaves
the session where it was; a forged or replayed import is refused; a session that cannot move
drains as before, counted by reason.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import websockets

from duplexserve.engine_bridge.engine import MoveRefused
from duplexserve.engine_bridge.synthetic import SyntheticEngine
from duplexserve.server.core import move
from duplexserve.server.peer_move import MOVE_PATH, signed_headers
from tests import conftest, test_nginx
from tests.conftest import free_port
from tests.resume_client import ResumingClient
from tests.test_nginx import NGINX, REPLICA, nginx_in_front
from tests.test_resume_forward import SECRET, TEMPLATE, round_robin_site

DELAY = 2
TEXT_EVERY = 3
FRAMES = 24
GAP_S = 0.05
ECHO = ("--delay-frames", str(DELAY), "--text-every", str(TEXT_EVERY), "--resume-grace-s", "30",
        "--max-sessions-per-client", "0", "--max-detached", "80", "--log-level", "info")


def replicas(server_factory: Any, monkeypatch: pytest.MonkeyPatch, *specs: tuple[str, ...]) -> list[Any]:
    """Replicas named by their ports; in a spec, ``PEER`` stands for the next replica's name, and
    ``MOVER`` for the peer flags (template, secret, ``--peers PEER``)."""
    ports = [free_port() for _ in specs]
    given = iter(ports)
    monkeypatch.setattr(conftest, "free_port", lambda: next(given))
    started = []
    for n, spec in enumerate(specs):
        peer = str(ports[(n + 1) % len(ports)])
        args: list[str] = []
        for arg in spec:
            if arg == "MOVER":
                args += ["--peer-url-template", TEMPLATE, "--peer-secret", SECRET, "--peers", peer]
            else:
                args.append(arg)
        started.append(server_factory("--replica-id", str(ports[n]), *args))
    return started


def frame(seed: int, i: int) -> bytes:
    return np.full(1920, (seed * 100 + i + 1) / 8192, np.float32).tobytes()  # distinct, within [-1, 1]


def reference(seed: int) -> list[bytes]:
    """What an unmoved echo answers: input frame i - DELAY (silence first), input.end's tail too."""
    silence = bytes(1920 * 4)
    return [silence if i < DELAY else frame(seed, i - DELAY) for i in range(FRAMES + DELAY)]


async def call(seed: int, source: str, fleet: str, streaming: asyncio.Event | None = None,
               counter: list[int] | None = None) -> ResumingClient:
    """One call: FRAMES frames paced, then input.end; a move is followed at ``fleet``."""
    client = ResumingClient(source, [frame(seed, i) for i in range(FRAMES)])
    await client.open()
    while True:
        try:
            while client.sent_frames < FRAMES:
                await client.send(client.sent_frames + 1)
                if counter is not None and client.sent_frames == 6:
                    counter[0] += 1
                    if streaming is not None and counter[0] == counter[1]:
                        streaming.set()
                await asyncio.sleep(GAP_S)
            await client.finish()
        except websockets.ConnectionClosed:
            await client.wait_closed()
        if client.close_code != 1012:
            return client
        first = await client.follow(fleet)  # session.moved, then 1012: resume where it went
        assert first["type"] == "session.resumed", first


def check_exact(client: ResumingClient, seed: int) -> None:
    closed = client.closed
    assert client.close_code == 1000 and closed and closed["reason"] == "completed", client.events
    assert client.frames == reference(seed)  # every frame exactly once, equal to the unmoved echo
    assert client.texts == list(range(0, FRAMES + DELAY, TEXT_EVERY))


def test_a_drain_moves_every_call_and_each_goes_on_exactly(server_factory, monkeypatch) -> None:
    calls = 64
    source, target = replicas(server_factory, monkeypatch,  # a loaded machine's moves take their time
                              ("MOVER", "--move-timeout-s", "30", *ECHO, "--max-sessions", "70"),
                              ("--peer-secret", SECRET, *ECHO, "--max-sessions", "70"))

    async def main() -> list[ResumingClient]:
        streaming = asyncio.Event()
        counter = [0, calls]
        tasks = [asyncio.create_task(call(s, source.ws(), target.ws(), streaming, counter))
                 for s in range(calls)]
        await asyncio.wait_for(streaming.wait(), 60)
        source.proc.send_signal(signal.SIGTERM)
        clients = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        code = await asyncio.to_thread(source.proc.wait, 30)
        assert code == 0  # it exited once its calls moved, long before its 30 s grace
        return clients

    clients = asyncio.run(main())
    for seed, client in enumerate(clients):
        check_exact(client, seed)
        assert len(client.moved) == 1, client.events
        moved = client.moved[0]
        assert set(moved) == {"type", "session_id", "frames_in", "frames_out", "resume"}
        assert moved["resume"]["token"].startswith(f"{target.port}.")  # it names the target
        assert moved["session_id"] == client.created["session_id"]
    metrics = target.metrics()
    assert metrics['duplexserve_session_imports_total{outcome="imported",reason=""}'] == calls
    assert metrics['duplexserve_session_resumes_total{outcome="resumed"}'] == calls
    log = source.log()
    assert f"drain: moved {calls} of {calls} sessions" in log, log[-3000:]
    assert "draining 0 sessions" in log  # nothing left to wait for: it exits at once
    assert "Traceback" not in log and "Traceback" not in target.log()


def test_a_peer_that_dies_mid_move_leaves_the_call_where_it_was(server_factory, monkeypatch) -> None:
    """The target's engine hangs (a test fault), so the import never answers; it is then killed.
    The source keeps the session, goes on with it from what the client sent meanwhile, and drains."""
    source, target = replicas(server_factory, monkeypatch, ("MOVER", "--move-timeout-s", "20", *ECHO),
                              ("--peer-secret", SECRET, "--synthetic-faults", "--engine-stall-s", "120",
                               *ECHO))

    async def main() -> ResumingClient:
        hang = np.zeros(1920, np.float32)
        hang[0] = -1000.0  # the synthetic engine's fault mark: its step never returns
        stuck = await websockets.connect(target.ws())
        await stuck.recv()
        await stuck.send(hang.tobytes())
        streaming = asyncio.Event()
        task = asyncio.create_task(call(0, source.ws(), target.ws(), streaming, [0, 1]))
        await asyncio.wait_for(streaming.wait(), 30)
        source.proc.send_signal(signal.SIGTERM)
        async def moving() -> None:  # until the source waits on the import
            while "a session moves here" not in target.log():
                await asyncio.sleep(0.05)

        await asyncio.wait_for(moving(), 30)
        target.proc.kill()  # dies mid-move
        client = await asyncio.wait_for(task, 60)
        stuck.transport.abort()
        await asyncio.to_thread(source.proc.wait, 30)
        return client

    client = asyncio.run(main())
    check_exact(client, 0)
    assert client.moved == [] and client.resumed == []  # never told to move: it stayed
    log = source.log()
    assert "could not move to" in log and "(unreachable)" in log, log[-3000:]  # not the timeout
    assert "drain: moved 0 of 1 sessions" in log


def test_a_forged_or_replayed_import_is_refused(server_factory) -> None:
    target = server_factory("--replica-id", "b", "--peer-secret", SECRET, *ECHO)
    url = target.http + MOVE_PATH
    body = move.pack({"protocol": "duplex/1"}, {"engine": b"x"})
    good = signed_headers(SECRET, "a", body)
    answers = [
        httpx.post(url, content=body),  # unsigned
        httpx.post(url, content=body, headers=signed_headers("not-the-secret", "a", body)),
        httpx.post(url, content=body + b"!", headers=good),  # the body changed after signing
        httpx.post(url, content=body, headers=signed_headers(SECRET, "a", body, time.time() - 600)),
        httpx.post(url, content=body, headers=good),  # signed well: parsed, refused on its merits (no model)
        httpx.post(url, content=body, headers=good),  # the same once more: replayed
    ]
    errors = [(a.status_code, a.json()["error"]) for a in answers]
    assert errors == [(403, "unsigned"), (403, "bad_signature"), (403, "bad_signature"), (403, "stale"),
                      (409, "move_mismatch"), (403, "replayed")], errors
    metrics = target.metrics()
    for reason, count in (("unsigned", 1), ("bad_signature", 2), ("stale", 1), ("replayed", 1),
                          ("move_mismatch", 1)):
        assert metrics[f'duplexserve_session_imports_total{{outcome="refused",reason="{reason}"}}'] == count
    assert httpx.get(target.http + "/ready").json()["sessions"] == 0  # nothing was opened


def test_sessions_that_cannot_move_drain_as_before_and_are_counted(server_factory, monkeypatch) -> None:
    source, target = replicas(server_factory, monkeypatch, ("MOVER", *ECHO, "--drain-grace-s", "30"),
                              ("--peer-secret", SECRET, *ECHO, "--max-sessions", "1"))  # one call fills it

    async def main() -> tuple[ResumingClient, dict[str, Any]]:
        busy = await websockets.connect(target.ws())  # the peer's only slot
        await busy.recv()
        dropped = ResumingClient(source.ws(), [frame(9, 0)])
        await dropped.open()
        dropped.drop()  # detached: nobody to tell where it went
        streaming = asyncio.Event()
        task = asyncio.create_task(call(1, source.ws(), target.ws(), streaming, [0, 1]))
        await asyncio.wait_for(streaming.wait(), 30)
        source.proc.send_signal(signal.SIGTERM)
        client = await asyncio.wait_for(task, 60)
        await asyncio.to_thread(source.proc.wait, 30)
        await busy.close()
        return client, {}

    client, _ = asyncio.run(main())
    check_exact(client, 1)  # it finished where it was, within the drain's grace
    assert client.moved == []
    log = source.log()
    assert "drain: moved 0 of 2 sessions" in log, log[-3000:]
    assert "'detached': 1" in log and "'no_peer_room': 1" in log, log[-3000:]


def moved_session(frames_in: int) -> bytes:
    """A duplex/1 session of the default echo as a source would send it: ``frames_in`` frames
    answered, none of them kept for a replay."""
    engine = SyntheticEngine(1, delay_frames=DELAY, text_every=TEXT_EVERY)
    engine.open(0, {})
    engine.frame_index[0] = frames_in
    pcm = {"format": "pcm_f32le", "sample_rate": 24000}
    header = {"session_id": "moved-by-hand", "state": "streaming", "frames_in": frames_in,
              "frames_out": frames_in, "age_s": 1.0, "timed": None, "protocol": "duplex/1",
              "model": "synthetic-echo", "engine": "synthetic", "input": pcm, "output": pcm,
              "prompted": False, "applied": None,
              "replay": {"first": frames_in, "next": frames_in, "frame_bytes": 1920 * 4}, "texts": []}
    return move.pack(header, {"engine": engine.export_slot(0), "replay": b""})


def test_an_import_nobody_resumes_expires_and_one_resumed_goes_on(server_factory) -> None:
    """The target's half of the two phases: an imported session waits detached for its grace,
    then ends (resume_expired); one resumed in time goes on from its frames_in."""
    target = server_factory("--replica-id", "b", "--peer-secret", SECRET, *ECHO, "--resume-grace-s", "1")
    url = target.http + MOVE_PATH
    body = moved_session(5)
    lost = httpx.post(url, content=body, headers=signed_headers(SECRET, "a", body)).json()
    body = moved_session(5)
    kept = httpx.post(url, content=body, headers=signed_headers(SECRET, "a", body)).json()
    assert lost["token"].startswith("b.") and kept["token"].startswith("b.")
    assert httpx.get(target.http + "/ready").json()["sessions"] == 2

    async def main() -> tuple[dict[str, Any], list[bytes]]:
        client = ResumingClient(target.ws(), [frame(3, i) for i in range(8)])
        client.frames = [b""] * 5  # it heard frames 0-4 on the source
        first = await client.resume(token=kept["token"])
        await client.send(8)
        await client.finish()
        return first, client.frames[5:]

    first, heard = asyncio.run(main())
    assert first["type"] == "session.resumed" and first["frames_in"] == 5 and first["replayed"] == 0
    # The echo goes on from the moved state: first its history (frames 3 and 4 of the source, silence
    # in this hand-made state), then frames 5 on.
    assert heard[2:] == [frame(3, i) for i in range(5, 8)]
    assert len(heard) == 3 + DELAY
    deadline = time.monotonic() + 10
    while httpx.get(target.http + "/ready").json()["sessions"] and time.monotonic() < deadline:
        time.sleep(0.1)
    metrics = target.metrics()
    assert metrics['duplexserve_session_resumes_total{outcome="expired"}'] == 1
    assert metrics['duplexserve_session_imports_total{outcome="imported",reason=""}'] == 2


@pytest.mark.skipif(not Path(NGINX).exists(), reason=f"nginx not installed at {NGINX}")
def test_the_loadgen_follows_moves_through_a_proxy(server_factory, tmp_path, monkeypatch) -> None:
    """`duplexserve loadgen --follow-moves` through a round-robin nginx: one replica drains mid-run,
    its calls move, and each resumes at the same URL (nginx; the draining replica answers a resume
    503, so nginx tries the other): the guards see every frame once, the echo as expected."""
    flags = (*ECHO, *REPLICA, "--max-sessions", "16", "--max-detached", "16")
    drained, other = replicas(server_factory, monkeypatch, ("MOVER", *flags), ("MOVER", *flags))
    monkeypatch.setattr("tests.test_nginx_resume.REPLICAS", 2)
    monkeypatch.setattr(test_nginx, "SHIPPED_CONF", round_robin_site(tmp_path / "site.conf"))
    with nginx_in_front(tmp_path, drained, other) as url:
        load = subprocess.Popen(
            [sys.executable, "-m", "duplexserve", "loadgen", url.rsplit("/v1", 1)[0], "--concurrency", "8",
             "--sessions", "8", "--warmup", "0", "--seconds", "4", "--expect", "echo", "--delay-frames",
             str(DELAY), "--follow-moves", "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True)
        time.sleep(2.5)
        drained.proc.send_signal(signal.SIGTERM)
        out, _ = load.communicate(timeout=120)
    assert load.returncode == 0, out
    assert drained.proc.wait(30) == 0
    found = re.search(r"drain: moved (\d+) of (\d+) sessions", drained.log())
    assert found and found[1] == found[2] and int(found[1]) >= 1, drained.log()[-3000:]


def test_a_moved_session_that_does_not_parse_is_refused() -> None:
    body = moved_session(3)
    header, blobs = move.unpack(body)
    assert header["frames_in"] == 3 and set(blobs) == {"engine", "replay"}
    size = int.from_bytes(body[:4], "little")
    other_version = json.loads(body[4 : 4 + size]) | {"version": 99}
    head = json.dumps(other_version).encode()
    for bad in (body[:-1], body + b"x", b"\xff\xff\xff\x7f", len(head).to_bytes(4, "little") + head):
        with pytest.raises(MoveRefused) as refused:
            move.unpack(bad)
        assert refused.value.code == "move_corrupt"


def test_the_move_metrics_say_what_moved_failed_and_could_not(monkeypatch) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from duplexserve.config import ServerConfig
    from duplexserve.server.peer_move import PeerMoveCollector, PeerMover, peer_names

    mover = PeerMover(ServerConfig(), None, None)  # type: ignore[arg-type]
    counts = mover.counts
    counts.moved, counts.bytes_out, counts.drain_s = 3, 900, 1.5
    counts.failed["unreachable"] += 1
    counts.unmovable["detached"] += 2
    counts.refused["replayed"] += 1
    for pause in (0.02, 0.15, 0.3):
        counts.pause(pause)
    registry = CollectorRegistry()
    registry.register(PeerMoveCollector(mover))
    text = generate_latest(registry).decode()
    for line in ('duplexserve_session_moves_total{outcome="moved",reason=""} 3.0',
                 'duplexserve_session_moves_total{outcome="failed",reason="unreachable"} 1.0',
                 'duplexserve_session_moves_total{outcome="unmovable",reason="detached"} 2.0',
                 'duplexserve_session_imports_total{outcome="refused",reason="replayed"} 1.0',
                 'duplexserve_session_move_bytes_total{direction="out"} 900.0',
                 'duplexserve_session_move_pause_seconds_bucket{le="0.2"} 2.0',
                 'duplexserve_session_move_pause_seconds_count 3.0',
                 "duplexserve_drain_move_seconds 1.5"):
        assert line in text, (line, text)
    assert peer_names("ordinals:3,x", "duplexserve-1") == ["duplexserve-0", "duplexserve-2", "x"]
