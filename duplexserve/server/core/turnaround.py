"""How late the server answers: the turnaround of every output frame, measured in bulk.

Turnaround of output frame *i* = the moment the output frame was handed to the socket
minus the moment the message carrying input frame *i* was received (docs/protocol.md, "How
late the server answers"). The hot path pays one clock read and one list append per
output frame, its pairing with the input message (a few list operations) and one tuple
append per input message that completed a frame; the histogram buckets, the sums and
the late count are done with numpy every :data:`FLUSH_FRAMES` frames of a session (and
at its end), never a metrics call per frame.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np

#: Bucket bounds of ``duplexserve_frame_turnaround_seconds`` (upper edges, seconds).
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
FLUSH_FRAMES = 512
#: Per-session turnarounds kept for p50 / p99 (float32); past this many values, every
#: other one is dropped: a uniform subsample keeps the percentiles, memory stays bounded.
KEEP_VALUES = 16384
_BUCKET_EDGES = np.array(BUCKETS)


@dataclass
class TurnaroundTotals:
    """Server-wide: what ``/metrics`` exports (a histogram and the late count)."""

    late_s: float = 0.2
    buckets: np.ndarray = field(default_factory=lambda: np.zeros(len(BUCKETS) + 1, dtype=np.int64))
    sum_s: float = 0.0
    count: int = 0
    late: int = 0


class FrameTimer:
    """One session's input arrival times and output hand-over times.

    The session core extends :attr:`arrivals` with (frames_in after a message, its
    receive time); the connection's writer appends the hand-over time of each output
    frame to :attr:`sent_times` (output frames leave in order, so the index is implied)
    and calls :meth:`flush` every :data:`FLUSH_FRAMES`, which pairs them with numpy.
    Frames are timed the first time they reach a socket: after a resume, :meth:`sent`
    times a replayed frame whose first send broke, and :meth:`resync` tells where the
    writer goes on.
    """

    __slots__ = ("_first", "_kept", "_kept_n", "_totals", "arrivals", "count", "late", "max_s", "sent_times")

    def __init__(self, totals: TurnaroundTotals) -> None:
        #: Flat: frames_in after a message, its receive time, the next message's, …
        #: ``array('d')``: appends in C, and numpy reads it without converting objects.
        self.arrivals = array("d")
        self.sent_times = array("d")
        self._first = 0  # output index of sent_times[0]
        self._totals = totals
        self._kept: list[np.ndarray] = []
        self._kept_n = 0
        self.max_s = 0.0
        self.count = 0
        self.late = 0

    def arrived(self, frames_in: int, t: float) -> None:
        """Input frames up to ``frames_in - 1`` were complete at ``t``."""
        self.arrivals.extend((frames_in, t))

    def sent(self, index: int, t: float) -> None:
        """Output frame ``index`` was handed to the socket at ``t`` (off the writer's path)."""
        expected = self._first + len(self.sent_times)
        if index < expected:
            return  # timed already, the first time it was sent
        if index > expected:
            self.flush()
            self._first = index
        self.sent_times.append(t)
        if len(self.sent_times) >= FLUSH_FRAMES:
            self.flush()

    def resync(self, index: int) -> None:
        """The writer's next output frame is ``index`` (after a resume)."""
        self.flush()
        self._first = max(self._first, index)

    def flush(self) -> None:
        """Pair the frames sent since the last flush with their messages; fold them in."""
        sent = self.sent_times
        if not sent:
            return
        first, n = self._first, len(sent)
        self._first += n
        arrivals = self.arrivals
        if not arrivals:  # only input.end's tail frames: they answer no input, nothing to time
            del sent[:]
            return
        arr = np.frombuffer(arrivals, dtype=np.float64).reshape(-1, 2).copy()  # no view may outlive
        ends = arr[:, 0]
        index = np.arange(first, first + n)
        answers = index < ends[-1]  # the rest are tail frames: no input frame arrived for them
        which = np.searchsorted(ends, index[answers], side="right")
        turn = np.maximum(np.frombuffer(sent, dtype=np.float64)[answers] - arr[which, 1], 0.0)
        del sent[:]
        del arrivals[: 2 * int(np.searchsorted(ends, self._first, side="right"))]  # fully timed
        n = len(turn)
        if not n:
            return
        totals = self._totals
        totals.buckets += np.bincount(np.searchsorted(_BUCKET_EDGES, turn), minlength=len(BUCKETS) + 1)
        late = int(np.count_nonzero(turn > totals.late_s))
        totals.sum_s += float(turn.sum())
        totals.count += n
        totals.late += late
        self.max_s = max(self.max_s, float(turn.max()))
        self.count += n
        self.late += late
        self._kept.append(turn.astype(np.float32))
        self._kept_n += n
        if self._kept_n > KEEP_VALUES:
            every = np.concatenate(self._kept)[::2]
            self._kept, self._kept_n = [every], len(every)

    def summary(self) -> dict[str, float]:
        """``turnaround_ms`` of ``session.closed``: p50 and p99 of the kept values, max exact."""
        self.flush()
        if not self._kept:
            return {"p50": 0.0, "p99": 0.0, "max": 0.0}
        p50, p99 = percentiles(np.concatenate(self._kept), (50.0, 99.0))
        return {"p50": round(float(p50) * 1000.0, 2), "p99": round(float(p99) * 1000.0, 2),
                "max": round(self.max_s * 1000.0, 2)}


def percentiles(values: np.ndarray, qs: tuple[float, ...]) -> list[float]:
    """``np.percentile``'s default (linear) estimate from one sort: at a session's end
    ``np.percentile`` cost about 250 us of the loop for 750 values, the sort 9."""
    ordered = np.sort(values)
    last = len(ordered) - 1
    out = []
    for q in qs:
        pos = q / 100.0 * last
        lo = int(pos)
        hi = min(lo + 1, last)
        out.append(float(ordered[lo]) + (float(ordered[hi]) - float(ordered[lo])) * (pos - lo))
    return out
