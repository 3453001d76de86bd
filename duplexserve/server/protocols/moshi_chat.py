"""Kyutai's Moshi protocol at ``/api/chat``, so its web and Python clients work unchanged.

Binary messages only; byte 0 is the kind (Kyutai's ``rust/protocol.md``):

- ``0x00`` handshake, sent once the session holds a slot and its prompt ran: ``u32
  protocol_version=0, u32 model_version=0`` little-endian, as Kyutai's Rust servers send
  (its Python server sends the bare byte; every client ignores the payload);
- ``0x01`` audio, an Ogg/Opus stream at 24 kHz mono in both directions; the first
  message out carries the OpusHead and OpusTags pages;
- ``0x02`` text, one token as UTF-8; ``0x05`` error, a UTF-8 string.

Control (``0x03``, "not used in full streaming mode"), metadata (``0x04``), ping
(``0x06``), a client's handshake and unknown kinds are ignored, as ``protocol.md``
asks. Unlike Kyutai's server, which serves one conversation at a time behind a lock
and leaves later sockets waiting without a handshake, every session here is served at
once; a server that is full or draining sends an error message and closes (1013), which
a client can show.

PersonaPlex's persona comes as its web client sends it, ``?text_prompt=...&voice_prompt=
NATF2.pt``: as NVIDIA's server does, the WebSocket is accepted, the prompt runs, then the
handshake goes out (audio a client sends before it is read after it). A refused prompt is
an error message (``0x05``): before the close for an unknown voice (1008), an invalid
prompt (1007) or an engine failure (1011); after the handshake, the session going on,
for a model that takes no prompt.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from duplexserve import errors
from duplexserve.codecs.formats import MODEL_RATE, AudioFormat, FormatError
from duplexserve.codecs.pipeline import make_decoder, make_encoder
from duplexserve.errors import SessionError
from duplexserve.server.core import prompts
from duplexserve.server.core.adapter import ProtocolAdapter, invalid_audio
from duplexserve.server.core.events import AudioOut, ClosedOut, ErrorOut, Notice, Outgoing, TextOut

HANDSHAKE = b"\x00" + struct.pack("<II", 0, 0)
AUDIO, TEXT, ERROR = 0x01, 0x02, 0x05
_AUDIO_PREFIX, _TEXT_PREFIX, _ERROR_PREFIX = b"\x01", b"\x02", b"\x05"
OPUS = AudioFormat("opus", MODEL_RATE)

#: Query parameters Kyutai's web client (``buildURL``) and LiveKit's PersonaPlex plugin
#: send, with their types. They go to the engine as ``open(slot, params)``; an engine
#: applies those it knows (the synthetic engine none). Others (``worker_auth_id``,
#: ``email``, ``image_url``...) are ignored.
QUERY_PARAMS: dict[str, type] = {
    "text_temperature": float,
    "text_topk": int,
    "audio_temperature": float,
    "audio_topk": int,
    "pad_mult": float,
    "repetition_penalty": float,
    "repetition_penalty_context": int,
    "text_seed": int,
    "audio_seed": int,
    "seed": int,
    "text_prompt": str,
    "voice_prompt": str,
}
#: Closes the client did not cause, that deserve an error message before the close.
_QUIET_CLOSES = ("completed", "client_closed", "disconnected")


def engine_params(query: dict[str, str]) -> dict[str, Any]:
    """The typed parameters of the query; raises ValueError naming a malformed one."""
    params: dict[str, Any] = {}
    for name, kind in QUERY_PARAMS.items():
        raw = query.get(name)
        if raw is None:
            continue
        try:
            params[name] = kind(float(raw)) if kind is int and "." in raw else kind(raw)
        except ValueError:
            raise ValueError(f"query parameter {name} must be {kind.__name__}, got {raw[:32]!r}") from None
    return params


class MoshiConnection(ProtocolAdapter):
    protocol = "moshi"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Kyutai's web client carries its key as ``worker_auth_id`` (moshi-server: ``auth_id``).
        key = self.query.get("worker_auth_id") or self.query.get("auth_id")
        if key and "token" not in self.query:
            self.query["token"] = key
        self._fatal_sent = False

    async def send_error(self, code: str, message: str, fatal: bool) -> None:
        """Kind 0x05: Kyutai's clients log it; the close that follows a fatal one ends the UI."""
        await self.send_bytes(_ERROR_PREFIX + message.encode())

    async def handshake(self) -> bool:
        try:
            params = engine_params(self.query)
        except ValueError as exc:
            await self.refuse(errors.POLICY, "invalid_params", str(exc))
            return False
        if not await self.open_session(params):
            return False
        # Opus holds the GIL: with --codec-processes it runs in a codec worker process.
        self.decoder, self.encoder = (
            make_decoder(OPUS, self.codec_procs),
            make_encoder(OPUS, self.codec_procs),
        )
        await self.accept()
        prompt = prompts.prompt_of(params)
        refused = await self.run_prompt(prompt) if prompt else None
        if refused is not None and refused.fatal:
            assert self.session is not None and refused.close_code is not None
            self.orch.close(self.session, refused.code, refused.close_code)
            await self.send_error(refused.code, f"{refused.code}: {refused.message}", True)
            await self.close(refused.close_code)
            return False
        await self.send_bytes(HANDSHAKE)
        self.ready()
        if refused is not None:  # prompt_unsupported: the session goes on without it
            await self.send_error(refused.code, f"{refused.code}: {refused.message}", False)
        return True

    async def on_binary(self, data: bytes) -> None:
        if not data or data[0] != AUDIO:
            return  # handshake, control, metadata, ping and unknown kinds: ignored
        try:
            samples = await self.decode(data[1:])
        except FormatError as exc:  # the Ogg stream cannot recover: this session ends
            assert self.session is not None
            raise invalid_audio(self.session, exc) from None
        await self.feed(samples)

    def audio_payload(self, data: bytes) -> memoryview | None:
        """Opus for the codec worker, straight from the fast path (transports/websocket/fast.py)."""
        return memoryview(data)[1:] if data and data[0] == AUDIO else None

    def audio_to_encode(self, item: AudioOut) -> np.ndarray:
        return item.audio

    def send_encoded(self, item: AudioOut, data: bytes | memoryview) -> None:
        if data:
            self.transport.send_bytes_now(_AUDIO_PREFIX + data)

    async def on_text(self, text: str) -> None:
        """Kyutai's server logs and ignores text frames; say so, and go on."""
        assert self.session is not None
        self.session.error(SessionError("text_ignored", "text WebSocket messages are ignored: send binary"))

    async def render(self, item: Outgoing) -> None:
        cls = item.__class__
        if cls is AudioOut:
            pages = await self.encode(item.audio)
            if pages:
                await self.send_bytes(_AUDIO_PREFIX + pages)
        elif cls is TextOut:
            await self.send_bytes(_TEXT_PREFIX + item.text.encode())
        elif cls is ErrorOut:
            self._fatal_sent |= item.fatal
            await self.send_error(item.code, item.message, item.fatal)
        elif cls is ClosedOut:
            if item.reason not in _QUIET_CLOSES and not self._fatal_sent:
                await self.send_error(item.reason, f"session closed: {item.reason}", True)
        elif cls is Notice and isinstance(item.payload, bytes):
            await self.send_bytes(item.payload)
