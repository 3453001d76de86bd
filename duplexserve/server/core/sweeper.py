"""The sweep: what ends sessions on the clock rather than on an event.

The part of the orchestrator (core/orchestrator.py) that runs twice a second on the loop:
it closes sessions past ``--max-session-s`` or idle past ``--idle-timeout-s``, gives
sessions held back by a full queue their turn if no result did, and, when a step has run
past ``--engine-stall-s``, fails every session and builds a fresh engine (the stalled one
is abandoned: its thread may never return).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from duplexserve import errors
from duplexserve.server.core.session import Session, State

if TYPE_CHECKING:
    from duplexserve.engine_bridge.bridge import EngineBridge
    from duplexserve.engine_bridge.engine import Engine

log = logging.getLogger(__name__)

#: What a session hears when the engine holding its model state failed (docs/protocol.md, guarantees).
ENGINE_LOST = "the engine failed and restarts: this conversation's model state is lost"
SWEEP_S = 0.5  # between two sweeps


class Sweeper:
    """Mixed into :class:`~duplexserve.server.core.orchestrator.Orchestrator`, which holds the state."""

    bridge: EngineBridge
    engine: Engine
    engine_factory: Callable[[], Engine] | None
    engine_stall_s: float
    idle_timeout_s: float
    max_session_s: float
    sessions: Callable[[], list[Session]]
    close: Callable[[Session, str, int], None]
    _release: Callable[[Session], None]
    _pump_waiting: Callable[[], None]
    _new_bridge: Callable[..., EngineBridge]
    counts: Any

    async def _rebuild_engine(self) -> None:
        """The engine is stuck in a step: fail every session and start a fresh engine."""
        stalled = self.bridge
        lost = self.sessions()
        log.error(
            "engine restart (cause: stalled, a step ran over %.1f s): %d sessions lost their model "
            "state and end with engine_error", self.engine_stall_s, len(lost),
        )  # fmt: skip
        stalled.abandon()
        stalled.counts.sessions_ended_by_restart["stalled"] += len(lost)
        for session in lost:
            session.error(errors.SessionError(
                "engine_error", f"the engine stopped answering; {ENGINE_LOST}", errors.INTERNAL
            ))
            self._release(session)
            session.notify()
        if self.engine_factory is None:  # /ready stays 503: the abandoned bridge is not running
            log.error("no engine factory: the server stays not ready")
            return
        try:
            engine = self.engine_factory()
            bridge = self._new_bridge(engine, stalled.counts)
            self.bridge, self.engine = bridge, engine
            await bridge.start()
            bridge.counts.engine_restarts += 1
        except Exception:
            log.exception("could not start a new engine; the server stays not ready")

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            try:
                await self._sweep_once()
            except Exception:
                log.exception("session sweep failed")

    async def _sweep_once(self) -> None:
        self._pump_waiting()  # a safety net: results normally do this at once
        started = self.bridge.step_started
        if started and not self.bridge.abandoned and time.monotonic() - started > self.engine_stall_s:
            await self._rebuild_engine()
        now = asyncio.get_running_loop().time()
        for session in self.sessions():
            if self.max_session_s and now - session.started > self.max_session_s:
                self.close(session, "max_duration", errors.NORMAL)
            elif (
                self.idle_timeout_s
                and not session.detached  # the resume grace bounds those
                and session.state in (State.CREATED, State.STREAMING)
                and session.inflight == 0
                and not session.input_paused
                and now - session.last_activity > self.idle_timeout_s
            ):
                self.close(session, "idle_timeout", errors.NORMAL)
