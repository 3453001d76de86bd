"""A codec worker process: holds Opus codec state for many sessions, answers in order.

Started by ``procpool.CodecProcesses`` as ``python -m duplexserve.codecs.worker FD``
with one end of a Unix socket pair. Requests and replies are length-prefixed frames
(layout in ``procpool.py``); requests are served strictly in the order received, so a
session's frames stay in order and its codec is only ever used by this one thread.
The process ends when the server closes its end of the socket.

Every request that one ``recv`` brings (the loop sends a batch of many sessions' work at
once) is served before the replies leave in one ``sendmsg``, so the loop wakes once per
batch, not once per frame; only a batch longer than ``_FLUSH_AFTER_S`` of work answers
in parts, so that the first sessions of a large batch do not wait for the last.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time
from collections.abc import Callable

import numpy as np

from duplexserve.codecs import procpool as pp
from duplexserve.codecs.formats import FormatError
from duplexserve.codecs.libopus import DEFAULT_COMPLEXITY
from duplexserve.codecs.opus_budget import OpusLimits, OverBudget
from duplexserve.codecs.opus_choice import make_opus_decoder, make_opus_encoder

_FLUSH_AFTER_S = 0.004
_MAX_IOV = 512

#: codec id -> (the op it serves, the call that turns a request payload into a reply body)
Handlers = dict[int, tuple[int, Callable[[memoryview], bytes]]]


def serve(sock: socket.socket) -> None:
    handlers: Handlers = {}
    rest = pp.Reassembler()  # an incomplete request, from the end of the last recv
    hdr, unpack = pp.REQUEST.size, pp.REQUEST.unpack_from
    chunk = bytearray(pp.RECV_SIZE)  # reused: recv(n) would allocate n bytes a call
    view = memoryview(chunk)
    clock = time.perf_counter
    while True:
        n = sock.recv_into(chunk)
        if not n:
            return
        data = rest.take(view[:n])
        if data is None:
            continue
        mv = memoryview(data)  # immutable bytes: payload views need no copy
        pos, end = 0, len(data)
        replies: list[bytes] = []
        since = clock()
        while end - pos >= hdr:
            op, cid, length = unpack(data, pos)
            start = pos + hdr
            if end - start < length:
                break
            pos = start + length
            reply = _handle(handlers, op, cid, mv[start:pos])
            if reply is not None:
                replies += reply
                if len(replies) >= _MAX_IOV or clock() - since > _FLUSH_AFTER_S:
                    _send(sock, replies)
                    replies, since = [], clock()
        if replies:
            _send(sock, replies)
        rest.keep(data, pos, hdr + unpack(data, pos)[2] if end - pos >= hdr else hdr)


def _send(sock: socket.socket, buffers: list[bytes]) -> None:
    sent, total = sock.sendmsg(buffers), sum(len(b) for b in buffers)
    if sent < total:
        sock.sendall(b"".join(buffers)[sent:])


def _handle(handlers: Handlers, op: int, cid: int, payload: memoryview) -> tuple[bytes, bytes] | None:
    entry = handlers.get(cid)
    if entry is not None and entry[0] == op:
        try:
            body = entry[1](payload)
            return pp.REPLY.pack(pp.OK, len(body)), body
        except OverBudget as exc:  # the loop counts it (budgets.over_budget) and closes the session
            return _error(pp.OVER_BUDGET, f"{exc.budget}\0{exc}")
        except FormatError as exc:
            return _error(pp.FORMAT_ERROR, str(exc))
        except Exception as exc:  # one session's failure, reported to it
            return _error(pp.FAILED, f"{type(exc).__name__}: {exc}")
    if op == pp.OP_OPEN_DECODER:
        decoder = make_opus_decoder(OpusLimits.unpack(payload) if len(payload) else None)
        handlers[cid] = (pp.OP_DECODE, lambda p: decoder.decode(p).tobytes())  # type: ignore[attr-defined]
        return None
    if op == pp.OP_OPEN_ENCODER:
        encoder = make_opus_encoder(payload[0] if len(payload) else DEFAULT_COMPLEXITY)
        handlers[cid] = (pp.OP_ENCODE, lambda p: encoder.encode(np.frombuffer(p, dtype=np.float32)))  # type: ignore[attr-defined]
        return None
    if op == pp.OP_CLOSE:
        handlers.pop(cid, None)
        return None
    return _error(pp.FAILED, f"no codec {cid} for operation {op}")


def _error(status: int, message: str) -> tuple[bytes, bytes]:
    body = message.encode()
    return pp.REPLY.pack(status, len(body)), body


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    sock.setblocking(True)
    with contextlib.suppress(ConnectionError, KeyboardInterrupt):
        serve(sock)


if __name__ == "__main__":
    main()
