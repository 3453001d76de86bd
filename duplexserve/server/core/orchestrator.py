"""Admission, slots and the flow of frames between sessions and the engine bridge.

Runs on the event-loop thread only. It hands each session's ready frames to the
bridge, routes every engine step's rows back to their sessions (checking the slot's
generation) and frees slots when sessions close. Who gets a slot is core/admission.py;
the twice-a-second sweep (timeouts, a stalled engine rebuilt) is core/sweeper.py.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from duplexserve import errors
from duplexserve.engine_bridge.bridge import OUTPUT_FAILED, EngineBridge, StepOutput
from duplexserve.engine_bridge.engine import Engine
from duplexserve.server.core.admission import Admission
from duplexserve.server.core.readiness import Readiness
from duplexserve.server.core.resume import ResumeRegistry
from duplexserve.server.core.session import Limits, Session, State, no_notify
from duplexserve.server.core.sweeper import ENGINE_LOST, Sweeper
from duplexserve.server.core.turnaround import TurnaroundTotals

log = logging.getLogger(__name__)

#: How long the loop lets sessions send their answers before it polls its sockets again.
DISPATCH_SLICE_S = 0.002
DISPATCH_CHECK_ROWS = 16  # sessions between two looks at the clock


@dataclass(slots=True)
class Counts:
    sessions_accepted: int = 0
    sessions_rejected: int = 0
    sessions_closed: int = 0
    frames_in: int = 0
    frames_out: int = 0
    frames_dropped: int = 0
    output_failures: int = 0  # sessions ended because their output could not be handed on
    #: Sessions ended, by their session.closed reason (completed, engine_error, ...): the alerts
    #: watch the share that ended in error (deploy/kubernetes/base/prometheusrule.yaml).
    ended: collections.Counter[str] = field(default_factory=collections.Counter)


class Orchestrator(Admission, Sweeper):
    def __init__(
        self,
        engine: Engine,
        limits: Limits,
        queue_size: int = 256,
        idle_timeout_s: float = 30.0,
        max_session_s: float = 0.0,
        max_sessions_per_client: int = 0,
        max_prompt_bytes: int = 16 << 10,
        engine_stall_s: float = 10.0,
        engine_factory: Callable[[], Engine] | None = None,
        coalesce_ms: float = 0.0,
        tick_ms: float = 0.0,
        gather: bool = False,
        resume_grace_s: float = 0.0,
        max_detached: int = -1,
        max_detached_per_client: int = -1,
        client_ipv6_prefix: int = 64,
        late_frame_ms: float = 200.0,
        replica_id: str = "",
    ) -> None:
        self.engine = engine
        self.limits = limits
        self.idle_timeout_s = idle_timeout_s
        self.max_session_s = max_session_s
        #: -1: a quarter of the slots, loopback addresses exempt (:meth:`refusal`).
        self.max_sessions_per_client = (
            max(1, engine.num_slots // 4) if max_sessions_per_client < 0 else max_sessions_per_client
        )
        self._loopback_exempt = max_sessions_per_client < 0
        self.client_ipv6_prefix = client_ipv6_prefix
        self.max_prompt_bytes = max_prompt_bytes
        self.engine_stall_s = engine_stall_s
        self.engine_factory = engine_factory
        self.on_step: Callable[[StepOutput], None] | None = None
        self.on_deliver: Callable[[float, float], None] | None = None
        self.counts = Counts()
        self._queue_size = queue_size
        self._coalesce_s = coalesce_ms / 1000.0
        self._tick_s = tick_ms / 1000.0
        self._gather = gather
        self.bridge = self._new_bridge(engine)
        self.draining = False
        self._per_client: collections.Counter[str] = collections.Counter()
        #: Sessions whose next frame found the engine queue full, oldest first.
        self._waiting: dict[int, Session] = {}
        self._client_of: dict[int, str] = {}
        self._free = list(range(engine.num_slots - 1, -1, -1))
        self._by_slot: list[Session | None] = [None] * engine.num_slots
        self._generations = itertools.count(1)
        self._sweeper: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.resume = ResumeRegistry(resume_grace_s, self._expire, replica_id)
        #: Detached sessions kept at most; past it the one detached longest ends.
        self.max_detached = max_detached if max_detached >= 0 else max(1, engine.num_slots // 4)
        #: Of them, one client's at most; past it its own detached longest ends.
        self.max_detached_per_client = (
            max_detached_per_client if max_detached_per_client >= 0 else max(1, self.max_detached // 4)
        )
        self.turnaround = TurnaroundTotals(late_frame_ms / 1000.0)
        #: Sessions with answers to send, in the order they were touched (:meth:`_on_outputs`).
        self._touched: dict[int, Session] = {}
        self._notify_pending = False
        #: Prompts handed to the engine and not yet answered, by slot (:meth:`run_prompt`).
        self._prompts: dict[int, asyncio.Future[tuple[str, str] | None]] = {}
        self.readiness = Readiness()

    def _new_bridge(self, engine: Engine, counts: Any = None) -> EngineBridge:
        make_bridge = getattr(engine, "make_bridge", None)
        if make_bridge is not None:  # an engine with sessions and threads of its own (vllm-omni)
            return make_bridge(self._on_outputs, counts=counts, on_step=self._observe_step)
        return EngineBridge(
            engine,
            self._on_outputs,
            queue_size=self._queue_size,
            window=self.limits.inflight_frames,
            on_step=self._observe_step,
            counts=counts,
            coalesce_s=self._coalesce_s,
            tick_s=self._tick_s,
            gather=self._gather,
            on_deliver=self._observe_delivery,
        )

    def _observe_delivery(self, pickup_s: float, dispatch_s: float) -> None:
        if self.on_deliver is not None:
            self.on_deliver(pickup_s, dispatch_s)

    def _observe_step(self, out: StepOutput) -> None:
        if self.on_step is not None:
            self.on_step(out)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.bridge.start()
        self._sweeper = asyncio.create_task(self._sweep(), name="session-sweeper")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        self.close_all("server_shutdown", errors.GOING_AWAY)
        if not self.bridge.abandoned:
            await self.bridge.stop()

    def close_all(self, reason: str, close_code: int) -> None:
        for session in self.sessions():
            self.close(session, reason, close_code)

    async def drain(self, grace_s: float) -> None:
        """Stop admitting; let live sessions end on their own for ``grace_s``, then close them.

        Detached sessions end at once: nobody is there to finish them, and a resume
        would only be refused by a server that is going away.
        """
        self.draining = True
        for session in self.resume.detached_sessions():
            self.close(session, "server_shutdown", errors.GOING_AWAY)
        deadline = time.monotonic() + grace_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        self.close_all("server_shutdown", errors.GOING_AWAY)

    # ------------------------------------------------------------------ admission
    @property
    def active(self) -> int:
        return self.engine.num_slots - len(self._free)

    def sessions(self) -> list[Session]:
        return [s for s in self._by_slot if s is not None]

    # --------------------------------------------------------------------- frames
    def pump(self, session: Session) -> None:
        """After the session changed: hand its ready frames over, or free its slot."""
        if session.state is State.CLOSED:
            self._release(session)
            return
        if session.complete_due:  # every frame answered: close once trailing text had its time
            session.complete_due = False
            assert self._loop is not None
            self._loop.call_later(session.completion_grace_s, self._complete, session)
            return
        if session.end_due:  # before the first tail frame: the engine marks that frame's index
            session.end_due = False
            self.bridge.end_input(session.slot, session.generation, session.frames_in)
        frames = session.frames_ready()
        if frames:
            slot, generation, try_submit = session.slot, session.generation, self.bridge.try_submit
            for i, frame in enumerate(frames):
                if not try_submit((slot, generation, frame)):
                    session.unready(frames[i:])
                    self._waiting[slot] = session  # pumped again when results come back
                    return

    def _complete(self, session: Session) -> None:
        if not session.closed:
            self.close(session, "completed", errors.NORMAL)

    def close(self, session: Session, reason: str, close_code: int) -> None:
        session.close(reason, close_code)
        self._release(session)
        session.notify()

    # --------------------------------------------------------------------- resume
    def detach(self, session: Session) -> bool:
        """The connection of an open session ended: keep the session for a resume.

        False (and the session is closed ``disconnected``) when resume is off, the
        session is not resumable or the server is draining; False too when keeping it
        would pass ``max_detached`` with nothing detached before it (``--max-detached 0``).
        Past its client's ``max_detached_per_client`` that client's own detached longest ends;
        past ``max_detached``, that of the client holding the most (core/resume.py).
        """
        entry = self.resume.entry_of(session)
        if session.closed:
            return False
        if entry is None or not self.resume.enabled or self.draining:
            self.close(session, "disconnected", errors.GOING_AWAY)
            return False
        assert self._loop is not None
        session.notify = no_notify
        client = self._client_of.get(session.slot)
        self.resume.detach(entry, self._loop, client)
        if client is not None:
            while self.resume.detached_by(client) > self.max_detached_per_client:
                self._evict(self.resume.evict_oldest_of(client))
        while self.resume.detached > self.max_detached:
            self._evict(self.resume.evict_oldest())
        return not session.closed

    def _evict(self, session: Session | None) -> None:
        """Close ``session``, the detached one chosen to give way (core/resume.py)."""
        if session is not None:
            log.info("session %s detached longest of its client: evicted (resume_evicted)", session.id)
            self.close(session, "resume_evicted", errors.GOING_AWAY)

    def _expire(self, session: Session) -> None:
        self.close(session, "resume_expired", errors.GOING_AWAY)

    def _release(self, session: Session) -> None:
        if self._by_slot[session.slot] is not session:
            return
        self.resume.forget(session)
        if session.timer is not None:
            session.timer.flush()
        self._by_slot[session.slot] = None
        self._free.append(session.slot)
        prompt = self._prompts.pop(session.slot, None)
        if prompt is not None and not prompt.done():  # an abandoned or stopped engine never answers
            prompt.set_result(("engine_error", "the session ended before its prompt ran"))
        if not self.bridge.abandoned:
            self.bridge.close(session.slot, session.generation)
        client = self._client_of.pop(session.slot, None)
        if client is not None:
            self._per_client[client] -= 1
            if not self._per_client[client]:
                del self._per_client[client]
        closed = session.closed_event
        self.counts.sessions_closed += 1
        if closed is not None:
            self.counts.ended[closed.reason] += 1
            self.counts.frames_in += closed.frames_in
            self.counts.frames_out += closed.frames_out
            self.counts.frames_dropped += closed.frames_dropped

    def _on_outputs(self, outputs: list[StepOutput]) -> None:
        """Engine results, on the loop: one call per wake-up, carrying whole steps.

        Every row goes to its session's output queue at once (cheap); the sends, which
        cost the loop milliseconds for hundreds of sessions, go out in slices of about
        :data:`DISPATCH_SLICE_S` (:meth:`_notify`), the loop polling its sockets between
        slices: meanwhile it reads no socket, and a frame that arrives then reaches the
        engine late (on a step clock, past its tick). A session touched by several steps
        before its turn still sends once; its answers stay in order either way.
        """
        by_slot = self._by_slot
        touched = self._touched
        for out in outputs:
            slots = out.slots.tolist()
            generations = out.generations.tolist()
            if out.error is not None:
                for slot, generation in zip(slots, generations, strict=True):
                    session = by_slot[slot]
                    if session is not None and session.generation == generation:
                        session.error(errors.SessionError(
                            out.error,
                            getattr(out, "message", "") or ENGINE_LOST,
                            getattr(out, "close_code", errors.INTERNAL),
                        ))
                        touched[id(session)] = session
                continue
            audio, text = out.audio, out.text
            finished = set(out.finished) if out.finished else ()
            for row, (slot, generation) in enumerate(zip(slots, generations, strict=True)):
                session = by_slot[slot]
                if session is None or session.generation != generation:
                    continue  # answer to a session that is gone
                try:
                    if audio is None:  # text whose frame already went out (vLLM-Omni)
                        session.deliver_text(text[row])
                    else:
                        session.deliver(audio[row], text.get(row) if text else None, row in finished)
                except Exception:  # this session's answer only: the step's others go on
                    self.output_failed(session)
                touched[id(session)] = session
        if not self._notify_pending:
            self._notify()

    def output_failed(self, session: Session) -> None:
        """Handing ``session`` its answer raised (a bug, a codec gone): it ends alone with
        ``internal_error`` and its counts, logged once; called from the except block."""
        log.exception("session %s: its output could not be handed on; it ends (internal_error)", session.id)
        self.counts.output_failures += 1
        session.error(errors.SessionError("internal_error", OUTPUT_FAILED, errors.INTERNAL))
        self._release(session)
        with contextlib.suppress(Exception):  # what failed may be the wake-up itself
            session.notify()

    def _notify(self) -> None:
        """Let touched sessions send (and take their next frames) for one slice of loop time."""
        self._notify_pending = False
        touched = list(self._touched.values())
        self._touched = {}
        deadline = time.perf_counter() + DISPATCH_SLICE_S
        for i, session in enumerate(touched, 1):
            try:
                self.pump(session)
                session.notify()
            except Exception:
                self.output_failed(session)
            if not i % DISPATCH_CHECK_ROWS and i < len(touched) and time.perf_counter() > deadline:
                self._touched = {id(s): s for s in touched[i:]}
                self._notify_pending = True
                assert self._loop is not None
                self._loop.call_soon(self._notify)
                return
        self._pump_waiting()

    def _pump_waiting(self) -> None:
        """Give sessions held back by a full queue their turn, oldest first."""
        waiting, self._waiting = self._waiting, {}
        for slot, session in waiting.items():
            if self._by_slot[slot] is session:
                self.pump(session)
                session.notify()
