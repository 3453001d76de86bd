"""duplex/1's live migration (docs/protocol.md, "Moved to another replica"): what of a connection's
session moves to another replica, and how the client is told.

What moves: the session core's counts and deadline counters (core/move.py), the formats, the
prompt asked for and the one the model ran, the replay ring (the last output frames as sent)
and its text deltas. What does not: a codec's inner state (a soxr resampler's filter history,
an Opus stream), which lives in this process or a codec worker. Instead the target makes fresh
codecs and the client sends its input again from input frame ``frames_in``, a frame boundary
(no partial frame moves); PCM and G.711 at 24 kHz need no resampler, so their sessions go on
bit-exact, a resampled one hears the new resampler's start (a few samples) at the cut, as Opus
does on every resume (each connection is its own Ogg stream).

While a move is under way the connection holds what the client sends (:meth:`hold`): if the
move fails it is taken as if it had just come; if it lands, it is dropped and the client sends
it again from ``frames_in`` to the target.
"""

from __future__ import annotations

import collections
from typing import Any

from duplexserve import errors
from duplexserve.codecs.formats import FRAME_SAMPLES, SAMPLE_BYTES, AudioFormat, FormatError
from duplexserve.codecs.pipeline import make_decoder, make_encoder
from duplexserve.codecs.resample import frame_samples_total
from duplexserve.engine_bridge.engine import MoveRefused
from duplexserve.server.core.move import movable, session_header
from duplexserve.server.core.replay import ReplayRing
from duplexserve.server.protocols.native_resume import OPUS, Carry

PROTOCOL = "duplex/1"


def ring_width(out: AudioFormat) -> int:
    """Bytes a replayed frame takes: wire bytes, or model audio for Opus (native.py's ring)."""
    return FRAME_SAMPLES * 4 if out.format == OPUS else SAMPLE_BYTES[out.format] * out.frame_samples


def carry_from(header: dict[str, Any], replay: bytes, codec_procs: Any, capacity: int) -> Carry:
    """What a resume on this replica takes over (native_resume.py), from a moved session's
    header and replay blob; ``MoveRefused`` if they do not fit together."""
    try:
        inp = AudioFormat.parse(header["input"]["format"], header["input"]["sample_rate"])
        out = AudioFormat.parse(header["output"]["format"], header["output"]["sample_rate"])
        ring_head = header["replay"]
        first, width = int(ring_head["first"]), int(ring_head["frame_bytes"])
        texts = [(int(i), str(t)) for i, t in header["texts"]]
        frames_in = int(header["frames_in"])
    except (KeyError, TypeError, ValueError, FormatError) as exc:
        raise MoveRefused("move_corrupt", f"a duplex/1 session without {exc}") from None
    if width != ring_width(out) or len(replay) % width:
        raise MoveRefused("move_corrupt", "replay frames of another size than the output format's")
    ring = ReplayRing(capacity, width)
    for n in range(len(replay) // width):
        ring.add(first + n, replay[n * width : (n + 1) * width])
    if not replay:
        ring.first = ring.next = int(ring_head.get("next", 0))
    # The client sends again from input frame frames_in: the new decoder starts at its first byte.
    width_in = 0 if inp.format == OPUS else SAMPLE_BYTES[inp.format]
    wire = frame_samples_total(frames_in, inp.sample_rate) * width_in
    return Carry(inp, out, make_decoder(inp, codec_procs), make_encoder(out, codec_procs), ring,
                 collections.deque(texts, maxlen=capacity), wire, bool(header.get("prompted")),
                 header.get("applied"))


class NativeMove:
    """Mixed into :class:`~duplexserve.server.protocols.native.NativeConnection`."""

    #: What the client sent while a move was under way; None: no move.
    _held: list[bytes | str] | None = None
    session: Any
    orch: Any
    config: Any
    input_format: AudioFormat
    output_format: AudioFormat
    _resumable: Any
    _sent_audio: ReplayRing | None
    _sent_text: collections.deque[tuple[int, str]] | None
    _prompted: bool
    _applied: dict[str, str] | None
    _prompting: Any
    _loop: Any
    replaced: bool
    close_sent: bool
    receive: Any

    def unmovable(self) -> str | None:
        """Why this connection's session cannot move now (a metrics reason), or None."""
        entry = self._resumable
        if entry is None or entry.owner is not self or self._sent_audio is None:
            return "no_resume"
        if self.replaced or self.close_sent:
            return "closed"
        if self._prompting is not None:
            return "prompt_running"
        return movable(self.session)

    def hold_input(self) -> None:
        self._held = []

    def hold(self, data: bytes | str) -> bool:
        """Keep a message that came during a move; False: no move, handle it now."""
        if self._held is None:
            return False
        self._held.append(data if isinstance(data, str) else bytes(data))
        return True

    async def release_input(self) -> None:
        """The move failed: the session goes on here, with what came meanwhile, in order."""
        held, self._held = self._held or [], None
        for data in held:
            await self.receive(data)

    def move_state(self) -> tuple[dict[str, Any], bytes]:
        """The header and replay blob of this session (core/move.py packs them with the engine's)."""
        session, ring = self.session, self._sent_audio
        assert ring is not None and self._sent_text is not None
        kept = ring.after(-1)
        header = {
            **session_header(session, self._loop.time()),
            "protocol": PROTOCOL,
            "model": self.config.model_name,
            "engine": self.orch.engine.name,
            "input": {"format": self.input_format.format, "sample_rate": self.input_format.sample_rate},
            "output": {"format": self.output_format.format, "sample_rate": self.output_format.sample_rate},
            "prompted": self._prompted,
            "applied": self._applied,
            "replay": {"first": kept[0][0] if kept else ring.next, "next": ring.next,
                       "frame_bytes": ring.frame_bytes},
            "texts": [[i, t] for i, t in self._sent_text if kept and i >= kept[0][0]],
        }
        return header, b"".join(data for _, data in kept)

    def moved(self, token: str, grace_s: float) -> None:
        """The target holds the session now: tell the client where (``session.moved``), then
        close 1012 "moved"; what it sent during the move goes again to the target."""
        session = self.session
        self._held = None
        session.say({
            "type": "session.moved",
            "session_id": session.id,
            "frames_in": session.frames_in,
            "frames_out": session.frames_out,
            "resume": {"token": token, "grace_s": grace_s},
        })
        self.orch.close(session, "moved", errors.SERVICE_RESTART)
