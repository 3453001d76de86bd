"""Resume after a dropped connection (duplex/1), over real sockets against a real server."""

from __future__ import annotations

import asyncio
import json
import signal as signals
import time

import httpx
import numpy as np
import pytest
import websockets.asyncio.client

from duplexserve.server.core.resume import ResumeRegistry
from duplexserve.server.core.session import Limits, Session
from tests.native_client import converse
from tests.native_client import signal as noise
from tests.resume_client import ResumingClient

FRAME_BYTES = 1920 * 4


def run(coro):
    return asyncio.run(coro)


def f32_chunks(frames: int, seed: int) -> tuple[bytes, list[bytes]]:
    audio = noise(frames, seed=seed).tobytes()
    return audio, [audio[i : i + FRAME_BYTES] for i in range(0, len(audio), FRAME_BYTES)]


def wait_until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


async def refused(url: str) -> tuple[dict, int | None]:
    async with websockets.asyncio.client.connect(url) as ws:
        first = json.loads(await ws.recv())
        with pytest.raises(websockets.ConnectionClosed):
            await ws.recv()
        return first, ws.close_code


async def drop_and_resume(url: str, frames: int, seed: int, drops: int = 1) -> tuple[bytes, ResumingClient]:
    audio, chunks = f32_chunks(frames, seed)
    client = ResumingClient(url, chunks)
    await client.open()
    per_leg = frames // (drops + 1)
    for leg in range(drops):
        await client.send(per_leg * (leg + 1), gap=0.005)
        await client.wait_frames(per_leg * leg + per_leg // 2)
        client.drop()
        first = await client.resume()
        assert first["type"] == "session.resumed", first
    await client.send(frames)
    await client.finish()
    return audio, client


def test_abort_mid_stream_and_resume_gets_every_frame_once(server_factory):
    server = server_factory()
    audio, client = run(drop_and_resume(server.ws(), 40, seed=11))
    assert b"".join(client.frames) == audio  # exactly once, in order, exact bytes
    assert client.texts == list(range(0, 40, 5))  # text deltas exactly once too
    (resumed,) = client.resumed
    assert resumed["session_id"] == client.created["session_id"]
    assert resumed["frames_lost"] == 0 and resumed["replayed"] >= 0
    assert resumed["resume"]["token"] != client.created["resume"]["token"]
    assert len(resumed["resume"]["token"]) * 6 >= 128  # url-safe base64: 6 bits a character
    assert resumed["input"] == client.created["input"]
    closed = client.closed
    assert closed["reason"] == "completed" and closed["frames_in"] == 40
    assert closed["frames_out"] == 40 and closed["frames_dropped"] == 0
    assert client.close_code == 1000
    metrics = server.metrics()
    assert metrics['duplexserve_session_resumes_total{outcome="resumed"}'] == 1
    assert metrics["duplexserve_sessions_detached"] == 0


def test_two_resumes_in_a_row(echo_server):
    audio, client = run(drop_and_resume(echo_server.ws(), 60, seed=12, drops=2))
    assert b"".join(client.frames) == audio
    assert len(client.resumed) == 2
    tokens = {client.created["resume"]["token"], *(r["resume"]["token"] for r in client.resumed)}
    assert len(tokens) == 3
    assert client.closed["frames_out"] == 60 and client.closed["frames_dropped"] == 0


def test_resume_right_after_the_drop_with_nothing_received(echo_server):
    async def go() -> tuple[bytes, ResumingClient]:
        audio, chunks = f32_chunks(20, 13)
        client = ResumingClient(echo_server.ws(), chunks)
        await client.open()
        await client.send(10)
        client.drop()
        first = await client.resume(last_frame=-1)
        assert first["type"] == "session.resumed"
        assert first["replayed"] + first["frames_lost"] == first["frames_out"]
        await client.send(20)
        await client.finish()
        return audio, client

    audio, client = run(go())
    assert b"".join(client.frames) == audio


def test_a_used_or_unknown_token_is_refused(echo_server):
    async def go() -> None:
        audio, chunks = f32_chunks(20, 14)
        client = ResumingClient(echo_server.ws(), chunks)
        await client.open()
        old_token = client.token
        await client.send(10)
        await client.wait_frames(5)
        client.drop()
        assert (await client.resume())["type"] == "session.resumed"
        for token in (old_token, "A" * 32, ""):
            first, code = await refused(f"{echo_server.ws()}?resume={token}&last_frame=0")
            assert first["type"] == "error" and first["code"] == "resume_failed" and first["fatal"]
            assert code == 1008
        await client.send(20)  # the failed attempts did not touch the session
        await client.finish()
        assert b"".join(client.frames) == audio

    run(go())


@pytest.mark.parametrize("last_frame", ["-2", "9999", "x", ""])
def test_last_frame_out_of_range_is_refused_and_keeps_the_token(echo_server, last_frame):
    async def go() -> None:
        audio, chunks = f32_chunks(12, 15)
        client = ResumingClient(echo_server.ws(), chunks)
        await client.open()
        await client.send(6)
        await client.wait_frames(6)
        client.drop()
        first, code = await refused(f"{echo_server.ws()}?resume={client.token}&last_frame={last_frame}")
        assert first["code"] == "resume_failed" and code == 1008
        assert (await client.resume())["type"] == "session.resumed"
        await client.send(12)
        await client.finish()
        assert b"".join(client.frames) == audio

    run(go())


def test_expiry_frees_the_slot_and_the_token(server_factory):
    server = server_factory("--max-sessions", "2", "--resume-grace-s", "3")

    async def go() -> None:
        _, chunks = f32_chunks(10, 16)
        client = ResumingClient(server.ws(), chunks)
        await client.open()
        await client.send(5)
        await client.wait_frames(5)
        client.drop()
        await asyncio.to_thread(
            wait_until, lambda: server.metrics()["duplexserve_sessions_detached"] == 1, "the detach"
        )
        await asyncio.to_thread(
            wait_until, lambda: server.metrics()["duplexserve_sessions_active"] == 0, "the expiry"
        )
        first, code = await refused(f"{server.ws()}?resume={client.token}&last_frame=4")
        assert first["code"] == "resume_failed" and code == 1008
        res = await converse(server.ws(), chunks)  # the freed slot serves a new session
        assert len(res.frames) == 10 and res.closed["reason"] == "completed"

    run(go())
    metrics = server.metrics()
    assert metrics['duplexserve_session_resumes_total{outcome="expired"}'] == 1
    assert metrics['duplexserve_session_resumes_total{outcome="refused"}'] == 1
    assert metrics['duplexserve_session_resumes_total{outcome="evicted"}'] == 0
    assert metrics["duplexserve_frames_dropped_total"] == 0  # all 5 were answered before the drop


async def connect_and_abort(url: str, frames: int = 0) -> str:
    """Open a session, send ``frames`` frames and read their answers, then vanish; its token."""
    _, chunks = f32_chunks(max(frames, 1), seed=frames)
    client = ResumingClient(url, chunks)
    await client.open()
    if frames:
        await client.send(frames)
        await client.wait_frames(frames)
    client.drop()
    return client.token


def test_a_full_server_of_detached_sessions_admits_a_full_set_of_new_ones(server_factory):
    """docs/protocol.md, "Under pressure": detached sessions never keep live ones out."""
    server = server_factory("--max-sessions", "16", "--max-detached", "16")

    async def go() -> None:
        tokens = await asyncio.gather(*(connect_and_abort(server.ws(), 3) for _ in range(16)))
        await asyncio.to_thread(
            wait_until, lambda: server.metrics()["duplexserve_sessions_detached"] == 16, "16 detaches"
        )
        assert server.metrics()["duplexserve_ready"] == 1  # every slot could be freed
        inputs = [f32_chunks(12, seed=100 + i) for i in range(16)]
        results = await asyncio.gather(*(converse(server.ws(), chunks) for _, chunks in inputs))
        for (audio, _), res in zip(inputs, results, strict=True):
            assert res.closed["reason"] == "completed", res.closed
            assert b"".join(res.frames) == audio  # every frame of every new session, exact
        first, code = await refused(f"{server.ws()}?resume={tokens[0]}&last_frame=2")
        assert first["code"] == "resume_failed" and code == 1008  # evicted: refused as expired

    run(go())
    metrics = server.metrics()
    assert metrics['duplexserve_session_resumes_total{outcome="evicted"}'] == 16
    assert metrics["duplexserve_sessions_detached"] == 0


def test_a_storm_of_vanishing_clients_never_makes_the_server_unready(server_factory):
    """200 connect-and-abort clients on 256 slots: /ready stays 200 throughout, at most
    --max-detached (a quarter of the slots) stay detached, the oldest give way first."""
    server = server_factory("--max-sessions", "256")

    async def go() -> list[str]:
        storm = asyncio.gather(*(connect_and_abort(server.ws()) for _ in range(200)))
        async with httpx.AsyncClient() as http:
            while not storm.done():
                assert (await http.get(server.http + "/ready")).status_code == 200
                await asyncio.sleep(0.02)
        return await storm

    tokens = run(go())
    wait_until(lambda: server.metrics()["duplexserve_sessions_detached"] == 64, "64 detached")
    metrics = server.metrics()
    assert metrics["duplexserve_ready"] == 1
    assert metrics['duplexserve_session_resumes_total{outcome="evicted"}'] == 136

    async def resumes() -> tuple[int, int]:
        results = [await refused_or_resumed(server.ws(), token) for token in tokens]
        return results.count("session.resumed"), results.count("error")

    resumed, refused_ = run(resumes())
    assert (resumed, refused_) == (64, 136)


async def refused_or_resumed(url: str, token: str) -> str:
    async with websockets.asyncio.client.connect(f"{url}?resume={token}&last_frame=-1") as ws:
        return json.loads(await ws.recv())["type"]


def test_resume_replaces_a_half_open_connection(echo_server):
    async def go() -> None:
        audio, chunks = f32_chunks(30, 17)
        old = ResumingClient(echo_server.ws(), chunks)
        await old.open()
        await old.send(15)
        await old.wait_frames(15)
        # The old socket is still open on both ends: the server cannot know it is dead.
        new = ResumingClient(echo_server.ws(), chunks, frames=list(old.frames), created=old.created)
        first = await new.resume(token=old.token)
        assert first["type"] == "session.resumed" and first["frames_in"] == 15
        await old.wait_closed()
        assert old.closed["reason"] == "replaced" and old.close_code == 1000
        await new.send(30)
        await new.finish()
        assert b"".join(new.frames) == audio
        assert new.closed["reason"] == "completed"

    run(go())


def test_resume_with_s16_at_16k_keeps_formats_and_resamplers(echo_server):
    rate = 16000
    pcm = (noise(30, seed=18, samples=1280) * 20000).astype("<i2")
    chunks = [pcm[i : i + 1280].tobytes() for i in range(0, len(pcm), 1280)]
    query = (f"input_format=pcm_s16le&input_sample_rate={rate}"
             f"&output_format=pcm_s16le&output_sample_rate={rate}")

    async def go() -> ResumingClient:
        client = ResumingClient(echo_server.ws(), chunks, query=query)
        await client.open()
        await client.send(16, gap=0.005)
        await client.wait_frames(8)
        client.drop()
        first = await client.resume()
        assert first["type"] == "session.resumed"
        assert first["input"] == {"format": "pcm_s16le", "sample_rate": rate, "frame_samples": 1280}
        assert first["output"] == first["input"]
        await client.send(30)
        await client.finish()
        return client

    client = run(go())
    reference = run(converse(echo_server.ws(query=query), chunks))
    assert len(client.frames) == len(reference.frames) == 30
    assert all(len(f) == 1280 * 2 for f in client.frames)
    assert client.frames == reference.frames  # the resampler went on as if nothing happened
    assert client.closed["frames_dropped"] == 0


@pytest.mark.parametrize("fmt", ["g711_ulaw", "g711_alaw"])
def test_resume_with_g711_returns_every_frame_once(echo_server, fmt):
    from duplexserve.codecs.g711 import f32_to_alaw, f32_to_ulaw

    encode = f32_to_ulaw if fmt == "g711_ulaw" else f32_to_alaw
    wire = encode(noise(30, seed=19, samples=640) * 0.5)
    chunks = [bytes(wire[i : i + 640]) for i in range(0, len(wire), 640)]
    query = f"input_format={fmt}&input_sample_rate=8000&output_format={fmt}&output_sample_rate=8000"

    async def go() -> ResumingClient:
        client = ResumingClient(echo_server.ws(), chunks, query=query)
        await client.open()
        await client.send(14, gap=0.005)
        await client.wait_frames(7)
        client.drop()
        assert (await client.resume())["type"] == "session.resumed"
        await client.send(30)
        await client.finish()
        return client

    client = run(go())
    reference = run(converse(echo_server.ws(query=query), chunks))
    assert len(client.frames) == 30 and all(len(f) == 640 for f in client.frames)
    assert client.frames == reference.frames
    assert client.closed["frames_out"] == 30 and client.closed["frames_dropped"] == 0


def test_resume_with_opus_starts_new_ogg_streams_both_ways(echo_server):
    from duplexserve.codecs.opus import OpusStreamEncoder

    def ogg_stream(frames: int, seed: int, start: int = 0) -> list[bytes]:
        """Frames ``start`` on of the signal, as a new Ogg stream (headers first)."""
        encoder = OpusStreamEncoder()
        audio = noise(frames, seed=seed) * 0.3
        return [encoder.encode(audio[i * 1920 : (i + 1) * 1920]) for i in range(start, frames)]

    query = "input_format=opus&output_format=opus"

    async def go() -> ResumingClient:
        client = ResumingClient(echo_server.ws(), ogg_stream(12, 20), query=query)
        await client.open()
        await client.send(12, gap=0.01)
        await client.wait_frames(6)
        client.drop()
        first = await client.resume()
        assert first["type"] == "session.resumed"
        # The client's Opus input starts a new Ogg stream: from frame frames_in on.
        fresh = ogg_stream(24, 20, start=first["frames_in"])
        client.chunks = [b""] * first["frames_in"] + fresh
        await client.send(24)
        await client.finish()
        return client

    client = run(go())
    first = client.resumed[0]
    k = first["frames_out"] - first["replayed"] - first["frames_lost"]
    assert client.frames[0].startswith(b"OggS") and b"OpusHead" in client.frames[0]
    assert b"OpusHead" in client.frames[k] and b"OpusTags" in client.frames[k]  # a new stream
    assert all(b"OpusHead" not in f for i, f in enumerate(client.frames) if i not in (0, k))
    assert client.closed["reason"] == "completed" and client.closed["frames_dropped"] == 0
    assert client.closed["frames_out"] == len(client.frames)


def test_a_drain_ends_detached_sessions_at_once(server_factory):
    server = server_factory("--drain-grace-s", "60")

    async def go() -> None:
        _, chunks = f32_chunks(200, 21)
        dropped = ResumingClient(server.ws(), chunks)
        await dropped.open()
        await dropped.send(5)
        await dropped.wait_frames(5)
        dropped.drop()
        streaming = ResumingClient(server.ws(), chunks)  # keeps the drain going
        await streaming.open()
        await streaming.send(5)
        await asyncio.to_thread(
            wait_until, lambda: server.metrics()["duplexserve_sessions_detached"] == 1, "the detach"
        )
        server.proc.send_signal(signals.SIGTERM)
        await asyncio.to_thread(
            wait_until, lambda: server.metrics()["duplexserve_sessions_active"] == 1, "the detached end"
        )
        assert server.metrics()["duplexserve_sessions_detached"] == 0
        first, code = await refused(f"{server.ws()}?resume={dropped.token}&last_frame=4")
        assert first["code"] == "resume_failed" and code == 1008
        await streaming.send(20)
        await streaming.finish()
        assert streaming.closed["reason"] == "completed" and len(streaming.frames) == 20

    run(go())
    assert server.proc.wait(30) == 0


def test_sixty_four_sessions_drop_and_resume_while_others_stream(server_factory):
    server = server_factory("--max-sessions", "96", "--max-detached", "64")  # all 64 may wait at once

    async def steady(seed: int) -> bool:
        audio, chunks = f32_chunks(60, seed)
        res = await converse(server.ws(), chunks, gap=0.01)
        return b"".join(res.frames) == audio and res.closed["frames_dropped"] == 0

    async def go() -> None:
        droppers = [drop_and_resume(server.ws(), 60, seed=100 + i) for i in range(64)]
        others = [steady(500 + i) for i in range(16)]
        results = await asyncio.gather(*droppers, *others)
        for audio, client in results[:64]:
            assert b"".join(client.frames) == audio
            assert client.closed["frames_out"] == 60 and client.closed["frames_dropped"] == 0
        assert all(results[64:])

    run(go())
    metrics = server.metrics()
    assert metrics['duplexserve_session_resumes_total{outcome="resumed"}'] == 64
    assert metrics["duplexserve_sessions_active"] == 0
    assert np.isclose(metrics["duplexserve_frames_dropped_total"], 0)


def test_registry_tokens_are_single_use_and_die_with_the_session():
    """The token registry alone, without sockets (server/core/resume.py)."""
    expired: list[Session] = []
    registry = ResumeRegistry(30.0, expired.append)
    session = Session("s", 0, 1, Limits())
    entry = registry.issue(session, owner="conn-1")
    first = entry.token
    assert len(first) >= 32 and registry.peek(first) is entry
    loop = asyncio.new_event_loop()
    try:
        registry.detach(entry, loop)
        assert session.detached and registry.detached == 1
        assert registry.claim(first) is entry and not session.detached
        second = registry.attach(entry, "conn-2")
        assert second != first and registry.peek(first) is None  # spent
        assert registry.claim(first) is None and registry.counts.refused == 1
        registry.forget(session)
        assert registry.peek(second) is None and registry.detached == 0
    finally:
        loop.close()
