"""The jitter buffer of a WebRTC call's incoming audio: pure state, no I/O, no clock.

RTP packets arrive as the network lets them: late, out of order, twice, or never. The
model needs one 80 ms frame every 80 ms. Packets go in with :meth:`JitterBuffer.push`
as they arrive; whoever owns the clock calls :meth:`JitterBuffer.pull` once per model
frame, ``depth`` packets after the first packet arrived, and gets what to play for the
next 80 ms of the stream, in RTP timestamps (48 kHz units): a packet to decode, or for a
packet that did not come in time, its recovery from the next packet's in-band FEC when
that one is already here, else libopus's concealment. The decisions are returned, not
carried out, so this file needs neither libopus nor a socket, and tests drive it packet
by packet.

What it does with what the network does:

- **late** (its time was played, concealed, before it came): dropped, counted. Except
  when the buffer is empty, which means the sender stalled rather than that this one
  packet was slow: then playback picks up at that packet (``resyncs``), so a stall
  costs latency once instead of every packet after it.
- **duplicate**: dropped, counted.
- **lost**: concealed (``concealed``) or recovered from FEC (``recovered``), 20 ms each.
- **too far ahead** (a sender whose clock runs fast, or a burst after a stall): past
  ``depth + slack`` packets queued beyond those the clock is about to play, the oldest
  are dropped (``overflow``), so latency stays bounded; a jump of more than ``capacity``
  packets starts over at the new packet. What a trim or a jump passes over unplayed is
  counted too, in 20 ms pieces (``skipped``): so every piece of the stream from the first
  packet on is accounted for (decoded, recovered, concealed or skipped).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

#: What :meth:`JitterBuffer.pull` asks for.
DECODE, RECOVER, CONCEAL = "decode", "recover", "conceal"
PACKET_TS = 960  # 20 ms at Opus's 48 kHz RTP clock: the duration assumed for a missing packet
FRAME_TS = 3840  # one 80 ms model frame in RTP timestamp units


class Play(NamedTuple):
    kind: str  # DECODE: ``payload`` itself; RECOVER: FEC of ``payload`` (the next packet); CONCEAL
    payload: bytes | None
    duration: int  # RTP timestamp units (48 kHz) this covers


@dataclass(slots=True)
class JitterCounts:
    packets: int = 0  # received, played or waiting
    late: int = 0
    duplicate: int = 0
    concealed: int = 0  # 20 ms pieces of concealment
    recovered: int = 0  # 20 ms pieces rebuilt from the next packet's FEC
    overflow: int = 0
    resyncs: int = 0
    skipped: int = 0  # 20 ms pieces of the stream passed over unplayed (a trim's or a jump's)

    def as_dict(self) -> dict[str, int]:
        return {
            "packets": self.packets, "late": self.late, "duplicate": self.duplicate,
            "concealed": self.concealed, "recovered": self.recovered,
            "overflow": self.overflow, "resyncs": self.resyncs, "skipped": self.skipped,
        }  # fmt: skip


def _diff(a: int, b: int) -> int:
    """a - b on the 32-bit RTP timestamp circle, in -2^31 .. 2^31."""
    return ((a - b + (1 << 31)) & 0xFFFFFFFF) - (1 << 31)


class JitterBuffer:
    def __init__(
        self,
        depth: int = 3,
        slack: int = 8,
        capacity: int = 256,
        duration: Callable[[bytes], int] | None = None,
    ) -> None:
        """``depth``: packets of 20 ms the clock keeps behind the first arrival; ``slack``:
        packets queued beyond ``depth`` before the oldest are dropped; ``duration``: a
        callable giving a packet's length in RTP units (``opus_rtp.packet_samples``;
        20 ms when None or when it says 0)."""
        self.depth, self.slack, self.capacity = depth, slack, capacity
        self._duration = duration
        self.counts = JitterCounts()
        self._packets: dict[int, bytes] = {}  # RTP timestamp -> payload
        self._next: int | None = None  # the timestamp playback reaches next
        self._ahead = 0  # played beyond the frames pulled so far (a packet longer than asked)
        self._playing = False  # pulled at least once

    @property
    def started(self) -> bool:
        return self._next is not None

    @property
    def queued(self) -> int:
        return len(self._packets)

    def push(self, timestamp: int, payload: bytes) -> None:
        """A received packet's RTP timestamp and Opus payload."""
        counts, packets = self.counts, self._packets
        if self._next is None:
            self._next = timestamp
        offset = _diff(timestamp, self._next)
        if offset < 0 and not self._playing:  # reordered before playback began: start earlier
            self._next, offset = timestamp, 0
        elif offset < 0:
            if packets:
                counts.late += 1
                return
            self._next, offset = timestamp, 0  # a stall: pick up here
            counts.resyncs += 1
        elif offset > self.capacity * PACKET_TS:
            packets.clear()  # a jump: start over at this packet
            self._next = timestamp
            counts.skipped += offset // PACKET_TS
            offset = 0
            counts.resyncs += 1
        if timestamp in packets:
            counts.duplicate += 1
            return
        counts.packets += 1
        packets[timestamp] = payload

    def pull(self, span: int = FRAME_TS, backlog: int = 0) -> list[Play]:
        """What to play for the next ``span`` RTP units of the stream (one model frame).
        ``backlog``: the pulls of ``span`` that follow at once (a clock catching up after
        its loop stood still): the packets they play are due, not a sender running ahead."""
        if self._next is None:
            return []
        self._playing = True
        plays: list[Play] = []
        need = span - self._ahead
        packets, counts = self._packets, self.counts
        while need > 0:
            ts = self._next
            payload = packets.pop(ts, None)
            if payload is not None:
                length = self._length(payload)
                plays.append(Play(DECODE, payload, length))
            else:
                length = PACKET_TS
                following = packets.get((ts + PACKET_TS) & 0xFFFFFFFF)
                if following is not None:
                    plays.append(Play(RECOVER, following, length))
                    counts.recovered += 1
                else:
                    plays.append(Play(CONCEAL, None, length))
                    counts.concealed += 1
            self._next = (ts + length) & 0xFFFFFFFF
            need -= length
        self._ahead = -need
        self._trim(backlog * span // PACKET_TS)
        return plays

    def _length(self, payload: bytes) -> int:
        duration = self._duration
        length = duration(payload) if duration is not None else 0
        return length or PACKET_TS

    def _trim(self, due: int) -> None:
        """Drop what playback passed (a packet that came late into a gap) and, past
        ``depth + slack`` packets queued beyond the ``due`` ones, the oldest: a sender
        running ahead."""
        packets, nxt = self._packets, self._next
        assert nxt is not None
        for ts in [ts for ts in packets if _diff(ts, nxt) < 0]:
            del packets[ts]
            self.counts.late += 1
        excess = len(packets) - (self.depth + self.slack + due)
        if excess > 0:
            for ts in sorted(packets, key=lambda t: _diff(t, nxt))[:excess]:
                del packets[ts]
            self.counts.overflow += excess
            self._next = min(packets, key=lambda t: _diff(t, nxt))
            self.counts.skipped += _diff(self._next, nxt) // PACKET_TS
