"""Twilio Media Streams at ``/v1/twilio``: phone calls on the same session core.

``<Connect><Stream url="wss://host/v1/twilio">`` makes Twilio open a WebSocket and
stream the call as JSON text (:mod:`.wire` has the shapes): ``connected``,
``start``, a ``media`` message of 20 ms mu-law at 8 kHz every 20 ms, ``dtmf``, ``mark``
echoes and ``stop``. Inbound mu-law is gathered into whole 80 ms model frames (640
bytes) and decoded inline (G.711 table, soxr 8 -> 24 kHz): one conversion per frame, not
four. Each answered frame, or each group of frames the writer finds queued together,
goes back as one ``media`` message (whole 80 ms frames) and one ``mark`` named after
the count of frames sent; Twilio echoes the mark once that audio has played, which
tells how far playback lags. A session that ends while the call goes on (idle timeout,
shutdown, a fatal error) first sends ``clear``, so Twilio drops the audio it still holds.

Twilio sets no headers and drops the URL's query string, so the API key comes as the
``customParameters`` entry ``token`` (``<Parameter name="token" .../>``), or as
``?token=`` for providers that keep the query. The session therefore opens when
``start`` arrives, after the WebSocket was accepted. Twilio has no error message: bad
input is logged, counted and dropped, and the call goes on; a call that cannot be
served is closed, and Twilio goes on with the TwiML after ``<Connect>``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from typing import Any

from duplexserve import errors
from duplexserve.codecs.formats import AudioFormat
from duplexserve.codecs.pipeline import make_decoder, make_encoder
from duplexserve.server import auth
from duplexserve.server.core import prompts
from duplexserve.server.core.adapter import ProtocolAdapter
from duplexserve.server.core.client_address import client_of
from duplexserve.server.core.events import AudioOut, ClosedOut, ErrorOut, Outgoing
from duplexserve.server.log_redaction import clip
from duplexserve.server.protocols.moshi_chat import engine_params
from duplexserve.server.protocols.twilio import wire
from duplexserve.server.protocols.twilio.wire import COUNTS, BadMessage

log = logging.getLogger(__name__)

MULAW_8K = AudioFormat("g711_ulaw", 8000)
FRAME_BYTES = MULAW_8K.frame_samples  # 640 mu-law bytes: one 80 ms model frame
MAX_GROUP_FRAMES = 8  # frames per outgoing media message at most (640 ms)
MARKS_KEPT = 4096  # marks awaiting their echo (5 minutes of frames); older ones are forgotten
LOGGED_PER_CALL = 5  # dropped messages logged one by one per call; the rest only counted
#: Closes after which Twilio no longer listens: no clear, nothing to drop.
_CALL_GONE = ("client_closed", "disconnected")
_START_REFUSALS = {"invalid_start": errors.INVALID_PAYLOAD, "unsupported_format": errors.UNSUPPORTED_DATA}


class TwilioConnection(ProtocolAdapter):
    protocol = "twilio"
    deferred_auth = True  # the key comes in the start event

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.start: wire.Start | None = None
        self._sid_json = '""'
        self._accepted = False
        self._inbound = bytearray()  # mu-law not yet a whole frame
        self._group = bytearray()  # encoded answer frames not yet sent
        self._group_frames = 0
        self._frames_sent = 0
        self._marks_sent = 0
        self._marks: collections.deque[tuple[int, float]] = collections.deque(maxlen=MARKS_KEPT)
        self._played = 0  # frames Twilio confirmed played (by its latest mark echo)
        self._lag_max = 0  # most frames sent but not yet played, seen at a mark echo
        self._delay_sum, self._echoed = 0.0, 0
        self._dropped: collections.Counter[str] = collections.Counter()

    @property
    def call(self) -> str:
        """The call for the log: its callSid as the client sent it, escaped and cut short;
        "-" until the key is checked (nothing of an unauthenticated start is logged)."""
        return clip(self.start.call_sid or self.start.stream_sid) if self.start else "-"

    # -------------------------------------------------------------- handshake
    async def accept(self, subprotocol: str | None = None) -> None:
        self._accepted = True
        await super().accept(subprotocol)

    async def send_error(self, code: str, message: str, fatal: bool) -> None:
        """Twilio has no error message: the log is the only place an error can go."""
        log.warning("twilio call %s: %s: %s%s", self.call, code, message, " (call ended)" if fatal else "")

    async def refuse(self, code: int, error: str, message: str) -> None:
        if not self._accepted:  # before the upgrade: the base refusal (or HTTP 503 behind a proxy)
            await super().refuse(code, error, message)
            return
        await self.send_error(error, message, True)
        await self.close(code, error)

    async def handshake(self) -> bool:
        refusal = self.orch.refusal(client_of(self.scope))
        if refusal is not None:  # full or draining: say so at the upgrade, before any message
            self.orch.rejected(refusal)
            await self.refuse(*refusal)
            return False
        await self.accept()
        start = await self._wait_start()
        if start is None:
            return False
        allowed = auth.parse_list(self.config.api_keys)
        token = start.custom.get("token")
        if not (
            auth.key_ok(self.scope, self.query, allowed)
            or (token is not None and auth.key_ok({}, {"token": token}, allowed))
        ):
            await self.refuse(errors.POLICY, "unauthorized", "a valid API key is required")
            return False
        self.start, self._sid_json = start, json.dumps(start.stream_sid)
        try:
            params = engine_params({k: v for k, v in start.custom.items() if k != "token"})
        except ValueError as exc:
            await self.refuse(errors.POLICY, "invalid_params", str(exc))
            return False
        if not await self.open_session(params):
            return False
        prompt = prompts.prompt_of(params)  # <Parameter name="text_prompt" .../>: media waits for it
        refused = await self.run_prompt(prompt) if prompt else None
        if refused is not None:
            if refused.fatal:
                await self.refuse_session(refused)
                return False
            await self.send_error(refused.code, refused.message, False)  # the call goes on without it
        self.decoder, self.encoder = make_decoder(MULAW_8K), make_encoder(MULAW_8K)
        COUNTS.calls += 1
        self.ready()
        log.info("twilio call %s stream %s started (session %s)", self.call, clip(start.stream_sid),
                 self.session.id if self.session else "-")
        return True

    async def _wait_start(self) -> wire.Start | None:
        """Messages up to ``start``: ``connected`` is expected, anything else dropped.

        ``start`` is part of Twilio's handshake (it comes at once), so it gets the handshake's
        time limit, ``--handshake-timeout-s``.
        """
        limit = self.config.handshake_timeout_s
        loop, deadline = self._loop, self._loop.time() + limit
        while True:
            try:
                message = await asyncio.wait_for(self.transport.receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                await self.refuse(errors.POLICY, "no_start", f"no start event within {limit:g} s")
                return None
            if message is None:
                return None  # gone before start
            try:
                event = wire.parse(message if message.__class__ is str else None)  # type: ignore[arg-type]
                kind = event["event"]
                if kind == "start":
                    return wire.parse_start(event)
                if kind == "stop":
                    await self.close(errors.NORMAL)
                    return None
                if kind != "connected":
                    raise BadMessage(
                        "before_start" if kind in ("media", "mark", "dtmf") else "unknown_event",
                        f"{kind[:32]!r} before start",
                    )
            except BadMessage as exc:
                code = _START_REFUSALS.get(exc.reason)
                if code is None:
                    self._drop(exc)
                    continue
                COUNTS.bad[exc.reason] += 1  # a start this server cannot serve: the call ends
                await self.refuse(code, exc.reason, exc.message)
                return None

    # --------------------------------------------------------------- incoming
    async def on_binary(self, data: bytes) -> None:
        self._drop(BadMessage("binary", f"a {len(data)}-byte binary message: Twilio sends JSON text only"))

    async def on_text(self, text: str) -> None:
        try:
            event = wire.parse(text)
            kind = event["event"]
            if kind == "media":
                data = wire.media_payload(event)
                if data:
                    await self._media(data)
            elif kind == "mark":
                self._mark_echoed(wire.mark_name(event))
            elif kind == "stop":
                assert self.session is not None
                self.orch.close(self.session, "client_closed", errors.NORMAL)
            elif kind == "dtmf":
                COUNTS.dtmf += 1  # the model hears no keypresses
            elif kind in ("connected", "start"):
                raise BadMessage("repeated_" + kind, f"a second {kind} event")
            else:
                raise BadMessage("unknown_event", f"unknown event {kind[:32]!r}")
        except BadMessage as exc:
            self._drop(exc)

    async def _media(self, data: bytes) -> None:
        """Whole 80 ms frames of mu-law go to the session; the rest waits for the next chunk."""
        buf = self._inbound
        buf += data
        if len(buf) < FRAME_BYTES:
            return
        chunk = bytes(buf)
        buf.clear()
        decoder, session = self.decoder, self.session
        assert decoder is not None and session is not None
        if self.inline_ok:  # G.711 and soxr at 8 kHz are inline: no await on the hot path
            session.receive_audio(decoder.decode(chunk))
        else:
            await self.feed(await self.decode(chunk))

    def _mark_echoed(self, name: str) -> None:
        """Twilio played the audio before mark ``frames-N``: N frames are out of its buffer."""
        if not name.startswith("frames-") or not name[7:].isdigit():
            raise BadMessage("unknown_mark", f"a mark this server did not send: {name[:32]!r}")
        played, marks, sent_at = int(name[7:]), self._marks, None
        while marks and marks[0][0] <= played:
            frames, at = marks.popleft()
            if frames == played:
                sent_at = at
        if sent_at is None:
            if played > self._frames_sent:
                raise BadMessage("unknown_mark", f"a mark this server did not send: {name[:32]!r}")
            return  # forgotten (over MARKS_KEPT) or echoed twice
        delay = self._loop.time() - sent_at
        self._played = played
        self._lag_max = max(self._lag_max, self._frames_sent - played)
        self._delay_sum += delay
        self._echoed += 1
        COUNTS.marks_echoed += 1
        COUNTS.mark_delay_s += delay

    def _drop(self, exc: BadMessage) -> None:
        COUNTS.bad[exc.reason] += 1
        self._dropped[exc.reason] += 1
        if sum(self._dropped.values()) <= LOGGED_PER_CALL:
            log.warning("twilio call %s: dropped a message (%s): %s", self.call, exc.reason, exc.message)

    # --------------------------------------------------------------- outgoing
    async def render(self, item: Outgoing) -> None:
        cls = item.__class__
        if cls is AudioOut:
            encoder, session = self.encoder, self.session
            assert encoder is not None and encoder.inline and session is not None
            self._group += encoder.encode(item.audio)
            self._group_frames += 1
            if self._group_frames >= MAX_GROUP_FRAMES or not session.has_outgoing:
                await self._send_group()
            return
        if self._group_frames:
            await self._send_group()
        if cls is ErrorOut:
            await self.send_error(item.code, item.message, item.fatal)
        elif cls is ClosedOut:
            await self._end(item)
        # TextOut: a phone call carries no text. Notice: this adapter queues none.

    async def _send_group(self) -> None:
        """One media message of whole frames, then the mark that will say when it played."""
        self._frames_sent += self._group_frames
        payload = bytes(self._group)
        self._group.clear()
        self._group_frames = 0
        self._marks.append((self._frames_sent, self._loop.time()))
        self._marks_sent += 1
        COUNTS.marks_sent += 1
        await self.send_text(wire.media_json(self._sid_json, payload))
        await self.send_text(wire.mark_json(self._sid_json, f"frames-{self._frames_sent}"))

    async def _end(self, item: ClosedOut) -> None:
        if item.reason not in _CALL_GONE and self._frames_sent > self._played:
            COUNTS.clears_sent += 1  # the session is over: drop what Twilio still holds of it
            await self.send_text(wire.clear_json(self._sid_json))

    def ended(self, item: ClosedOut) -> None:
        log.info(
            "twilio call %s ended (%s): frames in %d, out %d, dropped %d; marks sent %d, echoed %d,"
            " mean mark delay %.0f ms, most audio queued at Twilio %d ms; messages dropped %s",
            self.call, item.reason, item.frames_in, item.frames_out, item.frames_dropped,
            self._marks_sent, self._echoed,
            1e3 * self._delay_sum / self._echoed if self._echoed else 0.0,
            80 * self._lag_max, dict(self._dropped) or "none",
        )
