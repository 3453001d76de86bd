"""A WebRTC peer for the tests: aiortc as a client, as a browser would use the server.

It offers one Opus audio track (a signal encoded by libopus, paced in real time, 20 ms
packets) and the ``oai-events`` data channel, collects the server's events, and hears
the server's audio through aiortc's own receiver (PyAV's decoder at 48 kHz), as any
aiortc application would. Loss and jitter are made at the RTP transport by the load
generator's ``impair`` (duplexserve/loadgen/drivers/webrtc.py).

ICE stays on loopback: the server and this peer offer only 127.0.0.1 as host candidate
(``restrict_host_addresses``) and no STUN server is ever asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import json
from typing import Any

import av
import httpx
import numpy as np
from aiortc import MediaStreamTrack, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError

from duplexserve.codecs.opus_rtp import PACKET_SAMPLES, RtpOpusEncoder
from duplexserve.server.transports.webrtc import peer as webrtc_peer

webrtc_peer.restrict_host_addresses(("127.0.0.1",))

RATE = 24000
_TIME_BASE = fractions.Fraction(1, 48000)


class SignalTrack(MediaStreamTrack):
    """``signal`` (24 kHz float32) as 20 ms Opus packets, one every 20 ms; then silence
    for as long as the call lasts (a microphone does not stop)."""

    kind = "audio"

    def __init__(self, signal: np.ndarray) -> None:
        super().__init__()
        whole = len(signal) // PACKET_SAMPLES * PACKET_SAMPLES
        self.signal = np.ascontiguousarray(signal[:whole], dtype=np.float32)
        self.encoder = RtpOpusEncoder(complexity=5, fec=True)
        self.sent = 0
        self._start: float | None = None

    async def recv(self) -> av.Packet:
        loop = asyncio.get_running_loop()
        if self._start is None:
            self._start = loop.time()
        due = self._start + self.sent * 0.02
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        at = self.sent * PACKET_SAMPLES
        chunk = self.signal[at : at + PACKET_SAMPLES]
        if len(chunk) < PACKET_SAMPLES:
            chunk = np.zeros(PACKET_SAMPLES, dtype=np.float32)
        packet = av.Packet(self.encoder.encode(chunk)[0])
        packet.pts, packet.time_base = self.sent * 960, _TIME_BASE
        self.sent += 1
        return packet


class Peer:
    """One call: ``connect`` posts the offer; ``events`` and ``heard`` fill as it runs."""

    def __init__(self, signal: np.ndarray) -> None:
        self.pc = webrtc_peer.new_peer([])
        self.track = SignalTrack(signal)
        self.sender = self.pc.addTrack(self.track)
        self.channel = self.pc.createDataChannel("oai-events")
        self.events: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self.heard: list[np.ndarray] = []  # 48 kHz mono float32 chunks as played
        self.answer: httpx.Response | None = None
        self._listener: asyncio.Task[None] | None = None
        self.channel_open = asyncio.Event()
        self.closed = asyncio.Event()
        self.channel.on("open", self.channel_open.set)
        self.channel.on("message", self._message)
        self.channel.on("close", self.closed.set)

        @self.pc.on("track")
        def on_track(track: MediaStreamTrack) -> None:
            if track.kind == "audio":
                self._listener = asyncio.ensure_future(self._listen(track))

    def _message(self, data: str | bytes) -> None:
        self.raw.append(data if isinstance(data, str) else "")
        with contextlib.suppress(ValueError):
            self.events.append(json.loads(data))

    async def _listen(self, track: MediaStreamTrack) -> None:
        with contextlib.suppress(MediaStreamError, asyncio.CancelledError):
            while True:
                frame = await track.recv()
                pcm = frame.to_ndarray().astype(np.float32) / 32768.0
                channels = len(frame.layout.channels)
                self.heard.append(pcm.reshape(-1, channels).mean(axis=1))

    async def offer(self) -> str:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        return self.pc.localDescription.sdp

    async def connect(self, http: str, key: str | None = None, session: dict[str, Any] | None = None) -> int:
        """POST the offer (application/sdp, or multipart with ``session``); returns the status."""
        sdp = await self.offer()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with httpx.AsyncClient(timeout=20) as client:
            if session is None:
                headers["Content-Type"] = "application/sdp"
                response = await client.post(http + "/v1/realtime/calls", content=sdp, headers=headers)
            else:
                files = {"sdp": (None, sdp, "application/sdp"), "session": (None, json.dumps(session))}
                response = await client.post(http + "/v1/realtime/calls", files=files, headers=headers)
        self.answer = response
        if response.status_code == 201:
            await self.accept(response.text)
        return response.status_code

    async def accept(self, answer_sdp: str) -> None:
        await self.pc.setRemoteDescription(RTCSessionDescription(answer_sdp, "answer"))

    def send(self, event: dict[str, Any] | str) -> None:
        self.channel.send(event if isinstance(event, str) else json.dumps(event))

    def kinds(self) -> list[str]:
        return [e.get("type", "?") for e in self.events]

    async def wait_for(self, predicate: Any, timeout: float = 20.0) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate():
            if loop.time() > deadline:
                raise TimeoutError(f"timed out; events so far: {self.kinds()[-20:]}")
            await asyncio.sleep(0.02)

    def audio(self) -> np.ndarray:
        """What was heard, at 24 kHz (48 kHz decimated after a 2-tap average)."""
        if not self.heard:
            return np.zeros(0, dtype=np.float32)
        x = np.concatenate(self.heard)
        x = x[: len(x) // 2 * 2].reshape(-1, 2).mean(axis=1)
        return x.astype(np.float32)

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
        await self.pc.close()


def best_lag(sent: np.ndarray, heard: np.ndarray, max_lag: int) -> tuple[int, float]:
    """The lag (samples) at which ``heard`` matches ``sent`` best, and the normalized
    correlation there."""
    n = len(sent)

    def at(lag: int) -> float:
        seg = heard[lag : lag + n]
        if len(seg) < n:
            return -1.0
        return float(np.dot(seg, sent) / (np.linalg.norm(seg) * np.linalg.norm(sent) + 1e-12))

    best = max(((lag, at(lag)) for lag in range(0, max_lag, 24)), key=lambda b: b[1], default=(0, -1.0))
    lag0 = best[0]  # a 1 ms grid, then refined around its best
    return max([best, *((lag, at(lag)) for lag in range(max(0, lag0 - 24), lag0 + 25))], key=lambda b: b[1])
