"""uvicorn's sans-I/O WebSocket protocol with a callback fast path for the app.

uvicorn stays in charge of the HTTP upgrade, the handshake messages, refusals (403 and
``websocket.http.response``), keepalive pings, server shutdown and the close timer. What
changes is the per-message path once the app has accepted: through the scope extension
``duplexserve.fast_socket`` the app may call :meth:`FastWebSocketProtocol.start` and from
then on

- each received message is a call ``on_message(bytes | str)``: no ASGI dict, no queue,
  no task wake-up, and no ``pause_reading`` per message; reading pauses only when the app
  says so (:meth:`pause_reading`, :meth:`resume_reading`);
- :meth:`send_bytes` and :meth:`send_text` write one frame to the transport at once;
  :attr:`writable` says whether the transport is under its high-water mark and
  ``on_writable`` is called when it drains again;
- ``on_lost`` is called once when the connection is gone.

Frames are read by :class:`~duplexserve.server.transports.websocket.frames.FrameReader` (the
common data frame here, everything else by websockets), in slices and within the
connection's budgets (:class:`~duplexserve.server.transports.websocket.budgets.MeteredProtocol`).
The subclass reads internals of both
libraries (the attributes and methods listed below); :func:`fast_path_problem` checks
once at start-up that the installed versions have them, and the server falls back to
uvicorn's own ``websockets-sansio`` protocol when they do not. An app that does not
call ``start`` gets exactly uvicorn's behaviour.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import uvicorn
import websockets
from uvicorn.protocols.utils import ClientDisconnected
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from uvicorn.server import ServerState
from websockets.server import ServerProtocol

from duplexserve.server.transports.websocket.budgets import (
    METERED_METHODS,
    METERED_STATE,
    METERED_WEBSOCKETS_METHODS,
    SLICE_BYTES,
    SLICE_FRAMES,
    MeteredProtocol,
)
from duplexserve.server.transports.websocket.frames import (
    FIN_BINARY,
    FIN_TEXT,
    FRAGMENT_SIZE,
    HANDED,
    FrameReader,
    Oversized,
    header,
)

EXTENSION = "duplexserve.fast_socket"
#: Corked frames are written once they reach this many bytes.
CORK_LIMIT = 1 << 16
#: After a protocol error, how long the connection stays open (what comes is discarded)
#: so that a client still sending can read the close frame before the socket closes.
ERROR_LINGER_S = 2.0

OnMessage = Callable[[Any], None]  # bytes (binary) or str (text)


def _ignore(*_: Any) -> None:
    pass


#: What the subclass reads of uvicorn's ``WebSocketsSansIOProtocol`` beyond the asyncio
#: protocol interface and what its base reads (``budgets.METERED_*``): instance state
#: set in ``__init__``, and the methods it overrides or calls.
UVICORN_STATE = (
    *METERED_STATE, "config", "disconnected", "close_timeout", "writable",
)  # fmt: skip
UVICORN_METHODS = (
    *METERED_METHODS, "handle_events", "handle_parser_exception", "handle_ping", "resume_writing", "send",
)  # fmt: skip
#: And of websockets' sans-I/O ``ServerProtocol`` (besides ``current_size``/``cur_size``).
WEBSOCKETS_STATE = ("state", "extensions", "parser_exc", "close_sent")
WEBSOCKETS_METHODS = ("receive_data", "events_received", "data_to_send", "send_close", "fail")


async def _no_app(scope: Any, receive: Any, send: Any) -> None:
    """The probe's protocol is never connected: its app is never called."""


def fast_path_problem() -> str | None:
    """What the installed uvicorn or websockets lacks of the internals this module reads,
    or None when the fast path can run. Checked once at start-up, on fresh instances."""
    if FRAGMENT_SIZE is None:
        return f"websockets' ServerProtocol has no current_size or cur_size ({_versions()})"
    return _lacking(UVICORN_STATE, UVICORN_METHODS, WEBSOCKETS_STATE, WEBSOCKETS_METHODS)


def fallback_problem() -> str | None:
    """The same for :class:`~.fallback.SansIOFallback`, which reads less."""
    return _lacking(METERED_STATE, METERED_METHODS, (), METERED_WEBSOCKETS_METHODS)


def _versions() -> str:
    return f"uvicorn {uvicorn.__version__}, websockets {websockets.__version__}"


def _lacking(
    uvicorn_state: tuple[str, ...], uvicorn_methods: tuple[str, ...],
    websockets_state: tuple[str, ...], websockets_methods: tuple[str, ...],
) -> str | None:  # fmt: skip
    conn = ServerProtocol()
    missing = [f"websockets ServerProtocol.{n}" for n in websockets_state if not hasattr(conn, n)]
    missing += [f"websockets ServerProtocol.{n}()" for n in websockets_methods if not hasattr(conn, n)]
    loop = asyncio.new_event_loop()
    try:
        config = uvicorn.Config(_no_app, ws="websockets-sansio")
        config.load()
        proto = WebSocketsSansIOProtocol(config, ServerState(), {}, _loop=loop)
    except Exception as exc:  # a constructor of another shape
        return f"uvicorn's WebSocketsSansIOProtocol could not be built ({exc!r}; {_versions()})"
    finally:
        loop.close()
    missing += [f"uvicorn {n}" for n in uvicorn_state if not hasattr(proto, n)]
    missing += [f"uvicorn {n}()" for n in uvicorn_methods if not callable(getattr(proto, n, None))]
    if missing:
        return f"{_versions()} lack{'s' if len(missing) == 1 else ''} {', '.join(missing)}"
    return None


class FastWebSocketProtocol(MeteredProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reader = FrameReader(self.conn, self.config.ws_max_size)
        self._on_message: OnMessage | None = None
        self._on_lost: Callable[[], None] = _ignore
        self._on_writable: Callable[[], None] = _ignore
        self._held = False  # the app asked to stop reading
        self._parsing = False
        self._corked: list[Any] | None = None  # frames collected for one write
        self._corked_bytes = 0
        self._pong = b""  # the latest pong, held while the transport is over its mark
        self._failed = False  # a protocol error was answered: closing after ERROR_LINGER_S

    # ----------------------------------------------------------------- the app's API
    def start(
        self,
        on_message: OnMessage,
        on_lost: Callable[[], None],
        on_writable: Callable[[], None],
        max_message: int | None = None,
    ) -> None:
        """Switch this accepted connection to callbacks; messages that arrived before are
        delivered first, in order. A data frame longer than ``max_message`` bytes comes to
        ``on_message`` as an :class:`~duplexserve.server.transports.websocket.frames.Oversized` (its length
        only), for the app to refuse with its own error event; its payload is dropped."""
        self._on_message, self._on_lost, self._on_writable = on_message, on_lost, on_writable
        self.reader.refuse_over = max_message
        lost = False
        while not self.queue.empty():
            event = self.queue.get_nowait()
            if event["type"] == "websocket.receive":
                text = event.get("text")
                on_message(text if text is not None else event["bytes"])
            elif event["type"] == "websocket.disconnect":
                lost = True
        if self.read_paused and not self._held:  # uvicorn's pause per message: ours from here on
            self.read_paused = False
            if not self._yielding:
                self.transport.resume_reading()
        if lost or self.disconnected:
            self.connection_gone()

    @property
    def can_write(self) -> bool:
        """False while the transport's buffer is over its high-water mark."""
        return self.writable.is_set()

    def send_bytes(self, data: bytes | bytearray | memoryview) -> None:
        self._write(FIN_BINARY, data)

    def send_text(self, text: str) -> None:
        self._write(FIN_TEXT, text.encode())

    def _write(self, first: int, data: bytes | bytearray | memoryview) -> None:
        if self.close_sent or self.disconnected:
            raise ClientDisconnected()
        parts = self._corked
        if parts is None:
            self.transport.writelines((header(first, len(data)), data))
            return
        parts.append(header(first, len(data)))
        parts.append(data)
        self._corked_bytes += len(data)
        if self._corked_bytes > CORK_LIMIT:  # write now, so ``can_write`` sees these bytes
            self.uncork()
            self.cork()

    def cork(self) -> None:
        """Frames sent from now until :meth:`uncork` go out in one write: one system call
        for, say, an audio frame and its text."""
        self._corked = []
        self._corked_bytes = 0

    def uncork(self) -> None:
        parts, self._corked = self._corked, None
        if parts and not self.transport.is_closing():
            self.transport.writelines(parts)

    def close(self, code: int, reason: str = "") -> None:
        """Start the closing handshake; the peer's reply (or the close timer) ends it."""
        self.uncork()  # what was sent before goes before the close frame
        if self.close_sent or self.disconnected or self.transport.is_closing():
            return
        self.queue.put_nowait({"type": "websocket.disconnect", "code": code, "reason": reason})
        self.conn.send_close(code, reason)
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        self.close_timer = self.loop.call_later(self.close_timeout, self.transport.close)
        self.resume_reading()  # the reply must come through

    def pause_reading(self) -> None:
        if not self._held:
            self._held = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if not self._held:
            return
        self._held = False
        if self.reader.buffered:  # frames that came while held go first
            self._slice_cut()
        elif not self._yielding:
            self.transport.resume_reading()

    # ------------------------------------------------------------ transport events
    def data_received(self, data: bytes) -> None:
        if not self.handshake_initiated:  # the upgrade request, replayed by uvicorn
            super().data_received(data)
            return
        if not self._arrived(len(data)) or self._failed:  # the library would drop it all
            return
        self.reader.feed(data)
        if not self.handshake_complete:  # frames before our 101: held until the accept
            if not self.read_paused:
                self.read_paused = True
                self.transport.pause_reading()
            return
        if self._yielding:  # reading resumed (uvicorn's receive, a close) while a slice waits
            self.transport.pause_reading()
            return
        self._parse()

    def _next_slice(self) -> None:
        self._yielding = False
        self._parse()
        if not (self._held or self._yielding or self.read_paused or self.transport.is_closing()):
            self.transport.resume_reading()

    def _parse(self) -> None:
        """Parse and deliver what was read, one slice (``SLICE_FRAMES`` frames, about
        ``SLICE_BYTES``) at most: the rest waits for :meth:`_next_slice`."""
        if self._parsing or self._dropping:  # a callback resumed reading: the loop below goes on
            return
        self._parsing = True
        reader, conn, transport = self.reader, self.conn, self.transport
        frames, start = SLICE_FRAMES, reader.pos
        try:
            while not self._held and not transport.is_closing():
                if not frames or reader.pos - start > SLICE_BYTES:
                    self._slice_cut()
                    return
                item = reader.next()
                if item is None:
                    return
                frames -= 1
                if item is HANDED:
                    if conn.parser_exc is not None:
                        self.handle_parser_exception()
                        return
                    self.handle_events()
                elif item.__class__ is Oversized:  # only once started: ``start`` sets the limit
                    if self._on_message is not None and not self.close_sent:
                        self._on_message(item)
                elif self._on_message is not None:
                    self._deliver(*item)  # type: ignore[misc]
                else:  # before start: through uvicorn's queue, like the library's frames
                    payload, is_text = item  # type: ignore[misc]
                    self.curr_msg_data_type = "text" if is_text else "bytes"
                    self.frames = [payload]
                    self.send_receive_event_to_app()
        finally:
            self._parsing = False
            controls, reader.controls = reader.controls, 0
            self._spent(SLICE_FRAMES - frames, controls)

    def send_receive_event_to_app(self) -> None:
        if self._on_message is None:
            super().send_receive_event_to_app()
            return
        data = self.frames[0] if len(self.frames) == 1 else b"".join(self.frames)
        self.frames = []
        self._deliver(data, self.curr_msg_data_type == "text")

    def _deliver(self, data: bytes, is_text: bool) -> None:
        if self.close_sent:
            return  # past our close: reading on only for the peer's reply
        if is_text:
            if not self._affords(len(data)):  # refused unread: its budget cannot hold it
                return
            try:
                message: Any = data.decode()
            except UnicodeDecodeError:
                self.conn.fail(1007, "invalid UTF-8 in a text message")
                self.handle_parser_exception()
                return
            started = time.thread_time()
            self._on_message(message)  # type: ignore[misc]
            self._parsed(time.thread_time() - started)  # JSON: the loop's CPU it took is charged
            return
        self._on_message(data)  # type: ignore[misc]

    async def send(self, message: Any) -> None:
        await super().send(message)
        if self.handshake_complete and self.reader.buffered and not self.close_sent:
            self._parse()  # frames that came before the accept

    def handle_parser_exception(self) -> None:
        """uvicorn's, except that the transport closes :data:`ERROR_LINGER_S` later instead of
        at once: a socket closed with bytes unread makes the kernel reset the connection, and
        a client still sending (a fragmented message past the limit, say) would lose the
        close frame, and with it the code that says what it did wrong. Meanwhile reading goes
        on and the library, failed, discards every byte; the app learns of the end now."""
        if self._failed:  # bytes after the error: the library dropped them, the timer runs
            return
        self._failed = True
        close = self.conn.close_sent
        assert close is not None
        self.queue.put_nowait({"type": "websocket.disconnect", "code": close.code, "reason": close.reason})
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        self.close_timer = self.loop.call_later(ERROR_LINGER_S, self.transport.close)
        self._held = False
        if self.read_paused:  # uvicorn's own pause, before ``start``
            self.read_paused = False
        self.transport.resume_reading()
        self.connection_gone()

    def handle_ping(self) -> None:
        """Answer a ping, but never past the transport's high-water mark: a client that
        sends pings and reads nothing would otherwise fill the server's memory with pongs
        (uvicorn writes each one). RFC 6455 (5.5.3) lets an endpoint answer only the latest
        of the pings it has not answered yet; that one goes out when the buffer drains."""
        pong = b"".join(self.conn.data_to_send())
        if self.writable.is_set():
            self.transport.write(pong)
        else:
            self._pong = pong

    def resume_writing(self) -> None:
        super().resume_writing()
        pong, self._pong = self._pong, b""
        if pong and not self.transport.is_closing():
            self.transport.write(pong)
        self._on_writable()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.connection_gone()

    def _app_gone(self) -> None:
        self.connection_gone()

    def connection_gone(self) -> None:
        self._on_message = None
        on_lost, self._on_lost = self._on_lost, _ignore
        self._on_writable = _ignore
        on_lost()

    def release(self) -> None:
        """The app is done with this connection: drop its callbacks and the scope's
        reference back to this protocol, so that no reference cycle keeps the connection
        and its session alive until the cyclic garbage collector runs (with hundreds of
        sessions ending together, one collection stops the loop for tens of ms)."""
        self._on_message = None
        self._on_lost = self._on_writable = _ignore
        scope = getattr(self, "scope", None)
        if scope is not None:
            scope["extensions"].pop(EXTENSION, None)

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None:  # a 101 may follow: the app may take the fast path
            scope["extensions"][EXTENSION] = {"socket": self}
