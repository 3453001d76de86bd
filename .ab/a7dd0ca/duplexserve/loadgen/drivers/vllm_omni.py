"""vLLM-Omni's own duplex frontend at ``/v1/realtime?duplex=1`` (0.30), as its PersonaPlex client speaks it.

The first message is ``session.update`` with PersonaPlex's preset (``pcm_f32le`` at
24 kHz in, ``pcm16`` at 24 kHz out, ``extra_body.auto_response``); ``session.created``
is the go-ahead. Each message of audio is one ``input_audio_buffer.append`` carrying
base64 ``pcm_f32le`` with its format, rate and timing, as ``vllm_omni.clients.duplex``
sends it. Each ``response.output_audio.delta`` is decoded and cut into 80 ms frames of
``pcm_s16le`` (the output format of runs through this driver). vLLM-Omni has no
end-of-input event: ``end_input`` notes how many frames went out and the driver sends
``session.close`` and reports the session ``completed`` once as many came back.
"""

from __future__ import annotations

import asyncio
import base64
import json

from duplexserve.codecs import FRAME_SAMPLES, AudioFormat
from duplexserve.loadgen.drivers.base import HangUpWhenAnswered, Sink

_FRAME_BYTES = 2 * FRAME_SAMPLES  # one output frame of pcm16
_DELTA = '"type":"response.output_audio.delta"'
_CLOSE = json.dumps({"type": "session.close"})


def session_update(model: str = "duplexserve/standin-echo") -> str:
    """PersonaPlex's preset (``vllm_omni.clients.personaplex``), as ``SessionConfig.to_session_payload``."""
    return json.dumps(
        {
            "type": "session.update",
            "session": {
                "model": model,
                "modalities": ["audio", "text"],
                "input_audio_format": "pcm_f32le",
                "output_audio_format": "pcm16",
                "sample_rate_hz": 24000,
                "audio": {"input": {"sample_rate_hz": 24000}, "output": {"sample_rate_hz": 24000}},
                "turn_detection": None,
                "extra_body": {"auto_response": True},
            },
        }
    )


class VllmOmniDriver(HangUpWhenAnswered):
    name = "vllm_omni"
    default_path = "/v1/realtime"
    input_formats = ("pcm_f32le",)
    awaited = "session.created"
    handshake = ("created",)

    def __init__(self, input_format: AudioFormat, output_format: AudioFormat, sink: Sink) -> None:
        if (input_format.format, input_format.sample_rate) != ("pcm_f32le", 24000):
            raise ValueError("the vLLM-Omni driver sends pcm_f32le at 24000 Hz (PersonaPlex's preset)")
        if (output_format.format, output_format.sample_rate) != ("pcm_s16le", 24000):
            raise ValueError("vLLM-Omni answers pcm16 at 24000 Hz: use --output-format pcm_s16le")
        super().__init__(input_format, output_format, sink)
        self._bytes_sent = 0
        self._audio_end_ms = 0
        self._pending = b""

    def query(self) -> str:
        return "duplex=1"

    async def ready(self, timeout: float) -> None:
        assert self.ws is not None
        self.ws.send_text(session_update())
        await asyncio.wait_for(self._future("created"), timeout)

    def send_audio(self, chunk: bytes | memoryview) -> None:
        assert self.ws is not None
        self._bytes_sent += len(chunk)
        duration_ms = len(chunk) // 4 * 1000 // 24000
        self._audio_end_ms += duration_ms
        self.ws.send_text(
            '{"type":"input_audio_buffer.append","audio":"'
            + base64.b64encode(chunk).decode("ascii")
            + f'","format":"pcm_f32le","sample_rate_hz":24000,"duration_ms":{duration_ms},'
            f'"audio_end_ms":{self._audio_end_ms}}}'
        )

    def end_input(self) -> None:
        self._expect(self._bytes_sent // (4 * FRAME_SAMPLES))

    def on_text(self, text: str, now: float) -> None:
        sink = self.sink
        event = self.parse_event(text)
        if event is None:
            return
        kind = event["type"]
        if kind == "response.output_audio.delta":
            data = self._pending + base64.b64decode(event["delta"])
            whole = len(data) // _FRAME_BYTES * _FRAME_BYTES
            self._pending = data[whole:]
            for i in range(0, whole, _FRAME_BYTES):
                self._answered(data[i : i + _FRAME_BYTES], now)
        elif kind in ("response.output_audio_transcript.delta", "response.output_text.delta"):
            if event.get("delta"):
                sink.on_text(now)
        elif kind == "session.created":
            session = event.get("session") or {}
            sink.on_ready(
                {
                    "session_id": str(session.get("id", "")),
                    "output": {"format": "pcm_s16le", "sample_rate": 24000},
                }
            )
            self._resolve("created")
        elif kind == "error":
            error = event.get("error") or {}
            sink.on_error(str(error.get("code")), str(error.get("message")), False)
            self._fail_open(f"server refused: {error.get('code')}: {error.get('message')}")
        elif kind in ("session.closed", "session.expired") and not self._finished:
            sink.on_closed(str(event.get("reason") or kind), {})

    def on_binary(self, data: bytes, now: float) -> None:
        self.sink.on_error(
            "unexpected_binary", f"a {len(data)}-byte binary message: vLLM-Omni is JSON only", False
        )

    def hang_up(self) -> None:
        assert self.ws is not None
        self.ws.send_text(_CLOSE)  # vLLM-Omni's clients say goodbye before closing
        self.close()


DRIVER = VllmOmniDriver
