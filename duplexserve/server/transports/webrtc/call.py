"""The WebRTC transport: one call, its ``oai-events`` data channel and its Opus media track.

A call carries a protocol adapter as a WebSocket does (core/transport.py): the events go
over the data channel the client opened as ``oai-events``, and the audio goes as an Opus
media track both ways (48 kHz RTP clock on the wire, the model's 24 kHz inside, libopus
converting, codecs/opus_rtp.py) instead of in the protocol's messages. Realtime over
WebRTC (server/calls.py answers ``POST /v1/realtime/calls``) is the Realtime adapter on
this transport.

Incoming audio is played out on the call's clock: one model frame every 80 ms from the
call's jitter buffer (jitter.py), packets that did not come in time concealed or
recovered by libopus, so the model is fed on time whatever the network does. The calls
share one clock in a few phases (clock.py), so that their frames reach the engine
together. The Opus packets go in and out beside aiortc's per-packet tasks (rtp.py), one
80 ms packet a frame out where the peer allows (``--webrtc-packet-ms``). aiortc (peer.py)
runs on the server's event loop (docs/benchmarks.md has its cost per frame).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from duplexserve import errors
from duplexserve.codecs.opus_rtp import RTP_RATE, RtpOpusDecoder, RtpOpusEncoder, packet_samples
from duplexserve.config import ServerConfig
from duplexserve.server.core.session import Session
from duplexserve.server.core.tasks import TaskDriver
from duplexserve.server.served_models import not_served
from duplexserve.server.transports.webrtc import peer as webrtc_peer
from duplexserve.server.transports.webrtc import rtp as webrtc_rtp
from duplexserve.server.transports.webrtc.clock import PlayClock
from duplexserve.server.transports.webrtc.jitter import CONCEAL, DECODE, JitterBuffer

if TYPE_CHECKING:
    from duplexserve.server.core.adapter import ProtocolAdapter

log = logging.getLogger(__name__)

CHANNEL = "oai-events"
FRAME_S = 0.08
PACKET_S = 0.02
#: Data-channel messages waiting for the session's reader at most; past it the call ends.
MAX_INBOX = 1024
#: Events kept for a data channel not yet open at most (session.created and its like).
MAX_UNSENT = 256
#: How long a hung-up call keeps its peer connection, for the last events to leave.
LINGER_S = 0.2


def refusal_status(code: int, error: str) -> int:
    """The HTTP status that refuses an offer for what closes a WebSocket with ``code``."""
    if error == errors.MODEL_NOT_FOUND:
        return 404  # as OpenAI's API answers a model it does not have
    return 429 if error == "too_many_sessions" else 503 if code == errors.TRY_AGAIN else 403


class DataChannel:
    """The call's ``oai-events`` data channel: what came in, queued for the reader; what goes
    out, held until the channel opens.

    What goes out is bounded as on a WebSocket: aiortc queues it without end for a peer
    that does not acknowledge it (SCTP), so past ``limit`` bytes not yet acknowledged
    (``bufferedAmount``) ``overflow`` is called, once."""

    def __init__(self, limit: int = 0, overflow: Callable[[], None] | None = None) -> None:
        self.inbox: asyncio.Queue[bytes | str | None] = asyncio.Queue()
        self.channel: Any = None
        self.unsent: list[str] = []
        self.ended = False
        self.limit = limit
        self._overflow = overflow

    def attach(self, channel: Any) -> None:
        self.channel = channel
        channel.on("message", self._message)
        channel.on("close", self.end)
        if channel.readyState == "open":
            self._flush()
        else:
            channel.on("open", self._flush)

    def _flush(self) -> None:
        unsent, self.unsent = self.unsent, []
        for text in unsent:
            self.channel.send(text)

    def _message(self, data: str | bytes) -> None:
        if self.ended:
            return
        if self.inbox.qsize() >= MAX_INBOX:  # a client flooding the channel: its call ends
            log.warning("webrtc call: more than %d events waiting; ending the call", MAX_INBOX)
            self.end()
            return
        self.inbox.put_nowait(data)

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.inbox.put_nowait(None)

    async def receive(self) -> bytes | str | None:
        return await self.inbox.get()

    def send(self, text: str) -> None:
        channel = self.channel
        if channel is not None and channel.readyState == "open":
            channel.send(text)
            if self._overflow is not None and channel.bufferedAmount > self.limit:
                overflow, self._overflow = self._overflow, None
                overflow()
        elif (channel is None or channel.readyState == "connecting") and len(self.unsent) < MAX_UNSENT:
            self.unsent.append(text)


class WebRTCCall:
    """One call; ``run(adapter)`` serves it (server/calls.py makes it from an offer)."""

    media = True

    def __init__(
        self, scope: dict[str, Any], config: ServerConfig, call_id: str, clock: PlayClock | None = None
    ) -> None:
        self.scope = scope
        self.config = config
        self.call_id = call_id
        self._loop = asyncio.get_running_loop()
        self.clock = clock if clock is not None else PlayClock(self._loop)
        self.events = DataChannel(config.max_output_event_bytes, self._slow_consumer)
        self.adapter: ProtocolAdapter | None = None
        self._driver: TaskDriver | None = None
        #: The handshake's outcome for the HTTP route: None (the session is open) or
        #: (HTTP status, error code, message).
        self.answer: asyncio.Future[tuple[int, str, str] | None] = self._loop.create_future()
        self.jitter = JitterBuffer(depth=config.webrtc_jitter_frames, duration=packet_samples)
        self.opus_in = RtpOpusDecoder()
        self.opus_out = RtpOpusEncoder(config.opus_complexity, fec=config.webrtc_output_fec)
        self.track = webrtc_peer.OutgoingAudio()
        self.rtp_out: webrtc_rtp.RtpSendStream | None = None  # attach: our own RTP for the track
        self._fast_out: bool | None = None  # decided at the first packet: our RTP, or aiortc's
        self.packet_ms = config.webrtc_packet_ms  # the Opus packets sent (attach: the peer's maxptime)
        self.pc: Any = None
        self.connected = False  # the peer connection came up (ICE and DTLS) at least once
        self.frames_skipped = 0  # whole frames not fed: the engine was behind (input paused)
        self.decode_errors = 0
        self._playing = False  # on the clock
        self._arrival = 0.0
        self._hung_up = False

    def _slow_consumer(self) -> None:
        """The peer left ``--max-output-event-bytes`` unacknowledged on the data channel: its
        session ends ``slow_consumer``, as a WebSocket client's that reads nothing (the adapter
        counts it and says so once, as the call ends)."""
        session, adapter = self.session, self.adapter
        if session is not None and adapter is not None and not session.closed:
            adapter.orch.close(session, "slow_consumer", errors.POLICY)

    @property
    def session(self) -> Session | None:
        return self.adapter.session if self.adapter is not None else None

    async def run(self, adapter: ProtocolAdapter) -> None:
        """The protocol's handshake, then its events both ways until the call ends."""
        self.adapter = adapter
        refused = not_served(self.config, adapter.query.get("model"))  # ?model= or session.model
        if refused is not None:
            await adapter.refuse(errors.POLICY, errors.MODEL_NOT_FOUND, refused)
            return
        if not await adapter.open():
            return
        session = adapter.session
        assert session is not None
        driver = self._driver = TaskDriver(adapter, self.events.receive)
        try:
            await driver.serve(session, lambda s: adapter.client_gone(s, None))
        finally:
            driver.cancel()
            adapter.finish()
            driver.release(session)

    # ------------------------------------------------------- the Transport interface
    def opened(self, outcome: tuple[int, str, str] | None) -> None:
        if not self.answer.done():
            self.answer.set_result(outcome)

    async def refuse(self, code: int, error: str, message: str) -> bool:
        """A refusal is the HTTP answer to the offer, not an event on a channel."""
        self.opened((refusal_status(code, error), error, message))
        return True

    async def accept(self, subprotocol: str | None = None) -> None:
        return None  # the HTTP answer accepts the call

    async def receive(self) -> bytes | str | None:
        return await self.events.receive()

    async def send_bytes(self, data: bytes) -> None:
        return None  # nothing binary goes on oai-events

    async def send_text(self, text: str) -> None:
        self.events.send(text)

    def send_bytes_now(self, data: bytes | memoryview) -> None:
        return None

    def send_text_now(self, text: str) -> None:
        self.events.send(text)

    async def close(self, code: int, reason: str = "") -> None:
        self.hang_up()  # the session's close went out

    def replaced(self) -> None:
        return None  # a call is not resumed: its session ends with it

    def send_audio(self, audio: np.ndarray) -> None:
        """One model frame onto the track, as Opus packets of ``packet_ms``."""
        ms = self.packet_ms
        packets = self.opus_out.encode(audio, ms * 24)  # 24 kHz in, 48 kHz RTP clock out
        fast = self._fast_out
        if fast is None:  # one path for the whole call: two would break the sequence numbers
            fast = self._fast_out = self.rtp_out is not None and self.rtp_out.ready()
        if fast:
            self.rtp_out.push(packets, ms * 48)  # type: ignore[union-attr]
        else:
            self.track.push(packets, ms * 48)

    def audio_counts(self) -> dict[str, int]:
        return {
            **self.jitter.counts.as_dict(),
            "frames_skipped": self.frames_skipped, "decode_errors": self.decode_errors,
            "packets_sent_dropped": self.track.dropped + (self.rtp_out.dropped if self.rtp_out else 0),
        }  # fmt: skip

    # ------------------------------------------------------------ incoming audio
    def on_packet(self, timestamp: int, payload: bytes) -> None:
        """An Opus RTP packet from the peer (peer.tap_audio)."""
        now = self._loop.time()
        self._arrival = now
        jitter = self.jitter
        first = not jitter.started
        jitter.push(timestamp, payload)
        session = self.session
        if first and not self._playing and session is not None and not session.closed:
            # The first frame's last packet comes 80 ms less this packet's length after this
            # one: play it ``depth`` packets of 20 ms after that (at the clock's next phase),
            # and every 80 ms from there.
            self._playing = True
            length = min(packet_samples(payload) / RTP_RATE or PACKET_S, FRAME_S)
            self.clock.join(self, now + FRAME_S - length + jitter.depth * PACKET_S, self._on_tick)

    def _on_tick(self, backlog: int) -> None:
        session = self.session
        if session is None or session.closed or self._hung_up:
            self.clock.leave(self)
            return
        self._play(session, backlog)

    def _play(self, session: Session, backlog: int) -> None:
        """One model frame of the stream, as the jitter buffer says, into the session;
        ``backlog`` more follow at once (the clock catching up)."""
        pieces, heard, opus = [], False, self.opus_in
        for kind, payload, duration in self.jitter.pull(backlog=backlog):
            samples = duration // 2  # RTP units are 48 kHz, the decoder gives 24 kHz
            try:
                if kind is DECODE:
                    pieces.append(opus.decode(payload))  # type: ignore[arg-type]
                    heard = True
                elif kind is CONCEAL:
                    pieces.append(opus.conceal(samples))
                else:
                    pieces.append(opus.recover(payload, samples))  # type: ignore[arg-type]
                    heard = True
            except ValueError:  # a payload that is not Opus: concealed like a lost one
                self.decode_errors += 1
                pieces.append(opus.conceal(samples))
        if not pieces or not session.accepts_audio:
            return
        if session.input_paused:  # the engine is behind: real time first, this frame goes
            self.frames_skipped += 1
            return
        if heard:  # the receive time its answer is timed from; and the idle sweep's clock
            session.last_activity = self._arrival
        session.receive_audio(pieces[0] if len(pieces) == 1 else np.concatenate(pieces))
        assert self.adapter is not None
        self.adapter.received(session)

    # ----------------------------------------------------------------- the peer
    def attach(self, pc: Any, opus_types: set[int], packet_ms: int) -> None:
        """Wire the peer connection to this call: its audio to the jitter buffer, our
        track (Opus packets of ``packet_ms``) to its sender, its ``oai-events`` channel to
        the events."""
        self.pc = pc
        self.packet_ms = packet_ms
        for transceiver in pc.getTransceivers():
            if transceiver.kind == "audio":
                webrtc_peer.tap_audio(transceiver.receiver, opus_types, self.on_packet)
                webrtc_rtp.fast_audio(transceiver.receiver, opus_types, self.on_packet)
                break
        self.rtp_out = webrtc_rtp.RtpSendStream(pc.addTrack(self.track))

        @pc.on("datachannel")
        def on_datachannel(channel: Any) -> None:
            if channel.label == CHANNEL and self.events.channel is None:
                self.events.attach(channel)

        @pc.on("connectionstatechange")
        async def on_state() -> None:
            if pc.connectionState == "connected":
                self.connected = True
            elif pc.connectionState in ("failed", "closed"):
                self.events.end()

    def hang_up(self) -> None:
        """The session's close went out (or the call is being torn down): stop the clock;
        the peer connection closes once the last events had a moment to leave."""
        self._hung_up = True
        self.clock.leave(self)
        self.events.end()

    async def teardown(self) -> None:
        self.hang_up()
        self.track.stop()
        if self.pc is not None:
            await asyncio.sleep(LINGER_S)
            await self.pc.close()
