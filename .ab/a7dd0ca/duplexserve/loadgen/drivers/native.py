"""The native ``duplex/1`` protocol: raw audio in binary messages, JSON events in text."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlencode

from duplexserve.loadgen.drivers.base import ClientDriver

_INPUT_END = json.dumps({"type": "input.end"})


class NativeDriver(ClientDriver):
    name = "native"
    default_path = "/v1/duplex"
    takes_prompt = True  # in the query: session.created comes once the prompt ran

    def query(self) -> str:
        i, o = self.input_format, self.output_format
        return urlencode({
            "input_format": i.format, "input_sample_rate": i.sample_rate,
            "output_format": o.format, "output_sample_rate": o.sample_rate, **self.prompt,
        })

    _created: asyncio.Future[None] | None = None

    def _created_future(self) -> asyncio.Future[None]:
        """Made on first use: session.created may come in the same read as the handshake."""
        if self._created is None:
            self._created = asyncio.get_running_loop().create_future()
        return self._created

    async def ready(self, timeout: float) -> None:
        await asyncio.wait_for(self._created_future(), timeout)

    def send_audio(self, chunk: bytes | memoryview) -> None:
        assert self.ws is not None
        self.ws.send_binary(chunk)

    def end_input(self) -> None:
        assert self.ws is not None
        self.ws.send_text(_INPUT_END)

    def on_binary(self, data: bytes, now: float) -> None:
        self.sink.on_audio(data, now)

    def on_text(self, text: str, now: float) -> None:
        sink = self.sink
        event = self.parse_event(text)
        if event is None:
            return
        kind = event["type"]
        if kind == "text.delta":
            sink.on_text(now)
        elif kind == "session.created":
            sink.on_ready(event)
            created = self._created_future()
            if not created.done():
                created.set_result(None)
        elif kind == "error":
            sink.on_error(str(event.get("code")), str(event.get("message")), bool(event.get("fatal")))
            self._fail_open(f"server refused: {event.get('code')}: {event.get('message')}")
        elif kind == "session.closed":
            sink.on_closed(str(event.get("reason")), event)

    def on_close(self, code: int | None, reason: str) -> None:
        self._fail_open(f"closed with {code} before session.created")
        super().on_close(code, reason)

    def _fail_open(self, why: str) -> None:
        created = self._created_future()
        if not created.done():
            created.set_exception(ConnectionError(why))
            created.exception()  # retrieved here; ready() raises it


DRIVER = NativeDriver
