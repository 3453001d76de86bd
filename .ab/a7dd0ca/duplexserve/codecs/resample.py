"""Streaming sample-rate conversion with soxr, one resampler per session and direction.

The resampler keeps its filter state between calls, so a stream cut into messages
sounds the same as the stream resampled at once: frame boundaries make no clicks.
soxr (HQ) works in blocks and holds back a varying part of its input: from 24 kHz to
48 kHz one 80 ms frame in gives 0 to 1.5 frames out. Input toward the model may come
out in any length (the session buffers it), but every output message must be one whole
80 ms frame, so the output side starts the stream with the measured worst shortfall in
silence and then always has a full frame to hand out (docs/codecs.md has the latencies).

soxr releases the GIL while it works (measured by ``duplexserve bench codec-costs``),
so a thread pool can run it beside the event loop; whether that pays is ``runs_inline``.
"""

from __future__ import annotations

import functools

import numpy as np
import soxr

from duplexserve.codecs.formats import FRAME_MS, MODEL_RATE

QUALITY = "HQ"  # 20-bit precision, passband to 91% of the lower Nyquist rate
_EMPTY = np.zeros(0, dtype=np.float32)

#: Above this rate a frame costs more than two thread-pool hops on the loop thread
#: (37-47 us against about 16 us a hop, docs/codecs.md), and soxr leaves the GIL, so the
#: pool saves loop time; at and below it the hop would cost more than the work.
INLINE_MAX_RATE = 96000


def runs_inline(rate: int) -> bool:
    return rate <= INLINE_MAX_RATE


def frame_samples_total(frames: int, rate: int) -> int:
    """Samples in the first ``frames`` 80 ms frames at ``rate``, exact over any count."""
    return frames * rate * FRAME_MS // 1000


class StreamResampler:
    """Any rate in, any rate out, float32 mono; call ``flush`` once at the end."""

    def __init__(self, in_rate: int, out_rate: int) -> None:
        self._soxr = soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality=QUALITY)
        self._ended = False

    def process(self, samples: np.ndarray) -> np.ndarray:
        if not len(samples):
            return _EMPTY
        return self._soxr.resample_chunk(np.ascontiguousarray(samples, dtype=np.float32))

    def flush(self) -> np.ndarray:
        if self._ended:
            return _EMPTY
        self._ended = True
        return self._soxr.resample_chunk(_EMPTY, last=True)


@functools.cache
def start_padding(out_rate: int) -> int:
    """Worst shortfall of soxr's output behind whole frames, from 24 kHz to ``out_rate``.

    Measured once per rate on silence over 200 frames (block patterns repeat well
    within that), plus two samples for the rounding of odd rates.
    """
    rs = soxr.ResampleStream(MODEL_RATE, out_rate, 1, dtype="float32", quality=QUALITY)
    frame = np.zeros(MODEL_RATE * FRAME_MS // 1000, dtype=np.float32)
    produced, worst = 0, 0
    for k in range(1, 201):
        produced += len(rs.resample_chunk(frame))
        worst = max(worst, frame_samples_total(k, out_rate) - produced)
    return worst + 2


class FrameResampler:
    """Model frames (1920 samples at 24 kHz) to whole 80 ms frames at ``out_rate``.

    Frame k is exactly ``frame_samples_total(k) - frame_samples_total(k-1)`` samples:
    one 80 ms frame, with odd rates alternating lengths so that no drift builds up.
    """

    def __init__(self, out_rate: int) -> None:
        self.out_rate = out_rate
        self._rs = StreamResampler(MODEL_RATE, out_rate)
        self._buf = np.zeros(start_padding(out_rate), dtype=np.float32)
        self._frames = 0
        self.underruns = 0  # silence inserted because soxr was later than measured

    def process(self, frame: np.ndarray) -> np.ndarray:
        out = self._rs.process(frame)
        buf = np.concatenate((self._buf, out)) if len(self._buf) else out
        self._frames += 1
        need = frame_samples_total(self._frames, self.out_rate) - frame_samples_total(
            self._frames - 1, self.out_rate
        )
        if len(buf) < need:
            self.underruns += 1
            buf = np.concatenate((buf, np.zeros(need - len(buf), dtype=np.float32)))
        self._buf = buf[need:]
        return buf[:need]
