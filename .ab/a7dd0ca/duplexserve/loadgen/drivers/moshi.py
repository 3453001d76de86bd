"""Kyutai's Moshi protocol at ``/api/chat``: kind-prefixed binary messages, Ogg/Opus both ways.

It has no end-of-input message (a Moshi client just hangs up), so ``end_input`` notes
how many frames went out and the driver hangs up itself, reporting the session
``completed``, once as many audio messages came back: the server sends one per frame.
Frames sent are read from the Ogg pages' granule positions (48 kHz units), so the
driver needs no help from the runner to count them.
"""

from __future__ import annotations

import asyncio
import struct
from urllib.parse import urlencode

from duplexserve.codecs import AudioFormat
from duplexserve.loadgen.drivers.base import HangUpWhenAnswered, Sink

_GRANULES_PER_FRAME = 3840  # 80 ms at 48 kHz, Opus's granule clock
_AUDIO = b"\x01"


def last_granule(pages: bytes | memoryview) -> int:
    """Granule position of the last Ogg page in ``pages`` (-1 when none is complete)."""
    data = memoryview(pages)
    granule, i = -1, 0
    while i + 27 <= len(data) and data[i : i + 4] == b"OggS":
        segments = data[i + 27 : i + 27 + data[i + 26]]
        granule = struct.unpack_from("<q", data, i + 6)[0]
        i += 27 + len(segments) + sum(segments)
    return granule


class MoshiDriver(HangUpWhenAnswered):
    name = "moshi"
    default_path = "/api/chat"
    input_formats = ("opus",)
    awaited = "the handshake"
    takes_prompt = True  # PersonaPlex's query fields: the handshake comes once the prompt ran

    def __init__(self, input_format: AudioFormat, output_format: AudioFormat, sink: Sink) -> None:
        if output_format.format != "opus":
            raise ValueError("the Moshi protocol answers in Ogg/Opus: use output format opus")
        super().__init__(input_format, output_format, sink)
        self._frames_sent = 0

    def query(self) -> str:
        return urlencode(self.prompt)

    async def ready(self, timeout: float) -> None:
        await asyncio.wait_for(self._future("ready"), timeout)

    def send_audio(self, chunk: bytes | memoryview) -> None:
        assert self.ws is not None
        granule = last_granule(chunk)
        if granule > 0:
            self._frames_sent = granule // _GRANULES_PER_FRAME
        self.ws.send_binary(_AUDIO + bytes(chunk))

    def end_input(self) -> None:
        self._expect(self._frames_sent)

    def on_binary(self, data: bytes, now: float) -> None:
        if not data:
            return
        kind, sink = data[0], self.sink
        if kind == 1:
            self._answered(data[1:], now)
        elif kind == 2:
            sink.on_text(now)
        elif kind == 0:
            sink.on_ready({"session_id": "", "output": {"format": "opus", "sample_rate": 24000}})
            self._resolve("ready")
        elif kind == 5:
            message = data[1:].decode(errors="replace")
            sink.on_error("moshi_error", message, True)
            self._fail_open(f"server refused: {message}")

    def on_text(self, text: str, now: float) -> None:
        self.sink.on_error(
            "unexpected_text", f"the Moshi protocol has no text messages: {text[:80]!r}", False
        )


DRIVER = MoshiDriver
