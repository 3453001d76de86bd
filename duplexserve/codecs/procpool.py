"""Codec worker processes for Opus, driven from the event loop.

libopus through ctypes releases the GIL, but the Ogg framing and dispatch around each
call do not, and a thread's CPU is the loop process's; in a process the whole codec runs
on another core and the loop pays only the hand-off (docs/codecs.md). Each worker is a
child process (``worker.py``) behind a Unix socket pair. A session's codec lives in one
worker, chosen when it opens (the one with the least open cost, ``COST``), and all its
requests go there; the worker answers in the order it was asked, so replies are matched
to their requesters by order alone.

The hand-off is paid per batch, not per frame: paced sessions send at their own moments,
so a loop iteration often makes one request, and one ``sendmsg``, one worker wake-up and
one reply read per request cost the loop more than the request itself. Requests wait up
to ``batch_ms`` (``--codec-batch-ms``, 2 ms) to leave together (at once when 16 have
gathered, as every session's encode after an engine step does), the worker serves a
whole batch before it answers in one ``sendmsg``, and a reader callback drains every
reply that has arrived and hands each to its requester in one go.

A reply goes to a plain callback, ``done(status, body)`` (``submit``): the connection's
fast path resumes the session's message right there, with no future, no task and no
loop turn per frame, so one read of the worker's socket feeds every session it answered.
``call`` wraps the same in a future for code that awaits.

Wire layout, little-endian: request ``u8 op, u32 codec id, u32 length, payload``;
reply ``u8 status, u32 length, payload``, one per DECODE or ENCODE request. The payload
of OPEN_ENCODER is one byte, the Opus complexity (``libopus.py``); that of OPEN_DECODER the
session's ``OpusLimits`` (``opus_budget.py``), or nothing for no budget. A DECODE refused
for its budget is answered OVER_BUDGET, ``budget NUL message``.

A reply is as long as what the input decodes to, so reading one must cost the loop time
in proportion to its size only: a reply longer than one read is gathered in pieces and
joined once (``Reassembler``; re-copying its growing start on every 256 KiB read had cost
30 s of loop time for three replies of 300 MB, before the budget bounded them).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import os
import socket
import struct
import subprocess
import sys
import weakref
from collections.abc import Callable

import numpy as np

from duplexserve.codecs.formats import FormatError
from duplexserve.codecs.libopus import DEFAULT_COMPLEXITY, LIBOPUS
from duplexserve.codecs.opus_budget import OpusLimits, OverBudget

log = logging.getLogger(__name__)

REQUEST = struct.Struct("<BII")
REPLY = struct.Struct("<BI")
OP_OPEN_DECODER, OP_OPEN_ENCODER, OP_DECODE, OP_ENCODE, OP_CLOSE = range(5)
OK, FORMAT_ERROR, FAILED, OVER_BUDGET = range(4)
#: What a codec costs its worker per frame, in units of an Opus decode: encoding is 4 to
#: 13 times dearer (duplexserve bench codec-costs: decode 75-120 us; encode 330 us on
#: steady tones, 1300 us on speech or silence). A new codec goes to the worker with the
#: least open cost; counting codecs instead would put every session's decoder on one
#: worker and every encoder on the other.
#: With libopus loaded, encoding goes through ``libopus.py`` at complexity 5 (about 190 us
#: a frame on speech, two decodes) instead of sphn.
COST = {OP_OPEN_DECODER: 1, OP_OPEN_ENCODER: 2 if LIBOPUS is not None else 8}
_SOCKET_BUFFER = 4 << 20
#: How long a request may wait for others to share its sendmsg (and the worker's wake-up
#: and reply): sessions send at their own times, so per loop iteration there is often one.
DEFAULT_BATCH_MS = 2.0
_FULL_BATCH = 32  # buffers (16 requests with payloads): send now, the timer would add only latency
_MAX_IOV = 512  # buffers per sendmsg (Linux allows 1024)
RECV_SIZE = 256 << 10
_EMPTY = np.zeros(0, dtype=np.float32)

#: Where a reply goes: ``done(status, body)``, status OK (body: the result, a view of the
#: received bytes, valid as long as it is referenced), FORMAT_ERROR or FAILED (body: the
#: message, UTF-8). Called on the loop thread, from the worker socket's reader callback.
Done = Callable[[int, "bytes | memoryview"], None]


class CodecProcessError(RuntimeError):
    """A codec worker failed or went away; the sessions it served cannot go on."""


class Reassembler:
    """The start of an incomplete frame read from a stream socket, until it is whole.

    ``take`` returns the bytes to parse: the read itself while nothing waits (one copy, as
    before), else nothing until the ``need`` bytes of the waiting frame have come, then
    every piece joined once. Time and memory stay linear in the frame's size however many
    reads it takes.
    """

    __slots__ = ("_need", "_pieces", "_size")

    def __init__(self) -> None:
        self._pieces: list[bytes] = []
        self._size = 0
        self._need = 0

    def take(self, chunk: memoryview) -> bytes | None:
        if not self._size:
            return bytes(chunk)
        self._pieces.append(bytes(chunk))
        self._size += len(chunk)
        if self._size < self._need:
            return None
        data = b"".join(self._pieces)
        self._pieces, self._size = [], 0
        return data

    def keep(self, data: bytes, pos: int, need: int) -> None:
        """``data[pos:]`` is an incomplete frame (or none, ``pos == len(data)``) that is
        ``need`` bytes long once whole."""
        if pos < len(data):
            self._pieces, self._size, self._need = [data[pos:]], len(data) - pos, need


class _Worker:
    """The loop's end of one worker process."""

    def __init__(self, loop: asyncio.AbstractEventLoop, batch_s: float = 0.0) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for s in (parent, child):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "duplexserve.codecs.worker", str(child.fileno())],
            pass_fds=(child.fileno(),),
            stdin=subprocess.DEVNULL,
        )
        child.close()
        parent.setblocking(False)
        self.sock, self.loop = parent, loop
        self.fd = parent.fileno()
        self.alive = True
        self.load = 0  # cost units of the codecs open here (COST)
        self._waiting: collections.deque[Done] = collections.deque()  # one per DECODE/ENCODE sent
        self._unsent: collections.deque[bytes] = collections.deque()
        self._batch: list[bytes | memoryview] = []  # requests not yet sent
        self._batch_bytes = 0
        self._batch_s = batch_s
        self._flush_at: asyncio.Handle | None = None
        self._timed = False  # _flush_at is the batch window's timer (not a call_soon)
        self._rest = Reassembler()  # an incomplete reply, from the end of the last recv
        # recv_into one reused buffer: recv(n) would allocate (and, past 128 KiB, mmap) n bytes a call.
        self._chunk = bytearray(RECV_SIZE)
        self._chunk_view = memoryview(self._chunk)
        loop.add_reader(self.fd, self._on_readable)

    def request(self, op: int, cid: int, payload: bytes | memoryview = b"") -> None:
        """Queue a request; all requests queued within ``batch_s`` leave in one sendmsg."""
        if not self.alive:
            raise CodecProcessError("codec worker is gone")
        batch = self._batch
        n = len(payload)
        batch.append(REQUEST.pack(op, cid, n))
        if n:
            batch.append(payload)
        self._batch_bytes += REQUEST.size + n
        if self._flush_at is None:
            self._schedule()
        elif self._timed and len(batch) >= _FULL_BATCH:
            self._send_soon()

    def _schedule(self) -> None:
        delay, loop = self._batch_s, self.loop
        self._timed = bool(delay)
        self._flush_at = loop.call_later(delay, self._flush) if delay else loop.call_soon(self._flush)

    def _send_soon(self) -> None:
        """Enough requests to share the wake-ups already (every session's encode after an
        engine step): send at the end of this iteration rather than wait out the timer.
        (A flag, not ``isinstance(handle, asyncio.TimerHandle)``: uvloop's timer handles
        are not asyncio's, and the check never held in the server.)"""
        assert self._flush_at is not None
        self._flush_at.cancel()
        self._timed = False
        self._flush_at = self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_at = None
        self._timed = False
        batch, self._batch = self._batch, []
        total, self._batch_bytes = self._batch_bytes, 0
        if not self.alive or not batch:
            return
        if self._unsent or len(batch) > _MAX_IOV:
            data = b"".join(batch)
            if self._unsent:  # already backed up: queue behind, in order
                self._unsent.append(data)
                return
            batch = [data]
        try:
            sent = self.sock.sendmsg(batch)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._fail(CodecProcessError(f"codec worker is gone: {exc}"))
            return
        if sent < total:
            self._unsent.append(b"".join(batch)[sent:])
            self.loop.add_writer(self.fd, self._on_writable)

    def submit(self, op: int, cid: int, payload: bytes | memoryview, done: Done) -> None:
        """Queue a request whose reply goes to ``done(status, body)`` (``Done``)."""
        self.request(op, cid, payload)
        self._waiting.append(done)

    def submit_frame(self, op: int, cid: int, payload: bytes | memoryview, done: Done) -> None:
        """``submit`` for the per-frame requests (DECODE, ENCODE, with a payload), inlined:
        one Python call a frame instead of three."""
        if not self.alive:
            raise CodecProcessError("codec worker is gone")
        n = len(payload)
        batch = self._batch
        batch.append(REQUEST.pack(op, cid, n))
        batch.append(payload)
        self._batch_bytes += REQUEST.size + n
        self._waiting.append(done)
        if self._flush_at is None:
            self._schedule()
        elif self._timed and len(batch) >= _FULL_BATCH:
            self._send_soon()

    async def call(self, op: int, cid: int, payload: bytes | memoryview) -> bytes:
        """The same, awaited: the result as bytes, or FormatError / CodecProcessError."""
        future = self.loop.create_future()
        self.submit(op, cid, payload, functools.partial(_resolve, future))
        return await future

    def _on_writable(self) -> None:
        unsent = self._unsent
        while unsent:
            try:
                sent = self.sock.send(unsent[0])
            except BlockingIOError:
                return
            except OSError as exc:
                self._fail(CodecProcessError(f"codec worker is gone: {exc}"))
                return
            if sent < len(unsent[0]):
                unsent[0] = unsent[0][sent:]
                return
            unsent.popleft()
        self.loop.remove_writer(self.fd)

    def _on_readable(self) -> None:
        try:
            n = self.sock.recv_into(self._chunk)
        except BlockingIOError:
            return
        except OSError as exc:
            self._fail(CodecProcessError(f"codec worker is gone: {exc}"))
            return
        if not n:
            self._fail(CodecProcessError(f"codec worker exited ({self.proc.poll()})"))
            return
        data = self._rest.take(self._chunk_view[:n])
        if data is None:
            return
        view = memoryview(data)  # immutable bytes: the bodies are views, not copies
        pos, end, hdr, unpack = 0, len(data), REPLY.size, REPLY.unpack_from
        waiting = self._waiting
        while end - pos >= hdr:
            status, length = unpack(data, pos)
            start = pos + hdr
            if end - start < length:
                break
            pos = start + length
            done = waiting.popleft()
            try:
                done(status, view[start:pos])
            except Exception:  # one session's bug must not stop the replies of the others
                log.exception("codec reply callback failed")
        self._rest.keep(data, pos, hdr + unpack(data, pos)[1] if end - pos >= hdr else hdr)

    def _fail(self, exc: CodecProcessError) -> None:
        if not self.alive:
            return
        log.error("%s", exc)
        self.alive = False
        self.loop.remove_reader(self.fd)
        self.loop.remove_writer(self.fd)
        self.sock.close()
        message = str(exc).encode()
        while self._waiting:
            done = self._waiting.popleft()
            with contextlib.suppress(Exception):
                done(FAILED, message)
        if self.proc.poll() is None:
            self.proc.kill()

    def close(self) -> None:
        if self.alive:
            self.alive = False
            self.loop.remove_reader(self.fd)
            self.loop.remove_writer(self.fd)
            self.sock.close()  # the worker sees EOF and exits
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class CodecProcesses:
    """Up to ``size`` worker processes, started on first use (a server without Opus
    sessions never starts one); a worker that died is replaced for new sessions."""

    def __init__(self, size: int, opus_complexity: int = DEFAULT_COMPLEXITY,
                 batch_ms: float = DEFAULT_BATCH_MS, opus_limits: OpusLimits | None = None) -> None:
        self.size = size
        self.batch_s = batch_ms / 1000
        self.opus_complexity = opus_complexity  # libopus encoders, here or inline (pipeline.py)
        self.opus_limits = opus_limits  # every decoder's budget, here or inline; None: none
        self._workers: list[_Worker] = []
        self._next_id = 0
        self._cpu_seen: dict[int, float] = {}  # pid -> CPU seconds when last read

    def cpu_seconds(self) -> float:
        """CPU time of every worker started so far (user + system), for /metrics."""
        for worker in self._workers:
            with contextlib.suppress(OSError, ValueError, IndexError):
                self._cpu_seen[worker.proc.pid] = stat_cpu_seconds(f"/proc/{worker.proc.pid}/stat")
        return sum(self._cpu_seen.values())

    @property
    def enabled(self) -> bool:
        return self.size > 0

    def _pick(self) -> _Worker:
        self._workers = [w for w in self._workers if w.alive]
        if len(self._workers) < self.size:
            worker = _Worker(asyncio.get_running_loop(), self.batch_s)
            self._workers.append(worker)
            return worker
        return min(self._workers, key=lambda w: w.load)

    def _open(self, op: int, payload: bytes = b"") -> tuple[_Worker, int, int]:
        worker = self._pick()
        self._next_id = cid = (self._next_id + 1) & 0xFFFFFFFF
        worker.request(op, cid, payload)
        worker.load += COST[op]
        return worker, cid, COST[op]

    def opus_decoder(self) -> RemoteOpusDecoder:
        limits = self.opus_limits
        return RemoteOpusDecoder(*self._open(OP_OPEN_DECODER, limits.pack() if limits is not None else b""))

    def opus_encoder(self) -> RemoteOpusEncoder:
        return RemoteOpusEncoder(*self._open(OP_OPEN_ENCODER, bytes([self.opus_complexity])))

    def close(self) -> None:
        self.cpu_seconds()
        for worker in self._workers:
            worker.close()
        self._workers.clear()


def _resolve(future: asyncio.Future[bytes], status: int, body: bytes | memoryview) -> None:
    if future.done():  # its session stopped waiting
        return
    if status == OK:
        future.set_result(bytes(body))
    else:
        future.set_exception(reply_error(status, body))


def reply_error(status: int, body: bytes | memoryview) -> Exception:
    """The exception a non-OK reply stands for (FormatError: the input is at fault)."""
    text = bytes(body).decode(errors="replace")
    if status == OVER_BUDGET:
        return OverBudget(*text.split("\0", 1))
    return FormatError(text) if status == FORMAT_ERROR else CodecProcessError(text)


def stat_cpu_seconds(stat: str) -> float:
    """User + system CPU seconds from a /proc stat file: ``/proc/PID/stat`` for a process,
    ``/proc/self/task/TID/stat`` for one thread."""
    with open(stat) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _release(worker: _Worker, cid: int, cost: int) -> None:
    """Free a codec in its worker. A finalizer can run on whichever thread collects the
    codec object, so hand the work to the loop thread."""
    with contextlib.suppress(RuntimeError):  # the loop is closed: the worker is gone too
        worker.loop.call_soon_threadsafe(_release_on_loop, worker, cid, cost)


def _release_on_loop(worker: _Worker, cid: int, cost: int) -> None:
    worker.load -= cost
    if worker.alive:
        with contextlib.suppress(CodecProcessError):
            worker.request(OP_CLOSE, cid)


class _RemoteCodec:
    """A codec whose state lives in a worker; freed there when this object goes."""

    inline = False
    remote = True  # the protocol adapter awaits decode_async / encode_async instead of a pool hop

    def __init__(self, worker: _Worker, cid: int, cost: int) -> None:
        self._worker, self._cid = worker, cid
        self._submit = worker.submit_frame
        self._release = weakref.finalize(self, _release, worker, cid, cost)
        self._release.atexit = False

    def close(self) -> None:
        self._release()


class RemoteOpusDecoder(_RemoteCodec):
    async def decode_async(self, data: bytes) -> np.ndarray:
        return np.frombuffer(await self._worker.call(OP_DECODE, self._cid, data), dtype=np.float32)

    def submit(self, data: bytes | memoryview, done: Done) -> None:
        """Decode ``data``; ``done(OK, body)`` gets the float32 samples' bytes (``Done``).
        Raises CodecProcessError at once if the worker is gone."""
        self._submit(OP_DECODE, self._cid, data, done)

    def decode(self, data: bytes) -> np.ndarray:
        raise TypeError("this decoder lives in a codec process: await decode_async()")

    def flush(self) -> np.ndarray:
        return _EMPTY  # Opus holds no decoded samples back (opus.OpusStreamDecoder.flush)


class RemoteOpusEncoder(_RemoteCodec):
    async def encode_async(self, frame: np.ndarray) -> bytes:
        samples = np.ascontiguousarray(frame, dtype=np.float32)
        return await self._worker.call(OP_ENCODE, self._cid, memoryview(samples).cast("B"))

    def submit(self, frame: np.ndarray, done: Done) -> None:
        """Encode one frame; ``done(OK, body)`` gets the message's bytes (``Done``).
        Raises CodecProcessError at once if the worker is gone."""
        samples = frame if frame.flags.c_contiguous and frame.dtype == np.float32 else \
            np.ascontiguousarray(frame, dtype=np.float32)
        self._submit(OP_ENCODE, self._cid, memoryview(samples).cast("B"), done)

    def encode(self, frame: np.ndarray) -> bytes:
        raise TypeError("this encoder lives in a codec process: await encode_async()")
