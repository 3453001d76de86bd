"""WebSocket frames of the hot path, read and written without websockets' generators.

Sans-I/O, like the library it leans on: bytes go in with :meth:`FrameReader.feed`, and
:meth:`FrameReader.next` hands out one received message at a time. Only the common
case is parsed here: a complete, final, masked text or binary frame with no reserved
bits, within the size limit, on an open connection that is not inside a fragmented
message and has no extension. Its payload is unmasked with websockets' C
``apply_mask`` (the one copy the library would make too). Every other frame, control
frames, fragments and anything malformed or too large, is handed *whole* to
websockets' ``ServerProtocol``, which applies the rest of RFC 6455 (masking, control
frame rules, continuation, UTF-8 of fragmented text, the close handshake) and produces
its own events and errors. Because the library only ever gets whole frames, its
parser is at a frame boundary whenever the next frame comes, whichever side parses it.

A data frame over the app's own limit (``refuse_over``) is refused from its header: the
reader hands out an :class:`Oversized` in its place and drops its payload as it comes,
so the app answers with its error event and close code (1009) without the frame ever
being buffered, and the reader stays at a frame boundary for the peer's close reply.

Written frames are a header built here plus the payload as it is (server frames are
not masked), handed to the transport together so the payload is not copied.
"""

from __future__ import annotations

import struct

from websockets.protocol import OPEN
from websockets.server import ServerProtocol

try:
    from websockets.speedups import apply_mask
except ImportError:  # pragma: no cover - websockets without its C extension
    from websockets.utils import apply_mask

#: First header byte of a final unfragmented frame without reserved bits.
FIN_TEXT = 0x81
FIN_BINARY = 0x82
#: :meth:`FrameReader.next` handed a frame to websockets: read ``conn.events_received()``.
HANDED = object()


def _fragment_size_attribute() -> str | None:
    """The name under which websockets keeps the size of the fragmented message being
    received (None outside one): ``current_size`` from 16.0, ``cur_size`` in 13 to 15.
    None if this version has neither, and then the fast path is not used (protocol.py)."""
    conn = ServerProtocol()
    for name in ("current_size", "cur_size"):
        if name in vars(conn) and getattr(conn, name) is None:
            return name
    return None


#: Read once at import: which websockets attribute says "inside a fragmented message".
FRAGMENT_SIZE = _fragment_size_attribute()

_LENGTH16 = struct.Struct("!BBH")
_LENGTH64 = struct.Struct("!BBQ")


class Oversized:
    """Stands in for a message refused from its frame header: only its length is known.
    ``len()`` gives that length, so the app's size check refuses it like any other."""

    __slots__ = ("length",)

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length


def header(first: int, length: int) -> bytes:
    """The header of an unmasked frame (server to client) with ``length`` bytes of payload."""
    if length < 126:
        return bytes((first, length))
    if length < 65536:
        return _LENGTH16.pack(first, 126, length)
    return _LENGTH64.pack(first, 127, length)


class FrameReader:
    """Client frames in; whole messages (or "see the library's events") out, in order."""

    def __init__(self, conn: ServerProtocol, max_size: int | None) -> None:
        self.conn = conn
        self.max_size = max_size if max_size is not None else 1 << 63
        #: Complete data frames longer than this come out as :class:`Oversized` (None: no
        #: such limit; websockets' ``max_size`` still closes 1009 past ``max_size``).
        self.refuse_over: int | None = None
        self._buf: bytes = b""
        #: Where the next frame starts in the buffer; it only grows between two feeds.
        self.pos = 0
        self._skip = 0  # bytes of a refused frame still to come, dropped as they arrive
        #: Control frames handed out since the owner last reset this (its budget counts them).
        self.controls = 0

    @property
    def buffered(self) -> int:
        """Bytes received and not yet parsed (at most one partial frame, or more while held)."""
        return len(self._buf) - self.pos

    def feed(self, data: bytes) -> None:
        if self._skip:
            drop = min(self._skip, len(data))
            self._skip -= drop
            data = data[drop:]
        if self.pos < len(self._buf):  # a partial frame waits: the only copy, of that part
            self._buf = self._buf[self.pos :] + data
        else:
            self._buf = data
        self.pos = 0

    def next(self) -> tuple[bytes, bool] | Oversized | object | None:
        """One message ``(payload, is_text)``, an :class:`Oversized`, :data:`HANDED`, or None
        until more bytes come. Frames go to websockets one at a time also while the
        connection closes, so that its owner can stop after any of them (budgets.py)."""
        buf, pos = self._buf, self.pos
        avail = len(buf) - pos
        if avail < 2:
            return None
        first, second = buf[pos], buf[pos + 1]
        length = second & 0x7F
        head = 2
        if length == 126:
            if avail < 4:
                return None
            length = (buf[pos + 2] << 8) | buf[pos + 3]
            head = 4
        elif length == 127:
            if avail < 10:
                return None
            length = int.from_bytes(buf[pos + 2 : pos + 10], "big")
            head = 10
        if not second & 0x80:
            return self._hand(avail)  # refused from the header: unmasked (1002)
        conn = self.conn
        common = (
            first in (FIN_BINARY, FIN_TEXT)
            and conn.state is OPEN  # closing: the library takes every frame from here on
            and getattr(conn, FRAGMENT_SIZE) is None  # type: ignore[arg-type]  # not inside a fragment
            and not conn.extensions
        )
        refuse_over = self.refuse_over
        if common and refuse_over is not None and length > refuse_over:
            drop = min(avail - head, 4 + length)  # the mask and the payload, as far as here
            self.pos = pos + head + drop
            self._skip = 4 + length - drop
            return Oversized(length)
        if length > self.max_size:
            return self._hand(avail)  # refused from the header: too big (1009)
        end = head + 4 + length
        if avail < end:
            return None
        if common:
            start = pos + head + 4
            self.pos = pos + end
            payload = apply_mask(memoryview(buf)[start : pos + end], buf[start - 4 : start])
            return payload, first == FIN_TEXT
        if first & 0x08:
            self.controls += 1
        return self._hand(end)

    def _hand(self, size: int) -> object:
        """Give the next ``size`` bytes (one whole frame, or what a refused header came in) to
        websockets; its events and any error are the caller's to read."""
        pos = self.pos
        self.pos = pos + size
        self.conn.receive_data(self._buf[pos : pos + size])
        return HANDED
