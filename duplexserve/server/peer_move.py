"""Live migration between replicas (docs/protocol.md, "Moved to another replica"): on drain each
duplex/1 session moves to a peer with room, and its client is told where it went.

Source (:meth:`PeerMover.drain`, before the drain of server/run.py): the peers of ``--peers`` are
asked for room (``GET /ready``); each movable session then, up to :data:`CONCURRENCY` at once,
holds its client's input, lets the engine answer every frame it took (the bridge's export is
ordered after them), waits for its writer to hand them to the socket, and is sent, engine state
and protocol state in one body (core/move.py), to a peer's :data:`MOVE_PATH`. Only once the peer
answered with the session's new token does the source tell the client (``session.moved``, close
1012) and drop its copy; a move that fails or times out leaves the session here, going on with
what its client sent meanwhile. A target's import nobody resumes expires with its grace: a
session is never live in two places for its client.

Target (:meth:`PeerMover.endpoint`): a move is a POST signed by the fleet's ``--peer-secret``:
HMAC-SHA256 over the time, a nonce, the sender and the body's digest. One too old or too far
ahead (:data:`MAX_SKEW_S`), a nonce seen before, or a wrong signature is refused (403) and
counted; so is a body that does not parse or a state of another model (409), or no room (503).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import hmac
import json
import logging
import secrets
import ssl
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from fastapi import Request, Response
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from duplexserve.config import ServerConfig
from duplexserve.engine_bridge.engine import MoveRefused
from duplexserve.server.core import move
from duplexserve.server.core.orchestrator import Orchestrator
from duplexserve.server.protocols.native_move import PROTOCOL, carry_from
from duplexserve.server.request_body import BodyTooLarge, read_body

log = logging.getLogger(__name__)

MOVE_PATH = "/internal/v1/move"
TIME_HEADER = "x-duplexserve-move-time"
NONCE_HEADER = "x-duplexserve-move-nonce"
FROM_HEADER = "x-duplexserve-move-from"
SIGNATURE_HEADER = "x-duplexserve-move-signature"
#: A move signed longer ago (or further ahead) than this is refused; nonces are kept twice as long.
MAX_SKEW_S = 30.0
#: The most a moved session may weigh: the replay (256 frames of 7.7 KB) and a model's state.
MAX_MOVE_BYTES = 256 << 20
#: Sessions moving at once: each holds its client's input while it moves.
CONCURRENCY = 16
PAUSE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


def sign(secret: str, stamp: str, nonce: str, sender: str, body: bytes) -> str:
    message = f"{stamp}\n{nonce}\n{sender}\n".encode() + hashlib.sha256(body).digest()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def signed_headers(secret: str, sender: str, body: bytes, now: float | None = None) -> dict[str, str]:
    """The headers that prove a move comes from this fleet, once (:meth:`PeerMover.verify`)."""
    stamp, nonce = f"{time.time() if now is None else now:.3f}", secrets.token_hex(16)
    return {TIME_HEADER: stamp, NONCE_HEADER: nonce, FROM_HEADER: sender,
            SIGNATURE_HEADER: sign(secret, stamp, nonce, sender, body)}


def peer_names(peers: str, replica_id: str) -> list[str]:
    """The replicas of ``--peers``, this one left out; ``ordinals:N`` names a StatefulSet's pods
    NAME-0 to NAME-(N-1), NAME this replica's id without its ordinal (those not running answer
    no room)."""
    names: list[str] = []
    for entry in filter(None, (p.strip() for p in peers.split(","))):
        if entry.startswith("ordinals:"):
            base = replica_id.rpartition("-")[0] or replica_id
            names += [f"{base}-{i}" for i in range(int(entry.partition(":")[2]))]
        else:
            names.append(entry)
    return [n for n in dict.fromkeys(names) if n != replica_id]


async def http_request(base: str, method: str, path: str, body: bytes = b"",
                       headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One HTTP/1.1 request to a peer (``base``: ``ws://host:port`` or ``http://...``), its
    status and body: the server depends on no HTTP client, and a peer speaks plain HTTP/1.1."""
    url = urlsplit(base)
    tls = url.scheme in ("wss", "https")
    port = url.port or (443 if tls else 80)
    reader, writer = await asyncio.open_connection(url.hostname, port, ssl=ssl.create_default_context()
                                                   if tls else None)
    try:
        lines = [f"{method} {path} HTTP/1.1", f"Host: {url.netloc}", f"Content-Length: {len(body)}",
                 "Connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        length = None
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        data = await (reader.readexactly(length) if length is not None else reader.read())
        return status, data
    finally:
        writer.close()


@dataclass
class MoveCounts:
    moved: int = 0
    imported: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    failed: collections.Counter[str] = field(default_factory=collections.Counter)
    unmovable: collections.Counter[str] = field(default_factory=collections.Counter)
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    pause_buckets: list[int] = field(default_factory=lambda: [0] * (len(PAUSE_BUCKETS) + 1))
    pause_sum_s: float = 0.0
    drain_s: float = 0.0  # the last drain: from SIGTERM to its last session moved

    def pause(self, seconds: float) -> None:
        self.pause_buckets[sum(seconds > b for b in PAUSE_BUCKETS)] += 1
        self.pause_sum_s += seconds


class PeerMover:
    """Both ends of a move: sending this replica's sessions away, taking a peer's in."""

    def __init__(self, config: ServerConfig, orch: Orchestrator, codec_procs: Any) -> None:
        self.config = config
        self.orch = orch
        self.codec_procs = codec_procs
        self.peers = peer_names(config.peers, config.replica_id)
        if self.peers and not (config.peer_url_template and config.peer_secret):
            log.warning("--peers without --peer-url-template and --peer-secret: sessions drain in place")
            self.peers = []
        self.counts = MoveCounts()
        self._nonces: dict[str, float] = {}

    # ------------------------------------------------------------------ target
    def verify(self, headers: Any, body: bytes | None, now: float | None = None) -> str | None:
        """Why a move is not this fleet's, once (a refusal reason), or None. With ``body`` None,
        what the headers alone tell (the secret, the fields, the time): checked before a body of
        up to :data:`MAX_MOVE_BYTES` is read, so that an unsigned sender costs no read."""
        secret = self.config.peer_secret
        if not secret:
            return "moves_off"
        stamp, nonce = headers.get(TIME_HEADER), headers.get(NONCE_HEADER)
        sender, given = headers.get(FROM_HEADER), headers.get(SIGNATURE_HEADER)
        if not (stamp and nonce and sender and given):
            return "unsigned"
        now = time.time() if now is None else now
        try:
            skew = abs(now - float(stamp))
        except ValueError:
            return "bad_signature"
        if skew > MAX_SKEW_S:
            return "stale"
        if body is None:
            return None
        if not hmac.compare_digest(given.encode(), sign(secret, stamp, nonce, sender, body).encode()):
            return "bad_signature"
        self._nonces = {n: t for n, t in self._nonces.items() if t > now}
        if nonce in self._nonces:
            return "replayed"
        self._nonces[nonce] = now + 2 * MAX_SKEW_S
        return None

    def _refuse(self, status: int, reason: str, message: str) -> Response:
        self.counts.refused[reason] += 1
        log.warning("a session moved here was refused (%s): %s", reason, message)
        payload = json.dumps({"error": reason, "message": message})
        return Response(payload, status, media_type="application/json")

    async def endpoint(self, request: Request) -> Response:
        """``POST /internal/v1/move``: take a peer's session into a free slot, detached; its token."""
        refused = "a move must be signed with this fleet's --peer-secret, once"
        reason = self.verify(request.headers, None)
        if reason is not None:
            return self._refuse(403, reason, refused)
        try:
            body = await read_body(request, MAX_MOVE_BYTES)
        except BodyTooLarge:
            return self._refuse(413, "too_large", f"a move over {MAX_MOVE_BYTES} bytes")
        reason = self.verify(request.headers, body)
        if reason is not None:
            return self._refuse(403, reason, refused)
        orch, config = self.orch, self.config
        log.info("a session moves here from %s (%d bytes)", request.headers.get(FROM_HEADER), len(body))
        try:
            header, blobs = move.unpack(body)
            if header.get("protocol") != PROTOCOL:
                raise MoveRefused("move_mismatch", f"protocol {header.get('protocol')!r} does not move")
            if header.get("model") != config.model_name or header.get("engine") != orch.engine.name:
                theirs = f"{header.get('model')}/{header.get('engine')}"
                raise MoveRefused("move_mismatch", f"a session of {theirs}")
            carry = carry_from(header, blobs.get("replay", b""), self.codec_procs, config.max_output_frames)
            session = await orch.adopt(header, blobs.get("engine", b""))
        except MoveRefused as exc:
            status = 503 if exc.code in ("no_room", "draining") else 409
            return self._refuse(status, exc.code, str(exc))
        entry = orch.resume.issue(session, None, carry)
        assert orch._loop is not None
        orch.resume.detach(entry, orch._loop)  # nobody's resume: it expires with its grace
        self.counts.imported += 1
        self.counts.bytes_in += len(body)
        return Response(json.dumps({"token": entry.token, "grace_s": orch.resume.grace_s}),
                        media_type="application/json")

    # ------------------------------------------------------------------ source
    def url_of(self, peer: str) -> str:
        return self.config.peer_url_template.format(replica=peer)

    async def rooms(self) -> dict[str, int]:
        """Free slots per peer, as each says on ``/ready``; a peer that does not answer has none."""

        async def room(peer: str) -> int:
            try:
                _, data = await asyncio.wait_for(http_request(self.url_of(peer), "GET", "/ready"),
                                                 self.config.move_timeout_s)
                ready = json.loads(data)
                if ready.get("draining"):
                    return 0
                return max(0, int(ready["max_sessions"]) - int(ready["sessions"]))
            except (OSError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
                return 0

        free = await asyncio.gather(*(room(p) for p in self.peers))
        return dict(zip(self.peers, free, strict=True))

    async def drain(self) -> None:
        """Move every session that can move; the rest drain as before (server/run.py), counted."""
        orch = self.orch
        if not self.peers:
            return
        if not hasattr(orch.bridge, "export"):  # an engine with a bridge of its own (vllm-omni)
            self.counts.unmovable["move_unsupported"] += orch.active
            log.info("drain: the %s engine's sessions cannot move; they drain in place", orch.engine.name)
            return
        started = time.monotonic()
        orch.draining = True  # admit nothing more; peers see it on /ready
        movers, before, total = [], dict(self.counts.unmovable), orch.active
        for entry in orch.resume.entries():
            owner = entry.owner
            reason = "detached" if owner is None else (owner.unmovable() if hasattr(owner, "unmovable")
                                                       else "no_resume")
            if reason is None:
                movers.append(owner)
            else:
                self.counts.unmovable[reason] += 1
        resumable = {id(e.session) for e in orch.resume.entries()}
        for session in orch.sessions():
            if id(session) not in resumable:
                self.counts.unmovable["no_resume"] += 1
        rooms = await self.rooms() if movers else {}
        limit = asyncio.Semaphore(CONCURRENCY)
        moved_before, failed_before = self.counts.moved, sum(self.counts.failed.values())
        bytes_before = self.counts.bytes_out

        async def one(conn: Any) -> None:
            async with limit:
                for _ in range(len(self.peers)):
                    peer = max(rooms, key=rooms.__getitem__, default=None)
                    if peer is None or rooms[peer] <= 0:
                        self.counts.unmovable["no_peer_room"] += 1
                        return
                    rooms[peer] -= 1
                    reason = await self.move(conn, peer)
                    if reason is None or reason not in ("no_room", "draining", "unreachable"):
                        return
                    rooms[peer] = 0  # that peer is full or gone: the next one

        await asyncio.gather(*(one(c) for c in movers))
        self.counts.drain_s = time.monotonic() - started
        not_moved = {k: v - before.get(k, 0) for k, v in self.counts.unmovable.items()
                     if v > before.get(k, 0)}
        log.info(
            "drain: moved %d of %d sessions to %s in %.2f s (%d bytes); failed %d; not moved: %s",
            self.counts.moved - moved_before, total, ",".join(self.peers),
            self.counts.drain_s, self.counts.bytes_out - bytes_before,
            sum(self.counts.failed.values()) - failed_before, not_moved or "none",
        )

    async def move(self, conn: Any, peer: str) -> str | None:
        """Move one connection's session to ``peer``; None once it landed, else why it stays here."""
        session, orch = conn.session, self.orch
        loop = asyncio.get_running_loop()
        started = loop.time()
        conn.hold_input()
        reason: str | None = None
        try:
            deadline = started + self.config.move_timeout_s
            while session.frames_waiting and not session.closed:  # every frame handed to the engine
                if loop.time() > deadline:
                    raise TimeoutError
                await asyncio.sleep(0.002)
            taken = session.frames_in
            state = await asyncio.wait_for(orch.bridge.export(session.slot, session.generation),
                                           max(0.1, deadline - loop.time()))
            while session.has_outgoing and not session.closed:  # the answers handed to the socket
                if loop.time() > deadline:
                    raise MoveRefused("slow_consumer", "its answers were not taken in time")
                await asyncio.sleep(0.002)
            if session.frames_in != taken or session.frames_waiting:  # a codec worker's late answer
                raise MoveRefused("busy", "input came after the export: it goes on here")
            reason = conn.unmovable()
            if reason is None:
                header, replay = conn.move_state()
                body = move.pack(header, {"engine": state, "replay": replay})
                headers = signed_headers(self.config.peer_secret, self.config.replica_id, body)
                status, data = await asyncio.wait_for(
                    http_request(self.url_of(peer), "POST", MOVE_PATH, body, headers),
                    max(0.1, deadline - loop.time()))
                answer = json.loads(data or b"{}")
                if status != 200:
                    reason = str(answer.get("error") or f"http_{status}")
        except MoveRefused as exc:
            reason = exc.code
        except TimeoutError:
            reason = "timeout"
        except (OSError, ValueError, IndexError, asyncio.IncompleteReadError):
            reason = "unreachable"
        except Exception:  # a bug: this session stays here, the drain goes on
            log.exception("session %s: its move failed", session.id)
            reason = "internal_error"
        if reason is None and (session.closed or session.detached):
            reason = "closed"  # the client left meanwhile: the target's copy expires unclaimed
        if reason is not None:
            self.counts.failed[reason] += 1
            log.warning("session %s could not move to %s (%s): it stays here", session.id, peer, reason)
            if not session.closed:
                await conn.release_input()
            return reason
        conn.moved(str(answer["token"]), float(answer.get("grace_s", 0.0)))
        self.counts.moved += 1
        self.counts.bytes_out += len(body)
        self.counts.pause(loop.time() - started)
        return None


def _by_outcome(
    name: str, documentation: str, done: tuple[str, int], failed: dict[str, collections.Counter[str]]
) -> CounterMetricFamily:
    """A counter of what was done (reason "") and of each other outcome by reason."""
    family = CounterMetricFamily(name, documentation, labels=["outcome", "reason"])
    family.add_metric([done[0], ""], done[1])
    for outcome, counter in failed.items():
        for reason, value in sorted(counter.items()):
            family.add_metric([outcome, reason], value)
    return family


class PeerMoveCollector(Collector):
    def __init__(self, mover: PeerMover) -> None:
        self.mover = mover

    def collect(self) -> Any:
        c = self.mover.counts
        yield _by_outcome(
            "duplexserve_session_moves",
            "sessions sent to a peer on drain: moved, failed (by reason: it stayed here), or not movable "
            "(by reason: no resume, detached, ending, no peer with room; drained in place)",
            ("moved", c.moved), {"failed": c.failed, "unmovable": c.unmovable},
        )
        yield _by_outcome(
            "duplexserve_session_imports",
            "sessions a peer moved here: imported, or refused (by reason: unsigned, bad_signature, "
            "stale, replayed, move_corrupt, move_mismatch, no_room, draining)",
            ("imported", c.imported), {"refused": c.refused},
        )
        sent = CounterMetricFamily("duplexserve_session_move_bytes", "bytes of moved sessions",
                                   labels=["direction"])
        sent.add_metric(["out"], c.bytes_out)
        sent.add_metric(["in"], c.bytes_in)
        yield sent
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, PAUSE_BUCKETS), "+Inf"), c.pause_buckets, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(
            "duplexserve_session_move_pause_seconds",
            "a moved session's pause at its source: input held until session.moved was queued",
            buckets=buckets, sum_value=c.pause_sum_s,
        )
        yield GaugeMetricFamily("duplexserve_drain_move_seconds",
                                "the last drain's moving: from its start to its last session moved",
                                c.drain_s)
