"""``--engine vllm-omni``: duplexserve's sessions fed into vLLM-Omni's duplex engine (0.30.x).

vLLM-Omni keeps each session's model state, turn policy and stage requests inside
its engine (``DuplexOmniEngine``: an ``orchestrator`` thread running
``DuplexOrchestrator`` / ``DuplexSessionManager`` / one runner per session), fed by a
janus request queue of 256 and answering on an unbounded janus output queue. It has
no batched ``step()`` to call, so this bridge replaces :class:`EngineBridge` for it,
with the same loop-facing methods (start, stop, open, close, submit, qsize, counts),
and hands results to the orchestrator's ``on_outputs`` callback as records shaped
like :class:`StepOutput`. vLLM-Omni's own WebSocket layer (``OmniDuplexSessionHandler``
and ``DuplexOmni``'s handles) is not used; its control path is:

- open / close / resume / detach: ``DuplexOmniEngine.open_session_async`` and its
  siblings (the correlated RPC; one executor hop per control operation, as shipped),
  with the session config normalised by ``DuplexOmni._resolve_session_config``;
- audio: one ``DuplexSessionCommandMessage(AppendAudio)`` per 80 ms frame, raw
  ``pcm_f32le`` bytes at the model's rate (no base64 on this side; the engine's own
  runner encodes once), put with ``put_nowait`` on the loop thread while the queue has
  room. When it is full, the orchestrator's frames (``try_submit``) wait on the loop
  for the next results, in order and with no thread hop; frames that cannot wait
  (``submit``: those that came before their session's open answered) join an overflow
  FIFO that one executor task drains with blocking puts, and every later frame queues
  behind it, so order holds either way;
- events: one daemon thread blocks on the output queue (no 1 ms polling), takes all
  that is there, and wakes the loop once per batch with ``call_soon_threadsafe``; the
  loop maps them onto sessions (:mod:`.events`).

Frames that arrive before a session's open RPC has answered wait in the slot, in
order, and follow the open. Every id and generation check happens on the loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duplexserve import errors
from duplexserve.codecs.formats import FRAME_SAMPLES
from duplexserve.engine_bridge.bridge import BridgeCounts
from duplexserve.engine_bridge.engine import Engine, StepResult
from duplexserve.engine_bridge.overflow import OrderedPutter
from duplexserve.engine_bridge.vllm_omni.events import (
    FATAL_CODES,
    MODEL_RATE,
    Decoded,
    InputFramer,
    OutputFramer,
)

log = logging.getLogger(__name__)

#: vLLM-Omni's own bound on a blocking command put (``_COMMAND_PUT_TIMEOUT_S``).
PUT_TIMEOUT_S = 30.0
_STOP = object()

#: Builds the engine (on an executor thread: it blocks until the orchestrator is up)
#: and returns it with the callable that shuts it down.
EngineBuilder = Callable[[], tuple[Any, Callable[[], None]]]


@dataclass(slots=True)
class VllmOmniOutput:
    """Rows for the orchestrator, shaped like ``StepOutput``; errors carry their text and code.
    Without audio and error: text for the frame its session last got (``Session.deliver_text``)."""

    slots: np.ndarray
    generations: np.ndarray
    audio: np.ndarray | None
    text: dict[int, str] = field(default_factory=dict)
    error: str | None = None
    message: str = ""
    close_code: int | None = errors.INTERNAL
    finished: list[int] | None = None  # no end-of-input tail (Engine.tail): never finished early
    duration_s: float = 0.0
    tick_lag_s: float | None = None  # vLLM-Omni steps on its own schedule: no step clock here
    catch_up: bool = False
    arrived_past_due_s: float = 0.0
    gil_wait_s: float = 0.0  # vLLM-Omni's answers arrive on the loop itself: nothing waits for the GIL


class _Slot:
    """One duplexserve session's vLLM-Omni session, on the loop thread."""

    __slots__ = (
        "closed",
        "framer",
        "generation",
        "lease_generation",
        "pending",
        "ready",
        "resampler",
        "sid",
    )

    def __init__(self, generation: int, sid: str, unit_ms: int, input_rate: int = MODEL_RATE) -> None:
        self.generation = generation
        self.sid = sid
        self.ready = False  # the open (or resume) RPC answered
        self.closed = False
        self.pending: list[np.ndarray] = []  # frames that came before the open answered
        self.lease_generation = 0
        self.framer = OutputFramer(unit_ms)
        #: Toward a model that does not take 24 kHz: its own 80 ms units, one per append.
        self.resampler = InputFramer(input_rate, unit_ms) if input_rate != MODEL_RATE else None


class VllmOmniBridge:
    """Loop-facing twin of :class:`EngineBridge` for vLLM-Omni's engine."""

    #: A unit's text event comes after its audio event, possibly in the next batch: a session
    #: whose input ended and whose every frame is out stays open this long for its last
    #: frame's text (``Session.completion_grace_s``).
    trailing_text_s = 0.05

    def __init__(
        self,
        build: EngineBuilder,
        on_outputs: Callable[[list[Any]], None],
        *,
        session_payload: dict[str, Any],
        model: str,
        input_rate: int = MODEL_RATE,
        unit_ms: int = 80,
        counts: BridgeCounts | None = None,
        put_timeout_s: float = PUT_TIMEOUT_S,
    ) -> None:
        self._build = build
        self._on_outputs = on_outputs
        self._session_payload = session_payload
        self._model = model
        self.input_rate = input_rate
        self._unit_ms = unit_ms
        self._put_timeout_s = put_timeout_s
        self.counts = counts or BridgeCounts()
        self.on_step: Callable[[Any], None] | None = None
        self.running = False
        self.abandoned = False  # the orchestrator's stall watchdog: vLLM-Omni watches its own engine
        self.step_started = 0.0
        self.engine: Any = None
        self._shutdown_engine: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots: dict[int, _Slot] = {}
        self._by_sid: dict[str, tuple[int, _Slot]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # Loop -> engine slow path.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-omni-put")
        self._putter: OrderedPutter[Any] | None = None
        # Engine -> loop.
        self._drain_thread: threading.Thread | None = None
        self._results: collections.deque[Any] = collections.deque()
        self._wake_pending = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        self.counts.executor_submissions += 1
        self.engine, self._shutdown_engine = await loop.run_in_executor(None, self._build)
        from vllm_omni.engine.duplex.commands import AppendAudio
        from vllm_omni.engine.duplex.messages import DuplexSessionCommandMessage
        from vllm_omni.entrypoints.duplex_omni import DuplexOmni

        self._append, self._message = AppendAudio, DuplexSessionCommandMessage
        self._session_config = DuplexOmni._resolve_session_config(self._session_payload, model=self._model)
        self._sync_q = self.engine.request_queue.sync_q
        self._putter = OrderedPutter(
            self._sync_q.put_nowait,
            lambda message: self._sync_q.put(message, timeout=self._put_timeout_s),
            queue.Full,
            self.counts,
            self._executor,
            timed_out=queue.Full,
            on_timeout=self._stuck,
        )
        self._drain_thread = threading.Thread(
            target=self._drain_outputs, name="vllm-omni-events", daemon=True
        )
        self._drain_thread.start()
        self.running = True

    async def stop(self) -> None:
        if self.engine is None:
            return
        self.running = False
        for slot in list(self._slots):
            self.close(slot, self._slots[slot].generation)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=10.0)
        loop = asyncio.get_running_loop()
        with contextlib.suppress(Exception):
            self.engine.output_queue.sync_q.put_nowait(_STOP)
        if self._shutdown_engine is not None:
            await loop.run_in_executor(None, self._shutdown_engine)
        if self._drain_thread is not None:
            await loop.run_in_executor(None, self._drain_thread.join, 5.0)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.engine = None

    def abandon(self) -> None:
        """Part of the bridge interface; vLLM-Omni has its own engine liveness, so a no-op."""

    def take_gil_wait(self) -> float:
        """For the overload manager, as ``EngineBridge``'s: no engine thread waits here."""
        return 0.0

    def qsize(self) -> int:
        if self.engine is None or self._putter is None:
            return 0
        return self._sync_q.qsize() + len(self._putter)

    # ------------------------------------------------------------- session control
    def open(self, slot: int, generation: int, params: dict[str, Any]) -> None:
        """Open a vLLM-Omni session for the slot, or resume one (``params['vllm_omni_resume']``)."""
        resume = params.get("vllm_omni_resume") if params else None
        sid = str(resume["session_id"]) if resume else f"duplex-{uuid.uuid4().hex}"
        state = _Slot(generation, sid, self._unit_ms, self.input_rate)
        self._slots[slot] = state
        self._by_sid[sid] = (slot, state)
        self._spawn(self._open(slot, state, resume))

    def close(self, slot: int, generation: int) -> None:
        state = self._slots.get(slot)
        if state is None or state.generation != generation:
            return
        del self._slots[slot]
        state.closed = True
        state.pending.clear()
        if state.ready:
            self._spawn(self._control(state, "close"))
        # else: the open coroutine sees ``closed`` when its RPC answers and closes then

    def detach(self, slot: int, generation: int) -> None:
        """Let go of the slot but keep the vLLM-Omni session for its disconnect grace (resumable)."""
        state = self._slots.get(slot)
        if state is None or state.generation != generation:
            return
        del self._slots[slot]
        state.closed = True
        if state.ready:
            self._spawn(self._control(state, "detach"))

    def session_of(self, slot: int) -> tuple[str, int] | None:
        """(vLLM-Omni session id, lease generation) of the slot, for a later resume."""
        state = self._slots.get(slot)
        return (state.sid, state.lease_generation) if state is not None and state.ready else None

    async def _open(self, slot: int, state: _Slot, resume: dict[str, Any] | None) -> None:
        engine = self.engine
        self.counts.executor_submissions += 1  # each *_session_async is one run_in_executor
        try:
            if resume:
                result = await engine.resume_session_async(
                    state.sid, expected_lease_generation=int(resume.get("lease_generation", 0))
                )
            else:
                result = await engine.open_session_async(state.sid, self._session_config)
        except Exception as exc:
            code = str(getattr(exc, "code", "engine_error"))
            self._by_sid.pop(state.sid, None)
            if not state.closed:
                self._slots.pop(slot, None)
                state.closed = True
                self._emit_issue(
                    slot, state.generation, code, str(exc), FATAL_CODES.get(code, errors.INTERNAL)
                )
            return
        state.lease_generation = int(result.lease_generation or 0)
        state.ready = True
        if state.closed:  # closed while the open was in flight
            await self._control(state, "close")
            return
        pending, state.pending = state.pending, []
        for frame in pending:
            for message in self._commands(state, frame):
                self._put(message)

    async def _control(self, state: _Slot, op: str) -> None:
        engine = self.engine
        self.counts.executor_submissions += 1
        try:
            if op == "close":
                await engine.close_session_async(state.sid, reason="client_close")
            else:
                await engine.touch_session_async(
                    state.sid, activity="detach", expected_lease_generation=state.lease_generation
                )
        except Exception as exc:
            log.warning("vLLM-Omni %s of %s failed: %s", op, state.sid, exc)
        finally:
            if op == "close":
                self._by_sid.pop(state.sid, None)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --------------------------------------------------------------- audio inward
    def try_submit(self, item: tuple[int, int, Any]) -> bool:
        """The orchestrator's path: put now if the queue has room; False means wait for results.

        The orchestrator keeps a refused frame at the head of its session and pumps it
        again when the next results wake the loop, so a full queue is waited out on the
        loop, in order, with no thread hop at all.
        """
        slot, generation, frame = item
        state = self._slots.get(slot)
        if state is None or state.generation != generation:
            return True  # a frame of a session already let go of: nothing to answer
        if not state.ready:
            state.pending.append(frame)
            return True
        if self._putter is not None and self._putter.backed_up:
            self.counts.full_waits += 1
            return False
        if state.resampler is None:
            try:
                self._sync_q.put_nowait(self._commands(state, frame)[0])
            except queue.Full:
                self.counts.full_waits += 1
                return False
            self.counts.fast_puts += 1
            return True
        # At another rate one frame makes 0, 1 or 2 appends and the resampler moves on:
        # once converted, the frame is taken, and what does not fit goes the slow way.
        if self._sync_q.qsize() + 2 > self._sync_q.maxsize:
            self.counts.full_waits += 1
            return False
        for message in self._commands(state, frame):
            self._put(message)
        return True

    def submit(self, item: tuple[int, int, Any]) -> None:
        """Always take the frame: ``put_nowait`` while there is room, else the executor, in order."""
        slot, generation, frame = item
        state = self._slots.get(slot)
        if state is None or state.generation != generation:
            return
        if not state.ready:
            state.pending.append(frame)
            return
        for message in self._commands(state, frame):
            self._put(message)

    async def submit_offloaded(self, item: tuple[int, int, Any]) -> None:
        """vLLM-Omni's own per-frame thread hop (``--offload-every-frame``), kept only to measure against."""
        slot, generation, frame = item
        state = self._slots.get(slot)
        if state is None or state.generation != generation or not state.ready:
            self.submit(item)
            return
        for message in self._commands(state, frame):
            self.counts.executor_submissions += 1
            self.counts.slow_puts += 1
            await asyncio.get_running_loop().run_in_executor(None, self._sync_q.put, message)

    def _commands(self, state: _Slot, frame: np.ndarray) -> list[Any]:
        """The appends one 80 ms frame makes: itself at 24 kHz, else whole frames at the model's rate."""
        if state.resampler is None:
            audio = frame.tobytes()
            return [
                self._message(
                    session_id=state.sid,
                    command=self._append(audio=audio, format="pcm_f32le", sample_rate_hz=MODEL_RATE),
                )
            ]
        return [
            self._message(
                session_id=state.sid,
                command=self._append(
                    audio=unit.tobytes(), format="pcm_f32le", sample_rate_hz=self.input_rate
                ),
            )
            for unit in state.resampler.push(frame)
        ]

    def _put(self, message: Any) -> None:
        assert self._putter is not None
        if self._putter.put(message):
            self.counts.fast_puts += 1

    def _stuck(self, message: Any) -> None:
        """Executor thread: vLLM-Omni's queue stayed full for its whole put timeout."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._backpressure, message.session_id)

    def _backpressure(self, sid: str) -> None:
        entry = self._by_sid.get(sid)
        if entry is not None and not entry[1].closed:
            slot, state = entry
            self._emit_issue(
                slot,
                state.generation,
                "engine_backpressure",
                "vLLM-Omni's request queue stayed full",
                errors.TRY_AGAIN,
            )

    # ------------------------------------------------------------- events outward
    def _drain_outputs(self) -> None:
        """Daemon thread: block on the output queue, hand each batch to the loop in one wake."""
        sync_q = self.engine.output_queue.sync_q
        results = self._results
        loop = self._loop
        assert loop is not None
        while True:
            try:
                message = sync_q.get()
            except Exception:  # closed at shutdown
                return
            if message is _STOP:
                return
            results.append(message)
            while True:
                try:
                    message = sync_q.get_nowait()
                except Exception:
                    break
                if message is _STOP:
                    return
                results.append(message)
            if not self._wake_pending:
                self._wake_pending = True
                try:
                    loop.call_soon_threadsafe(self._deliver)
                except RuntimeError:  # the loop closed during shutdown
                    return

    def _deliver(self) -> None:
        """On the loop: map one batch of engine messages onto sessions, then one callback."""
        self._wake_pending = False
        self.counts.loop_wakeups += 1
        results = self._results
        records: list[Any] = []
        rows: list[list[Any]] = []  # [slot, generation, frame, text]
        last_row: dict[int, int] = {}  # slot -> its latest row in ``rows``
        while results:
            message = results.popleft()
            event = getattr(message, "event", None)
            if event is None:
                self._engine_message(message, rows, last_row, records)
                continue
            entry = self._by_sid.get(message.session_id)
            if entry is None:
                continue  # a session duplexserve has let go of
            slot, state = entry
            if state.closed:
                continue
            decoded: Decoded = state.framer.on_event(event)
            if decoded.text:
                # Text of a unit follows its audio: it joins the frame that unit just made,
                # or, when that frame already went out (the two events came in different
                # batches), follows it on its own, before any later frame of the session.
                row = last_row.get(slot)
                if row is not None:
                    rows[row][3] += decoded.text
                else:
                    records.append(VllmOmniOutput(
                        np.array([slot]), np.array([state.generation]), None, {0: decoded.text}
                    ))
            for frame in decoded.frames:
                last_row[slot] = len(rows)
                rows.append([slot, state.generation, frame, ""])
            issue = decoded.issue
            if issue is None:
                continue
            self._flush_rows(rows, last_row, records)
            if issue.close_code is not None:
                self._slots.pop(slot, None)
                state.closed = True
                if event.type == "error" and state.ready:
                    self._spawn(self._control(state, "close"))
                else:
                    self._by_sid.pop(message.session_id, None)
            records.append(
                self._issue_record(slot, state.generation, issue.code, issue.message, issue.close_code)
            )
        self._flush_rows(rows, last_row, records)
        if records:
            self._on_outputs(records)

    def _engine_message(
        self, message: Any, rows: list[Any], last_row: dict[int, int], records: list[Any]
    ) -> None:
        """A message that is not a session event: a fatal engine error fails every session."""
        if type(message).__name__ != "ErrorMessage" or not getattr(message, "fatal", False):
            return
        log.error("vLLM-Omni engine failed: %s", getattr(message, "error", message))
        self._flush_rows(rows, last_row, records)
        self.running = False
        self.counts.engine_errors += 1
        for slot, state in list(self._slots.items()):
            state.closed = True
            records.append(
                self._issue_record(
                    slot,
                    state.generation,
                    "engine_error",
                    str(getattr(message, "error", "engine failed")),
                    errors.INTERNAL,
                )
            )
        self._slots.clear()
        self._by_sid.clear()

    def _flush_rows(self, rows: list[list[Any]], last_row: dict[int, int], records: list[Any]) -> None:
        last_row.clear()
        if not rows:
            return
        text = {row: t for row, (_, _, _, t) in enumerate(rows) if t}
        audio = np.stack([frame for _, _, frame, _ in rows]) if len(rows) > 1 else rows[0][2][None, :]
        record = VllmOmniOutput(
            np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows)),
            np.fromiter((r[1] for r in rows), dtype=np.int64, count=len(rows)),
            audio,
            text,
        )
        self.counts.steps += 1
        self.counts.frames_stepped += len(rows)
        if self.on_step is not None:
            self.on_step(record)
        records.append(record)
        rows.clear()

    @staticmethod
    def _issue_record(slot: int, generation: int, code: str, message: str, close_code: int | None) -> Any:
        return VllmOmniOutput(np.array([slot]), np.array([generation]), None, {}, code, message, close_code)

    def _emit_issue(
        self, slot: int, generation: int, code: str, message: str, close_code: int | None
    ) -> None:
        self._on_outputs([self._issue_record(slot, generation, code, message, close_code)])


class VllmOmniEngine(Engine):
    """The slot count and the bridge factory; the model itself lives in vLLM-Omni's engine."""

    name = "vllm-omni"
    frame_samples = FRAME_SAMPLES

    def __init__(self, num_slots: int, build: EngineBuilder, **bridge_options: Any) -> None:
        super().__init__(num_slots)
        self._build = build
        self._options = bridge_options

    def make_bridge(
        self,
        on_outputs: Callable[[list[Any]], None],
        counts: BridgeCounts | None = None,
        on_step: Callable[[Any], None] | None = None,
    ) -> VllmOmniBridge:
        bridge = VllmOmniBridge(self._build, on_outputs, counts=counts, **self._options)
        bridge.on_step = on_step
        return bridge

    def open(self, slot: int, params: dict[str, Any]) -> None:
        raise NotImplementedError("vLLM-Omni sessions are opened by VllmOmniBridge")

    def close(self, slot: int) -> None:
        raise NotImplementedError("vLLM-Omni sessions are closed by VllmOmniBridge")

    def step(self, slots: np.ndarray, frames: np.ndarray) -> StepResult:
        raise NotImplementedError("vLLM-Omni steps its own engine; VllmOmniBridge feeds it")
