"""The WebRTC load generator's audio bookkeeping: pure state, no sockets, no clock.

A WebRTC call carries Opus in RTP packets, lossy both ways, so the echo engine's answer
is not the audio sent but the audio sent *as the server heard it*, encoded by the
server, decoded by the client. :class:`EchoReplay` replays that path here, packet for
packet with the same libopus calls as server/transports/webrtc/call.py, so the loadgen's
content guard stays byte for byte: a frame that the server concealed, reordered, dropped or gave
another session fails it, as on the other protocols.

:class:`FrameAssembler` groups the server's packets back into its 80 ms frames by RTP
timestamp (four 20 ms packets or one 80 ms packet a frame), so the round trip of a
frame is timed from its last packet, as a player could start it then.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from duplexserve.codecs.formats import FRAME_SAMPLES
from duplexserve.codecs.opus_rtp import RtpOpusDecoder, RtpOpusEncoder

FRAME_TS = 3840  # one 80 ms frame at Opus's 48 kHz RTP clock
PACKET_TS = 960  # 20 ms: the length assumed for a piece that never came
#: Frames of sent audio remembered for answers that come later (``--delay-frames``).
KEEP_FRAMES = 256


def _diff(a: int, b: int) -> int:
    """a - b on the 32-bit RTP timestamp circle."""
    return ((a - b + (1 << 31)) & 0xFFFFFFFF) - (1 << 31)


class Piece(NamedTuple):
    payload: bytes | None  # None: nothing came for this part of the frame
    duration: int  # RTP units (48 kHz)


class FrameAssembler:
    """The server's packets, as they arrive, into whole 80 ms frames.

    A frame is complete when its packets cover 80 ms; a packet of a later frame closes
    the frame before it with what came (the rest as missing pieces). Frames with no
    packet at all are not made up: the guards count them as not received."""

    def __init__(self, duration: Callable[[bytes], int] | None = None) -> None:
        self._duration = duration
        self._base: int | None = None
        self._index = -1  # the frame being filled
        self._pieces: dict[int, bytes] = {}  # offset in the frame (RTP units) -> payload
        self._covered = 0
        self.packets = 0
        self.late = 0  # for a frame already handed on
        self.missing = 0  # 20 ms pieces of handed-on frames that never came

    def push(self, timestamp: int, payload: bytes) -> list[list[Piece]]:
        """One received packet; returns the frames it completes, oldest first."""
        self.packets += 1
        if self._base is None:
            self._base = timestamp
        offset = _diff(timestamp, self._base)
        index, within = divmod(offset, FRAME_TS)
        done: list[list[Piece]] = []
        if index < self._index or (index == self._index and within in self._pieces) or offset < 0:
            self.late += 1
            return done
        if index > self._index:
            if self._pieces:
                done.append(self._close())
            self._index, self._pieces, self._covered = index, {}, 0
        self._pieces[within] = payload
        length = self._duration(payload) if self._duration is not None else 0
        self._covered += length or PACKET_TS
        if self._covered >= FRAME_TS:
            done.append(self._close())
        return done

    def _close(self) -> list[Piece]:
        """The frame being filled, in order, with a piece for every gap."""
        pieces, at = [], 0
        for offset in sorted(self._pieces):
            while at < offset:  # a gap before this packet
                step = min(PACKET_TS, offset - at)
                pieces.append(Piece(None, step))
                self.missing += 1
                at += step
            payload = self._pieces[offset]
            length = (self._duration(payload) if self._duration is not None else 0) or PACKET_TS
            pieces.append(Piece(payload, length))
            at += length
        while at < FRAME_TS:
            pieces.append(Piece(None, PACKET_TS))
            self.missing += 1
            at += PACKET_TS
        self._pieces, self._covered = {}, 0
        self._index += 1  # whatever else comes for it is late
        return pieces


def decode_frame(decoder: RtpOpusDecoder, pieces: list[Piece]) -> bytes:
    """A frame's pieces as the model's 80 ms of float32 (missing ones concealed)."""
    parts = [
        decoder.decode(p.payload) if p.payload is not None else decoder.conceal(p.duration // 2)
        for p in pieces
    ]
    pcm = np.concatenate(parts) if len(parts) > 1 else parts[0]
    if len(pcm) != FRAME_SAMPLES:  # a sender's odd packet lengths: cut or padded to the frame
        pcm = pcm[:FRAME_SAMPLES] if len(pcm) > FRAME_SAMPLES else np.pad(pcm, (0, FRAME_SAMPLES - len(pcm)))
    return pcm.astype("<f4", copy=False).tobytes()


class EchoReplay:
    """What a WebRTC echo call's answers must be, from the packets this client sent.

    ``sent`` takes each packet as it leaves with the audio it holds; the server's decoder
    is replayed on it, and every whole frame of the original audio is paired with the
    frame the server heard. ``answer`` takes the loadgen's prediction of the engine's
    output (the original audio, delayed, or silence) and returns the float32 frame this
    client will decode from the server's packets: the paired frame, encoded as the server
    encodes (``complexity``, ``fec``: its ``--opus-complexity`` and
    ``--webrtc-output-fec``; ``packet_ms``: the packets it sends this peer), decoded as
    this client decodes."""

    def __init__(self, complexity: int = 5, fec: bool = False, packet_ms: int = 20) -> None:
        self._server_decoder = RtpOpusDecoder()
        self._server_encoder = RtpOpusEncoder(complexity, fec=fec)
        self._packet = packet_ms * 24  # samples at 24 kHz
        self._client_decoder = RtpOpusDecoder()
        self._heard: list[np.ndarray] = []
        self._original: list[np.ndarray] = []
        self._buffered = 0
        self._twins: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()

    def sent(self, pcm: np.ndarray, packets: list[bytes]) -> None:
        """``packets`` left, encoding ``pcm`` (24 kHz float32)."""
        decode = self._server_decoder.decode
        self._heard.extend(decode(p) for p in packets)
        self._original.append(np.asarray(pcm, dtype=np.float32))
        self._buffered += len(pcm)
        while self._buffered >= FRAME_SAMPLES:
            original = self._take(self._original)
            heard = self._take(self._heard)
            self._buffered -= FRAME_SAMPLES
            twins = self._twins
            twins[original.astype("<f4").tobytes()] = heard
            if len(twins) > KEEP_FRAMES:
                twins.popitem(last=False)

    @staticmethod
    def _take(chunks: list[np.ndarray]) -> np.ndarray:
        """The first frame's worth of samples of ``chunks``, removed from it."""
        joined = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
        chunks[:] = [joined[FRAME_SAMPLES:]] if len(joined) > FRAME_SAMPLES else []
        return joined[:FRAME_SAMPLES]

    def answer(self, engine_output: bytes) -> bytes:
        """The decoded frame that answers the engine output ``engine_output`` (float32)."""
        frame = self._twins.get(bytes(engine_output))
        if frame is None:  # silence, or audio this client never sent: encoded as it is
            frame = np.frombuffer(engine_output, dtype="<f4")
        packets = self._server_encoder.encode(frame, self._packet)
        decode = self._client_decoder.decode
        pcm = np.concatenate([decode(p) for p in packets])
        return pcm.astype("<f4", copy=False).tobytes()
