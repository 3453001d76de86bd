"""A lean callback WebSocket client: ``websockets``' sans-I/O protocol on an asyncio Protocol.

The load generator must cost far less per frame than the server it measures. The
asyncio client of ``websockets`` spends a future and a task switch per received
message; here received frames are handed to a handler straight from
``data_received``, stamped with the time the bytes arrived, and sends are plain
``transport.write`` calls. Client frames are masked with the library's C speedups.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol as TypingProtocol

from websockets.client import ClientProtocol
from websockets.exceptions import InvalidHandshake
from websockets.frames import Opcode
from websockets.http11 import Response
from websockets.protocol import State
from websockets.uri import parse_uri

monotonic = time.monotonic


class Handler(TypingProtocol):
    def on_text(self, text: str, now: float) -> None: ...

    def on_binary(self, data: bytes, now: float) -> None: ...

    def on_close(self, code: int | None, reason: str) -> None: ...


class WSClient(asyncio.Protocol):
    """One client connection. ``await opened`` before sending; ``closed`` resolves at the end."""

    def __init__(self, uri: str, handler: Handler, cookie: str = "") -> None:
        self.uri = parse_uri(uri)
        self.handler = handler
        self.cookie = cookie  # a Cookie header to send with the upgrade
        #: ``name=value`` of each Set-Cookie in the upgrade's answer (a gateway's session
        #: persistence names the replica there: a resume sends them back, docs/deploy-kubernetes.md).
        self.cookies: list[str] = []
        self.proto = ClientProtocol(self.uri, max_size=None)
        self.transport: asyncio.Transport | None = None
        loop = asyncio.get_running_loop()
        self.opened: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self._can_write: asyncio.Future[None] | None = None
        self._fragments: list[bytes] = []
        self._fragment_text = False
        self._close_reported = False

    @classmethod
    async def connect(cls, uri: str, handler: Handler, timeout: float = 30.0, cookie: str = "") -> WSClient:
        loop = asyncio.get_running_loop()
        client = cls(uri, handler, cookie)
        await asyncio.wait_for(
            loop.create_connection(lambda: client, client.uri.host, client.uri.port), timeout
        )
        await asyncio.wait_for(asyncio.shield(client.opened), timeout)
        return client

    # ------------------------------------------------------------------ sending
    def send_binary(self, data: bytes | memoryview) -> None:
        self.proto.send_binary(data)
        self._flush()

    def send_text(self, text: str) -> None:
        self.proto.send_text(text.encode())
        self._flush()

    def send_texts(self, texts: list[str]) -> None:
        """Several messages in one socket write (Twilio's four 20 ms media messages per frame)."""
        for text in texts:
            self.proto.send_text(text.encode())
        self._flush()

    async def drain(self) -> None:
        """Wait while the socket's write buffer is over its high-water mark."""
        if self._can_write is not None:
            await self._can_write

    def close(self, code: int = 1000) -> None:
        if self.proto.state is State.OPEN:
            self.proto.send_close(code)
            self._flush()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def _flush(self) -> None:
        transport = self.transport
        if transport is None:
            return
        for chunk in self.proto.data_to_send():
            if chunk:
                transport.write(chunk)
            else:
                transport.write_eof() if transport.can_write_eof() else transport.close()

    # ------------------------------------------------------- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not an asyncio.Transport
        request = self.proto.connect()
        if self.cookie:
            request.headers["Cookie"] = self.cookie
        self.proto.send_request(request)
        self._flush()

    def data_received(self, data: bytes) -> None:
        now = monotonic()
        self.proto.receive_data(data)
        handler = self.handler
        for event in self.proto.events_received():
            if event.__class__ is Response:
                self.cookies = [c.split(";", 1)[0].strip() for c in event.headers.get_all("Set-Cookie")]
                if self.proto.handshake_exc is not None:
                    _fail(self.opened, self.proto.handshake_exc)
                elif not self.opened.done():
                    self.opened.set_result(None)
                continue
            opcode = event.opcode
            if opcode is Opcode.BINARY or opcode is Opcode.TEXT:
                if not event.fin:
                    self._fragments = [event.data]
                    self._fragment_text = opcode is Opcode.TEXT
                    continue
                if opcode is Opcode.BINARY:
                    handler.on_binary(event.data, now)
                else:
                    handler.on_text(event.data.decode(), now)
            elif opcode is Opcode.CONT:
                self._fragments.append(event.data)
                if event.fin:
                    data_all = b"".join(self._fragments)
                    self._fragments = []
                    if self._fragment_text:
                        handler.on_text(data_all.decode(), now)
                    else:
                        handler.on_binary(data_all, now)
            elif opcode is Opcode.CLOSE:
                self._report_close()
        self._flush()

    def eof_received(self) -> bool | None:
        self.proto.receive_eof()
        self._flush()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        _fail(self.opened, exc or InvalidHandshake("connection closed during the handshake"))
        self._report_close()
        if self._can_write is not None and not self._can_write.done():
            self._can_write.set_result(None)
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        if self._can_write is None or self._can_write.done():
            self._can_write = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._can_write is not None and not self._can_write.done():
            self._can_write.set_result(None)
        self._can_write = None

    def _report_close(self) -> None:
        if self._close_reported:
            return
        self._close_reported = True
        rcvd = self.proto.close_rcvd
        if rcvd is None:
            self.handler.on_close(None, "")
        else:
            self.handler.on_close(rcvd.code, rcvd.reason)


def _fail(fut: asyncio.Future[None], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
        fut.exception()  # retrieved: a later failure is reported by whoever awaits
