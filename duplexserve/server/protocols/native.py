"""The native protocol ``duplex/1`` at ``/v1/duplex`` (docs/protocol.md).

Binary messages are audio and nothing else; text messages are JSON events. With
``pcm_f32le`` at 24 kHz in and out, received bytes reach the engine as views and the
answer leaves as one ``tobytes()`` per frame.
"""

from __future__ import annotations

import asyncio
import collections
import json
from typing import Any
from urllib.parse import parse_qsl

import numpy as np

from duplexserve import errors
from duplexserve.codecs.formats import FRAME_MS, FRAME_SAMPLES, SAMPLE_BYTES, AudioFormat, FormatError
from duplexserve.codecs.pipeline import make_decoder, make_encoder
from duplexserve.errors import SessionError
from duplexserve.server.core import prompts
from duplexserve.server.core.adapter import ProtocolAdapter, invalid_audio
from duplexserve.server.core.eager import run_eager
from duplexserve.server.core.events import AudioOut, ClosedOut, ErrorOut, Notice, Outgoing, TextOut
from duplexserve.server.core.replay import ReplayRing
from duplexserve.server.core.resume import Resumable
from duplexserve.server.core.session import State
from duplexserve.server.protocols.native_move import NativeMove
from duplexserve.server.protocols.native_resume import OPUS, NativeResume, text_delta


class NativeConnection(NativeMove, NativeResume, ProtocolAdapter):
    protocol = "duplex/1"
    _resumable: Resumable | None = None
    _sent_audio: ReplayRing | None = None
    _sent_text: collections.deque[tuple[int, str]] | None = None
    #: Input bytes fed to the decoder (PCM and G.711): after a resume, the client sends
    #: again from input frame ``frames_in``; the bytes the decoder already took are skipped,
    #: so its resampler and the session's partial frame go on as if nothing happened.
    _wire_bytes = 0
    _skip_bytes = 0
    #: A prompt was asked for (query or ``session.update``); one runs at most once a session.
    _prompted = False
    #: The prompt of a ``session.update`` running: audio is refused until ``session.updated``.
    _prompting: asyncio.Task[None] | None = None
    #: The prompt the model ran (from the query or a ``session.update``), echoed in ``session.updated``.
    _applied: dict[str, str] | None = None

    async def handshake(self) -> bool:
        q = self.query
        raw = dict(parse_qsl(self.scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True))
        if "resume" in raw:  # an empty token is a bad token, not a new session
            return await self._resume(raw["resume"], raw.get("last_frame", ""))
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
        # A prompt runs before the WebSocket is accepted: no audio can come before session.created.
        prompt = prompts.prompt_of(q)
        refused = await self.run_prompt(prompt) if prompt else None
        if refused is not None and refused.fatal:
            await self.refuse_session(refused)
            return False
        self._prompted = prompt is not None
        self._ran(prompt, refused)
        created = self._describe("session.created")
        registry = self.orch.resume
        if registry.enabled:
            assert self.session is not None
            self._sent_text = collections.deque(maxlen=self.config.max_output_frames)
            self._new_ring()
            self._resumable = registry.issue(self.session, self)
            created["resume"] = {"token": self._resumable.token, "grace_s": registry.grace_s}
        await self.accept()
        await self.send_json(created)
        self.ready()
        if refused is not None:  # prompt_unsupported: the session goes on without it
            await self.send_error(refused.code, refused.message, False)
        return True

    def _set_formats(self, inp: AudioFormat, out: AudioFormat) -> None:
        decoder, encoder = make_decoder(inp, self.codec_procs), make_encoder(out, self.codec_procs)
        self.input_format, self.output_format = inp, out
        self.decoder, self.encoder = decoder, encoder
        if self._sent_audio is not None:
            self._new_ring()

    def _new_ring(self) -> None:
        """Replay storage sized for the output format: wire bytes, or model audio for Opus."""
        out = self.output_format
        width = FRAME_SAMPLES * 4 if out.format == OPUS else SAMPLE_BYTES[out.format] * out.frame_samples
        self._sent_audio = ReplayRing(self.config.max_output_frames, width)

    def _describe(self, kind: str) -> dict[str, Any]:
        assert self.session is not None
        return {
            "type": kind,
            "protocol": self.protocol,
            "session_id": self.session.id,
            "model": self.query.get("model") or self.config.model_name,
            "engine": self.orch.engine.name,
            "frame_ms": FRAME_MS,
            "input": self.input_format.describe(),
            "output": self.output_format.describe(),
        }

    # ------------------------------------------------------------------ incoming
    def binary_now(self, data: bytes) -> bool:
        """Audio for an inline decoder (PCM, G.711), on the spot: the hot path."""
        decoder = self.decoder
        assert decoder is not None and self.session is not None
        if self._prompting is not None:
            raise SessionError(
                "prompt_running", "audio before session.updated is not accepted: the prompt is running"
            )
        if self._skip_bytes or self._held is not None or not (decoder.inline and self.inline_ok):
            return False  # a move under way: on_binary holds it
        self._wire_bytes += len(data)
        try:
            samples = decoder.decode(data)
        except FormatError as exc:
            raise invalid_audio(self.session, exc) from None
        self.session.receive_audio(samples)
        return True

    async def on_binary(self, data: bytes) -> None:
        if self.hold(data):  # a move under way (native_move.py)
            return
        if self._skip_bytes:  # sent again after a resume, already decoded
            skip = min(self._skip_bytes, len(data))
            self._skip_bytes -= skip
            data = data[skip:]
            if not data:
                return
        if self.binary_now(data):
            return
        self._wire_bytes += len(data)
        try:
            samples = await self.decode(data)
        except FormatError as exc:
            assert self.session is not None
            raise invalid_audio(self.session, exc) from None
        await self.feed(samples)

    def audio_payload(self, data: bytes) -> bytes | None:
        """Opus for the codec worker, straight from the fast path (transports/websocket/fast.py)."""
        if self._skip_bytes or self._prompting is not None or self._held is not None:  # binary_now refuses it
            return None
        self._wire_bytes += len(data)
        return data

    async def on_text(self, text: str) -> None:
        if self.hold(text):
            return
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
        if self._prompting is not None:
            raise SessionError("prompt_running", "the prompt is running: wait for its session.updated")
        if session.state is not State.CREATED:
            raise SessionError("session_locked", "session.update is only allowed before the first audio")
        try:
            prompt = prompts.prompt_of(event)
        except ValueError as exc:
            raise SessionError("invalid_event", str(exc), errors.INVALID_PAYLOAD) from None
        if prompt is not None and self._prompted and self.orch.engine.takes_prompts:
            raise SessionError("session_locked", "a session's prompt is set once, before its first audio")
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
        if prompt is None:
            session.say(self._updated())
            return
        self._prompted = True
        self._prompting = run_eager(self._prompt(prompt))  # None: answered at once (no engine)

    async def _prompt(self, prompt: dict[str, str]) -> None:
        """Run the prompt of a ``session.update``; ``session.updated`` follows once it ran.
        Meanwhile other messages are read: audio is refused, ``session.close`` ends it."""
        session = self.session
        assert session is not None
        try:
            refused = await self.run_prompt(prompt)
        finally:
            self._prompting = None
        if refused is not None:
            session.error(refused)
        self._ran(prompt, refused)
        if refused is None or not refused.fatal:
            session.say(self._updated())
        self.received(session)

    def _ran(self, prompt: dict[str, str] | None, refused: SessionError | None) -> None:
        if prompt is not None and refused is None:
            self._applied = {key: prompt.get(key, "") for key in prompts.PROMPT_KEYS}

    def _updated(self) -> dict[str, Any]:
        """``session.updated``: the formats, and the prompt the model ran, once one ran."""
        return {**self._describe("session.updated"), **(self._applied or {})}

    async def _end_input(self) -> None:
        session = self.session
        assert session is not None and self.decoder is not None
        if session.accepts_audio:
            tail = self.decoder.flush()
            if len(tail):
                await self.feed(tail)
        session.end_input()

    # ------------------------------------------------------------------ outgoing
    def audio_to_encode(self, item: AudioOut) -> np.ndarray:
        """As ``render``: the model audio is kept for a replay before it is encoded."""
        audio = np.ascontiguousarray(item.audio, dtype=np.float32)
        sent = self._sent_audio
        if sent is not None:
            sent.add(item.index, memoryview(audio).cast("B"))
        return audio

    def send_encoded(self, item: AudioOut, data: bytes | memoryview) -> None:
        self.transport.send_bytes_now(data)

    def render_now(self, item: Outgoing) -> bool:
        """``render``'s two per-frame items when the encoder runs inline (PCM, G.711)."""
        cls = item.__class__
        if cls is AudioOut:
            encoder = self.encoder
            if encoder is None or not encoder.inline or self.output_format.format == OPUS:
                return False
            data = encoder.encode(item.audio)  # type: ignore[attr-defined]
            if self._sent_audio is not None:
                self._sent_audio.add(item.index, data)  # type: ignore[attr-defined]
            self.transport.send_bytes_now(data)
            return True
        if cls is TextOut:
            self.transport.send_text_now(self._text_delta(item))  # type: ignore[arg-type]
            return True
        return False

    def _text_delta(self, item: TextOut) -> str:
        """The ``text.delta`` event of ``item``, kept for a replay first."""
        if self._sent_text is not None:
            self._sent_text.append((item.index, item.text))
        return text_delta(item.index, item.text)

    async def render(self, item: Outgoing) -> None:
        cls = item.__class__
        if cls is AudioOut:
            sent = self._sent_audio
            if sent is None:
                await self.send_bytes(await self.encode(item.audio))
            elif self.output_format.format == OPUS:  # kept before the send: a broken send is replayed
                audio = np.ascontiguousarray(item.audio, dtype=np.float32)
                sent.add(item.index, memoryview(audio).cast("B"))
                await self.send_bytes(await self.encode(audio))
            else:
                data = await self.encode(item.audio)
                sent.add(item.index, data)
                await self.send_bytes(data)
        elif cls is TextOut:
            await self.send_text(self._text_delta(item))  # type: ignore[arg-type]
        elif cls is Notice:
            await self.send_json(item.payload)
        elif cls is ErrorOut:
            await self.send_error(item.code, item.message, item.fatal)
        elif cls is ClosedOut:
            if item.reason == "moved":  # session.moved said it all; the close (1012) follows
                return
            await self.send_json({
                "type": "session.closed",
                "reason": item.reason,
                "frames_in": item.frames_in,
                "frames_out": item.frames_out,
                "frames_dropped": item.frames_dropped,
                **({"frames_tail": item.frames_tail} if item.frames_tail is not None else {}),
                **self._deadlines(),
            })

    def _deadlines(self) -> dict[str, Any]:
        timer = self.session.timer if self.session is not None else None
        if timer is None:
            return {}
        return {"turnaround_ms": timer.summary(), "late_frames": timer.late}
