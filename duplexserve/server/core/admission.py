"""Admission: who may open a session now, in which slot, and the prompt it runs first.

The part of the orchestrator (core/orchestrator.py) that a new connection meets: the
refusals (full, draining, an engine not ready, the per-client limit), the slot and
generation a session gets, and its prompt handed to the engine before its first audio.
A client is counted by :func:`~duplexserve.server.core.client_address.client_key`.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import secrets
from typing import TYPE_CHECKING, Any

from duplexserve import errors
from duplexserve.engine_bridge.engine import MoveRefused
from duplexserve.server.core.budgets import over_budget
from duplexserve.server.core.client_address import ClientAddress, client_key
from duplexserve.server.core.session import Limits, Session, State
from duplexserve.server.core.turnaround import FrameTimer, TurnaroundTotals

if TYPE_CHECKING:
    from duplexserve.engine_bridge.bridge import EngineBridge
    from duplexserve.engine_bridge.engine import Engine
    from duplexserve.server.core.resume import ResumeRegistry


class Admission:
    """Mixed into :class:`~duplexserve.server.core.orchestrator.Orchestrator`, which holds the state."""

    bridge: EngineBridge
    engine: Engine
    resume: ResumeRegistry
    limits: Limits
    turnaround: TurnaroundTotals
    draining: bool
    max_sessions_per_client: int
    client_ipv6_prefix: int
    max_prompt_bytes: int
    _loop: asyncio.AbstractEventLoop | None
    _loopback_exempt: bool
    _free: list[int]
    _by_slot: list[Session | None]
    _per_client: collections.Counter[str]
    _client_of: dict[int, str]
    _generations: itertools.count[int]
    _prompts: dict[int, asyncio.Future[tuple[str, str] | None]]
    counts: Any
    max_detached: int
    _evict: Any  # the orchestrator's

    @property
    def ready(self) -> bool:
        return self.bridge.running and not self.draining and self._has_room

    @property
    def _has_room(self) -> bool:
        """A slot is free, or one that a detached session holds can be freed for a new one."""
        return bool(self._free) or self.resume.detached > 0

    def client_key(self, client: ClientAddress | None) -> str | None:
        """What the per-client quotas count ``client`` as, or None where they do not count it:
        no limit (``--max-sessions-per-client 0``), no address, or, under the default limit,
        this host's own connection (a benchmark, a probe, this host through a proxy on it).
        A loopback peer passing on others' connections is not this host (docs/reliability.md)."""
        if client is None or not self.max_sessions_per_client:
            return None
        if self._loopback_exempt and client.local:
            return None
        return client_key(client.host, self.client_ipv6_prefix)

    def refusal(self, client: ClientAddress | None) -> tuple[int, str, str] | None:
        """Why a new session from ``client`` cannot be admitted now, or None.

        Returns (close code, error code, message): 1013 for full, draining or an engine
        not ready (try again later), 1008 for the per-client policy. ``client`` is the
        address in the scope: the peer's, or what a proxy of ``--forwarded-allow-ips``
        named (core/client_address.py).
        """
        return self._refusal(self.client_key(client))

    def _refusal(self, key: str | None) -> tuple[int, str, str] | None:
        """:meth:`refusal` for the client counted as ``key``. Its detached sessions do not
        count: one of them gives way to its new session (:meth:`open_session`)."""
        if self.draining:
            return errors.TRY_AGAIN, "server_unavailable", "server is draining, try again later"
        if not self.bridge.running:
            return errors.TRY_AGAIN, "server_unavailable", "engine is not ready, try again later"
        if not self._has_room:
            return errors.TRY_AGAIN, "server_unavailable", "server is full, try again later"
        limit = self.max_sessions_per_client
        if key is not None and self._per_client[key] - self.resume.detached_by(key) >= limit:
            return errors.POLICY, "too_many_sessions", f"at most {limit} sessions per client address"
        return None

    def open_session(
        self, params: dict[str, Any] | None = None, client: ClientAddress | None = None
    ) -> Session | None:
        """A new session in a free slot, or None when :meth:`refusal` says why not (1013).

        A detached session gives way to it where one must: the client's own detached longest
        when it is at its limit, or when every slot is taken and it has one; else that of
        the client holding the most detached sessions (core/resume.py)."""
        key = self.client_key(client)
        refusal = self._refusal(key)
        if refusal is not None:
            self.rejected(refusal)
            return None
        if key is not None and self._per_client[key] >= self.max_sessions_per_client:
            self._evict(self.resume.evict_oldest_of(key))
        if not self._free:
            victim = self.resume.evict_oldest_of(key)
            self._evict(victim if victim is not None else self.resume.evict_oldest())
        slot = self._free.pop()
        if key is not None:
            self._per_client[key] += 1
            self._client_of[slot] = key
        session = Session(
            secrets.token_hex(8), slot, next(self._generations), self.limits, FrameTimer(self.turnaround)
        )
        assert self._loop is not None
        session.started = session.last_activity = self._loop.time()
        session.completion_grace_s = getattr(self.bridge, "trailing_text_s", 0.0)
        session.tail = self.engine.tail
        self._by_slot[slot] = session
        self.counts.sessions_accepted += 1
        self.bridge.open(slot, session.generation, params or {})
        return session

    async def adopt(self, header: dict[str, Any], engine_state: bytes) -> Session:
        """A session a peer moved here (core/move.py), in a free slot, its engine state imported;
        ``MoveRefused`` (``no_room``, ``draining``, or the engine's refusal) leaves nothing behind."""
        if self.draining or not self.bridge.running:
            raise MoveRefused("draining", "this replica takes no session now")
        if not self._free:
            raise MoveRefused("no_room", "no free slot")
        if self.resume.detached >= self.max_detached:  # never evict a session waiting here for one
            raise MoveRefused("no_room", "as many sessions wait for a resume as --max-detached allows")
        if not self.resume.enabled:
            raise MoveRefused("no_resume", "this replica keeps no session for a resume (--resume-grace-s 0)")
        try:
            state = State(header["state"])
            frames_in, frames_out = int(header["frames_in"]), int(header["frames_out"])
            session_id, age_s = str(header["session_id"]), float(header["age_s"])
        except (KeyError, ValueError, TypeError) as exc:
            raise MoveRefused("move_corrupt", f"a session header without {exc}") from None
        if state not in (State.CREATED, State.STREAMING) or not 0 <= frames_out <= frames_in:
            raise MoveRefused("move_corrupt", "only a live session whose input was all answered moves")
        slot = self._free.pop()
        generation = next(self._generations)
        try:
            await self.bridge.import_(slot, generation, engine_state)
        except BaseException:
            self._free.append(slot)
            raise
        timer = FrameTimer(self.turnaround)
        session = Session(session_id or secrets.token_hex(8), slot, generation, self.limits, timer)
        session.state, session.frames_in, session.frames_out = state, frames_in, frames_out
        timed = header.get("timed") or {}
        timer.count, timer.late = int(timed.get("count", 0)), int(timed.get("late", 0))
        timer.max_s = float(timed.get("max_s", 0.0))
        timer.resync(frames_out)
        assert self._loop is not None
        now = self._loop.time()
        session.started, session.last_activity = now - age_s, now
        session.tail = self.engine.tail
        session.completion_grace_s = getattr(self.bridge, "trailing_text_s", 0.0)
        self._by_slot[slot] = session
        self.counts.sessions_accepted += 1
        return session

    def rejected(self, refusal: tuple[int, str, str]) -> None:
        """Count a new session refused for ``refusal``; one over its address's limit is over budget."""
        self.counts.sessions_rejected += 1
        if refusal[1] == "too_many_sessions":
            over_budget("sessions_per_client")

    async def run_prompt(self, session: Session, params: dict[str, Any]) -> tuple[str, str] | None:
        """Run a new session's prompt (``text_prompt``, ``voice_prompt``) before its first
        audio; None once the engine ran it, else (docs/protocol.md's error code, message). A model
        without prompts and an unknown voice are answered here, without the engine."""
        engine = self.engine
        if not engine.takes_prompts:
            return "prompt_unsupported", "this model takes no prompt; the session goes on without it"
        voice = params.get("voice_prompt")
        if voice and voice not in engine.voices:
            name = voice[:64]  # echoed back, not a megabyte of it
            return "voice_not_found", f"voice_prompt {name!r}: not one of this server's (GET /v1/voices)"
        refused = self._untokenizable(params.get("text_prompt") or "")
        if refused is not None:  # before the engine thread tokenizes it (a 1 MiB one took 0.6 s there)
            return refused
        assert self._loop is not None
        done: asyncio.Future[tuple[str, str] | None] = self._loop.create_future()
        self._prompts[session.slot] = done
        self.bridge.prompt(
            session.slot, session.generation, params, lambda outcome: done.done() or done.set_result(outcome)
        )
        try:
            return await done
        finally:
            if self._prompts.get(session.slot) is done:
                del self._prompts[session.slot]

    def _untokenizable(self, text: str) -> tuple[str, str] | None:
        """Why the text prompt ``text`` may not reach the engine (``invalid_prompt``), or None:
        over ``--max-prompt-bytes`` (counted as a budget), or not Unicode."""
        limit = self.max_prompt_bytes
        try:
            size = len(text) if len(text) > limit else len(text.encode())  # never fewer bytes than characters
        except UnicodeEncodeError:  # a lone surrogate (JSON's "\ud800"): the tokenizer raised on it
            return "invalid_prompt", "text_prompt is not valid Unicode"
        if size > limit:
            over_budget("prompt_bytes")
            return "invalid_prompt", f"text_prompt is over {limit} bytes (--max-prompt-bytes)"
        return None
