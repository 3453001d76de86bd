"""duplex/1 with dropped connections: cut the TCP connection, resume, go on.

Used by ``--drop-every``. :meth:`ResumingNativeDriver.drop_and_resume` aborts the
transport (no close handshake, like a pulled cable), opens ``?resume=<token>&
last_frame=<k>`` with ``k`` the last output frame received, and sends again, from input
frame ``frames_in`` on, whatever the server did not get; audio the runner sends during
the gap waits and goes out after the resume. A ``session.moved`` (the server drained and its
session went to another replica, docs/protocol.md) is followed the same way: a resume at the
same URL with the token it gives, from the last output frame received. The sink sees one
unbroken stream: the
guards then check that every output frame came exactly once and in order across resumes.
Each connection's callbacks go through a :class:`_Leg`, so the dying connection's
close never reaches the sink.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from duplexserve.codecs.formats import SAMPLE_BYTES
from duplexserve.codecs.resample import frame_samples_total
from duplexserve.loadgen.drivers.native import _INPUT_END, NativeDriver
from duplexserve.loadgen.wsclient import WSClient


class _Leg:
    """Forwards one connection's events to the driver while it is the current one."""

    def __init__(self, driver: ResumingNativeDriver, number: int) -> None:
        self.driver, self.number = driver, number

    def on_text(self, text: str, now: float) -> None:
        if self.driver.leg == self.number:
            self.driver.on_text(text, now)

    def on_binary(self, data: bytes, now: float) -> None:
        if self.driver.leg == self.number:
            self.driver.frames_received += 1
            self.driver.sink.on_audio(data, now)

    def on_close(self, code: int | None, reason: str) -> None:
        if self.driver.leg == self.number:
            self.driver.on_close(code, reason)


class ResumingNativeDriver(NativeDriver):
    name = "native"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.leg = 0
        self.frames_received = 0
        self.resumes = 0
        self.moves = 0  # session.moved followed
        self._follow: asyncio.Task[None] | None = None
        self._base = ""
        self._token = ""
        self._log: list[tuple[int, bytes | memoryview]] = []  # (byte offset, message) sent
        self._sent_bytes = 0
        self._ended = False
        self._gap: asyncio.Future[None] | None = None  # set while a resume is under way
        self._cookie = ""  # what the connections were told to send back (Set-Cookie)
        self._resumed: asyncio.Future[dict[str, Any]] | None = None
        self._width = SAMPLE_BYTES[self.input_format.format]  # runner checks: not Opus

    async def open(self, base_url: str, timeout: float = 30.0) -> None:
        self._base = base_url
        self.ws = await WSClient.connect(self.url(base_url), _Leg(self, self.leg), timeout)
        await self.ready(timeout)

    @property
    def resuming(self) -> bool:
        return self._gap is not None

    @property
    def input_ended(self) -> bool:
        """After input.end the session completes and ends: it can no longer be resumed."""
        return self._ended

    # ------------------------------------------------------------------ sending
    def send_audio(self, chunk: bytes | memoryview) -> None:
        log = self._log
        log.append((self._sent_bytes, chunk))
        self._sent_bytes += len(chunk)
        if len(log) >= 64 and self._gap is None:
            # Output frame i came back, so input frame i arrived: nothing before it is resent.
            have = frame_samples_total(self.frames_received, self.input_format.sample_rate) * self._width
            self._log = [(s, c) for s, c in log if s + len(c) > have]
        if self._gap is None:
            super().send_audio(chunk)

    def end_input(self) -> None:
        self._ended = True
        if self._gap is None:
            super().end_input()

    async def drain(self) -> None:
        if self._gap is not None:
            await asyncio.shield(self._gap)
        else:
            await super().drain()

    # ------------------------------------------------------------------ events
    def on_text(self, text: str, now: float) -> None:
        event = json.loads(text) if '"session.' in text[:40] else None
        if event is not None and event.get("type") == "session.moved":
            self._token = str(event["resume"]["token"])
            if self._gap is None:  # the close 1012 that follows is the old leg's: not the call's end
                self._begin_gap()
                self.moves += 1
                self._follow = asyncio.ensure_future(self._reconnect(30.0))
            return
        if event is not None and event.get("type") in ("session.created", "session.resumed"):
            self._token = str((event.get("resume") or {}).get("token", ""))
            if event["type"] == "session.resumed":
                if self._resumed is not None and not self._resumed.done():
                    self._resumed.set_result(event)
                return
        super().on_text(text, now)

    def on_close(self, code: int | None, reason: str) -> None:
        if self._resumed is not None and not self._resumed.done():
            self._resumed.set_exception(ConnectionError(f"resume closed with {code}"))
            self._resumed.exception()
        super().on_close(code, reason)

    # ------------------------------------------------------------------ the cut
    async def drop_and_resume(self, timeout: float = 30.0) -> None:
        """Abort the connection, resume the session on a new one, send what it missed."""
        if self._gap is not None or self.ws is None or not self._token or self._ended:
            return
        self._begin_gap()
        self.ws.abort()
        await self._reconnect(timeout)

    def _begin_gap(self) -> None:
        self._gap = asyncio.get_running_loop().create_future()
        self.leg += 1  # from here on the old connection's events are ignored

    async def _reconnect(self, timeout: float) -> None:
        """Resume on a new connection with the current token, send what the server missed."""
        loop = asyncio.get_running_loop()
        assert self.ws is not None
        try:
            last = self.frames_received - 1
            self._resumed = loop.create_future()
            url = f"{self.url(self._base)}&resume={self._token}&last_frame={last}"
            # The cookies the first connection was given (a gateway's session persistence) go back.
            self._cookie = "; ".join(self.ws.cookies) or self._cookie
            self.ws = await WSClient.connect(url, _Leg(self, self.leg), timeout, self._cookie)
            event = await asyncio.wait_for(self._resumed, timeout)
            self.resumes += 1
            self.sink.on_resumed(event)  # type: ignore[attr-defined]
            offset = frame_samples_total(int(event["frames_in"]), self.input_format.sample_rate) * self._width
            ws = self.ws
            for start, chunk in self._log:
                end = start + len(chunk)
                if end > offset:
                    ws.send_binary(chunk[max(0, offset - start):])
            self._log = [(s, c) for s, c in self._log if s + len(c) > offset]
            if self._ended:
                ws.send_text(_INPUT_END)
        except Exception as exc:  # the session is lost: say so, like a broken connection
            self.sink.on_error("resume_failed", repr(exc), True)
            self.leg += 1
            if self.ws is not None:
                self.ws.abort()
            self.sink.on_disconnect(None, "resume failed")
        finally:
            gap, self._gap = self._gap, None
            if gap is not None:
                gap.set_result(None)
