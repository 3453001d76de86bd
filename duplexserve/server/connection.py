"""The asyncio layer shared by every protocol: one WebSocket, one session.

It only moves data: received messages go to the protocol adapter, which feeds the
session core; the session's outgoing items go, in order, to the adapter's renderer.
Reading stops while the session's input is paused, so a client that sends faster than
the engine answers is held back by TCP instead of by memory. Transcoding that is not
``inline`` runs on the codec thread pool, or, for a ``remote`` codec (Opus), in a codec
worker process (docs/codecs.md).

Two ways to move the data, the same adapters on both:

- the fast path, where the server offers the ``duplexserve.fast_socket`` extension
  (server/ws_protocol.py, our uvicorn protocol): each message is handled in the receive
  callback and each answer is sent from the engine-results callback, both run eagerly
  (server/eager.py), so a message that needs no real wait costs no task, no future and
  no queue; only a message that must wait (a codec in another process or thread) starts
  a task, and the messages behind it queue up behind it in order while reading pauses.
  Audio for a codec worker process (Opus) takes no task either: the request goes out
  with a callback (``procpool.Done``) that the worker's batched reply calls, which feeds
  the session or sends the answer and goes on with what queued up behind it;
- the ASGI path anywhere else (another server, ``--ws websockets-sansio``): a reader
  task and a writer task per session over ``receive`` and ``send``.
"""

from __future__ import annotations

import asyncio
import collections
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
from duplexserve.codecs.formats import FormatError
from duplexserve.codecs.opus_budget import OverBudget
from duplexserve.codecs.pipeline import Decoder, Encoder
from duplexserve.codecs.procpool import OK, CodecProcessError, CodecProcesses, reply_error
from duplexserve.config import ServerConfig
from duplexserve.errors import SessionError
from duplexserve.server import auth, personas
from duplexserve.server.budgets import over_budget
from duplexserve.server.eager import run_eager
from duplexserve.server.events import AudioOut, ClosedOut, Outgoing
from duplexserve.server.orchestrator import Orchestrator
from duplexserve.server.session import Session, no_notify
from duplexserve.server.turnaround import FLUSH_FRAMES
from duplexserve.server.ws_budgets import OVER_BUDGET
from duplexserve.server.ws_frames import Oversized
from duplexserve.server.ws_protocol import EXTENSION, FastWebSocketProtocol

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

#: How long a closed session's connection may take to finish its close handshake.
CLOSE_GRACE_S = 10.0


def invalid_audio(session: Session, exc: FormatError) -> SessionError:
    """The fatal error that input which cannot be decoded ends its session with; input
    refused for what it would cost (codecs/opus_budget.py) is also counted and logged,
    once: the session ends with it."""
    if isinstance(exc, OverBudget) and not session.closed:
        over_budget(exc.budget)
        log.warning("session %s closed over its %s budget: %s", session.id, exc.budget, exc)
    return SessionError("invalid_audio", str(exc), errors.UNSUPPORTED_DATA)


class _CodecWait:
    """The fast path waits on a codec worker's reply (``Connection._lane`` or
    ``_writing``, where a task would otherwise be): cancelled, the reply is dropped."""

    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


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
        #: When the upgrade request came: time to ready is counted from here.
        self.connected_at = self._loop.time()
        self._writer_wait: asyncio.Future[None] | None = None
        self._reader_wait: asyncio.Future[None] | None = None
        self._tasks: tuple[asyncio.Task[None], ...] = ()
        self._abort_timer: asyncio.TimerHandle | None = None
        #: A resume took the session over while this connection still held it (half-open).
        self.replaced = False
        #: The fast path's socket, once the session streams over it.
        self._sock: FastWebSocketProtocol | None = None
        self._done: asyncio.Future[str] | None = None  # fast path: why the streaming ended
        self._gone: asyncio.Future[None] | None = None  # fast path: the connection is lost
        # Fast path: a message that had to wait (a task, or a codec worker's reply).
        self._lane: asyncio.Task[None] | _CodecWait | None = None
        self._backlog: collections.deque[bytes | str] = collections.deque()
        # Fast path: an answer that had to wait (a task, or a codec worker's reply).
        self._writing: asyncio.Task[None] | _CodecWait | None = None
        self._encoding: AudioOut | None = None  # the answer a codec worker is encoding
        self._encoder_lost = False  # its codec worker died: audio is skipped, the close goes out
        self._close_sent = False
        self._over_budget: str | None = None  # the ASGI path: the budget the transport closed for

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

    # Fast-path hooks for codecs in a worker process (Opus): a message or an answer goes
    # to the worker with a callback instead of through ``on_binary`` / ``render``.
    def audio_payload(self, data: bytes) -> bytes | memoryview | None:
        """The bytes of binary message ``data`` for the remote decoder, when the message
        is audio and nothing else; None: ``on_binary`` handles it."""
        return None

    def audio_to_encode(self, item: AudioOut) -> np.ndarray | None:
        """The samples of ``item`` for the remote encoder (any bookkeeping done);
        None: ``render`` handles it."""
        return None

    def send_audio(self, item: AudioOut, data: bytes | memoryview) -> None:
        """Send ``item`` encoded as ``data`` (what ``render`` does after its encode)."""
        raise NotImplementedError

    def ended(self, item: ClosedOut) -> None:
        """The session ended, whether or not its close reached the client (a dropped socket
        renders nothing): bookkeeping that needs no socket. Called once, as the connection
        ends; not for a session that lives on for a resume."""
        return None

    def binary_now(self, data: bytes) -> bool:
        """Fast path: take binary message ``data`` here and now, without ``on_binary``'s
        coroutine, when nothing in it can wait; False: ``on_binary`` (nothing done yet)."""
        return False

    def render_now(self, item: Outgoing) -> bool:
        """Fast path: send ``item`` here and now, without ``render``'s coroutines (four a
        frame with their eager driver), when nothing in it can wait; False: ``render``."""
        return False

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
        try:
            if not await self.handshake():
                return
        except (OSError, RuntimeError):  # the client left during it (while a prompt ran, say)
            session = self.session
            if session is not None and not session.closed and not session.detached:
                self.orch.close(session, "disconnected", errors.GOING_AWAY)
            return
        session = self.session
        assert session is not None
        sock = self.scope.get("extensions", {}).get(EXTENSION, {}).get("socket")
        try:
            if sock is None or self.config.offload_every_frame:
                await self._serve_tasks(session)
            else:
                await self._serve_fast(session, sock)
        finally:
            if self._abort_timer is not None:
                self._abort_timer.cancel()
            self._cancel_tasks()
            if not self.replaced:
                if not session.closed and not session.detached:
                    self.orch.close(session, "disconnected", errors.GOING_AWAY)
                self.orch.pump(session)
                if session.closed_event is not None:
                    if session.closed_event.reason == "slow_consumer":
                        self._slow_consumer()
                    self.ended(session.closed_event)
            if session.timer is not None:
                session.timer.flush()
            self._release(session)

    def _slow_consumer(self) -> None:
        """Count and say once that this client was closed for not reading what it was sent."""
        over_budget("slow_consumer")
        client = self.scope.get("client")
        log.warning(
            "%s session at %s closed slow_consumer: it read nothing while its answers or replies "
            "passed --max-output-frames or --max-output-event-bytes",
            self.protocol, f"{client[0]}:{client[1]}" if client else "?",
        )  # fmt: skip

    def _release(self, session: Session) -> None:
        """Break the reference cycles between this connection, its socket and its session
        (bound methods held as callbacks), so they are freed when the connection ends and
        not by the cyclic garbage collector, whose one pass over many ended sessions
        stops the loop (docs/architecture.md)."""
        if session.notify in (self._wake, self._wake_fast):  # not a resumed session's new one
            session.notify = no_notify
        if self._sock is not None:
            self._sock.release()
            self._sock = None

    async def _serve_tasks(self, session: Session) -> None:
        """The ASGI path: a reader task and a writer task until the connection ends."""
        session.notify = self._wake
        reader = asyncio.create_task(self._read_loop(session))
        writer = asyncio.create_task(self._write_loop(session))
        self._tasks = (reader, writer)
        done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
        if self.replaced:
            await self._say_replaced()
        elif reader in done:  # the client went away: nobody is left to write to
            if not session.closed and self._client_gone(session):
                return  # detached: the writer goes, the session stays for a resume
            await asyncio.wait((writer,), timeout=1.0)
        elif not session.closed and self._client_gone(session):  # the socket broke under the writer
            return
        else:  # the close was sent (or the socket broke): wait for the client's reply
            await asyncio.wait((reader,), timeout=CLOSE_GRACE_S)

    async def _serve_fast(self, session: Session, sock: FastWebSocketProtocol) -> None:
        """The fast path: callbacks in, sends from wherever the answers come, no tasks."""
        self._sock = sock
        self._done, self._gone = self._loop.create_future(), self._loop.create_future()
        session.notify = self._wake_fast
        sock.start(self._on_message, self._on_lost, self._flush, self.config.max_message_bytes)
        self._flush()
        how = await self._done
        if self.replaced:
            await self._say_replaced()
        elif how == "closed":  # wait for the client's reply (uvicorn's close timer bounds it)
            await asyncio.wait((self._gone,), timeout=CLOSE_GRACE_S)
        elif how != "aborted" and not session.closed:
            self._client_gone(session)  # detached for a resume, or closed

    def _client_gone(self, session: Session) -> bool:
        """The connection ended under an open session: ``lost`` (a resume may follow), unless
        the transport closed it for going over a budget (ws_budgets.py): then the session ends
        ``over_budget`` and its token with it; the client read the budget in the close frame."""
        sock = self._sock
        budget = self._over_budget or (sock.over if sock is not None else None)
        if budget is None:
            return self.lost(session)
        self.orch.close(session, "over_budget", errors.POLICY)
        return False

    def lost(self, session: Session) -> bool:
        """The connection ended under an open session; True: it was detached for a resume.

        Protocols without resume close it (``disconnected``)."""
        self.orch.close(session, "disconnected", errors.GOING_AWAY)
        return False

    def take_over(self) -> None:
        """A resume took this connection's session: stop moving its data at once."""
        self.replaced = True
        self._cancel_tasks()
        self._stop("replaced")

    def _cancel_tasks(self) -> None:
        """Stop every task moving this connection's data: both paths' (none on a fast
        path that never had to wait)."""
        for task in (*self._tasks, self._lane, self._writing):
            if task is not None:
                task.cancel()

    async def _say_replaced(self) -> None:
        """Tell a half-open connection it lost its session; never wait long on it."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.send_replaced(), 1.0)

    async def send_replaced(self) -> None:
        """The protocol's goodbye to a connection whose session moved to a new one."""
        await self.close(errors.NORMAL, "replaced")

    def _abort(self) -> None:
        """A closed session whose client neither reads nor goes away: stop waiting for it."""
        for task in self._tasks:
            task.cancel()
        self._stop("aborted")

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

    async def run_prompt(self, params: dict[str, Any]) -> SessionError | None:
        """Run this session's prompt (``text_prompt``, ``voice_prompt``), before its first audio
        reaches the engine; None once it ran, else what the client is told: an error that ends
        the session unless it is ``prompt_unsupported`` (``personas.refusal``)."""
        session = self.session
        assert session is not None
        started = self._loop.time()
        outcome: tuple[str, str] | None = ("engine_error", "the session ended before its prompt ran")
        if not session.closed:
            try:
                outcome = await self.orch.run_prompt(session, params)
            except Exception:  # a bridge gone under it, say: this session only
                log.exception("session %s: the prompt could not be run", session.id)
                outcome = ("engine_error", "the engine could not run the prompt")
        self.orch.readiness.observe_prompt(self.protocol, outcome[0] if outcome else "ran",
                                           self._loop.time() - started)
        closed = session.closed_event
        if closed is not None:  # it ended meanwhile (shutdown, the engine replaced): say why
            return SessionError(closed.reason, "the session ended before its prompt ran", closed.close_code)
        return None if outcome is None else personas.refusal(*outcome)

    async def refuse_session(self, error: SessionError) -> None:
        """Close the session this handshake opened and refuse the connection with ``error``."""
        assert self.session is not None and error.close_code is not None
        self.orch.close(self.session, error.code, error.close_code)
        await self.refuse(error.close_code, error.code, error.message)

    def ready(self) -> None:
        """The session is ready for audio (``session.created``, the handshake byte): observe
        the time since the connection came."""
        self.orch.readiness.observe_ready(self.protocol, self._loop.time() - self.connected_at)

    async def accept(self, subprotocol: str | None = None) -> None:
        message: dict[str, Any] = {"type": "websocket.accept"}
        if subprotocol:
            message["subprotocol"] = subprotocol
        await self._send(message)

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

    async def send_json(self, payload: Any) -> None:
        await self.send_text(json.dumps(payload))

    async def close(self, code: int, reason: str = "") -> None:
        sock = self._sock
        if sock is not None:
            sock.close(code, reason)
        else:
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

    async def _receive_one(self, data: bytes | str | Oversized) -> None:
        """One received message through the adapter into the session, and onward."""
        session = self.session
        assert session is not None
        session.last_activity = self._loop.time()
        session.reply_cost = len(data)  # what a reply to it may echo (Session's bound on replies)
        try:
            if len(data) > self.config.max_message_bytes:
                raise SessionError(
                    "message_too_big",
                    f"message of {len(data)} bytes is over the limit of {self.config.max_message_bytes}",
                    errors.TOO_BIG,
                )
            if data.__class__ is str:
                await self.on_text(data)  # type: ignore[arg-type]
            else:
                await self.on_binary(data)  # type: ignore[arg-type]
        except Exception as exc:
            self._receive_failed(session, exc)
        session.reply_cost = 0
        self._received(session)

    def _received(self, session: Session) -> None:
        """After a message: the session's ready frames to the engine, its answers out."""
        self.orch.pump(session)
        if session.has_outgoing:
            session.notify()

    def _receive_failed(self, session: Session, exc: Exception) -> None:
        """Handling a message raised: a SessionError says what to tell the client; anything
        else (a bug, a codec worker gone) is logged and costs this session only, saying
        nothing internal. Called from the except block, so the traceback is logged."""
        if isinstance(exc, SessionError):
            session.error(exc)
        else:
            log.exception("session %s failed", session.id)
            self.orch.close(session, "internal_error", errors.INTERNAL)

    async def _send_item(self, item: Outgoing) -> None:
        """One outgoing item on the wire; after a ClosedOut, the close frame too."""
        await self.render(item)
        cls = item.__class__
        if cls is AudioOut:
            self._audio_sent()
        elif cls is ClosedOut:
            await self.close(item.close_code, item.reason)  # type: ignore[attr-defined]
            self._close_sent = True

    def _audio_sent(self) -> None:
        timer = self.session.timer if self.session is not None else None
        if timer is not None:  # in order: the index is implied
            timer.sent_times.append(self._loop.time())
            if len(timer.sent_times) >= FLUSH_FRAMES:
                timer.flush()

    # ------------------------------------------------------------ the ASGI path
    async def _read_loop(self, session: Session) -> None:
        receive, loop = self._receive, self._loop
        while True:
            if session.input_paused and not session.closed:
                self._reader_wait = loop.create_future()
                await self._reader_wait
                self._reader_wait = None
            message = await receive()
            if message["type"] != "websocket.receive":  # websocket.disconnect
                reason = message.get("reason") or ""
                if reason.startswith(OVER_BUDGET):
                    self._over_budget = reason[len(OVER_BUDGET):]
                return
            data = message.get("bytes")
            await self._receive_one(data if data is not None else message.get("text") or "")

    async def _write_loop(self, session: Session) -> None:
        loop = self._loop
        try:
            while True:
                item = session.pop_outgoing()
                if item is None:
                    self._writer_wait = loop.create_future()
                    await self._writer_wait
                    self._writer_wait = None
                    continue
                await self._send_item(item)
                if self._close_sent:
                    return
        except (OSError, RuntimeError, asyncio.CancelledError):
            return  # the client is gone; the reader sees the disconnect
        except Exception:
            log.debug("writer of session %s stopped", session.id, exc_info=True)

    # ------------------------------------------------------------ the fast path
    def _stop(self, how: str) -> None:
        done = self._done
        if done is not None and not done.done():
            done.set_result(how)

    def _on_lost(self) -> None:
        self._stop("lost")
        gone = self._gone
        if gone is not None and not gone.done():
            gone.set_result(None)

    def _on_message(self, data: bytes | str | Oversized) -> None:
        """One message from the fast path. An :class:`Oversized` (a frame refused from its
        header) takes the general path, whose size check answers it with ``message_too_big``."""
        if self.replaced:
            return
        if self._lane is not None:  # an earlier message still waits: this one goes after it
            self._backlog.append(data)
            assert self._sock is not None
            self._sock.pause_reading()
            return
        session = self.session
        assert session is not None and self._sock is not None
        taken = False
        if data.__class__ is bytes and len(data) <= self.config.max_message_bytes:
            decoder = self.decoder
            if decoder is not None and decoder.remote:
                payload = self.audio_payload(data)  # type: ignore[arg-type]
                if payload is not None:
                    if not session.closed:  # else it would only cost the worker
                        self._decode_remote(session, decoder, payload)
                    return
            taken = self._receive_now(session, data)  # type: ignore[arg-type]
        lane = None if taken else run_eager(self._receive_one(data))
        if lane is not None:
            self._lane = lane
            self._sock.pause_reading()
            lane.add_done_callback(self._lane_done)
        elif session.input_paused and not session.closed:
            self._sock.pause_reading()

    def _receive_now(self, session: Session, data: bytes) -> bool:
        """``_receive_one`` without its coroutines, when ``binary_now`` takes the message."""
        session.last_activity = self._loop.time()  # the receive time its frames are timed from
        try:
            if not self.binary_now(data):
                return False
        except Exception as exc:
            self._receive_failed(session, exc)
        self._received(session)
        return True

    def _decode_remote(self, session: Session, decoder: Decoder, payload: bytes | memoryview) -> None:
        """Hand one audio message to the session's codec worker; ``_decoded`` goes on.
        Reading goes on meanwhile: a message that comes before the reply queues up (and
        pauses reading), so a paced session pays no pause and resume per message."""
        session.last_activity = self._loop.time()
        self.orch.bridge.counts.executor_submissions += 1
        self._lane = _CodecWait()
        try:
            decoder.submit(payload, self._decoded)  # type: ignore[attr-defined]
        except CodecProcessError as exc:
            self._decoded(-1, str(exc).encode())

    def _decoded(self, status: int, body: bytes | memoryview) -> None:
        """The codec worker's answer to ``_decode_remote``: what ``_receive_one`` does after
        its ``await self.decode(...)``, then the messages that queued up behind it."""
        lane = self._lane
        if lane is None or lane.__class__ is not _CodecWait or lane.cancelled:  # type: ignore[union-attr]
            return  # the connection stopped waiting (it ended, or a resume took it over)
        self._lane = None
        session = self.session
        assert session is not None
        try:
            if status == OK:
                session.receive_audio(np.frombuffer(body, dtype=np.float32))
            else:
                raise reply_error(status, body)
        except FormatError as exc:  # the Ogg stream cannot recover: this session ends
            session.error(invalid_audio(session, exc))
        except Exception as exc:  # a codec worker gone, say
            self._receive_failed(session, exc)
        self.orch.pump(session)
        if session.input_paused and not session.closed:  # the engine is behind: hold the client
            assert self._sock is not None
            self._sock.pause_reading()
        self._lane_done(None)

    def _lane_done(self, _: asyncio.Task[None] | None) -> None:
        self._lane = None
        backlog = self._backlog
        while backlog and self._lane is None and not self.replaced:
            self._on_message(backlog.popleft())
        if self._lane is None:
            self._wake_fast()

    def _wake_fast(self) -> None:
        session, sock = self.session, self._sock
        assert session is not None and sock is not None
        if session.closed and self._abort_timer is None:
            self._abort_timer = self._loop.call_later(CLOSE_GRACE_S, self._abort)
        self._flush()
        if self._lane is None and not session.input_paused:
            sock.resume_reading()

    def _flush(self) -> None:
        """Send what the session has queued, while the transport takes it."""
        if self._writing is not None or self.replaced or self._close_sent:
            return
        session, sock = self.session, self._sock
        assert session is not None and sock is not None
        if not session.has_outgoing:  # a decoded message, say: nothing to send yet
            return
        sock.cork()
        try:
            self._drain(session, sock)
        finally:
            sock.uncork()

    def _drain(self, session: Session, sock: FastWebSocketProtocol) -> None:
        """``_flush``'s loop, inside its cork."""
        while sock.can_write:
            item = session.pop_outgoing()
            if item is None:
                return
            if item.__class__ is AudioOut and self.encoder is not None and self.encoder.remote:
                if self._encoder_lost:
                    continue
                samples = self.audio_to_encode(item)  # type: ignore[arg-type]
                if samples is not None:
                    self._encode_remote(item, samples)  # type: ignore[arg-type]
                    return
            try:
                if self.render_now(item):
                    if item.__class__ is AudioOut:
                        self._audio_sent()
                    continue
                writing = run_eager(self._send_item(item))
            except Exception as exc:
                self._send_failed(session, exc)
                return
            if writing is not None:
                self._writing = writing
                writing.add_done_callback(self._writing_done)
                return
            if self._close_sent:
                self._stop("closed")
                return

    def _send_failed(self, session: Session, exc: Exception) -> None:
        """A send raised: the client is gone (or a bug, logged): this session ends."""
        if not isinstance(exc, (OSError, RuntimeError)):
            log.exception("writer of session %s failed", session.id)
        self._stop("broken")

    def _encode_remote(self, item: AudioOut, samples: np.ndarray) -> None:
        """Hand one answer to the session's codec worker; ``_encoded`` sends it and goes on."""
        self.orch.bridge.counts.executor_submissions += 1
        self._writing, self._encoding = _CodecWait(), item
        try:
            self.encoder.submit(samples, self._encoded)  # type: ignore[union-attr]
        except CodecProcessError as exc:
            self._loop.call_soon(self._encoded, -1, str(exc).encode())  # not inside the cork

    def _encoded(self, status: int, body: bytes | memoryview) -> None:
        """The codec worker's answer to ``_encode_remote``: send it, then what queued behind."""
        writing, item = self._writing, self._encoding
        if writing is None or writing.__class__ is not _CodecWait or writing.cancelled:  # type: ignore[union-attr]
            return
        self._writing = self._encoding = None
        session, sock = self.session, self._sock
        assert session is not None and sock is not None and item is not None
        if self.replaced or self._close_sent:
            return
        sock.cork()
        try:
            if status != OK:  # the codec worker is gone: the session ends, and says so
                log.warning("session %s: %s", session.id, reply_error(status, body))
                self._encoder_lost = True
                self.orch.close(session, "internal_error", errors.INTERNAL)
            else:
                try:
                    self.send_audio(item, body)
                except Exception as exc:
                    self._send_failed(session, exc)
                    return
                self._audio_sent()
            self._drain(session, sock)
        finally:
            sock.uncork()

    def _writing_done(self, task: asyncio.Task[None]) -> None:
        self._writing = None
        if task.cancelled():
            return
        if task.exception() is not None:
            self._stop("broken")
        elif self._close_sent:
            self._stop("closed")
        else:
            self._flush()
