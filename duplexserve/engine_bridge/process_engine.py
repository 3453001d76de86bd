"""Any engine, run in a process of its own behind the same Engine interface.

Why: a model's step is not all GPU time. Kernel launches, sampling and the library's
Python bookkeeping hold the GIL, and in the server process they take it away from the
event loop that moves every session's frames. In a child process they cannot.

How: the bridge's engine thread calls this proxy exactly as it would call the engine.
Frames go through shared memory (one (slots x 1920) float32 buffer each way, written
in place, never pickled; the bridge gathers each batch straight into the input buffer);
a pipe carries only the small commands and each step's text.
While the child steps, the engine thread waits on the pipe with the GIL released.

A command with nothing to answer (open, close, end of input) is not sent on its own: it
goes with the next call, so a step costs one round trip to the child however many sessions
opened or closed since the last. Each had been a round trip of its own between two steps, and
a waiting engine thread takes the GIL back only when the event loop lets it go (up to
``sys.getswitchinterval()``, 5 ms), twice a round trip: 512 sessions opening or ending within
two seconds held every other session's steps back by a frame (docs/moshi-engine.md).
A posted command that fails (a bug: they only keep books) fails that next call and marks
the engine lost, so the bridge starts it anew.

The same wait for the GIL comes after anything the engine thread does with the GIL let go,
and a loop kept busy (an HTTP flood, issue 67) never lets it go on its own: each such
hand-off costs a switch interval. A step makes two, counted in ``handoffs``: the request's
one write and the reply's one read (:func:`_read_reply`; multiprocessing's ``recv`` reads a
header and then the body, two), and no other (the answer's frames are copied out of shared
memory with the GIL kept, :func:`_copy_kept`: numpy lets it go for any large copy).
``gil_wait_s`` is the last reply's wait, from the child's send to the engine thread running
again (the clock is the system's monotonic one, shared by both processes); the bridge
exports it and the overload manager sheds work when it grows (server/overload.py).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import logging
import multiprocessing as mp
import os
import pickle
import struct
import time
import traceback
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from duplexserve.config import ServerConfig
from duplexserve.engine_bridge.engine import Engine, MoveRefused, PromptError, StepResult

log = logging.getLogger(__name__)
#: The engine process's name in ``ps`` and ``/proc/PID/comm`` (15 characters at most), and the spare's.
ENGINE_NAME, SPARE_NAME = "ds-engine", "ds-engine-spare"


class EngineProcessError(RuntimeError):
    pass


class ProcessEngine(Engine):
    """Proxy whose ``start()`` spawns a child that builds the configured engine."""

    def __init__(self, config: ServerConfig) -> None:
        super().__init__(config.max_sessions)
        self.name = config.engine
        self._config = dataclasses.replace(config, engine_process=False)
        self._proc: mp.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._shm: list[SharedMemory] = []
        self._lost = False
        self._posted: list[tuple[Any, ...]] = []  # commands waiting for the next call
        self._spare: tuple[mp.process.BaseProcess, Connection] | None = None  # --engine-spare
        self.handoffs = 0  # calls that let the GIL go and had to take it back (see above)
        self.gil_wait_s = 0.0  # the last reply's, from the child's send to this thread running
        self.child_step_s = 0.0  # the last step's time in the child

    def start(self) -> None:
        if not self._shm:
            size = self.num_slots * self.frame_samples * 4
            self._shm = [SharedMemory(create=True, size=size) for _ in range(2)]
            shape = (self.num_slots, self.frame_samples)
            self._in = np.ndarray(shape, np.float32, buffer=self._shm[0].buf)
            self._out = np.ndarray(shape, np.float32, buffer=self._shm[1].buf)
        self.input_buffer = self._in  # the bridge gathers each batch straight into shared memory
        began = time.perf_counter()
        try:
            spare, self._spare = self._spare, None
            if spare is not None and not spare[0].is_alive():
                _end(*spare)
                spare = None
            self._proc, self._conn = spare or self._spawn()  # a spare's imports are done
            self._lost = False
            # The child's engine says what input.end takes and whether sessions take prompts.
            self.tail, self.takes_prompts, self.voices, imported = self._call(("start",))
        except BaseException:
            # A refused start (the memory plan, a missing checkpoint) stops the child, which
            # stops its half-built engine, and unlinks the buffers: a daemon child killed at
            # exit and buffers left linked were the resource tracker's "leaked" warnings.
            self.stop()
            raise
        log.info(
            "engine process ready in %.1f s (%s)", time.perf_counter() - began,
            "a spare, imported before" if spare is not None else f"spawn and imports {imported:.1f} s",
        )  # fmt: skip
        if self._config.engine_spare == "on":
            self._spare = self._spawn()  # imports while this one serves; waits for a restart

    def _spawn(self) -> tuple[mp.process.BaseProcess, Connection]:
        """A child on the buffers, importing what its engine's start needs, then waiting."""
        ctx = mp.get_context("spawn")  # never fork a process that holds threads (or CUDA)
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=_child_main,
            args=(child, self._config, [s.name for s in self._shm], time.time()),
            name="duplexserve-engine",
            daemon=True,
        )
        try:
            proc.start()
        finally:
            child.close()
        return proc, parent

    def discard(self) -> None:
        """After a failure: this child goes, the spare and the buffers stay for ``start()``."""
        self._stop_child()

    def _post(self, message: tuple[Any, ...]) -> None:
        """Send ``message`` with the next call (see above)."""
        if self._conn is None:
            raise EngineProcessError("engine process is not running")
        self._posted.append(message)

    def _call(self, message: tuple[Any, ...]) -> Any:
        conn = self._conn
        if conn is None:
            raise EngineProcessError("engine process is not running")
        posted, self._posted = self._posted, []
        try:
            conn.send((posted, message))  # one write (two for a message over 16 KiB)
            status, value, sent = _read_reply(conn.fileno())  # blocks with the GIL released
        except (EOFError, OSError, BrokenPipeError) as exc:
            self._lost = True  # the pipe broke: it is dead even if not yet reaped
            raise EngineProcessError("engine process died") from exc
        self.gil_wait_s = time.monotonic() - sent
        self.handoffs += 2
        if status == "lost":
            self._lost = True  # a posted command failed: alive() is False, the bridge restarts
            raise EngineProcessError(value)
        if status == "prompt_error":
            raise PromptError(*value)
        if status == "move_refused":
            raise MoveRefused(*value)
        if status != "ok":
            raise EngineProcessError(value)
        return value

    def alive(self) -> bool:
        return not self._lost and self._proc is not None and self._proc.is_alive()

    def open(self, slot: int, params: dict[str, Any]) -> None:
        self._post(("open", slot, params))

    def close(self, slot: int) -> None:
        self._post(("close", slot))

    def prompt(self, slot: int, params: dict[str, Any]) -> None:
        self._call(("prompt", slot, params))

    def prompt_cached(self, params: dict[str, Any]) -> bool:
        return bool(self._call(("prompt_cached", params)))

    def warm(self) -> bool:
        return bool(self._call(("warm",)))

    def export_slot(self, slot: int) -> bytes:
        """The child engine's export, its bytes through the pipe (a session's state: megabytes
        to a few gigabytes, sent once a move); ``MoveRefused`` comes back as itself."""
        return bytes(self._call(("export", slot)))

    def import_slot(self, slot: int, state: bytes) -> None:
        self._call(("import", slot, state))

    def end_input(self, slot: int, frames: int) -> None:
        self._post(("end_input", slot, frames))

    def step(self, slots: np.ndarray, frames: np.ndarray) -> StepResult:
        n = len(slots)
        if frames.base is not self._in:  # not gathered into the shared buffer already
            self._in[:n] = frames
        text, finished, failed, kv_stops, self.child_step_s = self._call(("step", slots))
        return StepResult(_copy_kept(self._out[:n]), text, finished, failed, kv_stops)

    def stop(self) -> None:
        self._stop_child()
        if self._spare is not None:
            _end(*self._spare)
            self._spare = None
        self.input_buffer = None
        for shm in self._shm:
            shm.close()
            shm.unlink()
        self._shm = []

    def _stop_child(self) -> None:
        try:
            if self._conn is not None and self._proc is not None and self._proc.is_alive():
                self._call(("stop",))
        except EngineProcessError:
            pass
        if self._proc is not None:
            _end(self._proc, self._conn)
        self._posted = []  # for the child that is gone: a new one starts with no slot open
        self._proc = self._conn = None


def _read_reply(fd: int) -> tuple[Any, Any, float]:
    """The child's reply, ``(status, value, sent)``, in one read where it fits (every step's
    does): multiprocessing's framing, a 4-byte big-endian length then the pickle, read with
    ``os.read`` rather than ``Connection.recv``'s read of the header and then of the body."""
    data = os.read(fd, 1 << 16)
    while len(data) < 4:
        more = os.read(fd, 4 - len(data)) if data else b""
        if not more:
            raise EOFError
        data += more
    (size,) = struct.unpack("!i", data[:4])
    start = 4
    if size == -1:  # over 2 GiB (an exported slot's state may be): an 8-byte length follows
        data = _read_at_least(fd, data, 12)
        (size,) = struct.unpack("!Q", data[4:12])
        start = 12
    body = _read_at_least(fd, data, start + size)
    return pickle.loads(memoryview(body)[start : start + size])  # type: ignore[no-any-return]


def _read_at_least(fd: int, data: bytes, n: int) -> bytes:
    """``data`` and what follows it on ``fd``, ``n`` bytes at least."""
    parts, have = [data], len(data)
    while have < n:
        more = os.read(fd, n - have)
        if not more:
            raise EOFError
        parts.append(more)
        have += len(more)
    return b"".join(parts) if len(parts) > 1 else data


def _copy_kept(frames: np.ndarray) -> np.ndarray:
    """A copy of ``frames`` made with the GIL kept: through a bytearray, not numpy's copy,
    which lets the GIL go and then waits for it like any other hand-off."""
    out = np.frombuffer(bytearray(memoryview(frames).cast("B")), frames.dtype)
    return out.reshape(frames.shape)


def _end(proc: mp.process.BaseProcess, conn: Connection | None) -> None:
    """Wait for a child told to stop (a spare stops when its pipe closes), else kill it."""
    if conn is not None:
        conn.close()
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def _name_process(name: str) -> None:
    """What ``ps``, ``top`` and ``/proc/PID/comm`` call this process (Linux; elsewhere nothing)."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name)
    except OSError:
        pass


def _attach(name: str) -> SharedMemory:
    """Map the parent's buffer. The parent owns and unlinks it; a spawned child shares
    the parent's resource tracker, so attaching here registers nothing new."""
    try:
        return SharedMemory(name=name, track=False)  # type: ignore[call-arg]  # Python >= 3.13
    except TypeError:
        return SharedMemory(name=name)


def _child_main(conn: Connection, config: ServerConfig, shm_names: list[str], spawned: float) -> None:
    """The engine process: import what the engine's start needs, wait for ``start``, build
    the engine, then serve commands until stop or EOF (a spare waits here until a restart)."""
    from duplexserve.engine_bridge.local import build_local_engine

    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s engine %(message)s")
    _name_process(SPARE_NAME)
    if config.engine == "moshi":
        from duplexserve.engine_bridge.moshi.engine import COMPILE_IMPORTS, START_IMPORTS

        for name in START_IMPORTS + (COMPILE_IMPORTS if config.moshi_compile == "on" else ()):
            importlib.import_module(name)
    imported = time.time() - spawned  # from the parent's spawn: the start a spare saves
    shms = [_attach(name) for name in shm_names]
    shape = (config.max_sessions, 1920)
    frames_in = np.ndarray(shape, np.float32, buffer=shms[0].buf)
    frames_out = np.ndarray(shape, np.float32, buffer=shms[1].buf)
    engine: Engine | None = None
    try:
        while True:
            try:
                posted, message = conn.recv()
            except EOFError:
                return
            try:
                for command in posted:
                    assert engine is not None
                    _apply(engine, command)
            except Exception:  # the engine's books may be wrong now: the parent starts anew
                conn.send(("lost", traceback.format_exc(), time.monotonic()))
                continue
            kind = message[0]
            try:
                if kind == "step":
                    slots = message[1]
                    assert engine is not None
                    began = time.perf_counter()
                    result = engine.step(slots, frames_in[: len(slots)])
                    frames_out[: len(slots)] = result.audio
                    took = time.perf_counter() - began
                    reply = (result.text, result.finished, result.failed, result.kv_stops, took)
                    conn.send(("ok", reply, time.monotonic()))
                elif kind == "prompt":
                    assert engine is not None
                    engine.prompt(message[1], message[2])
                    conn.send(("ok", None, time.monotonic()))
                elif kind == "warm":
                    assert engine is not None
                    conn.send(("ok", engine.warm(), time.monotonic()))
                elif kind == "export":
                    assert engine is not None
                    conn.send(("ok", engine.export_slot(message[1]), time.monotonic()))
                elif kind == "import":
                    assert engine is not None
                    engine.import_slot(message[1], message[2])
                    conn.send(("ok", None, time.monotonic()))
                elif kind == "prompt_cached":
                    assert engine is not None
                    conn.send(("ok", engine.prompt_cached(message[1]), time.monotonic()))
                elif kind == "start":
                    _name_process(ENGINE_NAME)
                    engine = build_local_engine(config)
                    engine.start()
                    gc.collect()  # then torch and the model stay out of every later
                    gc.freeze()  # collection's walk (as the server does: server/gc_pauses.py)
                    started = (engine.tail, engine.takes_prompts, engine.voices, imported)
                    conn.send(("ok", started, time.monotonic()))
                elif kind == "stop":
                    conn.send(("ok", None, time.monotonic()))
                    return
            except PromptError as exc:  # refused, not failed: the parent raises it with its code
                conn.send(("prompt_error", (exc.code, str(exc)), time.monotonic()))
            except MoveRefused as exc:  # the same for a move
                conn.send(("move_refused", (exc.code, str(exc)), time.monotonic()))
            except Exception:  # the parent raises it where the call was made
                conn.send(("error", traceback.format_exc(), time.monotonic()))
    finally:
        if engine is not None:
            try:
                engine.stop()
            except Exception:
                log.exception("engine failed to stop cleanly")
        del frames_in, frames_out
        for shm in shms:
            shm.close()


def _apply(engine: Engine, command: tuple[Any, ...]) -> None:
    """A posted command: ``("open", slot, params)``, ``("close", slot)`` or
    ``("end_input", slot, frames)``."""
    kind = command[0]
    if kind == "open":
        engine.open(command[1], command[2])
    elif kind == "close":
        engine.close(command[1])
    else:
        engine.end_input(command[1], command[2])
