"""The metrics of docs/benchmarks.md, defined once, as its Definitions word them.

Every function here is plain arithmetic on timestamps (seconds, one monotonic clock)
so that the tests can check it on constructed timelines. Times of a session:

- ``sent[i]``: when the message carrying input frame *i* was written to the socket;
- ``received[i]``: when output frame *i* arrived.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

FRAME_S = 0.080  # one model frame, 80 ms


def percentile(values: Sequence[float] | np.ndarray, q: float) -> float:
    """Nearest-rank percentile: the smallest observed value with at least q% of values at or below it.

    Always an observed value (no interpolation), so "p99 = 35 ms" means some frame took
    35 ms. NaN for no values.
    """
    data = np.sort(np.asarray(values, dtype=np.float64))
    if not len(data):
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    rank = max(1, math.ceil(q / 100.0 * len(data)))
    return float(data[rank - 1])


def rtf(first_sent: float, last_received: float, frames_out: int, frame_s: float = FRAME_S) -> float:
    """Real-time factor of a session.

    (time last output frame received - time first input frame sent) / duration of output
    audio. Real time is <= 1.0 plus the model's own delay. NaN when nothing came back.
    """
    if frames_out <= 0:
        return math.nan
    return (last_received - first_sent) / (frames_out * frame_s)


def round_trips(sent: Sequence[float] | np.ndarray, received: Sequence[float] | np.ndarray) -> np.ndarray:
    """Frame round trip: time output frame i arrived - time input frame i was sent.

    Only frames present on both sides count (a missing frame is a guard failure, not a
    latency).
    """
    n = min(len(sent), len(received))
    return np.asarray(received[:n], dtype=np.float64) - np.asarray(sent[:n], dtype=np.float64)


def lateness(received: Sequence[float] | np.ndarray, frame_s: float = FRAME_S) -> np.ndarray:
    """How far output frame i arrived behind its playback deadline, first output time + i x 80 ms.

    Negative values are frames that arrived ahead of their deadline.
    """
    arrived = np.asarray(received, dtype=np.float64)
    if not len(arrived):
        return arrived
    return arrived - (arrived[0] + frame_s * np.arange(len(arrived)))


def underruns(late: Sequence[float] | np.ndarray, buffer_frames: int = 1, frame_s: float = FRAME_S) -> int:
    """Frames a player with a playback buffer of ``buffer_frames`` frames would miss.

    Lateness is measured against first output time + i x 80 ms, as defined above; the
    player holds ``buffer_frames`` frames before it starts, so its deadline for frame i
    is that much later and an underrun is lateness > 0 past the buffer. With the default
    buffer of one frame, a frame may arrive up to 80 ms behind the nominal deadline. A
    buffer of 0 counts every positive lateness, which any jitter at all produces.
    """
    return int(np.count_nonzero(underrun_mask(late, buffer_frames, frame_s)))


def underrun_mask(
    late: Sequence[float] | np.ndarray, buffer_frames: int = 1, frame_s: float = FRAME_S
) -> np.ndarray:
    """Which frames of ``late`` are underruns (see :func:`underruns`)."""
    if buffer_frames < 0:
        raise ValueError("a playback buffer cannot be negative")
    return np.asarray(late, dtype=np.float64) > buffer_frames * frame_s + 1e-9


def per_frame(delta: float, frames: float) -> float:
    """A server counter's increase divided by the frames handled in the same interval.

    Host cost per frame = server process CPU time (user + system) / frames handled;
    voluntary context switches and executor submissions per frame likewise.
    """
    return delta / frames if frames > 0 else math.nan
