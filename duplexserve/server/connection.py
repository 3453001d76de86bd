"""The asyncio layer shared by every protocol: one ASGI WebSocket, one session.

It only moves data: a reader feeds received messages to the protocol adapter, which
feeds the session core; a writer takes the session's outgoing items in order and
sends what the adapter renders. The reader stops reading while the session's input
is paused, so a client that sends faster than the engine answers is held back by TCP
instead of by memory. Transcoding that is not ``inline`` runs on the codec thread pool,
or, for a ``remote`` codec (Opus), in a codec worker process (docs/codecs.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from typing import Any
from urllib.parse import parse_qsl

import numpy as np

from duplexserve import errors
from duplexserve.codecs.pipeline import Decoder, Encoder
from duplexserve.codecs.procpool import CodecProcesses
from duplexserve.config import ServerConfig
from duplexserve.errors import SessionError
from duplexserve.server import auth
from duplexserve.server.events import AudioOut, ClosedOut, Outgoing
from duplexserve.server.orchestrator import Orchestrator
from duplexserve.server.session import Session
from duplexserve.server.turnaround import FLUSH_FRAMES

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

#: How long a closed session's connection may take to finish its close handshake.
CLOSE_GRACE_S = 10.0


class Connection(ABC):
    """Subclasses implement one wire protocol on top of the session core."""

    protocol = "?"
    #: True: the adapter checks the API key in ``handshake`` itself, because the key comes in
    #: a message after the WebSocket is accepted (Twilio: the ``start`` event).
    deferred_auth = False

    def __init__(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        orchestrator: Orchestrator,
        config: ServerConfig,
        codec_pool: Executor | None = None,
        codec_procs: CodecProcesses | None = None,
    ) -> None:
        self.scope = scope
        self._receive = receive
        self._send = send
        self.orch = orchestrator
        self.config = config
        self.codec_pool = codec_pool
        #: Inline codecs may run straight in the reader (not under --offload-every-frame).
        self.inline_ok = not config.offload_every_frame
        self.codec_procs = codec_procs  # hosts Opus codecs: pass to make_decoder / make_encoder
        self.query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        self.session: Session | None = None
        self.decoder: Decoder | None = None
        self.encoder: Encoder | None = None
        self._loop = asyncio.get_running_loop()
        self._writer_wait: asyncio.Future[None] | None = None
        self._reader_wait: asyncio.Future[None] | None = None
        self._tasks: tuple[asyncio.Task[None], ...] = ()
        self._abort_timer: asyncio.TimerHandle | None = None
        #: A resume took the session over while this connection still held it (half-open).
        self.replaced = False

    # ------------------------------------------------------------- adapter hooks
    @abstractmethod
    async def handshake(self) -> bool:
        """Accept (or refuse) the connection and open the session; False: refused."""

    @abstractmethod
    async def on_binary(self, data: bytes) -> None: ...

    @abstractmethod
    async def on_text(self, text: str) -> None: ...

    @abstractmethod
    async def render(self, item: Outgoing) -> None:
        """Send one outgoing item in this protocol's wire form."""

    # ----------------------------------------------------------------- plumbing
    async def run(self) -> None:
        message = await self._receive()
        if message["type"] != "websocket.connect":
            return
        if not auth.origin_ok(self.scope, auth.parse_list(self.config.allowed_origins)):
            await self.refuse(errors.POLICY, "origin_not_allowed", "this Origin may not connect")
            return
        if not self.deferred_auth and not auth.key_ok(
            self.scope, self.query, auth.parse_list(self.config.api_keys)
        ):
            await self.refuse(errors.POLICY, "unauthorized", "a valid API key is required")
            return
        if not await self.handshake():
            return
        session = self.session
        assert session is not None
        session.notify = self._wake
        reader = asyncio.create_task(self._guarded_read_loop(session))
        writer = asyncio.create_task(self._write_loop(session))
        self._tasks = (reader, writer)
        try:
            done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
            if self.replaced:
                await self._say_replaced()
            elif reader in done:  # the client went away: nobody is left to write to
                if not session.closed and self.lost(session):
                    return  # detached: the writer goes, the session stays for a resume
                await asyncio.wait((writer,), timeout=1.0)
            elif not session.closed and self.lost(session):  # the socket broke under the writer
                return
            else:  # the close was sent (or the socket broke): wait for the client's reply
                await asyncio.wait((reader,), timeout=CLOSE_GRACE_S)
        finally:
            if self._abort_timer is not None:
                self._abort_timer.cancel()
            for task in self._tasks:
                task.cancel()
            if not self.replaced:
                if not session.closed and not session.detached:
                    self.orch.close(session, "disconnected", errors.GOING_AWAY)
                self.orch.pump(session)
            if session.timer is not None:
                session.timer.flush()

    def lost(self, session: Session) -> bool:
        """The connection ended under an open session; True: it was detached for a resume.

        Protocols without resume close it (``disconnected``)."""
        self.orch.close(session, "disconnected", errors.GOING_AWAY)
        return False

    def take_over(self) -> None:
        """A resume took this connection's session: stop moving its data at once."""
        self.replaced = True
        for task in self._tasks:
            task.cancel()

    async def _say_replaced(self) -> None:
        """Tell a half-open connection it lost its session; never wait long on it."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.send_replaced(), 1.0)

    async def send_replaced(self) -> None:
        """The protocol's goodbye to a connection whose session moved to a new one."""
        await self.close(errors.NORMAL, "replaced")

    async def _guarded_read_loop(self, session: Session) -> None:
        try:
            await self._read_loop(session)
        except Exception:  # a bug costs this session only, and says nothing internal
            log.exception("session %s failed", session.id)
            self.orch.close(session, "internal_error", errors.INTERNAL)

    def _abort(self) -> None:
        """A closed session whose client neither reads nor goes away: stop waiting for it."""
        for task in self._tasks:
            task.cancel()

    async def open_session(self, params: dict[str, Any] | None = None) -> bool:
        """Take a slot for this connection, or refuse it in the protocol's own form."""
        client = self.scope.get("client")
        address = client[0] if client else None
        session = self.orch.open_session(params, address)
        if session is None:
            refusal = self.orch.refusal(address)
            code, error, message = refusal or (errors.TRY_AGAIN, "server_unavailable", "try again later")
            await self.refuse(code, error, message)
            return False
        self.session = session
        return True

    async def accept(self, subprotocol: str | None = None) -> None:
        message: dict[str, Any] = {"type": "websocket.accept"}
        if subprotocol:
            message["subprotocol"] = subprotocol
        await self._send(message)

    async def send_bytes(self, data: bytes) -> None:
        await self._send({"type": "websocket.send", "bytes": data})

    async def send_json(self, payload: Any) -> None:
        await self._send({"type": "websocket.send", "text": json.dumps(payload)})

    async def close(self, code: int, reason: str = "") -> None:
        await self._send({"type": "websocket.close", "code": code, "reason": reason})

    async def refuse(self, code: int, error: str, message: str) -> None:
        """Accept only to say why not, then close: a client can show the reason.

        Behind a load balancer (``refuse_with_http_503``), "full or draining" is instead an
        HTTP 503 to the upgrade itself: a proxy cannot see a close code, but it can retry a
        503 on another replica before the client ever sees it.
        """
        if (
            code == errors.TRY_AGAIN
            and self.config.refuse_with_http_503
            and "websocket.http.response" in self.scope.get("extensions", {})
        ):
            body = json.dumps({"type": "error", "code": error, "message": message, "fatal": True})
            await self._send({
                "type": "websocket.http.response.start",
                "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")],
            })
            await self._send({"type": "websocket.http.response.body", "body": body.encode()})
            return
        await self.accept()
        await self.send_error(error, message, fatal=True)
        await self.close(code)

    async def send_error(self, code: str, message: str, fatal: bool) -> None:
        await self.send_json({"type": "error", "code": code, "message": message, "fatal": fatal})

    async def decode(self, data: bytes) -> np.ndarray:
        decoder = self.decoder
        assert decoder is not None
        if self.config.offload_every_frame:  # the path measured against, never the default
            self.orch.bridge.counts.executor_submissions += 1
            return await self._loop.run_in_executor(None, decoder.decode, data)
        if decoder.inline:
            return decoder.decode(data)
        self.orch.bridge.counts.executor_submissions += 1
        if getattr(decoder, "remote", False):  # state in a codec process (codecs/procpool.py)
            return await decoder.decode_async(data)  # type: ignore[attr-defined]
        return await self._loop.run_in_executor(self.codec_pool, decoder.decode, data)

    async def encode(self, frame: np.ndarray) -> bytes:
        encoder = self.encoder
        assert encoder is not None
        if encoder.inline:
            return encoder.encode(frame)
        self.orch.bridge.counts.executor_submissions += 1
        if getattr(encoder, "remote", False):
            return await encoder.encode_async(frame)  # type: ignore[attr-defined]
        return await self._loop.run_in_executor(self.codec_pool, encoder.encode, frame)

    async def feed(self, samples: np.ndarray) -> None:
        """Decoded model-rate samples into the session, and its ready frames onward."""
        session = self.session
        assert session is not None
        session.receive_audio(samples)
        if self.config.offload_every_frame:
            bridge = self.orch.bridge
            for frame in session.frames_ready():
                await bridge.submit_offloaded((session.slot, session.generation, frame))

    def _wake(self) -> None:
        session = self.session
        assert session is not None
        if session.closed and self._abort_timer is None:
            self._abort_timer = self._loop.call_later(CLOSE_GRACE_S, self._abort)
        waiter = self._writer_wait
        if waiter is not None and not waiter.done() and session.has_outgoing:
            waiter.set_result(None)
        waiter = self._reader_wait
        if waiter is not None and not waiter.done() and not session.input_paused:
            waiter.set_result(None)

    async def _read_loop(self, session: Session) -> None:
        receive, orch, loop = self._receive, self.orch, self._loop
        max_bytes = self.config.max_message_bytes
        while True:
            if session.input_paused and not session.closed:
                self._reader_wait = loop.create_future()
                await self._reader_wait
                self._reader_wait = None
            message = await receive()
            if message["type"] != "websocket.receive":
                return  # websocket.disconnect
            session.last_activity = loop.time()
            data = message.get("bytes")
            try:
                if data is not None:
                    if len(data) > max_bytes:
                        raise SessionError(
                            "message_too_big",
                            f"message of {len(data)} bytes is over the limit of {max_bytes}",
                            errors.TOO_BIG,
                        )
                    await self.on_binary(data)
                else:
                    text = message.get("text") or ""
                    if len(text) > max_bytes:
                        raise SessionError(
                            "message_too_big",
                            f"message of {len(text)} bytes is over the limit of {max_bytes}",
                            errors.TOO_BIG,
                        )
                    await self.on_text(text)
            except SessionError as exc:
                session.error(exc)
            orch.pump(session)
            if session.has_outgoing:
                self._wake()

    async def _write_loop(self, session: Session) -> None:
        loop, timer = self._loop, session.timer
        sent_times = timer.sent_times if timer is not None else []
        try:
            while True:
                item = session.pop_outgoing()
                if item is None:
                    self._writer_wait = loop.create_future()
                    await self._writer_wait
                    self._writer_wait = None
                    continue
                await self.render(item)
                if item.__class__ is AudioOut and timer is not None:  # in order: index implied
                    sent_times.append(loop.time())
                    if len(sent_times) >= FLUSH_FRAMES:
                        timer.flush()
                elif item.__class__ is ClosedOut:
                    await self.close(item.close_code, item.reason)
                    return
        except (OSError, RuntimeError, asyncio.CancelledError):
            return  # the client is gone; the reader sees the disconnect
        except Exception:
            log.debug("writer of session %s stopped", session.id, exc_info=True)
