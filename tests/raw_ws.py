"""A WebSocket client on a bare socket, for what real clients will not do: send without
reading, send frames the library would refuse to build, keep sending after an error."""

from __future__ import annotations

import os
import socket
import struct

import numpy as np

from duplexserve.bench.attacks import upgrade


def connect(port: int, path: str = "/v1/duplex") -> tuple[socket.socket, bytes]:
    """Open and upgrade; returns the socket and any bytes that came after the 101 (a refused
    upgrade raises ConnectionError with its status line)."""
    return upgrade(port, path, timeout=10)


def frame(first: int, payload: bytes, masked: bool = True, length: int | None = None) -> bytes:
    """A client frame built by hand, so that it can also be wrong: ``first`` is its first
    byte (FIN, reserved bits, opcode), ``length`` the length its header claims."""
    n = len(payload) if length is None else length
    bit = 0x80 if masked else 0
    if n < 126:
        head = struct.pack("!BB", first, bit | n)
    elif n < 65536:
        head = struct.pack("!BBH", first, bit | 126, n)
    else:
        head = struct.pack("!BBQ", first, bit | 127, n)
    if not masked:
        return head + payload
    key = os.urandom(4)
    mask = np.frombuffer(key * (len(payload) // 4 + 1), dtype=np.uint8)[: len(payload)]
    return head + key + (np.frombuffer(payload, dtype=np.uint8) ^ mask).tobytes()


class Reader:
    """Server frames from the socket, one at a time: ``(opcode, payload)``."""

    def __init__(self, sock: socket.socket, rest: bytes = b"") -> None:
        self.sock, self.buf = sock, rest

    def next(self) -> tuple[int, bytes] | None:
        """The next frame, or None once the server closed the TCP connection."""
        while True:
            buf = self.buf
            if len(buf) >= 2:
                n, pos = buf[1] & 0x7F, 2
                if n == 126 and len(buf) >= 4:
                    n, pos = struct.unpack("!H", buf[2:4])[0], 4
                elif n == 127 and len(buf) >= 10:
                    n, pos = struct.unpack("!Q", buf[2:10])[0], 10
                if (n < 126 or pos > 2) and len(buf) >= pos + n:  # a whole frame is here
                    self.buf = buf[pos + n :]
                    return buf[0] & 0x0F, buf[pos : pos + n]
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                return None
            self.buf += chunk

    def until_close(self) -> tuple[list[tuple[int, bytes]], int | None]:
        """Every frame up to the close frame, and the close code (None: no close frame)."""
        frames = []
        while (item := self.next()) is not None:
            opcode, payload = item
            if opcode == 8:
                return frames, struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
            frames.append(item)
        return frames, None
