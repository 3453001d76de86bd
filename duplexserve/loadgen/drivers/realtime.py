"""OpenAI Realtime at ``/v1/realtime``: base64 pcm16 in JSON both ways (G.711 out on request).

The driver configures the output format with ``session.update`` and waits for
``session.updated`` before audio. Each ``response.output_audio.delta`` is one output
frame. The server only sends frames inside a response (docs/protocols.md), so runs
through this driver need input without long pauses (the generated signal has none):
a pause of ``realtime_silence_ms`` ends the response and the silent frames after it are
not sent, which the guards count as missing. There is no end-of-input event either:
``end_input`` notes how many frames went out and the driver hangs up, reporting the
session ``completed``, once as many deltas came back. Keys go in the URL (``?token=``).
"""

from __future__ import annotations

import asyncio
import base64
import json

from duplexserve.codecs import FRAME_SAMPLES, AudioFormat
from duplexserve.loadgen.drivers.base import ClientDriver, Sink

#: Our output formats -> the GA format objects.
GA_OUTPUT = {
    ("pcm_s16le", 24000): {"type": "audio/pcm", "rate": 24000},
    ("g711_ulaw", 8000): {"type": "audio/pcmu"},
    ("g711_alaw", 8000): {"type": "audio/pcma"},
}
_FROM_GA = {
    "audio/pcm": ("pcm_s16le", 24000),
    "audio/pcmu": ("g711_ulaw", 8000),
    "audio/pcma": ("g711_alaw", 8000),
}
_APPEND_HEAD = '{"type":"input_audio_buffer.append","audio":"'


class RealtimeDriver(ClientDriver):
    name = "realtime"
    default_path = "/v1/realtime"
    input_formats = ("pcm_s16le",)

    def __init__(self, input_format: AudioFormat, output_format: AudioFormat, sink: Sink) -> None:
        if input_format.sample_rate != 24000:
            raise ValueError("the Realtime driver sends pcm16 at 24000 Hz")
        key = (output_format.format, output_format.sample_rate)
        if key not in GA_OUTPUT:
            raise ValueError("Realtime output is pcm_s16le at 24000 Hz or G.711 at 8000 Hz")
        super().__init__(input_format, output_format, sink)
        self._created: asyncio.Future[None] | None = None
        self._ready: asyncio.Future[None] | None = None
        self._session_id = ""
        self._bytes_sent = 0
        self._frames_received = 0
        self._target: int | None = None
        self._finished = False

    def query(self) -> str:
        return "model=duplexserve"

    def _created_future(self) -> asyncio.Future[None]:
        """Made on first use: session.created may come in the same read as the handshake."""
        if self._created is None:
            self._created = asyncio.get_running_loop().create_future()
        return self._created

    def _ready_future(self) -> asyncio.Future[None]:
        if self._ready is None:
            self._ready = asyncio.get_running_loop().create_future()
        return self._ready

    async def ready(self, timeout: float) -> None:
        await asyncio.wait_for(self._created_future(), timeout)
        assert self.ws is not None
        fmt = GA_OUTPUT[(self.output_format.format, self.output_format.sample_rate)]
        self.ws.send_text(
            json.dumps(
                {
                    "type": "session.update",
                    "session": {
                        "type": "realtime",
                        "audio": {
                            "input": {"format": {"type": "audio/pcm", "rate": 24000}},
                            "output": {"format": fmt},
                        },
                    },
                }
            )
        )
        await asyncio.wait_for(self._ready_future(), timeout)

    def send_audio(self, chunk: bytes | memoryview) -> None:
        assert self.ws is not None
        self._bytes_sent += len(chunk)
        self.ws.send_text(_APPEND_HEAD + base64.b64encode(chunk).decode("ascii") + '"}')

    def end_input(self) -> None:
        self._target = self._bytes_sent // (2 * FRAME_SAMPLES)
        self._maybe_finish()

    def on_text(self, text: str, now: float) -> None:
        sink = self.sink
        if text.startswith('{"type":"response.output_audio.delta"'):  # the server's fixed prefix
            start = text.index('"delta":"') + 9
            self._frames_received += 1
            sink.on_audio(base64.b64decode(text[start : text.index('"', start)]), now)
            self._maybe_finish()
            return
        try:
            event = json.loads(text)
            kind = event["type"]
        except (ValueError, KeyError, TypeError):
            sink.on_error("bad_event", f"unparsable server event {text[:80]!r}", False)
            return
        if kind == "response.output_audio.delta":  # another server's field order
            self._frames_received += 1
            sink.on_audio(base64.b64decode(event["delta"]), now)
            self._maybe_finish()
        elif kind == "response.output_audio_transcript.delta":
            sink.on_text(now)
        elif kind == "session.created":
            self._session_id = str(event["session"].get("id", ""))
            created = self._created_future()
            if not created.done():
                created.set_result(None)
        elif kind == "session.updated":
            ga = event["session"]["audio"]["output"]["format"]["type"]
            fmt, rate = _FROM_GA.get(ga, (ga, 0))
            sink.on_ready({"session_id": self._session_id, "output": {"format": fmt, "sample_rate": rate}})
            ready = self._ready_future()
            if not ready.done():
                ready.set_result(None)
        elif kind == "error":
            error = event.get("error") or {}
            sink.on_error(str(error.get("code")), str(error.get("message")), False)
            self._fail_open(f"server refused: {error.get('code')}: {error.get('message')}")

    def on_binary(self, data: bytes, now: float) -> None:
        self.sink.on_error(
            "unexpected_binary", f"a {len(data)}-byte binary message: Realtime is JSON only", False
        )

    def on_close(self, code: int | None, reason: str) -> None:
        self._fail_open(f"closed with {code} before session.updated")
        super().on_close(code, reason)

    def _maybe_finish(self) -> None:
        if self._finished or self._target is None or self._frames_received < self._target:
            return
        self._finished = True
        self.sink.on_closed("completed", {})
        self.close()

    def _fail_open(self, why: str) -> None:
        for future in (self._created_future(), self._ready_future()):
            if not future.done():
                future.set_exception(ConnectionError(why))
                future.exception()  # retrieved here; ready() raises it


DRIVER = RealtimeDriver
