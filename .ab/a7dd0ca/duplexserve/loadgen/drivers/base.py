"""The interface between the load generator and a wire protocol.

The runner owns timing, audio and guards and speaks to a session through a driver:
``open`` (connect and wait for the server's go-ahead: the session is ready, its prompt
run), ``send_audio`` (one message of audio already in the session's input format),
``end_input`` and ``close``. The driver
turns whatever the protocol puts on the wire back into calls on a :class:`Sink`: one
``on_audio`` per output frame, in arrival order, stamped with the arrival time.
"""

from __future__ import annotations

import asyncio
import json
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol
from urllib.parse import urlsplit, urlunsplit

from duplexserve.codecs import AudioFormat
from duplexserve.loadgen.wsclient import WSClient


class Sink(Protocol):
    def on_ready(self, info: dict[str, Any]) -> None:
        """The session is open; ``info`` holds what the server said about it."""

    def on_audio(self, data: bytes, now: float) -> None:
        """One output frame in the session's output format."""

    def on_text(self, now: float) -> None:
        """A text token (only counted)."""

    def on_error(self, code: str, message: str, fatal: bool) -> None: ...

    def on_closed(self, reason: str, info: dict[str, Any]) -> None:
        """The server ended the session (for example ``completed`` after input.end)."""

    def on_disconnect(self, code: int | None, reason: str) -> None:
        """The WebSocket is closed."""

    def on_resumed(self, info: dict[str, Any]) -> None:
        """A dropped connection was resumed (``--drop-every``); ``info`` is session.resumed."""


class ClientDriver(ABC):
    """One session of one protocol over one WebSocket."""

    #: Name given to ``--protocol``.
    name: ClassVar[str] = "?"
    #: Path appended to a URL that has none.
    default_path: ClassVar[str] = "/"
    #: Input formats the protocol can carry (None: any the server accepts).
    input_formats: ClassVar[tuple[str, ...] | None] = None
    #: Whether the driver sends a persona prompt (``text_prompt``, ``voice_prompt``).
    takes_prompt: ClassVar[bool] = False

    def __init__(self, input_format: AudioFormat, output_format: AudioFormat, sink: Sink) -> None:
        self.input_format = input_format
        self.output_format = output_format
        self.sink = sink
        self.ws: WSClient | None = None
        #: The session's prompt, set by the runner before ``open``: its non-empty fields.
        self.prompt: dict[str, str] = {}

    def url(self, base: str) -> str:
        """The URL to open: ``base`` with this protocol's path when it has none, and its query."""
        parts = urlsplit(base)
        path = parts.path if parts.path not in ("", "/") else self.default_path
        query = self.query()
        if parts.query:
            query = parts.query + ("&" + query if query else "")
        return urlunsplit((parts.scheme, parts.netloc, path, query, ""))

    def query(self) -> str:
        return ""

    @classmethod
    def configure(cls, spec: Any) -> type[ClientDriver]:
        """The driver class for a run of ``spec`` (a LoadSpec), with the options only some
        protocols have checked (ValueError) and set; this one takes none of them."""
        if spec.loss or spec.jitter_ms:
            raise ValueError(f"--loss and --jitter-ms emulate a network for WebRTC; {cls.name} runs over TCP")
        return cls

    def answers(self, expected: list[bytes]) -> list[bytes]:
        """The output frames owed for the message just sent, from the runner's prediction
        of the engine's output (a protocol whose audio is lossy on the wire maps it)."""
        return expected

    async def open(self, base_url: str, timeout: float = 30.0) -> None:
        """Connect; returns when the server is ready for audio (``on_ready`` was called)."""
        self.ws = await WSClient.connect(self.url(base_url), self, timeout)
        await self.ready(timeout)

    @abstractmethod
    async def ready(self, timeout: float) -> None:
        """After the WebSocket handshake: whatever the protocol needs before audio."""

    @abstractmethod
    def send_audio(self, chunk: bytes | memoryview) -> None:
        """Send one message of input audio, already in the input format."""

    @abstractmethod
    def end_input(self) -> None:
        """No more audio: ask the server to answer what it has, then close."""

    async def drain(self) -> None:
        if self.ws is not None:
            await self.ws.drain()

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()

    def abort(self) -> None:
        if self.ws is not None:
            self.ws.abort()

    # WebSocket handler: a protocol implements what its server sends.
    @abstractmethod
    def on_text(self, text: str, now: float) -> None: ...

    @abstractmethod
    def on_binary(self, data: bytes, now: float) -> None: ...

    def on_close(self, code: int | None, reason: str) -> None:
        self.sink.on_disconnect(code, reason)

    def parse_event(self, text: str) -> dict[str, Any] | None:
        """A JSON server event with a ``type``; anything else is reported and gives None."""
        try:
            event = json.loads(text)
            if isinstance(event, dict) and isinstance(event.get("type"), str):
                return event
        except ValueError:
            pass
        self.sink.on_error("bad_event", f"unparsable server event {text[:80]!r}", False)
        return None


class HangUpWhenAnswered(ClientDriver):
    """For protocols with no end-of-input message (Moshi, OpenAI Realtime, vLLM-Omni).

    ``end_input`` records how many frames went out; once as many answers came back the
    driver reports the session ``completed`` and hangs up itself. Futures that the
    handshake waits on are made on first use (the server's first event may arrive in
    the same read as the WebSocket handshake) and all fail together if the connection
    closes before they are set.
    """

    #: What the driver waits for before audio, named in the error when the socket closes.
    awaited: ClassVar[str] = "the server's go-ahead"
    #: The futures the handshake waits on, in order; all fail if the connection does.
    handshake: ClassVar[tuple[str, ...]] = ("ready",)

    def __init__(self, input_format: AudioFormat, output_format: AudioFormat, sink: Sink) -> None:
        super().__init__(input_format, output_format, sink)
        self._futures: dict[str, asyncio.Future[None]] = {}  # made on first use
        self._frames_received = 0
        self._target: int | None = None
        self._finished = False

    def _future(self, name: str) -> asyncio.Future[None]:
        future = self._futures.get(name)
        if future is None:
            future = self._futures[name] = asyncio.get_running_loop().create_future()
        return future

    def _resolve(self, name: str) -> None:
        future = self._future(name)
        if not future.done():
            future.set_result(None)

    def _answered(self, frame: bytes, now: float) -> None:
        """One output frame came back."""
        self._frames_received += 1
        self.sink.on_audio(frame, now)
        self._maybe_finish()

    def _expect(self, frames: int) -> None:
        """Input is over: ``frames`` answers are due."""
        self._target = frames
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        if self._finished or self._target is None or self._frames_received < self._target:
            return
        self._finished = True
        self.sink.on_closed("completed", {})
        self.hang_up()

    def hang_up(self) -> None:
        """End the session the way this protocol's clients do."""
        self.close()

    def _fail_open(self, why: str) -> None:
        for future in map(self._future, self.handshake):
            if not future.done():
                future.set_exception(ConnectionError(why))
                future.exception()  # retrieved: nobody may be waiting any more

    def on_close(self, code: int | None, reason: str) -> None:
        self._fail_open(f"closed with {code} before {self.awaited}")
        super().on_close(code, reason)
