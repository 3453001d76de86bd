"""Live migration's session side (docs/protocol.md, "Moved to another replica"): a session's
state as bytes one replica sends and another takes into a free slot.

A moved session is one message: a little-endian ``u32`` length, a JSON header (the protocol's
state: counts, formats, prompt, replay bookkeeping, deadline counters), then the blobs the
header's ``blobs`` sizes name, in order (``engine``: ``Engine.export_slot``; ``replay``: the
replay ring's frames). The wire knows no protocol: an adapter fills the header
(protocols/native_move.py) and reads it back.

On the target, ``Orchestrator.adopt`` (core/admission.py) takes a free slot and opens it with the
engine state instead of ``open``; the caller makes the session resumable and detached, so that
nobody's resume leaves it to expire with its grace (two-phase: the source drops its copy only once
this answered).
"""

from __future__ import annotations

import json
import struct
from typing import Any

from duplexserve.engine_bridge.engine import MoveRefused
from duplexserve.server.core.session import Session, State

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
