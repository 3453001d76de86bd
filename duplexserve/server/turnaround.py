"""How late the server answers: the turnaround of every output frame, measured in bulk.

Turnaround of output frame *i* = the moment the output frame was handed to the socket
minus the moment the message carrying input frame *i* was received (PROTOCOL.md, "How
late the server answers"). The hot path pays one clock read and one list append per
output frame, its pairing with the input message (a few list operations) and one tuple
append per input message that completed a frame; the histogram buckets, the sums and
the late count are done with numpy every :data:`FLUSH_FRAMES` frames of a session (and
at its end), never a metrics call per frame.
"""

from __future__ import annotations

import collections
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

    ``arrived`` is fed by the session core with the receive time the adapter stamped on
    the message; ``sent`` by the connection's writer, which pairs the frame with the
    message that carried its input (a popleft now and then: messages arrive in order).
    Output frames are timed the first time they reach a socket: a frame sent again after
    a resume is not timed twice.
    """

    __slots__ = ("_arrivals", "_kept", "_kept_n", "_next", "_totals", "_turns", "count", "late", "max_s")

    def __init__(self, totals: TurnaroundTotals) -> None:
        self._arrivals: collections.deque[tuple[int, float]] = collections.deque()
        self._turns: list[float] = []
        self._next = 0  # the next output index to time
        self._totals = totals
        self._kept: list[np.ndarray] = []
        self._kept_n = 0
        self.max_s = 0.0
        self.count = 0
        self.late = 0

    @property
    def arrivals(self) -> collections.deque[tuple[int, float]]:
        """(frames_in after a message, its receive time); the session core appends to it."""
        return self._arrivals

    def arrived(self, frames_in: int, t: float) -> None:
        """Input frames up to ``frames_in - 1`` were complete at ``t``."""
        self._arrivals.append((frames_in, t))

    def sent(self, index: int, t: float) -> None:
        """Output frame ``index`` was handed to the socket at ``t``."""
        if index < self._next:
            return  # sent again after a resume: timed the first time
        self._next = index + 1
        arrivals = self._arrivals
        while arrivals and arrivals[0][0] <= index:
            arrivals.popleft()
        if not arrivals:  # cannot happen: an answer without its input
            return
        turns = self._turns
        turns.append(t - arrivals[0][1])
        if len(turns) >= FLUSH_FRAMES:
            self.flush()

    def flush(self) -> None:
        """Fold the frames timed since the last flush into the totals, with numpy."""
        turns = self._turns
        if not turns:
            return
        turn = np.array(turns)
        turns.clear()
        n = len(turn)
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
        p50, p99 = np.percentile(np.concatenate(self._kept), (50, 99))
        return {"p50": round(float(p50) * 1000.0, 2), "p99": round(float(p99) * 1000.0, 2),
                "max": round(self.max_s * 1000.0, 2)}
