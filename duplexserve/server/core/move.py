"""Live migration's session side (docs/protocol.md, "Moved to another replica"): a session's
state as bytes one replica sends and another takes into a free slot.

A moved session is one message: a little-endian ``u32`` length, a JSON header (the protocol's
state: counts, formats, prompt, replay bookkeeping, deadline counters), then the blobs the
header's ``blobs`` sizes name, in order (``engine``: ``Engine.export_slot``; ``replay``: the
replay ring's frames). The wire knows no protocol: an adapter fills the header
(protocols/native_move.py) and reads it back.

On the target, :func:`adopt` takes a free slot and opens it with the engine state instead of
``open``; the caller makes the session resumable and detached, so that nobody's resume leaves
it to expire with its grace (two-phase: the source drops its copy only once this answered).
"""

from __future__ import annotations

import json
import secrets
import struct
from typing import Any

from duplexserve.engine_bridge.engine import MoveRefused
from duplexserve.server.core.orchestrator import Orchestrator
from duplexserve.server.core.session import Session, State
from duplexserve.server.core.turnaround import FrameTimer

VERSION = 1
_LENGTH = struct.Struct("<I")
#: The most a header may hold (a replay's texts are its bulk: 256 short deltas).
MAX_HEADER_BYTES = 1 << 20


def pack(header: dict[str, Any], blobs: dict[str, bytes]) -> bytes:
    """One moved session as bytes: ``header`` with the sizes of ``blobs`` added, then them."""
    head = json.dumps({**header, "version": VERSION, "blobs": {k: len(v) for k, v in blobs.items()}}).encode()
    return b"".join((_LENGTH.pack(len(head)), head, *blobs.values()))


def unpack(body: bytes) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The header and blobs of ``pack``; ``MoveRefused("move_corrupt")`` if it does not parse."""
    try:
        (size,) = _LENGTH.unpack_from(body)
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"a header of {size} bytes")
        header = json.loads(body[_LENGTH.size : _LENGTH.size + size])
        if not isinstance(header, dict) or header.get("version") != VERSION:
            raise ValueError(f"not a version {VERSION} header")
        blobs, at = {}, _LENGTH.size + size
        for name, length in header.pop("blobs").items():
            if not isinstance(length, int) or length < 0 or at + length > len(body):
                raise ValueError(f"blob {name!r} runs past the body")
            blobs[name] = body[at : at + length]
            at += length
        if at != len(body):
            raise ValueError("bytes after the last blob")
    except (struct.error, ValueError, AttributeError, TypeError) as exc:
        raise MoveRefused("move_corrupt", f"a moved session that does not parse: {exc}") from None
    return header, blobs


def session_header(session: Session, now: float) -> dict[str, Any]:
    """What the session core carries: its counts, its age (``--max-session-s`` goes on counting)
    and its deadline counters. The kept turnarounds behind ``turnaround_ms`` do not move: the
    target's ``session.closed`` reports those measured after the move."""
    timer = session.timer
    return {
        "session_id": session.id,
        "state": session.state.value,
        "frames_in": session.frames_in,
        "frames_out": session.frames_out,
        "age_s": max(0.0, now - session.started),
        "timed": {"count": timer.count, "late": timer.late, "max_s": timer.max_s} if timer else None,
    }


def movable(session: Session) -> str | None:
    """Why ``session`` cannot move now (a ``duplexserve_session_moves_total`` reason), or None."""
    if session.closed:
        return "closed"
    if session.state not in (State.CREATED, State.STREAMING):
        return "ending"  # input.end: it finishes on its own within the drain's grace
    if session.detached:
        return "detached"
    return None


async def adopt(orch: Orchestrator, header: dict[str, Any], engine_state: bytes) -> Session:
    """A session moved here, in a free slot, its engine state imported; ``MoveRefused``
    (``no_room``, ``draining``, or the engine's refusal) leaves nothing behind."""
    if orch.draining or not orch.bridge.running:
        raise MoveRefused("draining", "this replica takes no session now")
    if not orch._free:
        raise MoveRefused("no_room", "no free slot")
    if orch.resume.detached >= orch.max_detached:  # never evict a session waiting here for one
        raise MoveRefused("no_room", "as many sessions wait for a resume as --max-detached allows")
    if not orch.resume.enabled:
        raise MoveRefused("no_resume", "this replica keeps no session for a resume (--resume-grace-s 0)")
    try:
        state = State(header["state"])
        frames_in, frames_out = int(header["frames_in"]), int(header["frames_out"])
        session_id, age_s = str(header["session_id"]), float(header["age_s"])
    except (KeyError, ValueError, TypeError) as exc:
        raise MoveRefused("move_corrupt", f"a session header without {exc}") from None
    if state not in (State.CREATED, State.STREAMING) or not 0 <= frames_out <= frames_in:
        raise MoveRefused("move_corrupt", "only a live session whose input was all answered moves")
    slot = orch._free.pop()
    generation = next(orch._generations)
    try:
        await orch.bridge.import_(slot, generation, engine_state)
    except BaseException:
        orch._free.append(slot)
        raise
    timer = FrameTimer(orch.turnaround)
    session = Session(session_id or secrets.token_hex(8), slot, generation, orch.limits, timer)
    session.state, session.frames_in, session.frames_out = state, frames_in, frames_out
    timed = header.get("timed") or {}
    timer.count, timer.late = int(timed.get("count", 0)), int(timed.get("late", 0))
    timer.max_s = float(timed.get("max_s", 0.0))
    timer.resync(frames_out)
    assert orch._loop is not None
    now = orch._loop.time()
    session.started, session.last_activity = now - age_s, now
    session.tail = orch.engine.tail
    session.completion_grace_s = getattr(orch.bridge, "trailing_text_s", 0.0)
    orch._by_slot[slot] = session
    orch.counts.sessions_accepted += 1
    return session
