"""uvicorn's own sans-I/O protocol with the fast path's budgets and slices.

Served for ``--ws websockets-sansio`` and wherever the fast path cannot run
(server/transports/websocket/protocol.py). uvicorn hands each read whole to websockets, which parses every
frame in it before the loop can do anything else: one read of 256 KiB is 40,000 pings,
and a connection sending them held the loop for seconds. Here a read goes to uvicorn
in slices of whole frames (:data:`~duplexserve.server.transports.websocket.budgets.SLICE_FRAMES`, about
:data:`~duplexserve.server.transports.websocket.budgets.SLICE_BYTES`), cut by :class:`FrameCounter` from
the frame headers alone, and the frames are charged to the connection's budgets
(server/transports/websocket/budgets.py). Everything else is uvicorn's.
"""

from __future__ import annotations

from typing import Any

from duplexserve.server.transports.websocket.budgets import SLICE_BYTES, SLICE_FRAMES, MeteredProtocol


class FrameCounter:
    """Frame boundaries in a client's byte stream, read from the headers alone: what is
    malformed is websockets' to refuse, and the count only decides where a slice ends."""

    def __init__(self) -> None:
        self._left = 0  # bytes of a frame begun in an earlier cut, still to come

    def cut(self, buf: bytes, frames: int, size: int) -> tuple[int, int, int, bool]:
        """Where to cut ``buf`` (the stream from the end of the last cut): after at most
        ``frames`` frames and about ``size`` bytes, a frame whose rest has not come
        included. Returns the cut, the frames begun before it, the control frames among
        them, and whether whole frames wait after it (a partial header waits for more)."""
        end = len(buf)
        pos = min(self._left, end)
        self._left -= pos
        begun = controls = 0
        while end - pos >= 2:
            if begun == frames or pos > size:
                return pos, begun, controls, True
            second = buf[pos + 1]
            length, head = second & 0x7F, 2
            if length == 126:
                if end - pos < 4:
                    break
                length, head = int.from_bytes(buf[pos + 2 : pos + 4], "big"), 4
            elif length == 127:
                if end - pos < 10:
                    break
                length, head = int.from_bytes(buf[pos + 2 : pos + 10], "big"), 10
            begun += 1
            if buf[pos] & 0x08:
                controls += 1
            frame_end = pos + head + (4 if second & 0x80 else 0) + length
            if frame_end > end:
                self._left = frame_end - end
                return end, begun, controls, False
            pos = frame_end
        return pos, begun, controls, False


class SansIOFallback(MeteredProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._counter = FrameCounter()
        self._backlog = b""  # read, not yet handed to uvicorn

    def data_received(self, data: bytes) -> None:
        if not self.handshake_initiated:  # the upgrade request, replayed by uvicorn's HTTP side
            super().data_received(data)
            return
        if not self._arrived(len(data)):
            return
        self._backlog = self._backlog + data if self._backlog else data
        if self._yielding:  # reading resumed (uvicorn's close) while a slice waits
            self.transport.pause_reading()
            return
        self._feed()

    def _feed(self) -> None:
        backlog = self._backlog
        size, frames, controls, more = self._counter.cut(backlog, SLICE_FRAMES, SLICE_BYTES)
        self._backlog = backlog[size:]
        if size:  # uvicorn's: websockets parses it, uvicorn dispatches the frames
            super().data_received(backlog if size == len(backlog) else backlog[:size])
        self._spent(frames, controls)
        if more and not self._dropping and not self.transport.is_closing():
            self._slice_cut()

    def _next_slice(self) -> None:
        self._yielding = False
        if self._dropping or self.transport.is_closing():
            return
        self._feed()
        if not self._yielding and not self.read_paused:
            self.transport.resume_reading()
