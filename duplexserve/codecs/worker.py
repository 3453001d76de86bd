"""A codec worker process: holds Opus codec state for many sessions, answers in order.

Started by ``procpool.CodecProcesses`` as ``python -m duplexserve.codecs.worker FD``
with one end of a Unix socket pair. Requests and replies are length-prefixed frames
(layout in ``procpool.py``); requests are served strictly in the order received, so a
session's frames stay in order and its codec is only ever used by this one thread.
The process ends when the server closes its end of the socket.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time

import numpy as np

from duplexserve.codecs import procpool as pp
from duplexserve.codecs.formats import FormatError
from duplexserve.codecs.libopus import DEFAULT_COMPLEXITY, LibopusStreamEncoder, make_opus_encoder
from duplexserve.codecs.opus import OpusStreamDecoder, OpusStreamEncoder

_FLUSH_AFTER_S = 0.001


def serve(sock: socket.socket) -> None:
    codecs: dict[int, OpusStreamDecoder | OpusStreamEncoder | LibopusStreamEncoder] = {}
    buf = bytearray()
    hdr = pp.REQUEST.size
    chunk = bytearray(pp.RECV_SIZE)  # reused: recv(n) would allocate n bytes a call
    view = memoryview(chunk)
    while True:
        n = sock.recv_into(chunk)
        if not n:
            return
        buf += view[:n]
        pos = 0
        replies: list[bytes] = []
        since = time.perf_counter()
        while len(buf) - pos >= hdr:
            op, cid, length = pp.REQUEST.unpack_from(buf, pos)
            if len(buf) - pos - hdr < length:
                break
            payload = bytes(buf[pos + hdr : pos + hdr + length])
            pos += hdr + length
            reply = _handle(codecs, op, cid, payload)
            if reply is not None:
                status, body = reply
                replies += (pp.REPLY.pack(status, len(body)), body)
                # Answer in batches (fewer wake-ups of the loop), but never hold a reply
                # back for more than about a millisecond of work.
                if time.perf_counter() - since > _FLUSH_AFTER_S:
                    sock.sendall(b"".join(replies))
                    replies, since = [], time.perf_counter()
        if replies:
            sock.sendall(b"".join(replies))
        del buf[:pos]


def _handle(codecs: dict, op: int, cid: int, payload: bytes) -> tuple[int, bytes] | None:
    if op == pp.OP_OPEN_DECODER:
        codecs[cid] = OpusStreamDecoder()
        return None
    if op == pp.OP_OPEN_ENCODER:
        codecs[cid] = make_opus_encoder(payload[0] if payload else DEFAULT_COMPLEXITY)
        return None
    if op == pp.OP_CLOSE:
        codecs.pop(cid, None)
        return None
    codec = codecs.get(cid)
    try:
        if op == pp.OP_DECODE and isinstance(codec, OpusStreamDecoder):
            return pp.OK, codec.decode(payload).tobytes()
        if op == pp.OP_ENCODE and isinstance(codec, (OpusStreamEncoder, LibopusStreamEncoder)):
            return pp.OK, codec.encode(np.frombuffer(payload, dtype=np.float32))
        return pp.FAILED, f"no codec {cid} for operation {op}".encode()
    except FormatError as exc:
        return pp.FORMAT_ERROR, str(exc).encode()
    except Exception as exc:  # one session's failure, reported to it
        return pp.FAILED, f"{type(exc).__name__}: {exc}".encode()


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    sock.setblocking(True)
    with contextlib.suppress(ConnectionError, KeyboardInterrupt):
        serve(sock)


if __name__ == "__main__":
    main()
