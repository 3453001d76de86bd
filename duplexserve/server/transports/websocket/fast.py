"""The WebSocket fast path: callbacks in, sends from wherever the answers come, no tasks.

Where the server offers the ``duplexserve.fast_socket`` extension
(server/transports/websocket/protocol.py, our uvicorn protocol), each message is handled in
the receive callback and each answer is sent from the engine-results callback, both run
eagerly (server/core/eager.py), so a message that needs no real wait costs no task, no
future and no queue; only a message that must wait (a codec in another process or thread)
starts a task, and the messages behind it queue up behind it in order while reading
pauses. Audio for a codec worker process (Opus) takes no task either: the request goes out
with a callback (``procpool.Done``) that the worker's batched reply calls, which feeds the
session or sends the answer and goes on with what queued up behind it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING

import numpy as np

from duplexserve import errors
from duplexserve.codecs.formats import FormatError
from duplexserve.codecs.pipeline import Decoder
from duplexserve.codecs.procpool import OK, CodecProcessError, reply_error
from duplexserve.config import ServerConfig
from duplexserve.server.core.adapter import invalid_audio
from duplexserve.server.core.eager import run_eager
from duplexserve.server.core.events import AudioOut
from duplexserve.server.core.session import Session
from duplexserve.server.core.tasks import CLOSE_GRACE_S
from duplexserve.server.transports.websocket.frames import Oversized
from duplexserve.server.transports.websocket.protocol import FastWebSocketProtocol

if TYPE_CHECKING:
    from duplexserve.server.core.adapter import ProtocolAdapter

log = logging.getLogger(__name__)


class _CodecWait:
    """The fast path waits on a codec worker's reply (``FastPath._lane`` or ``_writing``,
    where a task would otherwise be): cancelled, the reply is dropped."""

    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class FastPath:
    """The fast path's half of :class:`~.connection.WebSocketTransport`."""

    adapter: ProtocolAdapter | None
    config: ServerConfig
    _loop: asyncio.AbstractEventLoop

    def _init_fast(self) -> None:
        #: The fast path's socket, once the session streams over it.
        self._sock: FastWebSocketProtocol | None = None
        self._done: asyncio.Future[str] | None = None  # why the streaming ended
        self._gone: asyncio.Future[None] | None = None  # the connection is lost
        # A message that had to wait (a task, or a codec worker's reply).
        self._lane: asyncio.Task[None] | _CodecWait | None = None
        self._backlog: collections.deque[bytes | str | Oversized] = collections.deque()
        # An answer that had to wait (a task, or a codec worker's reply).
        self._writing: asyncio.Task[None] | _CodecWait | None = None
        self._encoding: AudioOut | None = None  # the answer a codec worker is encoding
        self._encoder_lost = False  # its codec worker died: audio is skipped, the close goes out
        self._abort_timer: asyncio.TimerHandle | None = None

    async def _serve_fast(
        self, adapter: ProtocolAdapter, session: Session, sock: FastWebSocketProtocol
    ) -> None:
        self._sock = sock
        self.send_bytes_now, self.send_text_now = sock.send_bytes, sock.send_text  # render_now's
        self._done, self._gone = self._loop.create_future(), self._loop.create_future()
        session.notify = self._wake_fast
        sock.start(self._on_message, self._on_lost, self._flush, self.config.max_message_bytes)
        self._flush()
        how = await self._done
        if adapter.replaced:
            await adapter.say_replaced()
        elif how == "closed":  # wait for the client's reply (uvicorn's close timer bounds it)
            await asyncio.wait((self._gone,), timeout=CLOSE_GRACE_S)
        elif how != "aborted" and not session.closed:
            adapter.client_gone(session, sock.over)  # detached for a resume, or closed

    def _abort(self) -> None:
        """A closed session whose client neither reads nor goes away: stop waiting for it."""
        self._stop("aborted")

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
        adapter = self.adapter
        assert adapter is not None
        if adapter.replaced:
            return
        if self._lane is not None:  # an earlier message still waits: this one goes after it
            self._backlog.append(data)
            assert self._sock is not None
            self._sock.pause_reading()
            return
        session = adapter.session
        assert session is not None and self._sock is not None
        taken = False
        if data.__class__ is bytes and len(data) <= self.config.max_message_bytes:
            decoder = adapter.decoder
            if decoder is not None and decoder.remote:
                payload = adapter.audio_payload(data)  # type: ignore[arg-type]
                if payload is not None:
                    if not session.closed:  # else it would only cost the worker
                        self._decode_remote(adapter, session, decoder, payload)
                    return
            taken = adapter.receive_now(session, data)  # type: ignore[arg-type]
        lane = None if taken else run_eager(adapter.receive(data))  # type: ignore[arg-type]
        if lane is not None:
            self._lane = lane
            self._sock.pause_reading()
            lane.add_done_callback(self._lane_done)
        elif session.input_paused and not session.closed:
            self._sock.pause_reading()

    def _decode_remote(
        self, adapter: ProtocolAdapter, session: Session, decoder: Decoder, payload: bytes | memoryview
    ) -> None:
        """Hand one audio message to the session's codec worker; ``_decoded`` goes on.
        Reading goes on meanwhile: a message that comes before the reply queues up (and
        pauses reading), so a paced session pays no pause and resume per message."""
        session.last_activity = self._loop.time()
        adapter.orch.bridge.counts.executor_submissions += 1
        self._lane = _CodecWait()
        try:
            decoder.submit(payload, self._decoded)  # type: ignore[attr-defined]
        except CodecProcessError as exc:
            self._decoded(-1, str(exc).encode())

    def _decoded(self, status: int, body: bytes | memoryview) -> None:
        """The codec worker's answer to ``_decode_remote``: what ``adapter.receive`` does after
        its ``await self.decode(...)``, then the messages that queued up behind it."""
        lane = self._lane
        if lane is None or lane.__class__ is not _CodecWait or lane.cancelled:  # type: ignore[union-attr]
            return  # the connection stopped waiting (it ended, or a resume took it over)
        self._lane = None
        adapter = self.adapter
        assert adapter is not None
        session = adapter.session
        assert session is not None
        try:
            if status == OK:
                session.receive_audio(np.frombuffer(body, dtype=np.float32))
            else:
                raise reply_error(status, body)
        except FormatError as exc:  # the Ogg stream cannot recover: this session ends
            session.error(invalid_audio(session, exc))
        except Exception as exc:  # a codec worker gone, say
            adapter.receive_failed(session, exc)
        adapter.orch.pump(session)
        if session.input_paused and not session.closed:  # the engine is behind: hold the client
            assert self._sock is not None
            self._sock.pause_reading()
        self._lane_done(None)

    def _lane_done(self, _: asyncio.Task[None] | None) -> None:
        self._lane = None
        adapter = self.adapter
        if adapter is None:  # the connection ended (and released) meanwhile
            return
        backlog = self._backlog
        while backlog and self._lane is None and not adapter.replaced:
            self._on_message(backlog.popleft())
        if self._lane is None:
            self._wake_fast()

    def _wake_fast(self) -> None:
        adapter, sock = self.adapter, self._sock
        assert adapter is not None and sock is not None
        session = adapter.session
        assert session is not None
        if session.closed and self._abort_timer is None:
            self._abort_timer = self._loop.call_later(CLOSE_GRACE_S, self._abort)
        self._flush()
        if self._lane is None and not session.input_paused:
            sock.resume_reading()

    def _flush(self) -> None:
        """Send what the session has queued, while the transport takes it."""
        adapter = self.adapter
        if self._writing is not None or adapter is None or adapter.replaced or adapter.close_sent:
            return
        session, sock = adapter.session, self._sock
        assert session is not None and sock is not None
        if not session.has_outgoing:  # a decoded message, say: nothing to send yet
            return
        sock.cork()
        try:
            self._drain(adapter, session, sock)
        finally:
            sock.uncork()

    def _drain(self, adapter: ProtocolAdapter, session: Session, sock: FastWebSocketProtocol) -> None:
        """``_flush``'s loop, inside its cork."""
        while sock.can_write:
            item = session.pop_outgoing()
            if item is None:
                return
            if item.__class__ is AudioOut and adapter.encoder is not None and adapter.encoder.remote:
                if self._encoder_lost:
                    continue
                samples = adapter.audio_to_encode(item)  # type: ignore[arg-type]
                if samples is not None:
                    self._encode_remote(adapter, item, samples)  # type: ignore[arg-type]
                    return
            try:
                if adapter.render_now(item):
                    if item.__class__ is AudioOut:
                        adapter.audio_sent()
                    continue
                writing = run_eager(adapter.send_item(item))
            except Exception as exc:
                self._send_failed(session, exc)
                return
            if writing is not None:
                self._writing = writing
                writing.add_done_callback(self._writing_done)
                return
            if adapter.close_sent:
                self._stop("closed")
                return

    def _send_failed(self, session: Session, exc: Exception) -> None:
        """A send raised: the client is gone (or a bug, logged): this session ends."""
        if not isinstance(exc, (OSError, RuntimeError)):
            log.exception("writer of session %s failed", session.id)
        self._stop("broken")

    def _encode_remote(self, adapter: ProtocolAdapter, item: AudioOut, samples: np.ndarray) -> None:
        """Hand one answer to the session's codec worker; ``_encoded`` sends it and goes on."""
        adapter.orch.bridge.counts.executor_submissions += 1
        self._writing, self._encoding = _CodecWait(), item
        try:
            adapter.encoder.submit(samples, self._encoded)  # type: ignore[union-attr]
        except CodecProcessError as exc:
            self._loop.call_soon(self._encoded, -1, str(exc).encode())  # not inside the cork

    def _encoded(self, status: int, body: bytes | memoryview) -> None:
        """The codec worker's answer to ``_encode_remote``: send it, then what queued behind."""
        writing, item = self._writing, self._encoding
        if writing is None or writing.__class__ is not _CodecWait or writing.cancelled:  # type: ignore[union-attr]
            return
        self._writing = self._encoding = None
        adapter, sock = self.adapter, self._sock
        if adapter is None or adapter.replaced or adapter.close_sent:
            return
        session = adapter.session
        assert session is not None and sock is not None and item is not None
        sock.cork()
        try:
            if status != OK:  # the codec worker is gone: the session ends, and says so
                log.warning("session %s: %s", session.id, reply_error(status, body))
                self._encoder_lost = True
                adapter.orch.close(session, "internal_error", errors.INTERNAL)
            else:
                try:
                    adapter.send_encoded(item, body)
                except Exception as exc:
                    self._send_failed(session, exc)
                    return
                adapter.audio_sent()
            self._drain(adapter, session, sock)
        finally:
            sock.uncork()

    def _writing_done(self, task: asyncio.Task[None]) -> None:
        self._writing = None
        if task.cancelled():
            return
        if task.exception() is not None:
            self._stop("broken")
        elif self.adapter is not None and self.adapter.close_sent:
            self._stop("closed")
        else:
            self._flush()
