"""OpenAI Realtime at ``/v1/realtime``: base64 pcm16 in JSON both ways (G.711 out on request).

The driver configures the output format with ``session.update`` (and the prompt: the
text as ``instructions``, the voice as ``audio.output.voice``) and waits for
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
from typing import Any

from duplexserve.codecs import FRAME_SAMPLES, AudioFormat
from duplexserve.loadgen.drivers.base import HangUpWhenAnswered, Sink

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


class RealtimeDriver(HangUpWhenAnswered):
    name = "realtime"
    default_path = "/v1/realtime"
    input_formats = ("pcm_s16le",)
    awaited = "session.updated"
    handshake = ("created", "ready")
    takes_prompt = True

    def __init__(self, input_format: AudioFormat, output_format: AudioFormat, sink: Sink) -> None:
        if input_format.sample_rate != 24000:
            raise ValueError("the Realtime driver sends pcm16 at 24000 Hz")
        key = (output_format.format, output_format.sample_rate)
        if key not in GA_OUTPUT:
            raise ValueError("Realtime output is pcm_s16le at 24000 Hz or G.711 at 8000 Hz")
        super().__init__(input_format, output_format, sink)
        self._session_id = ""
        self._bytes_sent = 0

    async def ready(self, timeout: float) -> None:
        await asyncio.wait_for(self._future("created"), timeout)
        assert self.ws is not None
        fmt = GA_OUTPUT[(self.output_format.format, self.output_format.sample_rate)]
        output: dict[str, Any] = {"format": fmt}
        session: dict[str, Any] = {
            "type": "realtime",
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}}, "output": output},
        }
        if "voice_prompt" in self.prompt:
            output["voice"] = self.prompt["voice_prompt"]
        if "text_prompt" in self.prompt:
            session["instructions"] = self.prompt["text_prompt"]
        self.ws.send_text(json.dumps({"type": "session.update", "session": session}))
        await asyncio.wait_for(self._future("ready"), timeout)

    def send_audio(self, chunk: bytes | memoryview) -> None:
        assert self.ws is not None
        self._bytes_sent += len(chunk)
        self.ws.send_text(_APPEND_HEAD + base64.b64encode(chunk).decode("ascii") + '"}')

    def end_input(self) -> None:
        self._expect(self._bytes_sent // (2 * FRAME_SAMPLES))

    def on_text(self, text: str, now: float) -> None:
        sink = self.sink
        if text.startswith('{"type":"response.output_audio.delta"'):  # the server's fixed prefix
            start = text.index('"delta":"') + 9
            self._answered(base64.b64decode(text[start : text.index('"', start)]), now)
            return
        event = self.parse_event(text)
        if event is None:
            return
        kind = event["type"]
        if kind == "response.output_audio.delta":  # another server's field order
            self._answered(base64.b64decode(event["delta"]), now)
        elif kind == "response.output_audio_transcript.delta":
            sink.on_text(now)
        elif kind == "session.created":
            self._session_id = str(event["session"].get("id", ""))
            self._resolve("created")
        elif kind == "session.updated":
            ga = event["session"]["audio"]["output"]["format"]["type"]
            fmt, rate = _FROM_GA.get(ga, (ga, 0))
            sink.on_ready({"session_id": self._session_id, "output": {"format": fmt, "sample_rate": rate}})
            self._resolve("ready")
        elif kind == "error":
            error = event.get("error") or {}
            sink.on_error(str(error.get("code")), str(error.get("message")), False)
            self._fail_open(f"server refused: {error.get('code')}: {error.get('message')}")

    def on_binary(self, data: bytes, now: float) -> None:
        self.sink.on_error(
            "unexpected_binary", f"a {len(data)}-byte binary message: Realtime is JSON only", False
        )


DRIVER = RealtimeDriver
