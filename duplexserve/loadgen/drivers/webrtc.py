"""OpenAI Realtime over WebRTC (``POST /v1/realtime/calls``): each session one aiortc peer.

The driver plays a browser's part: it offers one Opus track and the ``oai-events`` data
channel, POSTs the offer (``application/sdp``, the key of the URL's ``?token=`` in the
query), and waits for ``session.created`` on the channel before audio. The runner's
audio (``pcm_f32le`` at 24 kHz) goes out as Opus packets with in-band FEC, as browsers
send it, of the length the server's answer asks (``a=ptime``, which browsers follow; 20
ms without one): a packet goes when the pacer's messages have filled it, a longer message
its packets back to back, as RTP of the peer's own
(server/transports/webrtc/rtp.py; through aiortc's sender where the network is impaired). The
server's packets are taken as they arrive, before aiortc's own jitter buffer and
decoder thread (the server's fast path, server/transports/webrtc/rtp.py), grouped into 80 ms frames
(:class:`~duplexserve.loadgen.webrtc_audio.FrameAssembler`), decoded by libopus, and
each frame is one output frame for the sink, timed from its last packet.

With ``--expect echo`` the answers are predicted byte for byte by replaying the
server's Opus path on what this peer sent (:class:`~duplexserve.loadgen.webrtc_audio.EchoReplay`),
with the server's ``--opus-complexity`` and ``--webrtc-output-fec`` given to the
loadgen; with ``--expect none`` nothing is decoded and only the frames are counted, and
each packet's chunk of the signal is encoded once a process for every peer. The
offer says ``a=maxptime`` of ``--webrtc-packet-ms`` (80 by default, as the server
sends): the server sends packets that long unless its own ``--webrtc-packet-ms`` is
shorter, which the replay cannot know (then the content guard fails: pass the same).

``--loss`` and ``--jitter-ms`` make a bad network on this side: each RTP packet sent is
dropped with that probability, or held 0 to ``jitter-ms`` (so packets overtake each
other) before SRTP and the socket (:func:`impair`). Lost packets are concealed by the
server, which the replay cannot predict, so ``--loss`` needs ``--expect none``; jitter
within the server's jitter buffer (``--webrtc-jitter-frames``, 60 ms by default) keeps
the answers exact.

ICE: for a server on a loopback address only 127.0.0.1 is offered as candidate (the
server needs ``--ice-host-addresses 127.0.0.1`` too), and no STUN server is ever asked.
There is no end-of-input message: the driver hangs up (closes the peer connection) once
every frame was answered, reporting the session ``completed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import itertools
import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, ClassVar
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from duplexserve.codecs import FRAME_SAMPLES, AudioFormat
from duplexserve.codecs.opus_rtp import PACKET_SAMPLES, RtpOpusDecoder, RtpOpusEncoder, packet_samples
from duplexserve.loadgen.drivers.base import HangUpWhenAnswered, Sink
from duplexserve.loadgen.webrtc_audio import EchoReplay, FrameAssembler, decode_frame
from duplexserve.server.transports.webrtc import peer as webrtc_peer
from duplexserve.server.transports.webrtc import rtp as webrtc_rtp

CHANNEL = "oai-events"
#: This peer's Opus: cheap to encode (the client's CPU is what limits a run), in-band FEC on
#: as browsers send it, so the server's recovery from FEC is exercised under --loss.
CLIENT_COMPLEXITY = 0
_counter = itertools.count()
_closing: set[asyncio.Task[None]] = set()  # peer connections being closed, kept from the GC
#: --expect none: each packet's chunk of the signal encoded once a process, for every session
#: (the server's work is the same; the client's is what limits a run).
_ENCODED: dict[tuple[int, bytes], list[bytes]] = {}
MAX_ENCODED = 50_000  # chunks (10 MB or so): a new signal's start over

monotonic = time.monotonic


def impair(
    sender: Any,
    loss: float,
    jitter_ms: float,
    seed: int = 0,
    dropped_at: list[int] | None = None,
    lossy: Callable[[int], bool] | None = None,
) -> dict[str, int]:
    """Drop ``loss`` of the RTP packets ``sender`` sends and hold each other one for 0 to
    ``jitter_ms`` (so they may arrive out of order); returns the live counts, and appends
    each dropped packet's place in the sent order (0: the first) to ``dropped_at``.
    ``lossy(place)`` says which packets loss may take (None: every one).

    It wraps the DTLS transport's ``_send_rtp`` (before SRTP), so a dropped packet leaves
    a gap in the sequence numbers, as one lost on the way would. aiortc sends its RTCP
    (sender reports, about one a second) through the same call: those pass untouched and
    uncounted, or a dropped report would be counted as an audio packet lost."""
    from aiortc.rtp import is_rtcp  # what the transport itself tells RTCP by (SRTCP, not SRTP)

    rng = random.Random(seed)
    transport = sender.transport
    original = transport._send_rtp
    counts = {"sent": 0, "dropped": 0}
    loop = asyncio.get_running_loop()

    async def send(data: bytes) -> None:
        if is_rtcp(data):
            await original(data)
            return
        counts["sent"] += 1
        if rng.random() < loss and (lossy is None or lossy(counts["sent"] - 1)):
            counts["dropped"] += 1
            if dropped_at is not None:
                dropped_at.append(counts["sent"] - 1)
            return
        delay = rng.uniform(0, jitter_ms / 1000) if jitter_ms else 0
        if delay:
            loop.call_later(delay, lambda: asyncio.ensure_future(_quiet(original(data))))
        else:
            await original(data)

    transport._send_rtp = send
    return counts


async def _quiet(coro: Any) -> None:
    with contextlib.suppress(Exception):
        await coro


def _post_sdp(url: str, sdp: str, timeout: float) -> tuple[int, str]:
    """POST the offer; (status, body). Blocking: runs in a thread."""
    request = urllib.request.Request(
        url, data=sdp.encode(), headers={"Content-Type": "application/sdp"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return False


class WebRTCDriver(HangUpWhenAnswered):
    name = "webrtc"
    default_path = "/v1/realtime/calls"
    input_formats = ("pcm_f32le",)
    awaited = "session.created"
    handshake = ("created",)

    # Set by configure() from the run's options.
    loss: ClassVar[float] = 0.0
    jitter_ms: ClassVar[float] = 0.0
    seed: ClassVar[int] = 0
    server_complexity: ClassVar[int] = 5
    server_fec: ClassVar[bool] = False
    packet_ms: ClassVar[int] = 80
    check_content: ClassVar[bool] = True

    @classmethod
    def configure(cls, spec: Any) -> type[WebRTCDriver]:
        problem = webrtc_peer.internals_problem()
        if problem is not None:
            raise ValueError(problem)
        if not spec.paced:
            raise ValueError("webrtc runs paced only: the server plays each call on its own 80 ms clock")
        if not 0.0 <= spec.loss < 1.0 or spec.jitter_ms < 0:
            raise ValueError("--loss is a fraction in 0..1 and --jitter-ms not negative")
        if spec.webrtc_packet_ms not in (20, 40, 80):
            raise ValueError("--webrtc-packet-ms is 20, 40 or 80")
        if spec.loss and spec.expect != "none":
            raise ValueError("--loss: the server conceals what is lost, which no client can predict; "
                             "use --expect none (the frames are still counted)")
        if _loopback(spec.url):
            webrtc_peer.restrict_host_addresses(("127.0.0.1",))
        options = {
            "loss": spec.loss, "jitter_ms": spec.jitter_ms, "seed": spec.seed,
            "server_complexity": spec.opus_complexity, "server_fec": spec.opus_output_fec,
            "packet_ms": spec.webrtc_packet_ms, "check_content": spec.expect != "none",
        }  # fmt: skip
        return type(cls.__name__, (cls,), options)

    def __init__(self, input_format: AudioFormat, output_format: AudioFormat, sink: Sink) -> None:
        if (input_format.format, input_format.sample_rate) != ("pcm_f32le", 24000):
            raise ValueError("the WebRTC driver sends pcm_f32le at 24000 Hz (Opus on the wire)")
        if (output_format.format, output_format.sample_rate) != ("pcm_f32le", 24000):
            raise ValueError("the WebRTC driver answers pcm_f32le at 24000 Hz (decoded from Opus)")
        super().__init__(input_format, output_format, sink)
        self.pc: Any = None
        self.track: Any = None
        self.sender: Any = None
        self.channel: Any = None
        self.encoder = RtpOpusEncoder(CLIENT_COMPLEXITY, fec=True)
        self.decoder = RtpOpusDecoder() if self.check_content else None
        replay = self.check_content
        self.replay = EchoReplay(self.server_complexity, self.server_fec, self.packet_ms) if replay else None
        self.assembler = FrameAssembler(packet_samples)
        self.impaired: dict[str, int] = {}
        self.rtp_out: webrtc_rtp.RtpSendStream | None = None
        self._fast_out: bool | None = None
        self._samples_sent = 0
        self._packet = PACKET_SAMPLES  # samples a packet sent: what the answer asks (open)
        self._pending: np.ndarray | None = None  # less than a packet, waiting for more
        self._session_id = ""
        self._silent_frame = bytes(4 * FRAME_SAMPLES)
        self._closing = False

    def url(self, base: str) -> str:
        """The HTTP address of ``POST /v1/realtime/calls`` (ws -> http, wss -> https)."""
        parts = urlsplit(super().url(base))
        scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
        return urlunsplit((scheme, parts.netloc, parts.path, parts.query, ""))

    # ------------------------------------------------------------------ opening
    async def open(self, base_url: str, timeout: float = 30.0) -> None:
        pc = self.pc = webrtc_peer.new_peer([])
        self.track = webrtc_peer.OutgoingAudio()
        self.sender = pc.addTrack(self.track)
        self.rtp_out = webrtc_rtp.RtpSendStream(self.sender)  # our own RTP, unless impaired
        channel = self.channel = pc.createDataChannel(CHANNEL)
        channel.on("message", self._on_message)
        channel.on("close", lambda: self._lost("the oai-events channel closed"))
        pc.on("connectionstatechange", self._on_state)
        await pc.setLocalDescription(await pc.createOffer())
        offer = webrtc_peer.with_audio_attribute(pc.localDescription.sdp, "maxptime", self.packet_ms)
        status, answer = await asyncio.wait_for(
            asyncio.to_thread(_post_sdp, self.url(base_url), offer, timeout), timeout
        )
        if status != 201:
            raise ConnectionError(f"POST /v1/realtime/calls answered {status}: {answer[:200]}")
        self._packet = webrtc_peer.asked_ms(answer) * 24  # as a browser follows the answer's a=ptime
        parsed = webrtc_peer.SessionDescription.parse(answer)
        opus = {c.payloadType for m in parsed.media if m.kind == "audio" for c in m.rtp.codecs
                if c.mimeType.lower() == "audio/opus"}  # fmt: skip
        receiver = next(t.receiver for t in pc.getTransceivers() if t.kind == "audio")
        webrtc_peer.tap_audio(receiver, opus, self._on_packet)
        webrtc_rtp.fast_audio(receiver, opus, self._on_packet)
        await pc.setRemoteDescription(webrtc_peer.RTCSessionDescription(answer, "answer"))
        if self.loss or self.jitter_ms:
            self.impaired = impair(self.sender, self.loss, self.jitter_ms, self.seed * 1000 + next(_counter))
        await self.ready(timeout)

    async def ready(self, timeout: float) -> None:
        await asyncio.wait_for(self._future("created"), timeout)

    def _on_state(self) -> None:
        if self.pc is not None and self.pc.connectionState in ("failed", "closed"):
            self._lost(f"the peer connection is {self.pc.connectionState}")

    def _lost(self, why: str) -> None:
        """The call ended without this peer hanging up."""
        if self._closing:
            return
        self._closing = True
        self._fail_open(why)
        self.sink.on_disconnect(None, why)
        self._close_pc(report=False)

    # ------------------------------------------------------------------- audio
    def send_audio(self, chunk: bytes | memoryview) -> None:
        """Whole packets of the length the server asked for; the rest of the chunk waits
        for the next one (or for the end of the input)."""
        pcm = np.frombuffer(chunk, dtype="<f4")
        if self._pending is not None:
            pcm = np.concatenate([self._pending, pcm])
        whole = len(pcm) - len(pcm) % self._packet
        self._pending = pcm[whole:] if whole < len(pcm) else None
        if whole:
            self._send_packets(pcm[:whole])

    def _send_packets(self, pcm: np.ndarray) -> None:
        packet = self._packet
        if self.replay is None:  # nothing is checked: one encoding of each chunk a process
            key = (packet, pcm.tobytes())
            packets = _ENCODED.get(key)
            if packets is None:
                if len(_ENCODED) > MAX_ENCODED:
                    _ENCODED.clear()
                packets = _ENCODED[key] = self.encoder.encode(pcm, packet)
        else:
            packets = self.encoder.encode(pcm, packet)
            self.replay.sent(pcm, packets)
        fast = self._fast_out
        if fast is None:  # one path for the whole call: two would break the sequence numbers
            fast = self._fast_out = not self.impaired and self.rtp_out is not None and self.rtp_out.ready()
        if fast:
            self.rtp_out.push(packets, packet * 2)  # type: ignore[union-attr]
        else:
            self.track.push(packets, packet * 2)
        self._samples_sent += len(pcm)

    def answers(self, expected: list[bytes]) -> list[bytes]:
        replay = self.replay
        return [replay.answer(frame) for frame in expected] if replay is not None else expected

    def end_input(self) -> None:
        if self._pending is not None:  # the last packet's rest is silence
            self._send_packets(np.pad(self._pending, (0, self._packet - len(self._pending))))
            self._pending = None
        self._expect(-(-self._samples_sent // FRAME_SAMPLES))

    def _on_packet(self, timestamp: int, payload: bytes) -> None:
        frames = self.assembler.push(timestamp, payload)
        if not frames or self._closing:
            return
        now = monotonic()
        decoder = self.decoder
        for pieces in frames:
            self._answered(decode_frame(decoder, pieces) if decoder is not None else self._silent_frame, now)

    # ------------------------------------------------------------------ events
    def _on_message(self, data: str | bytes) -> None:
        if not isinstance(data, str):
            self.sink.on_error("unexpected_binary", f"a {len(data)}-byte binary message on {CHANNEL}", False)
            return
        now = monotonic()
        if data.startswith('{"type":"response.output_audio_transcript.delta"'):
            self.sink.on_text(now)
            return
        self.on_text(data, now)

    def on_text(self, text: str, now: float) -> None:
        event = self.parse_event(text)
        if event is None:
            return
        kind, sink = event["type"], self.sink
        if kind == "response.output_audio_transcript.delta":
            sink.on_text(now)
        elif kind == "session.created":
            self._session_id = str(event["session"].get("id", ""))
            sink.on_ready({"session_id": self._session_id,
                           "output": {"format": "pcm_f32le", "sample_rate": 24000}})  # fmt: skip
            self._resolve("created")
        elif kind == "session.closed" and not self._finished:
            sink.on_closed(str(event.get("reason")), event)
        elif kind == "error":
            error = event.get("error") or {}
            sink.on_error(str(error.get("code")), str(error.get("message")), False)
            self._fail_open(f"server refused: {error.get('code')}: {error.get('message')}")

    def on_binary(self, data: bytes, now: float) -> None:  # no WebSocket: never called
        self.sink.on_error("unexpected_binary", f"a {len(data)}-byte binary message", False)

    # ----------------------------------------------------------------- closing
    async def drain(self) -> None:
        await asyncio.sleep(0)

    def close(self) -> None:
        """Hang up: the peer connection closes (the server ends the session)."""
        if not self._closing:
            self._closing = True
            self._close_pc(report=True)

    def abort(self) -> None:
        if not self._closing:
            self._closing = True
            self._close_pc(report=False)

    def _close_pc(self, report: bool) -> None:
        if self.pc is None:
            if report:
                self.sink.on_disconnect(1000, "")
            return
        task = asyncio.ensure_future(self._closed(report))
        _closing.add(task)
        task.add_done_callback(_closing.discard)

    async def _closed(self, report: bool) -> None:
        with contextlib.suppress(Exception):
            await self.pc.close()
        if report:
            self.sink.on_disconnect(1000, "")


DRIVER = WebRTCDriver
