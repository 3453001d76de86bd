"""Admission, slots and the flow of frames between sessions and the engine bridge.

Runs on the event-loop thread only. It hands each session's ready frames to the
bridge, routes every engine step's rows back to their sessions (checking the slot's
generation), frees slots when sessions close, and sweeps idle sessions once a second.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
from dataclasses import dataclass
from typing import Any

from duplexserve.engine_bridge.bridge import EngineBridge, StepOutput
from duplexserve.engine_bridge.engine import Engine
from duplexserve.server import errors
from duplexserve.server.session import Limits, Session, State

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Counts:
    sessions_accepted: int = 0
    sessions_rejected: int = 0
    sessions_closed: int = 0
    frames_in: int = 0
    frames_out: int = 0
    frames_dropped: int = 0


class Orchestrator:
    def __init__(
        self,
        engine: Engine,
        limits: Limits,
        queue_size: int = 256,
        idle_timeout_s: float = 30.0,
        max_session_s: float = 0.0,
    ) -> None:
        self.engine = engine
        self.limits = limits
        self.idle_timeout_s = idle_timeout_s
        self.max_session_s = max_session_s
        self.counts = Counts()
        self.bridge = EngineBridge(
            engine, self._on_outputs, queue_size=queue_size, window=limits.inflight_frames
        )
        self.draining = False
        self._free = list(range(engine.num_slots - 1, -1, -1))
        self._by_slot: list[Session | None] = [None] * engine.num_slots
        self._generations = itertools.count(1)
        self._sweeper: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.bridge.start()
        self._sweeper = asyncio.create_task(self._sweep(), name="session-sweeper")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for session in self.sessions():
            self.close(session, "server_shutdown", errors.GOING_AWAY)
        await self.bridge.stop()

    # ------------------------------------------------------------------ admission
    @property
    def active(self) -> int:
        return self.engine.num_slots - len(self._free)

    @property
    def ready(self) -> bool:
        return self.bridge.running and not self.draining and bool(self._free)

    def sessions(self) -> list[Session]:
        return [s for s in self._by_slot if s is not None]

    def open_session(self, params: dict[str, Any] | None = None) -> Session | None:
        """A new session in a free slot, or None when full or draining (1013)."""
        if not self._free or self.draining or not self.bridge.running:
            self.counts.sessions_rejected += 1
            return None
        slot = self._free.pop()
        session = Session(secrets.token_hex(8), slot, next(self._generations), self.limits)
        assert self._loop is not None
        session.started = session.last_activity = self._loop.time()
        self._by_slot[slot] = session
        self.counts.sessions_accepted += 1
        self.bridge.open(slot, session.generation, params or {})
        return session

    # --------------------------------------------------------------------- frames
    def pump(self, session: Session) -> None:
        """After the session changed: hand its ready frames over, or free its slot."""
        if session.state is State.CLOSED:
            self._release(session)
            return
        frames = session.frames_ready()
        if frames:
            slot, generation, submit = session.slot, session.generation, self.bridge.submit
            for frame in frames:
                submit((slot, generation, frame))

    def close(self, session: Session, reason: str, close_code: int) -> None:
        session.close(reason, close_code)
        self._release(session)
        session.notify()

    def _release(self, session: Session) -> None:
        if self._by_slot[session.slot] is not session:
            return
        self._by_slot[session.slot] = None
        self._free.append(session.slot)
        self.bridge.close(session.slot, session.generation)
        closed = session.closed_event
        self.counts.sessions_closed += 1
        if closed is not None:
            self.counts.frames_in += closed.frames_in
            self.counts.frames_out += closed.frames_out
            self.counts.frames_dropped += closed.frames_dropped

    def _on_outputs(self, outputs: list[StepOutput]) -> None:
        """Engine results, on the loop: one call per wake-up, carrying whole steps."""
        by_slot = self._by_slot
        touched: dict[int, Session] = {}
        for out in outputs:
            slots = out.slots.tolist()
            generations = out.generations.tolist()
            if out.error is not None:
                for slot, generation in zip(slots, generations, strict=True):
                    session = by_slot[slot]
                    if session is not None and session.generation == generation:
                        session.error(errors.SessionError(
                            out.error, "the engine failed on this session's audio",
                            errors.INTERNAL,
                        ))
                        touched[slot] = session
                continue
            audio, text = out.audio, out.text
            assert audio is not None
            for row, (slot, generation) in enumerate(zip(slots, generations, strict=True)):
                session = by_slot[slot]
                if session is None or session.generation != generation:
                    continue  # answer to a session that is gone
                session.deliver(audio[row], text.get(row) if text else None)
                touched[slot] = session
        for session in touched.values():
            self.pump(session)
            session.notify()

    # ---------------------------------------------------------------------- sweep
    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            now = asyncio.get_running_loop().time()
            for session in self.sessions():
                if self.max_session_s and now - session.started > self.max_session_s:
                    self.close(session, "max_duration", errors.NORMAL)
                elif (
                    self.idle_timeout_s
                    and session.state in (State.CREATED, State.STREAMING)
                    and session.inflight == 0
                    and not session.input_paused
                    and now - session.last_activity > self.idle_timeout_s
                ):
                    self.close(session, "idle_timeout", errors.NORMAL)
