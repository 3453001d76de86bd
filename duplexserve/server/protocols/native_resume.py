"""duplex/1's resume (docs/protocol.md): a dropped connection detaches its session, and a new
one with ``?resume=<token>&last_frame=<k>`` takes it over and gets the frames it missed.

What a new connection must take over (formats, codecs, the last ``--max-output-frames``
frames as sent) is the :class:`Carry`; the token registry is core/resume.py.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

import numpy as np

from duplexserve import errors
from duplexserve.codecs.formats import SAMPLE_BYTES, AudioFormat
from duplexserve.codecs.pipeline import Decoder, Encoder, make_decoder, make_encoder
from duplexserve.codecs.resample import frame_samples_total
from duplexserve.server.core.replay import ReplayRing
from duplexserve.server.core.resume import Resumable

OPUS = "opus"


@dataclass
class Carry:
    """What a resumed session takes from its old connection: formats, codecs, replay.

    ``sent_audio`` holds the last output frames handed to a socket: the bytes as sent,
    or for Opus the model audio (each connection is its own Ogg stream, so a replayed
    Opus frame is encoded again by the new stream's encoder). ``sent_text`` holds the
    text deltas of those frames.
    """

    input_format: AudioFormat
    output_format: AudioFormat
    decoder: Decoder
    encoder: Encoder
    sent_audio: ReplayRing
    sent_text: collections.deque[tuple[int, str]]
    wire_bytes: int  # input bytes fed to the decoder so far (PCM and G.711)
    prompted: bool = False  # the session's prompt was asked for: it is set once
    applied: dict[str, str] | None = None  # the prompt the model ran (session.updated echoes it)


def text_delta(frame: int, text: str) -> str:
    """The ``text.delta`` event, byte for byte what ``json.dumps`` writes for its dict, in a
    fifth of the time (json's own C string encoder, no dict walk): a model's text goes out
    with its frame."""
    return f'{{"type": "text.delta", "frame": {frame:d}, "text": {encode_basestring_ascii(text)}}}'


class NativeResume:
    """Mixed into :class:`~duplexserve.server.protocols.native.NativeConnection`."""

    input_format: AudioFormat
    output_format: AudioFormat
    _resumable: Resumable | None
    _sent_audio: ReplayRing | None
    _sent_text: collections.deque[tuple[int, str]] | None
    _wire_bytes: int
    _skip_bytes: int
    _prompted: bool
    _applied: dict[str, str] | None
    session: Any
    decoder: Any
    encoder: Any
    orch: Any
    codec_procs: Any
    _loop: Any
    refuse: Any
    accept: Any
    send_json: Any
    send_bytes: Any
    send_text: Any
    encode: Any
    close: Any
    _describe: Any

    # -------------------------------------------------------------------- resume
    def carry(self) -> Carry:
        assert self.decoder is not None and self.encoder is not None
        assert self._sent_audio is not None and self._sent_text is not None
        return Carry(self.input_format, self.output_format, self.decoder, self.encoder,
                     self._sent_audio, self._sent_text, self._wire_bytes, self._prompted, self._applied)

    def lost(self, session: Any) -> bool:
        entry = self._resumable
        if entry is not None and entry.owner is self:
            entry.state = self.carry()
        return self.orch.detach(session)

    async def _resume(self, token: str, last_frame: str) -> bool:
        """``?resume=<token>&last_frame=<k>``: take a detached (or half-open) session over."""
        registry = self.orch.resume
        entry = registry.peek(token) if registry.enabled else None
        if entry is None:
            registry.refuse()
            await self.refuse(errors.POLICY, "resume_failed", "unknown, used or expired resume token")
            return False
        session = entry.session
        try:
            k = int(last_frame)
        except ValueError:
            k = -2
        if not -1 <= k <= session.frames_out - 1:
            registry.refuse()
            await self.refuse(errors.POLICY, "resume_failed",
                              f"last_frame must be -1 to {session.frames_out - 1}")
            return False
        old = entry.owner
        carry: Carry = old.carry() if old is not None else entry.state
        registry.claim(token)
        if old is not None:
            old.take_over()  # a half-open connection: it says session.closed "replaced"
        self.input_format, self.output_format = carry.input_format, carry.output_format
        # Each connection is its own Ogg stream both ways; resamplers keep their state.
        self.decoder = make_decoder(carry.input_format, self.codec_procs) \
            if carry.input_format.format == OPUS else carry.decoder
        self.encoder = make_encoder(carry.output_format, self.codec_procs) \
            if carry.output_format.format == OPUS else carry.encoder
        self._sent_audio, self._sent_text = carry.sent_audio, carry.sent_text
        self.session, self._resumable, self._prompted = session, entry, carry.prompted
        self._applied = carry.applied
        if carry.input_format.format == OPUS:
            session.drop_partial()  # the new Ogg stream starts at input frame frames_in
        else:
            width = SAMPLE_BYTES[carry.input_format.format]
            taken = frame_samples_total(session.frames_in, carry.input_format.sample_rate) * width
            self._wire_bytes = carry.wire_bytes
            self._skip_bytes = max(carry.wire_bytes - taken, 0)
        session.last_activity = self._loop.time()
        token = registry.attach(entry, self)
        replay = carry.sent_audio.after(k)
        unsent = session.frames_out - (replay[-1][0] + 1 if replay else k + 1)
        replayed = len(replay) + max(unsent, 0)
        resumed = self._describe("session.resumed")
        del resumed["protocol"], resumed["model"], resumed["engine"], resumed["frame_ms"]
        resumed.update({
            "frames_in": session.frames_in,
            "frames_out": session.frames_out,
            "replayed": replayed,
            "frames_lost": session.frames_out - (k + 1) - replayed,
            "resume": {"token": token, "grace_s": registry.grace_s},
        })
        try:
            await self.accept()
            await self.send_json(resumed)
            await self._replay(replay, [(i, t) for i, t in carry.sent_text if i > k])
            if session.timer is not None:  # the writer goes on after the last frame handed over
                session.timer.resync(carry.sent_audio.next)
        except (OSError, RuntimeError):  # gone again before the replay was out: detach again
            self.lost(session)
            return False
        return True

    async def _replay(self, audio: list[tuple[int, Any]], texts: list[tuple[int, str]]) -> None:
        """Send again the frames after ``last_frame`` that were handed to the old socket."""
        t = 0
        timer = self.session.timer if self.session is not None else None
        for index, payload in audio:
            if self.output_format.format == OPUS:
                data = await self.encode(np.frombuffer(payload, dtype=np.float32))
            else:
                data = payload
            await self.send_bytes(data)
            if timer is not None:  # a frame whose first send broke is timed now, gap included
                timer.sent(index, self._loop.time())
            while t < len(texts) and texts[t][0] <= index:
                if texts[t][0] == index:
                    await self.send_text(text_delta(index, texts[t][1]))
                t += 1

    async def send_replaced(self) -> None:
        session = self.session
        assert session is not None
        await self.send_json({
            "type": "session.closed", "reason": "replaced",
            "frames_in": session.frames_in, "frames_out": session.frames_out, "frames_dropped": 0,
        })
        await self.close(errors.NORMAL, "replaced")

