"""Twilio Media Streams at ``/v1/twilio``: calls as Twilio places them, mu-law 8 kHz in JSON.

The driver plays Twilio's part: ``connected`` and ``start`` (with the key of the URL's
``?token=`` also as ``customParameters.token``, where Twilio carries it), then each
message of the runner's audio as 20 ms ``media`` messages (160 bytes of mu-law each,
with ``sequenceNumber``, ``chunk`` and ``timestamp``), sent back to back: an 80 ms
message is four media messages, the rate Twilio sends at, and the round trip is
measured from the last of them, as for the other drivers. Each ``media`` message the
server sends holds whole 80 ms frames; each is one output frame for the sink. Every
``mark`` is echoed at once (the driver plays nothing aloud), as Twilio echoes it once
the audio before it has played.

Twilio has no end-of-input message and the server's resampler holds back part of the
last frame: ``end_input`` sends two frames of mu-law silence (what a quiet line sends),
waits for the answer to every frame of the runner's audio, hands only those to the
sink, then sends ``stop`` and hangs up. Silence through soxr equals soxr's own flush,
so the answers match the runner's replay of the server byte for byte.
"""

from __future__ import annotations

import base64
import json
import secrets
from urllib.parse import parse_qsl, urlsplit

from duplexserve.codecs import AudioFormat
from duplexserve.loadgen.drivers.base import HangUpWhenAnswered, Sink

CHUNK = 160  # 20 ms of mu-law at 8 kHz
FRAME = 640  # 80 ms: one model frame
RATE = 8000
_SILENCE = b"\xff" * (2 * FRAME)  # mu-law 0xFF decodes to 0


class TwilioDriver(HangUpWhenAnswered):
    name = "twilio"
    default_path = "/v1/twilio"
    input_formats = ("g711_ulaw",)
    awaited = "the start"
    handshake = ()  # Twilio's server side says nothing before audio

    def __init__(self, input_format: AudioFormat, output_format: AudioFormat, sink: Sink) -> None:
        for side in (input_format, output_format):
            if (side.format, side.sample_rate) != ("g711_ulaw", 8000):
                raise ValueError("Twilio streams g711_ulaw at 8000 Hz both ways")
        super().__init__(input_format, output_format, sink)
        self.stream_sid = "MZ" + secrets.token_hex(16)
        self._sid = json.dumps(self.stream_sid)
        self._seq = 0
        self._chunk = 0
        self._bytes_sent = 0
        self._token = ""

    def url(self, base: str) -> str:
        self._token = dict(parse_qsl(urlsplit(base).query)).get("token", "")
        return super().url(base)

    def _stamp(self) -> str:
        self._seq += 1
        return f'"sequenceNumber":"{self._seq}","streamSid":{self._sid}'

    async def ready(self, timeout: float) -> None:
        assert self.ws is not None
        custom = {"token": self._token} if self._token else {}
        self.ws.send_text('{"event":"connected","protocol":"Call","version":"1.0.0"}')
        start = {
            "accountSid": "AC" + "0" * 32,
            "streamSid": self.stream_sid,
            "callSid": "CA" + secrets.token_hex(16),
            "tracks": ["inbound"],
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
            "customParameters": custom,
        }
        self.ws.send_text(f'{{"event":"start",{self._stamp()},"start":{json.dumps(start)}}}')
        output = {"format": "g711_ulaw", "sample_rate": RATE}
        self.sink.on_ready({"session_id": self.stream_sid, "output": output})

    def send_audio(self, chunk: bytes | memoryview) -> None:
        self._bytes_sent += len(chunk)
        self._send_media(bytes(chunk))

    def _send_media(self, data: bytes) -> None:
        """20 ms media messages, all in one socket write."""
        ws = self.ws
        assert ws is not None
        messages = []
        for i in range(0, len(data), CHUNK):
            payload = base64.b64encode(data[i : i + CHUNK]).decode("ascii")
            timestamp = 20 * self._chunk
            self._chunk += 1
            messages.append(
                f'{{"event":"media",{self._stamp()},"media":{{"track":"inbound","chunk":"{self._chunk}",'
                f'"timestamp":"{timestamp}","payload":"{payload}"}}}}'
            )
        ws.send_texts(messages)

    def end_input(self) -> None:
        self._send_media(_SILENCE)
        self._expect(-(-self._bytes_sent // FRAME))

    def hang_up(self) -> None:
        if self.ws is not None:
            self.ws.send_text(
                f'{{"event":"stop",{self._stamp()},"stop":{{"accountSid":"AC{"0" * 32}","callSid":"CA"}}}}'
            )
        self.close()

    def on_text(self, text: str, now: float) -> None:
        if text.startswith('{"event":"media"'):  # the server's fixed field order
            start = text.index('"payload":"') + 11
            self._frames(base64.b64decode(text[start : text.index('"', start)]), now)
            return
        try:
            event = json.loads(text)
        except ValueError:
            event = None
        if not isinstance(event, dict):
            self.sink.on_error("bad_event", f"unparsable server message {text[:80]!r}", False)
            return
        kind = event.get("event")
        if kind == "mark":
            if self.ws is not None and not self._finished:
                name = json.dumps(event["mark"]["name"])
                self.ws.send_text(f'{{"event":"mark",{self._stamp()},"mark":{{"name":{name}}}}}')
        elif kind == "media":  # another server's field order
            self._frames(base64.b64decode(event["media"]["payload"]), now)
        elif kind != "clear":
            self.sink.on_error("unexpected_event", f"Twilio has no {kind!r} message", False)

    def _frames(self, data: bytes, now: float) -> None:
        if len(data) % FRAME:
            self.sink.on_error("partial_frame", f"a media payload of {len(data)} bytes", False)
        for i in range(0, len(data), FRAME):
            if self._finished:
                return  # answers to the silence sent after the audio: not the runner's
            self._answered(data[i : i + FRAME], now)

    def on_binary(self, data: bytes, now: float) -> None:
        self.sink.on_error("unexpected_binary", f"a {len(data)}-byte binary message: Twilio is JSON", False)


DRIVER = TwilioDriver
