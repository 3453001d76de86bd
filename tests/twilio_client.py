"""A stand-in for Twilio's side of a bidirectional Media Stream, for tests.

Written from Twilio's public "Media Streams - WebSocket Messages" page, not from the
server's adapter: ``connected`` first, then ``start`` (``streamSid``, ``start.callSid``,
``start.tracks``, ``start.mediaFormat``, ``start.customParameters``), then ``media``
every 20 ms (160 bytes of base64 mu-law at 8 kHz, ``track``, ``chunk``, ``timestamp``),
and ``stop``; every message but ``connected`` carries ``sequenceNumber`` and
``streamSid``, and the counters are strings, as Twilio sends them. Like Twilio, it
plays the ``media`` the application sends back in order and answers each ``mark`` the
application sends once the audio queued before it has played (here: at once, nothing
is played aloud), and drops its queue on ``clear``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

import websockets.asyncio.client

CHUNK = 160  # 20 ms of mu-law at 8 kHz
MULAW_8K = {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}


@dataclass
class Received:
    """Everything the application sent, in order."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    audio: bytearray = field(default_factory=bytearray)
    marks: list[str] = field(default_factory=list)
    clears: int = 0
    close_code: int | None = None

    def events(self) -> list[str]:
        return [m["event"] for m in self.messages]


class FakeTwilio:
    """One call: ``await call.open()``, ``send_audio``, ``stop``, ``close``."""

    def __init__(self, url: str, custom: dict[str, str] | None = None, echo_marks: bool = True) -> None:
        self.url = url
        self.custom = custom or {}
        self.echo_marks = echo_marks
        self.stream_sid = "MZ" + secrets.token_hex(16)
        self.call_sid = "CA" + secrets.token_hex(16)
        self.account_sid = "AC" + secrets.token_hex(16)
        self.received = Received()
        self._seq = itertools.count(1)
        self._chunk = itertools.count(1)
        self._timestamp_ms = 0
        self._ws: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._changed = asyncio.Event()  # set on every message from the application

    # ------------------------------------------------------------ Twilio -> app
    async def open(self, start: bool = True) -> None:
        self._ws = await websockets.asyncio.client.connect(self.url, compression=None, max_size=None)
        self._reader = asyncio.create_task(self._read())
        await self.send({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        if start:
            await self.send_start()

    async def send_start(self, media_format: dict[str, Any] | None = None) -> None:
        await self.send(self.stamped({
            "event": "start",
            "start": {
                "accountSid": self.account_sid,
                "streamSid": self.stream_sid,
                "callSid": self.call_sid,
                "tracks": ["inbound"],
                "mediaFormat": media_format or MULAW_8K,
                "customParameters": self.custom,
            },
        }))

    def stamped(self, message: dict[str, Any]) -> dict[str, Any]:
        message["sequenceNumber"] = str(next(self._seq))
        message["streamSid"] = self.stream_sid
        return message

    def media(self, payload: str) -> dict[str, Any]:
        """One media message, with the chunk count and the timestamp (ms since the start)."""
        message = self.stamped({
            "event": "media",
            "media": {
                "track": "inbound",
                "chunk": str(next(self._chunk)),
                "timestamp": str(self._timestamp_ms),
                "payload": payload,
            },
        })
        self._timestamp_ms += 20
        return message

    async def send_audio(self, mulaw: bytes, pace_s: float = 0.0) -> None:
        """The caller's audio as 20 ms media messages (every ``pace_s`` seconds)."""
        for i in range(0, len(mulaw), CHUNK):
            await self.send(self.media(base64.b64encode(mulaw[i : i + CHUNK]).decode()))
            if pace_s:
                await asyncio.sleep(pace_s)

    async def send_dtmf(self, digit: str) -> None:
        await self.send(self.stamped({"event": "dtmf", "dtmf": {"track": "inbound_track", "digit": digit}}))

    async def stop(self) -> None:
        await self.send(self.stamped({
            "event": "stop",
            "stop": {"accountSid": self.account_sid, "callSid": self.call_sid},
        }))

    async def send(self, message: dict[str, Any] | str | bytes) -> None:
        await self._ws.send(json.dumps(message) if isinstance(message, dict) else message)

    # ------------------------------------------------------------ app -> Twilio
    async def _read(self) -> None:
        received = self.received
        with contextlib.suppress(websockets.ConnectionClosed):
            async for raw in self._ws:
                message = json.loads(raw)
                received.messages.append(message)
                self._changed.set()
                kind = message["event"]
                if kind == "media":
                    received.audio += base64.b64decode(message["media"]["payload"], validate=True)
                elif kind == "mark":
                    name = message["mark"]["name"]
                    received.marks.append(name)
                    if self.echo_marks:  # the audio before it has "played": answer it
                        await self.send(self.stamped({"event": "mark", "mark": {"name": name}}))
                elif kind == "clear":
                    received.clears += 1

    async def wait_audio(self, count: int, timeout: float = 30.0) -> None:
        """Until at least ``count`` bytes of audio came back, and the mark after the last of it."""
        def done() -> bool:
            received = self.received
            return len(received.audio) >= count and received.events()[-1] != "media"

        async def wait() -> None:
            while not done():
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(wait(), timeout)

    async def wait_closed(self, timeout: float = 30.0) -> Received:
        assert self._reader is not None
        await asyncio.wait_for(self._reader, timeout)
        self.received.close_code = self._ws.close_code
        return self.received

    async def close(self) -> Received:
        await self._ws.close()
        return await self.wait_closed()
