"""The bridge between the event-loop thread and the engine thread.

Into the engine: a bounded janus queue. The items of one loop iteration (frames and
controls, in the order they came) go in as one entry with ``put_nowait``: one lock and at
most one wake-up of the engine thread per iteration, not per frame. A frame that finds
the queue full is not taken (``try_submit`` says so) and waits, first in its session's
FIFO, for the next results to wake the loop. Only an entry that finds the queue full at
the end of the iteration (controls cannot wait) takes the slow path of
``overflow.OrderedPutter``: one executor task per full-queue episode, order kept.

Out of the engine: each step's result is appended to a deque and the loop is woken
with ``call_soon_threadsafe`` only if no wake-up is already pending, so a busy loop
takes several steps per wake-up and never one call per frame.

Stepping on a clock (``tick_s``, one frame by default for the moshi engine): see
``batcher.StepClock``. Between ticks the engine thread sleeps in short slices and
drains the queue after each, so the queue never fills while it waits.

Gathering (``gather``, the moshi engine's default): at once, but under load a step waits
for the frames due within its own duration (``batcher.Gather``), blocked on the queue, so
a frame that comes ends the wait at once.

Queue entries are ``(received, items)``: ``time.monotonic()`` when the iteration's items
were put, so a frame's age counts from its arrival, not from when a busy engine thread
got to it. Items are ``(slot, generation, payload)``: payload is a frame (an ndarray view of
the received bytes), or an :class:`Open` / :class:`Close` control. The generation
stamps every output, so a late output of a closed session never reaches the next
occupant of its slot.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import janus
import numpy as np

from duplexserve.engine_bridge.batcher import FifoBatcher, Gather, SlotBatcher, StepClock
from duplexserve.engine_bridge.engine import Engine, MoveRefused, PromptError
from duplexserve.engine_bridge.overflow import OrderedPutter

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Open:
    params: dict[str, Any] = field(default_factory=dict)


#: Called on the loop once the engine ran a prompt: None, or (error code, message).
PromptDone = Callable[[tuple[str, str] | None], None]


@dataclass(slots=True)
class Prompt:
    params: dict[str, Any]
    done: PromptDone


@dataclass(slots=True)
class Close:
    pass


@dataclass(slots=True)
class EndInput:
    frames: int  # input frames of the session; the tail starts at this index


#: Called on the loop with what a move asked of the engine: the state (export), None
#: (import done), or a ``MoveRefused``/other exception.
MoveDone = Callable[[bytes | BaseException | None], None]


@dataclass(slots=True)
class Export:
    """Export the slot's state once every frame submitted before it was stepped."""

    done: MoveDone


@dataclass(slots=True)
class Import:
    """Open the slot with an exported state (``Engine.import_slot``) instead of ``open``."""

    state: bytes
    done: MoveDone


_CLOSE = Close()
_TICK_SLICE_S = 0.01  # between ticks, drain the queue this often
_ALIVE_CHECK_S = 0.5  # while idle, ask the engine this often whether it is alive
#: Prompts run between two steps for at most about this long (one prefill may take longer):
#: a burst of new sessions waits for the next steps, the live ones' frames do not wait for it.
_PROMPT_BUDGET_S = 0.02
#: Why an engine was restarted: a step raised, its process died, or a step never returned.
RESTART_CAUSES = ("step_failed", "engine_died", "stalled")
_STOP = object()
OUTPUT_FAILED = "this session's output could not be rendered; the other sessions go on"


@dataclass(slots=True)
class StepOutput:
    """What one engine step returns to the loop: row i belongs to ``slots[i]``."""

    slots: np.ndarray
    generations: np.ndarray
    audio: np.ndarray | None
    text: dict[int, str]
    error: str | None = None
    message: str = ""  # the error's text for the client (empty: the engine's failure)
    finished: list[int] | None = None  # rows whose answer ended (StepResult.finished)
    duration_s: float = 0.0
    published: float = 0.0  # perf_counter when the engine thread handed it to the loop
    #: On a step clock: how long after its tick the step started, and whether it was a
    #: catch-up step (frames that missed their tick; it costs a whole step on the GPU).
    tick_lag_s: float | None = None
    catch_up: bool = False
    arrived_past_due_s: float = 0.0  # the latest of its frames' arrival past its due time
    gil_wait_s: float = 0.0  # the engine's answer waited this long for the GIL (Engine.gil_wait_s)


@dataclass(slots=True)
class BridgeCounts:
    fast_puts: int = 0  # frames accepted for the engine without waiting
    queue_puts: int = 0  # janus puts: one per loop iteration that produced items
    full_waits: int = 0  # frames that found the queue full and waited on the loop for room
    slow_puts: int = 0  # items sent through the executor-drained overflow FIFO
    executor_submissions: int = 0
    loop_wakeups: int = 0
    steps: int = 0
    frames_stepped: int = 0
    catch_up_steps: int = 0  # clock steps for frames that missed their tick
    catch_up_frames: int = 0
    gather_waits: int = 0  # steps that waited for frames due within them (batcher.Gather)
    gather_wait_s: float = 0.0  # how long they waited, together
    engine_errors: int = 0
    output_failures: int = 0  # sessions ended because their output could not be rendered
    engine_restarts: int = 0
    kv_context_stops: int = 0  # calls whose KV context stopped growing (StepResult.kv_stops)
    gil_wait_s: float = 0.0  # the steps' answers' waits for the GIL, together (Engine.gil_wait_s)
    gil_wait_max_s: float = 0.0  # the largest since the overload manager last took it
    #: Sessions ended by restarts, per cause (:data:`RESTART_CAUSES`): every session the
    #: failed engine held lost its model state.
    sessions_ended_by_restart: collections.Counter[str] = field(default_factory=collections.Counter)


class EngineBridge:
    def __init__(
        self,
        engine: Engine,
        on_outputs: Callable[[list[StepOutput]], None],
        queue_size: int = 256,
        window: int = 8,
        on_step: Callable[[StepOutput], None] | None = None,
        counts: BridgeCounts | None = None,
        coalesce_s: float = 0.0,
        tick_s: float = 0.0,
        on_deliver: Callable[[float, float], None] | None = None,
        gather: bool = False,
    ) -> None:
        self.engine = engine
        #: After an idle wait, let this long pass before stepping, so one step (and one
        #: wake-up of the loop) serves the frames of many sessions instead of one.
        self.coalesce_s = coalesce_s
        #: Step on a clock of this period (0: whenever a frame is pending).
        self.clock = StepClock(tick_s) if tick_s else None
        frame_s = engine.frame_samples / 24000
        #: At once, but under load a step waits for the frames due within it (not on a clock).
        self.gather = Gather(frame_s) if gather and not tick_s else None
        self.counts = counts or BridgeCounts()
        self._on_outputs = on_outputs
        self.on_step = on_step
        #: Told, per wake-up of the loop, how long the oldest result waited for the loop
        #: and how long handing the answers to the sessions took (where a frame's time goes
        #: between the step and the socket).
        self.on_deliver = on_deliver
        self._queue_size = queue_size
        self._batcher = (
            SlotBatcher(engine.num_slots, window, frame_s)
            if tick_s or self.gather
            else FifoBatcher(engine.num_slots, window)
        )
        self._queue: janus.Queue[tuple[float, list[tuple[int, int, Any]]]] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready: asyncio.Future[None] | None = None
        # Loop -> engine: the items of one loop iteration, then the slow path.
        self._batch: list[tuple[int, int, Any]] = []
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bridge-put")
        self._putter: OrderedPutter[tuple[float, list[tuple[int, int, Any]]]] | None = None
        # Engine -> loop.
        self._results: collections.deque[StepOutput] = collections.deque()
        self._wake_pending = False
        self._open: dict[int, int] = {}  # open slot: its generation (all end if the engine does)
        self._prompts: collections.deque[tuple[int, int, Prompt]] = collections.deque()  # to run
        self._exports: list[tuple[int, int, Export]] = []  # waiting for their slot's frames to be stepped
        self.running = False  # False while starting, restarting or stopped: /ready says 503
        self.abandoned = False  # set when a stalled engine is replaced: its thread exits
        self.step_started = 0.0  # monotonic start of the step in progress, 0 when idle
        self._cold = True  # the engine may have start-up work left (Engine.warm), until it says not

    # ------------------------------------------------------------------ loop side
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue = janus.Queue(maxsize=self._queue_size)
        self._putter = OrderedPutter(
            self._queue.async_q.put_nowait,
            self._queue.sync_q.put,
            asyncio.QueueFull,
            self.counts,
            self._executor,
        )
        self._ready = self._loop.create_future()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        await self._ready
        self.running = True

    async def stop(self) -> None:
        if self._thread is None or self._queue is None:
            return
        self.running = False
        self.submit((-1, 0, _STOP))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10.0)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._queue.close()
        await self._queue.wait_closed()
        self._thread = None

    def abandon(self) -> None:
        """Give up on a stalled engine thread: its late results are dropped, it exits."""
        self.abandoned = True
        self.running = False
        if self._queue is not None:
            self._queue.close()  # unblocks the overflow drainer, if one waits for room

    def take_gil_wait(self) -> float:
        """The largest wait of a step's answer for the GIL since the last call (server/overload.py)."""
        counts = self.counts
        wait, counts.gil_wait_max_s = counts.gil_wait_max_s, 0.0
        return wait

    def qsize(self) -> int:
        return self._queue.sync_q.qsize() if self._queue is not None else 0

    def try_submit(self, item: tuple[int, int, Any]) -> bool:
        """Put a frame if the queue has room now; False means wait for the next results.

        The orchestrator keeps a refused frame at the head of its session's FIFO and
        tries again when the engine's next results wake the loop: a full queue is waited
        out on the loop, in order, with no thread hop and no extra wake-up.
        """
        assert self._queue is not None and self._putter is not None
        if self._putter.backed_up or self._queue.async_q.full():
            self.counts.full_waits += 1
            return False
        self._enqueue(item)
        self.counts.fast_puts += 1
        return True

    def _enqueue(self, item: tuple[int, int, Any]) -> None:
        """Collect this loop iteration's items; they go to the engine as one queue entry."""
        batch = self._batch
        batch.append(item)
        if len(batch) == 1:
            assert self._loop is not None
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Put the iteration's items with one ``put_nowait``: one lock, one wake-up."""
        batch, self._batch = self._batch, []
        if self.abandoned or self._putter is None:
            return
        if self._putter.put((time.monotonic(), batch), len(batch)):
            self.counts.queue_puts += 1

    def submit(self, item: tuple[int, int, Any]) -> None:
        """Hand a control (open, close) to the engine thread, in order with the frames.

        Controls cannot wait for results: if the queue is full when the iteration's
        items are put, they go to the overflow FIFO that one executor task drains.
        """
        assert self._queue is not None
        self._enqueue(item)

    def open(self, slot: int, generation: int, params: dict[str, Any]) -> None:
        self.submit((slot, generation, Open(params)))

    def prompt(self, slot: int, generation: int, params: dict[str, Any], done: PromptDone) -> None:
        """Run a session's prompt (Engine.prompt) after its open, before its frames."""
        self.submit((slot, generation, Prompt(params, done)))

    def close(self, slot: int, generation: int) -> None:
        self.submit((slot, generation, _CLOSE))

    def end_input(self, slot: int, generation: int, frames: int) -> None:
        self.submit((slot, generation, EndInput(frames)))

    async def export(self, slot: int, generation: int) -> bytes:
        """The slot's engine state (``Engine.export_slot``), taken on the engine thread between
        steps once every frame submitted for it before this call was stepped; the answers to
        those frames reach the session (``on_outputs``) before this returns. The slot stays open.
        ``MoveRefused`` if the engine cannot, or the session ended meanwhile (``move_gone``)."""
        return await self._move(slot, generation, Export)  # type: ignore[return-value]

    async def import_(self, slot: int, generation: int, state: bytes) -> None:
        """Open ``slot`` for a session moved here, with the state another replica's export
        made (instead of :meth:`open`); ``MoveRefused`` if the engine takes none or not this one."""
        await self._move(slot, generation, Import, state)

    async def _move(self, slot: int, generation: int, kind: Any, *args: Any) -> bytes | None:
        assert self._loop is not None
        future: asyncio.Future[bytes | None] = self._loop.create_future()

        def done(outcome: bytes | BaseException | None) -> None:
            if future.done():
                return
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

        self.submit((slot, generation, kind(*args, done)))
        return await future

    async def submit_offloaded(self, item: tuple[int, int, Any]) -> None:
        """The per-frame thread hop of vLLM-Omni's frontend, kept only to measure against."""
        assert self._queue is not None and self._loop is not None
        self.counts.executor_submissions += 1
        self.counts.slow_puts += 1
        entry = (time.monotonic(), [item])
        await self._loop.run_in_executor(None, self._queue.sync_q.put, entry)

    def _deliver(self) -> None:
        started = time.perf_counter()
        self._wake_pending = False
        self.counts.loop_wakeups += 1
        results = self._results
        batch = []
        while results:
            batch.append(results.popleft())
        if batch:
            self._on_outputs(batch)
            if self.on_deliver is not None:
                self.on_deliver(started - batch[0].published, time.perf_counter() - started)

    # ---------------------------------------------------------------- engine side
    def _publish(self, out: StepOutput) -> None:
        assert self._loop is not None
        if self.abandoned:
            return
        out.published = time.perf_counter()
        self._results.append(out)
        if not self._wake_pending:
            self._wake_pending = True
            with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
                self._loop.call_soon_threadsafe(self._deliver)

    def _run(self) -> None:
        assert self._loop is not None and self._queue is not None and self._ready is not None
        ready = self._ready
        try:
            self.engine.start()
        except BaseException as exc:
            log.exception("engine failed to start")
            self._loop.call_soon_threadsafe(_set_exception, ready, exc)
            return
        self._loop.call_soon_threadsafe(_set_result, ready)
        sync_q = self._queue.sync_q
        batcher = self._batcher
        clock, gather = self.clock, self.gather
        coalesce_s = 0.0 if clock else self.coalesce_s
        try:
            while True:
                if not batcher.pending and not self._prompts and not self._exports:  # idle: block for work
                    warm = self._cold and not self._open  # start-up work left, and no frame to delay
                    try:
                        entry = sync_q.get_nowait() if warm else sync_q.get(timeout=_ALIVE_CHECK_S)
                    except janus.SyncQueueEmpty:  # idle sessions learn of a dead engine too, and
                        if warm:
                            self._warm()
                        elif not self.engine.alive():  # with none, /ready says so until it is back
                            self._restart("engine_died")
                        continue
                    if self._take_all(entry):
                        return
                    if coalesce_s:
                        time.sleep(coalesce_s)
                while True:  # drain everything pending, then step once
                    try:
                        entry = sync_q.get_nowait()
                    except janus.SyncQueueEmpty:
                        break
                    if self._take_all(entry):
                        return
                if self._prompts:
                    self._run_prompts()
                if self._exports:
                    self._run_exports()
                if not batcher.pending:
                    continue
                if clock is not None:
                    now = time.monotonic()
                    wait, cutoff = clock.decide(now, batcher.oldest_due())
                    if wait > 0.0:
                        time.sleep(min(wait, _TICK_SLICE_S))  # then drain again
                        continue
                    self._step(cutoff, now - clock.last, clock.catch_up)
                elif gather is not None and (wait := gather.wait(time.monotonic(), batcher)) > 0.0:
                    entry = self._gather_wait(sync_q, wait)
                    if entry is not None and self._take_all(entry):
                        return
                    continue  # decide again, with what came
                else:
                    self._step()
                if self.abandoned:
                    return
        except janus.SyncQueueShutDown:
            return
        finally:
            try:
                self.engine.stop()
            except Exception:
                log.exception("engine failed to stop cleanly")

    def _warm(self) -> None:
        """The engine's start-up work left for later, a piece at a time (``Engine.warm``)."""
        self.step_started = time.monotonic()  # the stall check covers it as it does a step
        try:
            self._cold = self.engine.warm()
        except Exception:
            log.exception("engine failed in its idle warm-up")
            self._restart("step_failed" if self.engine.alive() else "engine_died")
        finally:
            self.step_started = 0.0

    def _gather_wait(self, sync_q: Any, wait: float) -> tuple[float, list[tuple[int, int, Any]]] | None:
        """Wait up to ``wait`` for the frames due within the coming step (``batcher.Gather``),
        blocked on the queue: the entry that ended the wait, or None (the time is up)."""
        started = time.monotonic()
        try:
            return sync_q.get(timeout=wait)  # type: ignore[no-any-return]
        except janus.SyncQueueEmpty:
            return None
        finally:
            self.counts.gather_waits += 1  # per wait: a step may wait in a few pieces
            self.counts.gather_wait_s += time.monotonic() - started

    def _take_all(self, entry: tuple[float, list[tuple[int, int, Any]]]) -> bool:
        """Apply one queue entry (a loop iteration's items); True means stop."""
        received, items = entry
        take = self._take
        return any(take(item, received) for item in items)

    def _take(self, item: tuple[int, int, Any], received: float) -> bool:
        """Apply one item from the queue; True means stop."""
        slot, generation, payload = item
        if payload.__class__ is np.ndarray:
            if not self._batcher.push(slot, generation, payload, received):
                self._fail_slot(slot, generation, "frame_window_exceeded")
            return False
        if payload is _STOP:
            return True
        if payload.__class__ is Open:
            if not self.engine.alive():  # died since the last check: the session opens on the next
                self._restart("engine_died")
            self._batcher.open(slot, generation)
            self._open[slot] = generation
            try:
                self.engine.open(slot, payload.params)
            except Exception:
                log.exception("engine.open failed for slot %d", slot)
                if not self.engine.alive():
                    self._restart("engine_died")
                else:
                    self._fail_slot(slot, generation, "engine_error")
        elif payload.__class__ is Prompt:
            self._prompts.append((slot, generation, payload))
        elif payload.__class__ is Export:
            self._exports.append((slot, generation, payload))
        elif payload.__class__ is Import:
            self._import(slot, generation, payload)
        elif payload.__class__ is EndInput:
            if self._open.get(slot) == generation:
                self.engine.end_input(slot, payload.frames)
        else:
            self._batcher.close(slot)
            self._open.pop(slot, None)
            try:
                self.engine.close(slot)
            except Exception:
                log.exception("engine.close failed for slot %d", slot)
                if not self.engine.alive():
                    self._restart("engine_died")
        return False

    def _run_prompts(self) -> None:
        """The prompts waiting, in order, until a second one would need a forward or their time
        passed ``_PROMPT_BUDGET_S``: a step of the live sessions waits for one prefill at most
        (a prompt the engine ran before is a copy of its keys and values, about 9 ms for
        personaplex-7b on the H200; one whose session ended costs nothing)."""
        forward = False
        started = time.perf_counter()
        while self._prompts:
            slot, generation, payload = self._prompts[0]
            live = self._open.get(slot) == generation
            cached = not live or self.engine.prompt_cached(payload.params)
            over = time.perf_counter() - started > _PROMPT_BUDGET_S
            if live and (over or (forward and not cached)):
                return
            self._prompts.popleft()
            forward = forward or not cached
            self._prompt(slot, generation, payload)

    def _prompt(self, slot: int, generation: int, payload: Prompt) -> None:
        """The prompt runs on this thread (a prefill: one forward), between two steps."""
        outcome: tuple[str, str] | None = None
        if self._open.get(slot) == generation:
            try:
                self.engine.prompt(slot, payload.params)
            except PromptError as exc:
                outcome = (exc.code, str(exc))
            except Exception:
                log.exception("engine.prompt failed for slot %d", slot)
                outcome = ("engine_error", "the engine failed to run the prompt")
                if not self.engine.alive():
                    self._restart("engine_died")
                else:
                    self._fail_slot(slot, generation, "engine_error")
        else:
            outcome = ("engine_error", "the session ended before its prompt ran")
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
            self._loop.call_soon_threadsafe(payload.done, outcome)

    def _answer(self, done: MoveDone, outcome: bytes | BaseException | None) -> None:
        """Hand a move's outcome to the loop, after the results published so far (both go
        through ``call_soon_threadsafe``, in order)."""
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed during shutdown
            self._loop.call_soon_threadsafe(done, outcome)

    def _run_exports(self) -> None:
        """Export the slots none of whose frames still wait for a step; the others wait."""
        waiting = []
        for slot, generation, payload in self._exports:
            if self._open.get(slot) != generation:
                self._answer(payload.done, MoveRefused("move_gone", "the session ended before its export"))
            elif self._batcher.held(slot):
                waiting.append((slot, generation, payload))
            else:
                try:
                    state: bytes | BaseException = self.engine.export_slot(slot)
                except Exception as exc:  # MoveRefused, or a failure: the session stays here
                    if not isinstance(exc, MoveRefused):
                        log.exception("engine.export_slot failed for slot %d", slot)
                    state = exc
                self._answer(payload.done, state)
        self._exports = waiting

    def _import(self, slot: int, generation: int, payload: Import) -> None:
        if not self.engine.alive():
            self._restart("engine_died")
        try:
            self.engine.import_slot(slot, payload.state)
        except Exception as exc:
            if not isinstance(exc, MoveRefused):
                log.exception("engine.import_slot failed for slot %d", slot)
            self._answer(payload.done, exc)
            return
        self._batcher.open(slot, generation)
        self._open[slot] = generation
        self._answer(payload.done, None)

    def _fail_slot(self, slot: int, generation: int, error: str, message: str = "") -> None:
        self._batcher.close(slot)
        self._open.pop(slot, None)
        self.counts.engine_errors += 1
        self._publish(StepOutput(np.array([slot]), np.array([generation]), None, {}, error, message))

    def _step(self, cutoff: float = math.inf, lag_s: float | None = None, catch_up: bool = False) -> None:
        slots, generations, frames = self._batcher.gather(cutoff, self.engine.input_buffer)
        if not len(slots):
            return  # a tick with nothing due yet
        started = time.perf_counter()
        self.step_started = time.monotonic()
        try:
            result = self.engine.step(slots, frames)
        except Exception:  # a failed step fails the engine's sessions, not the server
            self.step_started = 0.0
            log.exception("engine step failed for %d sessions", len(slots))
            self._restart("step_failed" if self.engine.alive() else "engine_died")
            return
        if self.gather is not None:
            self.gather.stepped(self.step_started, time.monotonic())
        self.step_started = 0.0
        out = StepOutput(slots, generations, result.audio, result.text, finished=result.finished)
        out.duration_s = time.perf_counter() - started
        out.tick_lag_s, out.catch_up = lag_s, catch_up
        out.arrived_past_due_s = self._batcher.arrived_past_due
        out.gil_wait_s = wait = self.engine.gil_wait_s
        self.counts.gil_wait_s += wait
        if wait > self.counts.gil_wait_max_s:
            self.counts.gil_wait_max_s = wait
        self.counts.steps += 1
        self.counts.frames_stepped += len(slots)
        self.counts.kv_context_stops += result.kv_stops
        if catch_up:
            self.counts.catch_up_steps += 1
            self.counts.catch_up_frames += len(slots)
        if self.on_step is not None:
            self.on_step(out)
        self._publish(out)
        for row in result.failed or ():  # after the step's frames: the session's last one goes out
            self.counts.output_failures += 1
            self._fail_slot(int(slots[row]), int(generations[row]), "internal_error", OUTPUT_FAILED)

    def _restart(self, cause: str) -> None:
        """Start the engine anew on this thread after it failed (``cause``).

        Its model state is gone for every session it held, whatever batch each was in, so
        every open slot ends with ``engine_error`` (docs/protocol.md, "What is guaranteed"): a session
        never goes on silently on a fresh state. The new engine starts with no slot open.
        """
        self.running = False
        lost, self._open = self._open, {}
        for slot in lost:
            self._batcher.close(slot)
        self.counts.engine_errors += 1
        self.counts.sessions_ended_by_restart[cause] += len(lost)
        log.error(
            "engine restart (cause: %s): %d sessions lost their model state and end with engine_error",
            cause,
            len(lost),
        )
        if lost:
            slots, generations = np.fromiter(lost, np.int64), np.fromiter(lost.values(), np.int64)
            self._publish(StepOutput(slots, generations, None, {}, "engine_error"))
        try:
            self.engine.discard()
        except Exception:
            log.exception("engine failed to stop before its restart")
        delay = 0.1
        while not self.abandoned:
            try:
                self.engine.start()
            except Exception:
                log.exception("engine restart failed; retrying in %.1f s", delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
            else:
                self.counts.engine_restarts += 1
                self._cold = True
                self.running = True
                return


def _set_result(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _set_exception(fut: asyncio.Future[None], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
