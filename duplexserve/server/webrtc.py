"""OpenAI Realtime over WebRTC: ``POST /v1/realtime/calls`` and the call it answers.

As OpenAI's: the client sends its SDP offer (``application/sdp``, or multipart with
``sdp`` and ``session``, the session config of ``session.update``) and gets ``201`` with
the answer and a ``Location`` naming the call. The Realtime events of ``/v1/realtime``
go over the data channel the client opened as ``oai-events``; the audio goes as an Opus
media track both ways (48 kHz RTP clock on the wire, the model's 24 kHz inside, libopus
converting, codecs/opus_rtp.py). ``POST /v1/realtime/calls/{id}/hangup`` ends a call.

A call is a :class:`WebRTCConnection`: the Realtime adapter (realtime.py) with the data
channel as its transport (:class:`CallSocket` gives it the shape of the ASGI WebSocket
that :class:`Connection` reads and writes) and the media track instead of
``response.output_audio.delta`` for audio. So the session core, the orchestrator, the
limits, drain, resume rules (none: a Realtime session ends with its connection) and the
turnaround figures are the same as every protocol's.

Incoming audio is played out on the call's clock: one model frame every 80 ms from the
call's jitter buffer (server/webrtc_jitter.py), packets that did not come in time
concealed or recovered by libopus, so the model is fed on time whatever the network
does. The calls share one clock in a few phases (server/webrtc_clock.py), so that their
frames reach the engine together. The Opus packets go in and out beside aiortc's
per-packet tasks (server/webrtc_rtp.py), one 80 ms packet a frame out where the peer
allows (``--webrtc-packet-ms``), and the answer asks the peer for 40 ms packets in
(``a=ptime``, ``--webrtc-ptime-ms``), half the packets browsers send unasked. aiortc
runs on the server's event loop (docs/benchmarks.md has its cost per frame, and why it
stays there).
"""

from __future__ import annotations

import asyncio
import collections
import email.parser
import email.policy
import logging
import secrets
from collections.abc import Iterator
from concurrent.futures import Executor
from typing import Any

import numpy as np
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from duplexserve import errors
from duplexserve.codecs.opus_rtp import RTP_RATE, RtpOpusDecoder, RtpOpusEncoder, packet_samples
from duplexserve.codecs.procpool import CodecProcesses
from duplexserve.config import ServerConfig
from duplexserve.server import auth, webrtc_peer, webrtc_rtp
from duplexserve.server.budgets import over_budget
from duplexserve.server.client_secrets import ClientSecrets
from duplexserve.server.events import AudioOut, ClosedOut, Outgoing
from duplexserve.server.http_errors import http_error
from duplexserve.server.orchestrator import Orchestrator
from duplexserve.server.realtime import ClientEventError, RealtimeConnection
from duplexserve.server.realtime_responses import Mode
from duplexserve.server.request_body import BodyTooLarge, parse_json, read_body
from duplexserve.server.session import SILENCE
from duplexserve.server.webrtc_clock import PlayClock
from duplexserve.server.webrtc_jitter import CONCEAL, DECODE, JitterBuffer, JitterCounts

log = logging.getLogger(__name__)

CHANNEL = "oai-events"
FRAME_S = 0.08
PACKET_S = 0.02
#: Distinct remote candidates an offer may name at most: the server sends STUN checks to each
#: (an offer naming 300 addresses made it send 1,800 packets to them). A browser names two or
#: three per network interface; past this the offer is refused (400 ``too_many_candidates``).
MAX_CANDIDATES = 32
#: Data-channel messages waiting for the session's reader at most; past it the call ends.
MAX_INBOX = 1024
#: Events kept for a data channel not yet open at most (session.created and its like).
MAX_UNSENT = 256
#: How long a hung-up call keeps its peer connection, for the last events to leave.
LINGER_S = 0.2


def _too_large(exc: BodyTooLarge) -> JSONResponse:
    """413, and the connection closed after it: the rest of the body is never read."""
    answer = http_error(413, "body_too_large", str(exc))
    answer.headers["connection"] = "close"
    return answer


class CallSocket:
    """The call's ``oai-events`` data channel in the shape of the ASGI WebSocket that
    :class:`Connection` reads (``receive``) and writes (``send``)."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.inbox.put_nowait({"type": "websocket.connect"})
        self.channel: Any = None
        self.unsent: list[str] = []
        self.ended = False
        self.on_close: Any = None  # called when the session's close goes out

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
        key = "text" if isinstance(data, str) else "bytes"
        self.inbox.put_nowait({"type": "websocket.receive", key: data})

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.inbox.put_nowait({"type": "websocket.disconnect", "code": errors.GOING_AWAY})

    async def receive(self) -> dict[str, Any]:
        return await self.inbox.get()

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "websocket.send":
            text = message.get("text")
            if text is None:
                return  # nothing binary goes on oai-events
            channel = self.channel
            if channel is not None and channel.readyState == "open":
                channel.send(text)
            elif (channel is None or channel.readyState == "connecting") and len(self.unsent) < MAX_UNSENT:
                self.unsent.append(text)
        elif kind == "websocket.close" and self.on_close is not None:
            self.on_close()


class WebRTCConnection(RealtimeConnection):
    """One call: the Realtime adapter over the data channel, audio on the media track."""

    protocol = "webrtc"
    deferred_auth = True  # the HTTP route checked the key (or the client secret)

    def __init__(
        self,
        scope: dict[str, Any],
        socket: CallSocket,
        orchestrator: Orchestrator,
        config: ServerConfig,
        codec_pool: Executor | None,
        codec_procs: CodecProcesses | None,
        call_id: str,
        session_config: dict[str, Any] | None,
        clock: PlayClock | None = None,
    ) -> None:
        super().__init__(scope, socket.receive, socket.send, orchestrator, config, codec_pool, codec_procs)
        self.clock = clock if clock is not None else PlayClock(self._loop)
        self.call_id = call_id
        self.socket = socket
        socket.on_close = self.hang_up
        self.session_config = session_config
        if session_config and isinstance(session_config.get("model"), str):
            self.query["model"] = session_config["model"]  # what session.created names
        #: The handshake's outcome for the HTTP route: None (the session is open) or
        #: (HTTP status, error code, message).
        self.opened: asyncio.Future[tuple[int, str, str] | None] = self._loop.create_future()
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

    # --------------------------------------------------------------- handshake
    def _settle(self, outcome: tuple[int, str, str] | None) -> None:
        if not self.opened.done():
            self.opened.set_result(outcome)

    async def refuse(self, code: int, error: str, message: str) -> None:
        """A refusal is the HTTP answer to the offer, not an event on a channel."""
        status = 429 if error == "too_many_sessions" else 503 if code == errors.TRY_AGAIN else 403
        self._settle((status, error, message))

    async def handshake(self) -> bool:
        if not await super().handshake():
            return False
        config = self.session_config
        if config:
            try:
                await self.update_session({"session": config}, None)  # runs a prompt it sets
            except ClientEventError as exc:
                self._settle((400, exc.code, f"session: {exc.message}"))
                assert self.session is not None
                self.orch.close(self.session, exc.code, errors.POLICY)
                return True
        self._settle(None)
        return True

    # ------------------------------------------------------------ incoming audio
    def on_packet(self, timestamp: int, payload: bytes) -> None:
        """An Opus RTP packet from the peer (webrtc_peer.tap_audio)."""
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

    def _play(self, session: Any, backlog: int) -> None:
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
        self._received(session)

    # ---------------------------------------------------------------- outgoing
    async def render(self, item: Outgoing) -> None:
        cls = item.__class__
        if cls is AudioOut:
            audio = item.audio  # type: ignore[union-attr]
            responses = self.responses
            before, response, after = responses.audio(float(np.dot(audio, audio)) > self._energy_floor)
            for event in before:
                await self._emit(event)
                if event["type"] == "response.created":
                    await self._emit(_buffer_event("started", event))
            if response is None and responses.mode is Mode.MUTED:
                audio = SILENCE  # response.cancel: the rest of that speech is not heard
            ms = self.packet_ms
            packets = self.opus_out.encode(audio, ms * 24)  # 24 kHz in, 48 kHz RTP clock out
            fast = self._fast_out
            if fast is None:  # one path for the whole call: two would break the sequence numbers
                fast = self._fast_out = self.rtp_out is not None and self.rtp_out.ready()
            if fast:
                self.rtp_out.push(packets, ms * 48)  # type: ignore[union-attr]
            else:
                self.track.push(packets, ms * 48)
            for event in after:
                await self._emit(event)
                if event["type"] == "response.done":
                    await self._emit(_buffer_event("stopped", event))
            return
        await super().render(item)
        if cls is ClosedOut:
            await self._emit(self._closed_event(item))  # type: ignore[arg-type]

    def _closed_event(self, item: ClosedOut) -> dict[str, Any]:
        """Not an OpenAI event: the counts of duplex/1's ``session.closed``, and what the
        jitter buffer did with the network's packets (docs/protocols.md)."""
        return {
            "type": "session.closed", "reason": item.reason, "frames_in": item.frames_in,
            "frames_out": item.frames_out, "frames_dropped": item.frames_dropped,
            "audio_in": self.audio_counts(),
        }  # fmt: skip

    def audio_counts(self) -> dict[str, int]:
        return {
            **self.jitter.counts.as_dict(),
            "frames_skipped": self.frames_skipped, "decode_errors": self.decode_errors,
            "packets_sent_dropped": self.track.dropped + (self.rtp_out.dropped if self.rtp_out else 0),
        }  # fmt: skip

    # ----------------------------------------------------------------- the peer
    def attach(self, pc: Any, opus_types: set[int], packet_ms: int) -> None:
        """Wire the peer connection to this call: its audio to the jitter buffer, our
        track (Opus packets of ``packet_ms``) to its sender, its ``oai-events`` channel to
        the Realtime adapter."""
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
            if channel.label == CHANNEL and self.socket.channel is None:
                self.socket.attach(channel)

        @pc.on("connectionstatechange")
        async def on_state() -> None:
            if pc.connectionState == "connected":
                self.connected = True
            elif pc.connectionState in ("failed", "closed"):
                self.socket.end()

    def hang_up(self) -> None:
        """The session's close went out (or the call is being torn down): stop the clock;
        the peer connection closes once the last events had a moment to leave."""
        self._hung_up = True
        self.clock.leave(self)
        self.socket.end()

    async def teardown(self) -> None:
        self.hang_up()
        self.track.stop()
        if self.pc is not None:
            await asyncio.sleep(LINGER_S)
            await self.pc.close()


def _buffer_event(what: str, event: dict[str, Any]) -> dict[str, Any]:
    """``output_audio_buffer.started`` / ``.stopped``: what OpenAI sends over WebRTC when
    a response's audio starts and ends on the track."""
    return {"type": f"output_audio_buffer.{what}", "response_id": event["response"]["id"]}


def _check_sdp(sdp: str) -> None:
    """What aiortc's lenient parser lets through: every line ``<letter>=...`` (RFC 8866),
    and the session's ``v=``, ``o=`` and ``s=`` lines."""
    lines = [line for line in sdp.splitlines() if line]
    bad = next((line for line in lines if len(line) < 2 or line[1] != "=" or not line[0].isalpha()), None)
    if bad is not None:
        raise ValueError(f"not an SDP line: {bad[:80]!r}")
    if not lines or lines[0] != "v=0" or not {"o", "s"} <= {line[0] for line in lines}:
        raise ValueError("an SDP description starts with v=0 and has o= and s= lines")


def _multipart(content_type: str, body: bytes) -> dict[str, str]:
    """The text parts of a multipart/form-data body, by name (stdlib, no extra package)."""
    raw = b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(raw)
    if not message.is_multipart():
        raise ValueError("not a multipart body")
    parts = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            payload = part.get_payload(decode=True) or b""
            parts[name] = payload.decode("utf-8")
    return parts


class WebRTCCalls:
    """The calls of this server and the HTTP routes that make and end them."""

    def __init__(
        self,
        config: ServerConfig,
        orchestrator: Orchestrator,
        codec_pool: Executor | None,
        codec_procs: CodecProcesses | None,
    ) -> None:
        self.config, self.orch = config, orchestrator
        self.codec_pool, self.codec_procs = codec_pool, codec_procs
        self.secrets = ClientSecrets()
        self.problem = webrtc_peer.internals_problem()
        if self.problem is not None:
            log.info("WebRTC is off: %s", self.problem)
        self.ice_servers = webrtc_peer.parse_ice_servers(config.ice_servers)
        webrtc_peer.restrict_host_addresses(auth.parse_list(config.ice_host_addresses))
        self.calls: dict[str, WebRTCConnection] = {}
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.ended_counts = JitterCounts()
        self.ended_skipped = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._clock: PlayClock | None = None  # made on the loop, with the first call

    def add_routes(self, app: FastAPI) -> None:
        app.post("/v1/realtime/calls")(self.create)
        app.post("/v1/realtime/calls/{call_id}/hangup")(self.hangup)
        app.post("/v1/realtime/client_secrets")(self.client_secret)
        app.get("/v1/realtime/ice_servers")(self.browser_ice_servers)

    # ------------------------------------------------------------------ checks
    def _server_key_ok(self, request: Request) -> bool:
        return auth.key_ok(request.scope, dict(request.query_params), auth.parse_list(self.config.api_keys))

    def _refused(self, request: Request) -> JSONResponse | None:
        if not auth.origin_ok(request.scope, auth.parse_list(self.config.allowed_origins)):
            self.outcomes["forbidden"] += 1
            return http_error(403, "origin_not_allowed", "this Origin may not connect")
        return None

    # ------------------------------------------------------------------ routes
    async def create(self, request: Request) -> Response:
        """``POST /v1/realtime/calls``: the offer in, the answer out (201)."""
        if self.problem is not None:
            self.outcomes["unavailable"] += 1
            return http_error(501, "webrtc_unavailable", self.problem)
        refused = self._refused(request)
        if refused is not None:
            return refused
        secret = None
        if not self._server_key_ok(request):
            secret = self.secrets.take(auth.presented_keys(request.scope, dict(request.query_params)))
            if secret is None:
                self.outcomes["unauthorized"] += 1
                return http_error(401, "invalid_api_key", "a valid API key or client secret is required")
        answered = False
        try:  # a secret is spent by an answered call only, whatever else happens
            try:
                sdp, session_config = await self._offer(request)
            except BodyTooLarge as exc:
                self.outcomes["bad_request"] += 1
                return _too_large(exc)
            except ValueError as exc:
                self.outcomes["bad_request"] += 1
                return http_error(400, "invalid_offer", str(exc))
            if secret is not None and secret.session:
                session_config = {**secret.session, **(session_config or {})}
            answer = await self._answer(request, sdp, session_config)
            answered = answer.status_code == 201
            return answer
        finally:
            if not answered:
                self.secrets.give_back(secret)

    async def _offer(self, request: Request) -> tuple[str, dict[str, Any] | None]:
        """The SDP offer and the session config of the request body."""
        body = await read_body(request)
        content_type = request.headers.get("content-type", "")
        kind = content_type.split(";")[0].strip().lower()
        if kind == "application/sdp":
            return body.decode("utf-8", "replace"), None
        if kind != "multipart/form-data":
            raise ValueError(
                "send the offer as application/sdp, or multipart/form-data with 'sdp' and 'session'"
            )
        try:
            parts = _multipart(content_type, body)
        except Exception as exc:
            raise ValueError(f"the multipart body does not parse: {exc}") from None
        if "sdp" not in parts:
            raise ValueError("the multipart body has no 'sdp' part")
        config = None
        if parts.get("session"):
            config = parse_json(parts["session"], "the 'session' part")
            if not isinstance(config, dict):
                raise ValueError("the 'session' part is not a JSON object")
        return parts["sdp"], config

    async def _answer(self, request: Request, sdp: str, config: dict[str, Any] | None) -> Response:
        offer = webrtc_peer.without_mdns_candidates(sdp)
        candidates = webrtc_peer.candidate_count(offer)
        if candidates > MAX_CANDIDATES:
            self.outcomes["bad_request"] += 1
            over_budget("webrtc_candidates")
            message = f"the offer names {candidates} ICE candidates, more than {MAX_CANDIDATES}"
            return http_error(400, "too_many_candidates", message)
        try:
            _check_sdp(offer)
            parsed = webrtc_peer.SessionDescription.parse(offer)
        except Exception as exc:
            self.outcomes["bad_request"] += 1
            return http_error(400, "invalid_sdp", f"the offer is not valid SDP: {exc}")
        audio = [m for m in parsed.media if m.kind == "audio"]
        if not audio:
            self.outcomes["bad_request"] += 1
            return http_error(400, "no_audio", "the offer has no audio m-line")
        opus = {c.payloadType for c in audio[0].rtp.codecs if c.mimeType.lower() == "audio/opus"}
        if not opus:
            self.outcomes["bad_request"] += 1
            return http_error(400, "no_opus", "the offer's audio does not offer Opus")
        pc = webrtc_peer.new_peer(self.ice_servers)
        try:
            await pc.setRemoteDescription(webrtc_peer.RTCSessionDescription(offer, "offer"))
        except Exception as exc:
            await pc.close()
            self.outcomes["bad_request"] += 1
            return http_error(400, "invalid_sdp", f"the offer was refused: {exc}")
        call_id = "rtc_" + secrets.token_hex(12)
        socket = CallSocket()
        headers = [(k, v) for k, v in request.scope.get("headers", []) if k.lower() != b"authorization"]
        scope = {
            "type": "websocket", "path": "/v1/realtime/calls", "headers": headers, "subprotocols": [],
            "query_string": request.scope.get("query_string", b""), "client": request.scope.get("client"),
        }  # fmt: skip
        if self._clock is None:
            self._clock = PlayClock(asyncio.get_running_loop())
        conn = WebRTCConnection(
            scope, socket, self.orch, self.config, self.codec_pool, self.codec_procs, call_id, config,
            self._clock,
        )  # fmt: skip
        conn.attach(pc, opus, webrtc_peer.packet_ms(offer, self.config.webrtc_packet_ms))
        task = asyncio.create_task(self._serve(conn), name=f"webrtc-{call_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        outcome = await conn.opened
        if outcome is not None:
            status, code, message = outcome
            self.outcomes["refused" if status != 400 else "bad_request"] += 1
            return http_error(status, code, message)
        try:
            await pc.setLocalDescription(await pc.createAnswer())
        except Exception as exc:
            log.exception("webrtc call %s: no answer", call_id)
            if conn.session is not None:
                self.orch.close(conn.session, "internal_error", errors.INTERNAL)
            self.outcomes["failed"] += 1
            return http_error(500, "answer_failed", f"the server could not answer the offer: {exc}")
        self.calls[call_id] = conn
        self.outcomes["answered"] += 1
        asyncio.get_running_loop().call_later(self.config.webrtc_connect_timeout_s, self._unconnected, conn)
        asked = webrtc_peer.packet_ms(offer, self.config.webrtc_ptime_ms)
        answer = pc.localDescription.sdp
        if asked != 20:  # browsers send 20 ms unless asked
            answer = webrtc_peer.with_audio_attribute(answer, "ptime", asked)
        return Response(
            answer, status_code=201, media_type="application/sdp",
            headers={"Location": f"/v1/realtime/calls/{call_id}"},
        )  # fmt: skip

    def _unconnected(self, conn: WebRTCConnection) -> None:
        """``--webrtc-connect-timeout-s`` after the answer: a call whose peer never came up
        ends, so an offer that never connects holds its slot and UDP socket seconds, not
        until the idle timeout (its session's close tears the peer connection down)."""
        session = conn.session
        if conn.connected or session is None or session.closed:
            return
        over_budget("webrtc_connect")
        log.info("webrtc call %s: not connected after %.1f s, ended (connect_timeout)",
                 conn.call_id, self.config.webrtc_connect_timeout_s)  # fmt: skip
        self.orch.close(session, "connect_timeout", errors.NORMAL)

    async def _serve(self, conn: WebRTCConnection) -> None:
        try:
            await conn.run()
        except Exception:
            log.exception("webrtc call %s failed", conn.call_id)
        finally:
            conn._settle((500, "internal_error", "the call ended before it was answered"))
            self.calls.pop(conn.call_id, None)
            counts, ended = conn.jitter.counts, self.ended_counts
            for name, value in counts.as_dict().items():
                setattr(ended, name, getattr(ended, name) + value)
            self.ended_skipped += conn.frames_skipped
            await conn.teardown()

    async def hangup(self, call_id: str, request: Request) -> Response:
        """``POST /v1/realtime/calls/{id}/hangup``: the session ends (``client_closed``)."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        if not self._server_key_ok(request):
            return http_error(401, "invalid_api_key", "a valid API key is required")
        conn = self.calls.get(call_id)
        if conn is None or conn.session is None:
            return http_error(404, "call_not_found", f"no call {call_id[:64]!r}")
        self.orch.close(conn.session, "client_closed", errors.NORMAL)
        return Response(status_code=200)

    async def client_secret(self, request: Request) -> Response:
        """``POST /v1/realtime/client_secrets``: a short-lived single-use key for one call."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        if not self._server_key_ok(request):
            return http_error(401, "invalid_api_key", "a valid API key is required")
        try:
            spec = parse_json(await read_body(request) or b"{}", "the body")
            secret = self.secrets.mint(spec, self.config.model_name)
        except BodyTooLarge as exc:
            return _too_large(exc)
        except ValueError as exc:
            return http_error(400, "invalid_value", str(exc))
        return JSONResponse(secret.response())

    async def browser_ice_servers(self, request: Request) -> Response:
        """``GET /v1/realtime/ice_servers`` (not OpenAI's): the STUN servers a browser should
        give its RTCPeerConnection to reach this server (webrtc_peer.stun_for_browsers). With
        keys, for a key or a live client secret (not spent: the call it is for spends it)."""
        refused = self._refused(request)
        if refused is not None:
            return refused
        if not self._server_key_ok(request) and not self.secrets.valid(
            auth.presented_keys(request.scope, dict(request.query_params))
        ):
            return http_error(401, "invalid_api_key", "a valid API key or client secret is required")
        return JSONResponse({"ice_servers": webrtc_peer.stun_for_browsers(self.ice_servers)})

    async def close(self) -> None:
        """At shutdown: every call's peer connection closed (its session closes with the rest)."""
        for task in list(self._tasks):
            task.cancel()
        for conn in list(self.calls.values()):
            await conn.teardown()


class WebRTCCollector(Collector):
    """Calls by outcome, live calls, and what the calls' jitter buffers did."""

    def __init__(self, calls: WebRTCCalls) -> None:
        self.calls = calls

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        calls = self.calls
        outcomes = CounterMetricFamily(
            "duplexserve_webrtc_calls", "POST /v1/realtime/calls by outcome", labels=["protocol", "outcome"]
        )
        for outcome in ("answered", "refused", "bad_request", "unauthorized", "forbidden", "failed",
                        "unavailable"):  # fmt: skip
            outcomes.add_metric(["webrtc", outcome], calls.outcomes[outcome])
        yield outcomes
        yield GaugeMetricFamily(
            "duplexserve_webrtc_calls_active", "calls with a live session", len(calls.calls)
        )
        totals = dict(calls.ended_counts.as_dict())
        skipped = calls.ended_skipped
        for conn in calls.calls.values():
            for name, value in conn.jitter.counts.as_dict().items():
                totals[name] += value
            skipped += conn.frames_skipped
        packets = CounterMetricFamily(
            "duplexserve_jitter_packets",
            "incoming audio packets by what the jitter buffer did: packets (received), late, duplicate, "
            "concealed and recovered (20 ms pieces), overflow (dropped, sender ahead), resyncs, skipped "
            "(20 ms pieces passed over unplayed)",
            labels=["protocol", "event"],
        )
        for name, value in totals.items():
            packets.add_metric(["webrtc", name], value)
        yield packets
        yield CounterMetricFamily(
            "duplexserve_webrtc_frames_skipped",
            "input frames not fed to the model because the engine was behind (real time kept)",
            value=skipped,
        )
