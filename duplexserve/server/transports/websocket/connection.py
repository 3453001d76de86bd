"""The WebSocket transport: one WebSocket carrying one protocol adapter's session.

It only moves data: received messages go to the protocol adapter (core/adapter.py),
which feeds the session core; the session's outgoing items go, in order, to the adapter's
renderer. Two ways to move the data, the same adapters on both:

- the fast path (fast.py), where the server offers the ``duplexserve.fast_socket``
  extension (protocol.py, our uvicorn protocol): callbacks in, synchronous sends out;
- the ASGI path anywhere else (another server, ``--ws websockets-sansio``): a reader task
  and a writer task per session over ``receive`` and ``send`` (core/tasks.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from duplexserve import errors
from duplexserve.config import ServerConfig
from duplexserve.server import auth
from duplexserve.server.core.eager import run_eager
from duplexserve.server.core.session import Session, no_notify
from duplexserve.server.core.tasks import TaskDriver
from duplexserve.server.served_models import not_served
from duplexserve.server.transports.websocket.budgets import OVER_BUDGET, PARSE_EXTENSION
from duplexserve.server.transports.websocket.fast import FastPath
from duplexserve.server.transports.websocket.protocol import EXTENSION

if TYPE_CHECKING:
    from duplexserve.server.core.adapter import ProtocolAdapter

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class AsgiDriver(TaskDriver):
    """The ASGI path's reader reads ASGI messages; a disconnect whose reason names a budget
    (transports/websocket/budgets.py) is remembered for the session's close. A text message's
    handling up to its first wait is charged to the connection's parse budgets, as the fast
    path charges it (``charge``: the protocol's, through the scope; None: no budgets)."""

    def __init__(self, adapter: ProtocolAdapter, receive: Receive,
                 charge: Callable[[float], None] | None = None) -> None:  # fmt: skip
        super().__init__(adapter, None)  # type: ignore[arg-type]
        self._asgi_receive = receive
        self._charge = charge
        self.over_budget: str | None = None

    async def read_loop(self, session: Session) -> None:
        adapter, receive, loop = self.adapter, self._asgi_receive, self._loop
        assert adapter is not None
        while True:
            if session.input_paused and not session.closed:
                self._reader_wait = loop.create_future()
                await self._reader_wait
                self._reader_wait = None
            message = await receive()
            if message["type"] != "websocket.receive":  # websocket.disconnect
                reason = message.get("reason") or ""
                if reason.startswith(OVER_BUDGET):
                    self.over_budget = reason[len(OVER_BUDGET):]
                return
            data = message.get("bytes")
            if data is not None or self._charge is None:
                await adapter.receive(data if data is not None else message.get("text") or "")
                continue
            started = time.thread_time()
            lane = run_eager(adapter.receive(message.get("text") or ""))
            self._charge(time.thread_time() - started)  # over budget: the next receive says so
            if lane is not None:
                await lane


class WebSocketTransport(FastPath):
    """One accepted WebSocket (an ASGI ``websocket`` scope); ``run(adapter)`` serves it."""

    media = False

    def __init__(self, scope: Scope, receive: Receive, send: Send, config: ServerConfig) -> None:
        self.scope = scope
        self._receive = receive
        self._send = send
        self.config = config
        self.adapter: ProtocolAdapter | None = None
        self._loop = asyncio.get_running_loop()
        self._driver: AsgiDriver | None = None
        self._init_fast()

    async def run(self, adapter: ProtocolAdapter) -> None:
        self.adapter = adapter
        message = await self._receive()
        if message["type"] != "websocket.connect":
            return
        if not auth.origin_allowed(self.scope, auth.parse_list(self.config.allowed_origins)):
            await adapter.refuse(errors.POLICY, "origin_not_allowed", "this Origin may not connect")
            return
        if not adapter.deferred_auth and not auth.key_ok(
            self.scope, adapter.query, auth.parse_list(self.config.api_keys)
        ):
            await adapter.refuse(errors.POLICY, "unauthorized", "a valid API key is required")
            return
        refused = not_served(self.config, adapter.query.get("model"))
        if refused is not None:
            await adapter.refuse(errors.POLICY, errors.MODEL_NOT_FOUND, refused)
            return
        if not await adapter.open():
            return
        session = adapter.session
        assert session is not None
        sock = self.scope.get("extensions", {}).get(EXTENSION, {}).get("socket")
        try:
            if sock is None or self.config.offload_every_frame:
                charge = self.scope.get("extensions", {}).get(PARSE_EXTENSION, {}).get("charge")
                driver = self._driver = AsgiDriver(adapter, self._receive, charge)
                await driver.serve(session, lambda s: adapter.client_gone(s, driver.over_budget))
            else:
                await self._serve_fast(adapter, session, sock)
        finally:
            if self._abort_timer is not None:
                self._abort_timer.cancel()
            self._cancel_tasks()
            adapter.finish()
            self._release(session)

    def _release(self, session: Session) -> None:
        """Break the reference cycles between this connection, its socket, its adapter and
        its session (bound methods held as callbacks), so they are freed when the connection
        ends and not by the cyclic garbage collector, whose one pass over many ended
        sessions stops the loop (docs/architecture.md)."""
        if session.notify == self._wake_fast:  # not a resumed session's new one
            session.notify = no_notify
        if self._driver is not None:
            self._driver.release(session)
        if self._sock is not None:
            self._sock.release()
            self._sock = None
        self.__dict__.pop("send_bytes_now", None)
        self.__dict__.pop("send_text_now", None)
        self.adapter = None

    def _cancel_tasks(self) -> None:
        """Stop every task moving this connection's data: both paths' (none on a fast
        path that never had to wait)."""
        if self._driver is not None:
            self._driver.cancel()
        for task in (self._lane, self._writing):
            if task is not None:
                task.cancel()

    # ------------------------------------------------------- the Transport interface
    def replaced(self) -> None:
        self._cancel_tasks()
        self._stop("replaced")

    async def accept(self, subprotocol: str | None = None) -> None:
        message: dict[str, Any] = {"type": "websocket.accept"}
        if subprotocol:
            message["subprotocol"] = subprotocol
        await self._send(message)

    async def receive(self) -> bytes | str | None:
        message = await self._receive()
        if message["type"] != "websocket.receive":
            return None
        data = message.get("bytes")
        return data if data is not None else message.get("text") or ""

    async def send_bytes(self, data: bytes) -> None:
        sock = self._sock
        if sock is not None:
            sock.send_bytes(data)
        else:
            await self._send({"type": "websocket.send", "bytes": data})

    async def send_text(self, text: str) -> None:
        sock = self._sock
        if sock is not None:
            sock.send_text(text)
        else:
            await self._send({"type": "websocket.send", "text": text})

    async def close(self, code: int, reason: str = "") -> None:
        sock = self._sock
        if sock is not None:
            sock.close(code, reason)
        else:
            await self._send({"type": "websocket.close", "code": code, "reason": reason})

    def send_bytes_now(self, data: bytes | memoryview) -> None:  # the fast path binds the socket's
        raise RuntimeError("no synchronous send outside the fast path")

    def send_text_now(self, text: str) -> None:
        raise RuntimeError("no synchronous send outside the fast path")

    async def refuse(self, code: int, error: str, message: str) -> bool:
        """Behind a load balancer (``refuse_with_http_503``), "full or draining" is an HTTP
        503 to the upgrade itself: a proxy cannot see a close code, but it can retry a 503
        on another replica before the client ever sees it. Else the adapter says why."""
        if not (
            code == errors.TRY_AGAIN
            and self.config.refuse_with_http_503
            and "websocket.http.response" in self.scope.get("extensions", {})
        ):
            return False
        body = json.dumps({"type": "error", "code": error, "message": message, "fatal": True})
        await self._send({
            "type": "websocket.http.response.start",
            "status": 503,
            "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")],
        })
        await self._send({"type": "websocket.http.response.body", "body": body.encode()})
        return True

    def opened(self, outcome: tuple[int, str, str] | None) -> None:
        return None

    def send_audio(self, audio: np.ndarray) -> None:
        raise RuntimeError("a WebSocket carries audio in the protocol's messages")

    def audio_counts(self) -> dict[str, int]:
        return {}
