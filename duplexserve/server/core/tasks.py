"""A session's data moved by two tasks: a reader and a writer.

The way for a transport whose messages come from an awaitable (the ASGI WebSocket, a
WebRTC call's data channel): the reader hands each message to the adapter and stops
reading while the session's input is paused, so a client that sends faster than the
engine answers is held back by TCP instead of by memory; the writer sends the session's
outgoing items, in order, through the adapter.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from duplexserve.server.core.session import Session, no_notify

if TYPE_CHECKING:
    from duplexserve.server.core.adapter import ProtocolAdapter

log = logging.getLogger(__name__)

#: How long a closed session's connection may take to finish its close handshake.
CLOSE_GRACE_S = 10.0


class TaskDriver:
    """Subclasses may read their own way (``read_loop``); ``receive`` gives the next
    message, None once the client is gone."""

    def __init__(
        self, adapter: ProtocolAdapter, receive: Callable[[], Awaitable[bytes | str | None]]
    ) -> None:
        self.adapter: ProtocolAdapter | None = adapter
        self._receive = receive
        self._loop = asyncio.get_running_loop()
        self._writer_wait: asyncio.Future[None] | None = None
        self._reader_wait: asyncio.Future[None] | None = None
        self.tasks: tuple[asyncio.Task[None], ...] = ()
        self._abort_timer: asyncio.TimerHandle | None = None

    async def serve(self, session: Session, gone: Callable[[Session], bool]) -> None:
        """Until the connection ends. ``gone(session)``: the client went away under an open
        session; True: it was detached for a resume."""
        adapter = self.adapter
        assert adapter is not None
        session.notify = self.wake
        reader = asyncio.create_task(self.read_loop(session))
        writer = asyncio.create_task(self._write_loop(session))
        self.tasks = (reader, writer)
        done, _ = await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
        if adapter.replaced:
            await adapter.say_replaced()
        elif reader in done:  # the client went away: nobody is left to write to
            if not session.closed and gone(session):
                return  # detached: the writer goes, the session stays for a resume
            await asyncio.wait((writer,), timeout=1.0)
        elif not session.closed and gone(session):  # the socket broke under the writer
            return
        else:  # the close was sent (or the socket broke): wait for the client's reply
            await asyncio.wait((reader,), timeout=CLOSE_GRACE_S)

    def cancel(self) -> None:
        """Stop both tasks (a resume took the session, or the connection ended)."""
        if self._abort_timer is not None:
            self._abort_timer.cancel()
        for task in self.tasks:
            task.cancel()

    def release(self, session: Session) -> None:
        """Drop the references that would keep this connection for the cyclic collector."""
        if session.notify == self.wake:  # not a resumed session's new one
            session.notify = no_notify
        self.adapter = None

    def wake(self) -> None:
        adapter = self.adapter
        assert adapter is not None
        session = adapter.session
        assert session is not None
        if session.closed and self._abort_timer is None:
            self._abort_timer = self._loop.call_later(CLOSE_GRACE_S, self.cancel)
        waiter = self._writer_wait
        if waiter is not None and not waiter.done() and session.has_outgoing:
            waiter.set_result(None)
        waiter = self._reader_wait
        if waiter is not None and not waiter.done() and not session.input_paused:
            waiter.set_result(None)

    async def read_loop(self, session: Session) -> None:
        adapter, receive, loop = self.adapter, self._receive, self._loop
        assert adapter is not None
        while True:
            if session.input_paused and not session.closed:  # the engine is behind: wait
                self._reader_wait = loop.create_future()
                await self._reader_wait
                self._reader_wait = None
            data = await receive()
            if data is None:
                return
            await adapter.receive(data)

    async def _write_loop(self, session: Session) -> None:
        adapter, loop = self.adapter, self._loop
        assert adapter is not None
        try:
            while True:
                item = session.pop_outgoing()
                if item is None:
                    self._writer_wait = loop.create_future()
                    await self._writer_wait
                    self._writer_wait = None
                    continue
                await adapter.send_item(item)
                if adapter.close_sent:
                    return
        except (OSError, RuntimeError, asyncio.CancelledError):
            return  # the client is gone; the reader sees the disconnect
        except Exception:
            log.debug("writer of session %s stopped", session.id, exc_info=True)
