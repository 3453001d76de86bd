"""How late the server answers: the turnaround of every output frame, measured in bulk.

Turnaround of output frame *i* = the moment the output frame was handed to the socket
minus the moment the message carrying input frame *i* was received (PROTOCOL.md, "How
late the server answers"). The hot path pays one clock read and one list append per
output frame and one tuple append per input message that completed a frame; the
arithmetic, the histogram buckets and the late count are done with numpy every
:data:`FLUSH_FRAMES` frames (and at the session's end), never a metrics call per frame.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

import numpy as np

#: Bucket bounds of ``duplexserve_frame_turnaround_seconds`` (upper edges, seconds).
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
FLUSH_FRAMES = 256
#: Per-session percentiles: log-spaced bins 1 % apart from 10 us to 1000 s.
_FINE_LO, _FINE_STEP = math.log(1e-5), math.log(1.01)
_FINE_BINS = int((math.log(1e3) - _FINE_LO) / _FINE_STEP) + 2
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
    the message; ``sent`` by the connection's writer. Output frames are timed the first
    time they reach a socket: a frame sent again after a resume is not timed twice.
    """

    __slots__ = ("_arrivals", "_fine", "_first", "_sent", "_totals", "count", "late", "max_s")

    def __init__(self, totals: TurnaroundTotals) -> None:
        self._arrivals: collections.deque[tuple[int, float]] = collections.deque()
        self._sent: list[float] = []
        self._first = 0  # output index of _sent[0]
        self._totals = totals
        self._fine: np.ndarray | None = None
        self.max_s = 0.0
        self.count = 0
        self.late = 0

    def arrived(self, frames_in: int, t: float) -> None:
        """Input frames up to ``frames_in - 1`` were complete at ``t``."""
        self._arrivals.append((frames_in, t))

    def sent(self, index: int, t: float) -> None:
        """Output frame ``index`` was handed to the socket at ``t``."""
        sent = self._sent
        expected = self._first + len(sent)
        if index != expected:
            if index < expected:
                return  # sent again after a resume: timed the first time
            self.flush()  # a frame never handed over (lost across a resume): skip it
            self._first = index
        sent.append(t)
        if len(sent) >= FLUSH_FRAMES:
            self.flush()

    def flush(self) -> None:
        sent = self._sent
        if not sent:
            return
        n, first = len(sent), self._first
        arrivals = self._arrivals
        ends = np.fromiter((a[0] for a in arrivals), dtype=np.int64, count=len(arrivals))
        times = np.fromiter((a[1] for a in arrivals), dtype=np.float64, count=len(arrivals))
        if not len(ends):  # cannot happen: an answer without its input
            sent.clear()
            self._first += n
            return
        which = np.searchsorted(ends, np.arange(first, first + n), side="right")
        which = np.minimum(which, len(ends) - 1)
        turn = np.maximum(np.asarray(sent) - times[which], 0.0)
        totals = self._totals
        totals.buckets += np.bincount(np.searchsorted(_BUCKET_EDGES, turn), minlength=len(BUCKETS) + 1)
        total = float(turn.sum())
        late = int((turn > totals.late_s).sum())
        totals.sum_s += total
        totals.count += n
        totals.late += late
        if self._fine is None:
            self._fine = np.zeros(_FINE_BINS, dtype=np.int64)
        bins = np.clip(((np.log(np.maximum(turn, 1e-5)) - _FINE_LO) / _FINE_STEP).astype(np.int64),
                       0, _FINE_BINS - 1)
        self._fine += np.bincount(bins, minlength=_FINE_BINS)
        self.max_s = max(self.max_s, float(turn.max()))
        self.count += n
        self.late += late
        self._first += n
        sent.clear()
        last = self._first
        while arrivals and arrivals[0][0] <= last:  # every frame of it is timed
            arrivals.popleft()

    def summary(self) -> dict[str, float]:
        """``turnaround_ms`` of ``session.closed``: p50 and p99 within 1 %, max exact."""
        self.flush()
        fine = self._fine
        if fine is None or not self.count:
            return {"p50": 0.0, "p99": 0.0, "max": 0.0}
        cum = np.cumsum(fine)

        def pct(q: float) -> float:
            b = int(np.searchsorted(cum, q * self.count))
            upper = math.exp(_FINE_LO + (b + 1) * _FINE_STEP)
            return round(min(upper, self.max_s) * 1000.0, 2)

        return {"p50": pct(0.5), "p99": pct(0.99), "max": round(self.max_s * 1000.0, 2)}
