"""What Opus input may decode to: a packet's TOC byte, and a connection's budget of samples.

An Opus packet says in its first byte (the TOC, RFC 6716 section 3.1) how long it is:
the frame duration (2.5 to 60 ms) and, in the two low bits, one frame, two, or a count
in the next byte. One byte can therefore stand for 120 ms of audio (code 1: two empty
60 ms frames, decoded as concealment): 2880 float32 samples, 11,520 bytes of PCM, for
one byte on the wire. So the Ogg reader reads each packet's TOC before it decodes
anything and charges the packet's duration to the connection's :class:`OpusBudget`:
decoded audio may run at most ``ahead_s`` ahead of the connection's wall clock (from its
first message) and at most ``ms_per_byte`` of audio per byte received (after the same
``ahead_s`` allowance). A connection over either is refused (:class:`OverBudget`) before
the packets that would go over are decoded, so what one message can cost is bounded by
the budget, not by how much audio its bytes claim.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from duplexserve.codecs.formats import MODEL_RATE, FormatError

#: Samples at 24 kHz of one frame, by TOC configuration (``toc >> 3``): SILK NB, MB, WB at
#: 10/20/40/60 ms; hybrid SWB, FB at 10/20 ms; CELT NB, WB, SWB, FB at 2.5/5/10/20 ms.
_FRAME_SAMPLES = (240, 480, 960, 1440) * 3 + (240, 480) * 2 + (60, 120, 240, 480) * 4
MAX_PACKET_SAMPLES = 2880  # 120 ms: no Opus packet is longer (RFC 6716 section 3.2.5)


class OverBudget(FormatError):
    """Input refused for what it would cost: ``budget`` names the budget it went over
    (``budgets.over_budget``'s label: ``opus_samples``, ``ogg_packet``)."""

    def __init__(self, budget: str, message: str) -> None:
        super().__init__(message)
        self.budget = budget


def packet_samples(packet: bytes) -> int:
    """Samples at 24 kHz that ``packet`` decodes to, read from its TOC byte (and the frame
    count byte of code 3); FormatError for a packet no decoder would take."""
    if not packet:
        raise FormatError("invalid Ogg/Opus data: an empty Opus packet (RFC 6716 R1)")
    toc = packet[0]
    code = toc & 3
    frame = _FRAME_SAMPLES[toc >> 3]
    if code == 0:
        return frame
    if code != 3:
        return 2 * frame
    if len(packet) < 2 or not packet[1] & 0x3F or (packet[1] & 0x3F) * frame > MAX_PACKET_SAMPLES:
        raise FormatError("invalid Ogg/Opus data: an Opus packet's frame count is 0 or over 120 ms")
    return (packet[1] & 0x3F) * frame


@dataclass(frozen=True, slots=True)
class OpusLimits:
    """``--opus-ahead-s`` and ``--opus-ms-per-byte`` (config.py), as a codec worker gets them."""

    ahead_s: float = 10.0
    ms_per_byte: float = 20.0

    _WIRE = struct.Struct("<dd")

    def pack(self) -> bytes:
        return self._WIRE.pack(self.ahead_s, self.ms_per_byte)

    @classmethod
    def unpack(cls, data: bytes | memoryview) -> OpusLimits:
        return cls(*cls._WIRE.unpack(data))


class OpusBudget:
    """One connection's allowance of decoded samples: see the module's doc."""

    def __init__(self, limits: OpusLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._ahead = limits.ahead_s * MODEL_RATE
        self._per_byte = limits.ms_per_byte * MODEL_RATE / 1000
        self._clock = clock
        self._start: float | None = None
        self.received = 0  # bytes
        self.decoded = 0  # samples charged

    def left(self, nbytes: int) -> int:
        """Samples this connection may still decode, counting ``nbytes`` just received."""
        now = self._clock()
        if self._start is None:
            self._start = now
        self.received += nbytes
        by_time = (now - self._start) * MODEL_RATE
        return int(self._ahead + min(by_time, self.received * self._per_byte)) - self.decoded

    def refusal(self, wanted: int) -> OverBudget:
        """The error for a connection whose input would decode to ``wanted`` more samples."""
        total = (self.decoded + wanted) / MODEL_RATE
        assert self._start is not None
        elapsed = self._clock() - self._start
        if elapsed * MODEL_RATE <= self.received * self._per_byte:
            why = (f"{total:.1f} s of audio in {elapsed:.1f} s: more than "
                   f"{self.limits.ahead_s:g} s ahead of real time")
        else:
            why = (f"{total:.1f} s of audio from {self.received} bytes: more than "
                   f"{self.limits.ms_per_byte:g} ms a byte")
        return OverBudget("opus_samples", f"Opus input over its budget: {why}")
