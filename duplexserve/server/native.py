"""The native protocol ``duplex/1`` at ``/v1/duplex`` (docs/protocol.md).

Binary messages are audio and nothing else; text messages are JSON events. With
``pcm_f32le`` at 24 kHz in and out, received bytes reach the engine as views and the
answer leaves as one ``tobytes()`` per frame.
"""

from __future__ import annotations

import json
from typing import Any

from duplexserve import errors
from duplexserve.codecs.formats import FRAME_MS, AudioFormat, FormatError
from duplexserve.codecs.pipeline import make_decoder, make_encoder
from duplexserve.errors import SessionError
from duplexserve.server.connection import Connection
from duplexserve.server.events import AudioOut, ClosedOut, ErrorOut, Notice, Outgoing, TextOut
from duplexserve.server.session import State


class NativeConnection(Connection):
    protocol = "duplex/1"

    async def handshake(self) -> bool:
        q = self.query
        try:
            self._set_formats(
                AudioFormat.parse(q.get("input_format"), q.get("input_sample_rate")),
                AudioFormat.parse(q.get("output_format"), q.get("output_sample_rate")),
            )
        except FormatError as exc:
            await self.refuse(errors.UNSUPPORTED_DATA, "unsupported_format", str(exc))
            return False
        if not await self.open_session():
            return False
        await self.accept()
        await self.send_json(self._describe("session.created"))
        return True

    def _set_formats(self, inp: AudioFormat, out: AudioFormat) -> None:
        decoder, encoder = make_decoder(inp, self.codec_procs), make_encoder(out, self.codec_procs)
        self.input_format, self.output_format = inp, out
        self.decoder, self.encoder = decoder, encoder

    def _describe(self, kind: str) -> dict[str, Any]:
        assert self.session is not None
        return {
            "type": kind,
            "protocol": self.protocol,
            "session_id": self.session.id,
            "model": self.config.model_name,
            "engine": self.orch.engine.name,
            "frame_ms": FRAME_MS,
            "input": self.input_format.describe(),
            "output": self.output_format.describe(),
        }

    # ------------------------------------------------------------------ incoming
    async def on_binary(self, data: bytes) -> None:
        decoder = self.decoder
        assert decoder is not None and self.session is not None
        try:
            if decoder.inline and self.inline_ok:  # no await on the hot path
                self.session.receive_audio(decoder.decode(data))
                return
            samples = await self.decode(data)
        except FormatError as exc:
            raise SessionError("invalid_audio", str(exc), errors.UNSUPPORTED_DATA) from None
        await self.feed(samples)

    async def on_text(self, text: str) -> None:
        try:
            event = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than Python's stack
            raise SessionError("invalid_json", "text messages must be JSON", errors.INVALID_PAYLOAD) from None
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            raise SessionError(
                "invalid_event", "an event is a JSON object with a string 'type'", errors.INVALID_PAYLOAD
            )
        session = self.session
        assert session is not None
        kind = event["type"]
        if kind == "ping":
            session.say({"type": "pong", "id": event.get("id")})
        elif kind == "session.update":
            self._update(event)
        elif kind == "input.end":
            await self._end_input()
        elif kind == "session.close":
            self.orch.close(session, "client_closed", errors.NORMAL)
        else:
            raise SessionError("unknown_event", f"unknown event type {kind[:64]!r}")

    def _update(self, event: dict[str, Any]) -> None:
        session = self.session
        assert session is not None
        if session.state is not State.CREATED:
            raise SessionError("session_locked", "session.update is only allowed before the first audio")
        sides = []
        for side, current in (("input", self.input_format), ("output", self.output_format)):
            spec = event.get(side)
            if spec is None:
                sides.append(current)
                continue
            if not isinstance(spec, dict):
                raise SessionError("invalid_event", f"'{side}' must be an object", errors.INVALID_PAYLOAD)
            try:
                sides.append(AudioFormat.parse(
                    spec.get("format", current.format),
                    spec.get("sample_rate", current.sample_rate if "format" not in spec else None),
                ))
            except FormatError as exc:
                raise SessionError("unsupported_format", str(exc)) from None
        try:
            self._set_formats(*sides)
        except FormatError as exc:
            raise SessionError("unsupported_format", str(exc)) from None
        session.say(self._describe("session.updated"))

    async def _end_input(self) -> None:
        session = self.session
        assert session is not None and self.decoder is not None
        if session.accepts_audio:
            tail = self.decoder.flush()
            if len(tail):
                await self.feed(tail)
        session.end_input()

    # ------------------------------------------------------------------ outgoing
    async def render(self, item: Outgoing) -> None:
        cls = item.__class__
        if cls is AudioOut:
            await self.send_bytes(await self.encode(item.audio))
        elif cls is TextOut:
            await self.send_json({"type": "text.delta", "frame": item.index, "text": item.text})
        elif cls is Notice:
            await self.send_json(item.payload)
        elif cls is ErrorOut:
            await self.send_error(item.code, item.message, item.fatal)
        elif cls is ClosedOut:
            await self.send_json({
                "type": "session.closed",
                "reason": item.reason,
                "frames_in": item.frames_in,
                "frames_out": item.frames_out,
                "frames_dropped": item.frames_dropped,
            })
