"""Kyutai's Moshi protocol at /api/chat over real sockets, with a client that behaves like Kyutai's.

The client waits for the handshake, sends 1920-sample blocks through
``sphn.OpusStreamWriter`` as kind-1 messages and decodes kind-1 answers with
``sphn.OpusStreamReader``, as ``moshi/client.py`` and LiveKit's PersonaPlex plugin do.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import sphn
import websockets.asyncio.client

from tests.conftest import start_server

FRAME = 1920
RATE = 24000
# What Kyutai's web client puts in the URL (Conversation.tsx buildURL).
WEB_QUERY = (
    "text_temperature=0.7&text_topk=25&audio_temperature=0.8&audio_topk=250&pad_mult=0"
    "&text_seed=12345&audio_seed=54321&repetition_penalty_context=64&repetition_penalty=1"
)


def run(coro):
    return asyncio.run(coro)


def voice(frames: int, seed: int = 0) -> np.ndarray:
    """A few harmonics with a slow envelope: something Opus codes faithfully."""
    t = np.arange(frames * FRAME) / RATE
    f0 = 140 + 20 * seed
    x = sum(np.sin(2 * np.pi * f0 * k * t) / k for k in range(1, 6))
    return (0.25 * x * (0.6 + 0.4 * np.sin(2 * np.pi * 1.5 * t))).astype(np.float32)


@dataclass
class Conversation:
    handshake: bytes = b""
    first_audio: bytes = b""
    audio: list[np.ndarray] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    close_code: int | None = None

    @property
    def pcm(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, np.float32)


class KyutaiLikeClient:
    """The parts of ``moshi/client.py`` that touch the wire, minus the sound card."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.writer = sphn.OpusStreamWriter(RATE)
        self.reader = sphn.OpusStreamReader(RATE)
        self.result = Conversation()

    async def wait_handshake(self) -> None:
        while True:
            msg = await self.ws.recv()
            if msg[0] == 0:
                self.result.handshake = msg
                return
            self._handle(msg)

    async def send_pcm(self, pcm: np.ndarray) -> None:
        for i in range(0, len(pcm), FRAME):
            pages = self.writer.append_pcm(pcm[i : i + FRAME])
            if pages:
                await self.ws.send(b"\x01" + pages)

    async def read_until(self, samples: int, timeout: float = 30.0) -> None:
        async def loop() -> None:
            while len(self.result.pcm) < samples:
                self._handle(await self.ws.recv())

        await asyncio.wait_for(loop(), timeout)

    async def read_to_close(self, timeout: float = 30.0) -> None:
        async def loop() -> None:
            try:
                while True:
                    self._handle(await self.ws.recv())
            except websockets.ConnectionClosed:
                self.result.close_code = self.ws.close_code

        await asyncio.wait_for(loop(), timeout)

    def _handle(self, msg: bytes) -> None:
        kind, payload = msg[0], msg[1:]
        if kind == 1:
            if not self.result.first_audio:
                self.result.first_audio = payload
            pcm = self.reader.append_bytes(payload)
            if len(pcm):
                self.result.audio.append(pcm)
        elif kind == 2:
            self.result.text.append(payload.decode())
        elif kind == 5:
            self.result.errors.append(payload.decode())


def dominant_hz(pcm: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(pcm * np.hanning(len(pcm))))
    return float(np.argmax(spectrum)) * RATE / len(pcm)


def envelope(pcm: np.ndarray, block: int = 240) -> np.ndarray:
    n = len(pcm) // block
    return np.sqrt((pcm[: n * block].reshape(n, block) ** 2).mean(axis=1))


def assert_same_voice(sent: np.ndarray, got: np.ndarray) -> None:
    """Opus keeps pitch, loudness and envelope, not the exact waveform: compare those.

    The first frame is skipped on both sides (codec start-up); the envelope is compared
    at its best lag within 160 ms (each Opus pass delays by a few milliseconds)."""
    sent, got = sent[FRAME:], got[FRAME : len(sent)]
    assert abs(dominant_hz(got) - dominant_hz(sent)) < 5
    assert 0.7 < float(np.sqrt((got**2).mean() / (sent**2).mean())) < 1.3
    a, b = envelope(sent), envelope(got)
    n = len(b) - 16
    assert max(float(np.corrcoef(a[:n], b[lag : lag + n])[0, 1]) for lag in range(16)) > 0.9


async def converse(url: str, pcm: np.ndarray) -> Conversation:
    async with websockets.asyncio.client.connect(url, max_size=None) as ws:
        client = KyutaiLikeClient(ws)
        await client.wait_handshake()
        await client.send_pcm(pcm)
        await client.read_until(len(pcm) - FRAME)
        return client.result


@pytest.fixture(scope="module")
def moshi_server(tmp_path_factory):
    server = start_server(str(tmp_path_factory.mktemp("moshi")), "--max-sessions", "16")
    yield server
    server.stop()


def test_kyutai_like_client_gets_audio_and_text_back(moshi_server):
    sent = voice(25)
    res = run(converse(moshi_server.ws("/api/chat", WEB_QUERY), sent))
    assert res.handshake == b"\x00" + bytes(8)  # u32 protocol version 0, u32 model version 0
    # The first audio message opens the Ogg stream: OpusHead, then OpusTags, then audio.
    assert res.first_audio.startswith(b"OggS") and b"OpusHead" in res.first_audio
    assert res.first_audio.index(b"OpusHead") < res.first_audio.index(b"OpusTags")
    got = res.pcm
    assert len(got) >= len(sent) - FRAME
    # The echo engine returns what it heard: through two Opus codecs, the same waveform.
    assert_same_voice(sent, got)
    assert "hello from" in "".join(res.text)  # the synthetic engine's words
    assert res.errors == []


def test_sixteen_sessions_at_once(moshi_server):
    async def go():
        clients = []
        async with contextlib.AsyncExitStack() as stack:
            for _ in range(16):
                ws = await stack.enter_async_context(
                    websockets.asyncio.client.connect(moshi_server.ws("/api/chat"), max_size=None)
                )
                clients.append(KyutaiLikeClient(ws))
            # Every session holds its handshake before any audio is sent: served at once,
            # where Kyutai's server would hold the other fifteen behind its lock.
            await asyncio.gather(*(c.wait_handshake() for c in clients))
            sent = [voice(15, seed=i) for i in range(16)]  # each its own pitch
            await asyncio.gather(*(c.send_pcm(s) for c, s in zip(clients, sent, strict=True)))
            await asyncio.gather(*(c.read_until(len(s) - FRAME) for c, s in zip(clients, sent, strict=True)))
            return [c.result for c in clients], sent

    results, sent = run(go())
    for res, pcm in zip(results, sent, strict=True):
        assert_same_voice(pcm, res.pcm)
        assert res.text and res.errors == []


def test_ignored_kinds_and_bad_audio_cost_only_their_session(moshi_server):
    async def go():
        url = moshi_server.ws("/api/chat")
        connect = websockets.asyncio.client.connect
        async with connect(url) as bad_ws, connect(url) as good_ws:
            bad, good = KyutaiLikeClient(bad_ws), KyutaiLikeClient(good_ws)
            await bad.wait_handshake()
            await good.wait_handshake()
            # Control, metadata, ping, a client handshake, an unknown kind and an empty
            # message are ignored; a text frame is answered with a (non-fatal) error.
            for msg in (b"\x03\x00", b'\x04{"a":1}', b"\x06", b"\x00", b"\x42junk", b""):
                await bad_ws.send(msg)
            await bad_ws.send("hello")
            await bad.send_pcm(voice(5))
            await bad.read_until(4 * FRAME)
            # Audio that is not an Ogg stream ends this session: an error, then 1003.
            await bad_ws.send(b"\x01" + b"this is not ogg" * 10)
            await bad.read_to_close()
            await good.send_pcm(voice(5, seed=2))
            await good.read_until(4 * FRAME)
            return bad.result, good.result

    bad, good = run(go())
    assert len(bad.errors) == 2 and "ignored" in bad.errors[0]
    assert "Ogg" in bad.errors[1] and bad.close_code == 1003
    assert len(bad.pcm) >= 4 * FRAME
    assert good.errors == []
    assert_same_voice(voice(5, seed=2), good.pcm)


async def refused(url: str) -> tuple[list[str], int | None]:
    async with websockets.asyncio.client.connect(url) as ws:
        client = KyutaiLikeClient(ws)
        await client.read_to_close()
        assert client.result.handshake == b""
        return client.result.errors, client.result.close_code


def test_full_server_sends_an_error_then_closes(server_factory):
    server = server_factory("--max-sessions", "1")

    async def go():
        async with websockets.asyncio.client.connect(server.ws("/api/chat")) as first:
            await KyutaiLikeClient(first).wait_handshake()
            return await refused(server.ws("/api/chat"))

    errors, code = run(go())
    assert len(errors) == 1 and "full" in errors[0] and code == 1013


def test_keys_and_query_parameters(server_factory):
    server = server_factory("--api-keys", "k1")
    errors, code = run(refused(server.ws("/api/chat")))
    assert len(errors) == 1 and code == 1008
    errors, code = run(refused(server.ws("/api/chat", "worker_auth_id=k1&text_topk=many")))
    assert "text_topk" in errors[0] and code == 1008
    res = run(converse(server.ws("/api/chat", "worker_auth_id=k1&" + WEB_QUERY), voice(5)))
    assert res.handshake and len(res.pcm) >= 4 * FRAME


@pytest.mark.parametrize("paced", [False, True])
def test_load_generator_drives_moshi_with_its_guards_held(moshi_server, paced):
    """Byte for byte: the client replays the server's Opus decode and encode (deterministic)."""
    from duplexserve.loadgen.runner import LoadSpec, run_load

    spec = LoadSpec(
        url=f"ws://127.0.0.1:{moshi_server.port}",
        protocol="moshi",
        concurrency=4,
        sessions=6,
        frames=12,
        message_ms=160,
        paced=paced,
        input_format="opus",
        output_format="opus",
        scrape_metrics=False,
    )
    result = run_load(spec)
    assert len(result.sessions) == 6
    for session in result.sessions:
        assert session.guards.ok, session.guards.describe()
        assert session.frames_received == 12 and session.closed_reason == "completed"


def doc_example(name: str) -> str:
    """The Python example under ``<!-- example: name -->`` in docs/protocols.md."""
    text = (Path(__file__).parent.parent / "docs" / "protocols.md").read_text()
    return text.split(f"<!-- example: {name} -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


def test_the_documented_example_works(moshi_server):
    env = {**os.environ, "DUPLEXSERVE_URL": f"ws://127.0.0.1:{moshi_server.port}"}
    done = subprocess.run(
        [sys.executable, "-c", doc_example("moshi")], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "hello from" in done.stdout and "heard 1.9" in done.stdout
