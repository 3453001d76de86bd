"""OpenAI Realtime API at ``/v1/realtime`` (GA event names; beta names accepted).

So that the ``openai`` SDK, pipecat and LiveKit work unchanged. Audio arrives as
base64 in ``input_audio_buffer.append`` and leaves as ``response.output_audio.delta``,
pcm16 at 24 kHz or G.711. The model speaks continuously; :mod:`.responses`
cuts its speech into responses (docs/protocols.md says how).

Ordering: the reader validates client events and answers at once where the answer
does not depend on output state; anything that does (``response.create``/``cancel``,
``conversation.item.truncate``, a new output format) is queued as an :class:`_Apply`
in the session's outgoing stream and run by the writer, so it takes effect exactly
between the output frames around it.

Personas: for a model that takes prompts (PersonaPlex), ``instructions`` is its text
prompt and the output voice names a voice prompt. The first ``session.update`` that sets
them before any audio runs the prompt, and its ``session.updated`` goes out once it ran;
the messages after it wait meanwhile (reading pauses), so the model hears no audio before
its prompt. Audio first: the model's default prompt runs. A later change of either gets
``session_locked`` (the session goes on). A model without prompts only echoes them.
"""

from __future__ import annotations

import binascii
import itertools
import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from duplexserve import errors
from duplexserve.codecs.formats import FRAME_MS, FRAME_SAMPLES, MODEL_RATE, FormatError
from duplexserve.codecs.pipeline import Decoder, Encoder, make_decoder, make_encoder
from duplexserve.server import auth
from duplexserve.server.core.adapter import ProtocolAdapter
from duplexserve.server.core.events import AudioOut, ClosedOut, ErrorOut, Notice, Outgoing, TextOut
from duplexserve.server.core.session import SILENCE
from duplexserve.server.protocols.realtime import events as ev
from duplexserve.server.protocols.realtime.responses import Mode, Responses
from duplexserve.server.protocols.realtime.update import (
    DEFAULT_VOICE,
    ClientEventError,
    SessionUpdate,
    _Apply,
)

SUBPROTOCOL = "realtime"
#: Closes the client did not ask for that deserve an ``error`` event before the close.
_QUIET_CLOSES = ("completed", "client_closed", "disconnected")
_SERVER_SIDE = (errors.INTERNAL, errors.TRY_AGAIN, errors.GOING_AWAY)
_COMMIT_MIN_MS = 100  # OpenAI's: less since the last commit or clear is refused
_UNSUPPORTED = (
    "conversation.item.create",
    "conversation.item.delete",
    "conversation.item.retrieve",
    "output_audio_buffer.clear",
    "transcription_session.update",
)


class RealtimeConnection(SessionUpdate, ProtocolAdapter):
    """The Realtime protocol on any transport: on a WebSocket, audio as base64 events; on a
    transport with a media track (a WebRTC call: ``name="webrtc"``, the call's
    ``session_config``), audio on the track and the events on its data channel."""

    protocol = "openai-realtime"

    def __init__(
        self, *args: Any, name: str | None = None, session_config: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        if name is not None:
            self.protocol = name
        self.media = self.transport.media
        #: A call's ``session`` from its offer, applied as a first ``session.update``.
        self.session_config = session_config
        if session_config and isinstance(session_config.get("model"), str):
            self.query["model"] = session_config["model"]  # what session.created names
        offered = auth.subprotocols(self.scope)
        self._subprotocol = SUBPROTOCOL if SUBPROTOCOL in offered else None
        self._event_ids = itertools.count(1)
        self._id_base = ""
        self._fatal_sent = False
        rms = 10.0 ** (self.config.realtime_speech_dbfs / 20.0)
        self._energy_floor = rms * rms * FRAME_SAMPLES  # compared with sum(x^2): no sqrt per frame
        self._silence_frames = max(1, math.ceil(self.config.realtime_silence_ms / FRAME_MS))
        self._uncommitted = 0  # model-rate samples appended since the last commit or clear
        self._prompted = False  # instructions and voice went to the model: they are fixed
        self._after_prompt: Callable[[], list[dict[str, Any]]] | None = None

    # --------------------------------------------------------------- handshake
    async def accept(self, subprotocol: str | None = None) -> None:
        """Browsers fail the connection unless the server selects an offered subprotocol."""
        await super().accept(subprotocol or self._subprotocol)

    async def send_error(self, code: str, message: str, fatal: bool) -> None:
        server_side = code.startswith(("server", "engine", "internal"))
        await self._emit(ev.error(code, message, "server_error" if server_side else "invalid_request_error"))

    async def handshake(self) -> bool:
        if self.query.get("intent") == "transcription":
            await self.refuse(
                errors.POLICY,
                "unsupported_intent",
                "transcription sessions are not supported: the model converses",
            )
            return False
        if not await self.open_session({}):
            return False
        session = self.session
        assert session is not None
        self._id_base = session.id
        self.decoder, self.encoder = self._codecs("audio/pcm", "audio/pcm")
        self.state: dict[str, Any] = {
            "id": "sess_" + session.id,
            "model": self.query.get("model") or self.config.model_name,
            "instructions": "",
            "voice": DEFAULT_VOICE,
            "input_format": "audio/pcm",
            "output_format": "audio/pcm",
            "turn_detection": None,
        }
        self.responses = Responses(self._new_id, self._silence_frames)
        await self.accept()
        await self._emit({"type": "session.created", "session": ev.session_object(self.state)})
        self.ready()
        config = self.session_config
        if config:
            try:
                refused = await self.update_session({"session": config}, None)  # runs a prompt it sets
            except ClientEventError as exc:
                self.transport.opened((400, exc.code, f"session: {exc.message}"))
                self.orch.close(session, exc.code, errors.POLICY)
                return True
            if refused is not None:  # its prompt, or the session ended meanwhile: the answer says why
                close = refused.close_code
                later = close in (errors.TRY_AGAIN, errors.GOING_AWAY)
                status = 503 if later else 500 if close == errors.INTERNAL else 400
                self.transport.opened((status, refused.code, refused.message))
                return True
        self.transport.opened(None)
        return True

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}_{self._id_base}_{next(self._event_ids)}"

    def _codecs(self, inp: str, out: str) -> tuple[Decoder, Encoder]:
        procs = self.codec_procs
        return make_decoder(ev.GA_FORMATS[inp], procs), make_encoder(ev.GA_FORMATS[out], procs)

    # ---------------------------------------------------------------- incoming
    async def on_binary(self, data: bytes) -> None:
        self._reply(
            ev.error(
                "invalid_message",
                "binary messages are not part of the Realtime API; send input_audio_buffer.append",
            )
        )

    async def on_text(self, text: str) -> None:
        client_event_id = None
        try:
            try:
                event = json.loads(text)
            except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
                raise ClientEventError("invalid_json", "the message is not valid JSON") from None
            if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                raise ClientEventError("invalid_event", "an event is a JSON object with a string 'type'")
            raw_id = event.get("event_id")
            client_event_id = raw_id if isinstance(raw_id, str) else None
            kind = event["type"]
            if kind == "input_audio_buffer.append":
                await self._append(event)
            elif kind == "session.update":
                await self.update_session(event, client_event_id)
            elif kind == "response.create":
                self._response_create(event, client_event_id)
            elif kind == "response.cancel":
                response_id = event.get("response_id")
                rid = response_id if isinstance(response_id, str) else None
                self._apply(lambda: self.responses.cancel(rid, client_event_id))
            elif kind == "conversation.item.truncate":
                self._truncate(event, client_event_id)
            elif kind == "input_audio_buffer.commit":
                self._commit()
            elif kind == "input_audio_buffer.clear":
                self._uncommitted = 0
                self._reply({"type": "input_audio_buffer.cleared"})
            elif kind in _UNSUPPORTED:
                raise ClientEventError("unsupported_event", f"{kind} is not supported by this server")
            else:
                raise ClientEventError("unknown_event", f"unknown event type {kind[:64]!r}", "type")
        except ClientEventError as exc:
            self._reply(ev.error(exc.code, exc.message, client_event_id=client_event_id, param=exc.param))

    async def _append(self, event: dict[str, Any]) -> None:
        audio = event.get("audio")
        if not isinstance(audio, str):
            raise ClientEventError("invalid_value", "'audio' must be a base64 string", "audio")
        try:
            data = binascii.a2b_base64(audio, strict_mode=True)
        except (binascii.Error, ValueError):
            raise ClientEventError("invalid_base64", "'audio' is not valid base64", "audio") from None
        try:
            samples = await self.decode(data)
        except FormatError as exc:
            raise ClientEventError("invalid_audio", str(exc), "audio") from None
        self._uncommitted += len(samples)
        await self.feed(samples)

    def _commit(self) -> None:
        """As OpenAI's server: a commit needs 100 ms of audio appended since the last commit
        or clear (``input_audio_buffer_commit_empty`` otherwise, the session goes on)."""
        heard_ms = 1000 * self._uncommitted / MODEL_RATE
        if heard_ms < _COMMIT_MIN_MS:
            raise ClientEventError(
                "input_audio_buffer_commit_empty",
                f"Error committing input audio buffer: buffer too small. Expected at least "
                f"{_COMMIT_MIN_MS}ms of audio, but buffer only has {heard_ms:.2f}ms of audio.",
            )
        self._uncommitted = 0
        item = self._new_id("item")
        self._reply({"type": "input_audio_buffer.committed", "item_id": item, "previous_item_id": None})

    def _response_create(self, event: dict[str, Any], client_event_id: str | None) -> None:
        spec = event.get("response") or {}
        if not isinstance(spec, dict):
            raise ClientEventError("invalid_value", "'response' must be an object", "response")
        metadata = spec.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise ClientEventError("invalid_value", "metadata must be an object", "response.metadata")
        self._apply(lambda: self.responses.create(metadata, client_event_id))

    def _truncate(self, event: dict[str, Any], client_event_id: str | None) -> None:
        item_id, index, end = event.get("item_id"), event.get("content_index", 0), event.get("audio_end_ms")
        if not isinstance(item_id, str):
            raise ClientEventError("invalid_value", "item_id must be a string", "item_id")
        for name, value in (("content_index", index), ("audio_end_ms", end)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ClientEventError("invalid_value", f"{name} must be an integer", name)
        self._apply(lambda: self.responses.truncate(item_id, index, end, client_event_id))

    def _reply(self, event: dict[str, Any]) -> None:
        """An answer queued in order with the output (session.say)."""
        assert self.session is not None
        self.session.say(event)

    def _apply(self, run: Callable[[], list[dict[str, Any]]]) -> None:
        assert self.session is not None
        self.session.say(_Apply(run))

    # ---------------------------------------------------------------- outgoing
    async def _emit(self, event: dict[str, Any]) -> None:
        event["event_id"] = self._new_id("event")
        await self.send_json(event)

    async def render(self, item: Outgoing) -> None:
        cls = item.__class__
        if cls is AudioOut and self.media:
            await self._render_on_track(item)  # type: ignore[arg-type]
        elif cls is AudioOut:
            audio = item.audio
            before, response, after = self.responses.audio(float(np.dot(audio, audio)) > self._energy_floor)
            for event in before:
                await self._emit(event)
            if response is not None:
                delta = binascii.b2a_base64(await self.encode(audio), newline=False).decode("ascii")
                await self.send_text(
                    ev.audio_delta_json(self._new_id("event"), response.id, response.item_id, delta)
                )
            for event in after:
                await self._emit(event)
        elif cls is TextOut:
            for event in self.responses.text(item.text):
                await self._emit(event)
        elif cls is Notice:
            payload = item.payload
            for event in payload.run() if payload.__class__ is _Apply else (payload,):
                await self._emit(event)
        elif cls is ErrorOut:
            self._fatal_sent |= item.fatal
            await self.send_error(item.code, item.message, item.fatal)
        elif cls is ClosedOut:
            for event in self.responses.finish():
                await self._emit(event)
            if item.reason not in _QUIET_CLOSES and not self._fatal_sent:
                kind = "server_error" if item.close_code in _SERVER_SIDE else "invalid_request_error"
                await self._emit(ev.error(item.reason, f"the session was closed: {item.reason}", kind))
            if self.media:
                await self._emit(self._closed_event(item))  # type: ignore[arg-type]

    # ------------------------------------------------------------ on a media track
    async def _render_on_track(self, item: AudioOut) -> None:
        """A frame of speech on the transport's media track, the response events around it
        on the data channel, with ``output_audio_buffer.started`` / ``.stopped``: what OpenAI
        sends over WebRTC when a response's audio starts and ends on the track."""
        audio = item.audio
        responses = self.responses
        before, response, after = responses.audio(float(np.dot(audio, audio)) > self._energy_floor)
        for event in before:
            await self._emit(event)
            if event["type"] == "response.created":
                await self._emit(_buffer_event("started", event))
        if response is None and responses.mode is Mode.MUTED:
            audio = SILENCE  # response.cancel: the rest of that speech is not heard
        self.transport.send_audio(audio)
        for event in after:
            await self._emit(event)
            if event["type"] == "response.done":
                await self._emit(_buffer_event("stopped", event))

    def _closed_event(self, item: ClosedOut) -> dict[str, Any]:
        """Not an OpenAI event: the counts of duplex/1's ``session.closed``, and what the
        transport did with the network's packets (docs/protocols.md)."""
        return {
            "type": "session.closed", "reason": item.reason, "frames_in": item.frames_in,
            "frames_out": item.frames_out, "frames_dropped": item.frames_dropped,
            "audio_in": self.transport.audio_counts(),
        }  # fmt: skip


def _buffer_event(what: str, event: dict[str, Any]) -> dict[str, Any]:
    return {"type": f"output_audio_buffer.{what}", "response_id": event["response"]["id"]}
