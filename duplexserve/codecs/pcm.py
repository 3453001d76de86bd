"""Linear PCM: float32 passes through as a view, int16 converts with one vector op.

Float32 from a client is the one input that can hold what no audio holds: NaN, infinities,
or finite values so large that the model's float32 arithmetic overflows (3e38). Fed to
the engine they poison the session's model state (Mimi's encoder attends over its ring)
and cost the model nothing to refuse here, so ``f32_view`` refuses them: a message whose
samples' L2 norm is above ``MAX_NORM`` (NaN and inf included) raises ``SampleRangeError``.
The norm bounds every sample (``|x| <= MAX_NORM``), and nominal audio ([-1, 1]) never
comes near it: 1920 full-scale samples have a norm of 44. One ``np.vdot`` of the view
with itself does it: a BLAS pass, no copy, and unlike ``np.dot`` no overflow warning;
0.6 us for 1920 samples where ``np.isfinite(v).all()`` costs 2.2 us and a min/max 2.9 us
(docs/codecs.md). Huge values are refused, not clipped: a clip would copy and quietly
change what the client sent, and such values mean a client sending something else than
audio in [-1, 1] (int16 scale, garbage).
"""

from __future__ import annotations

import numpy as np

from duplexserve.codecs.formats import FormatError

_S16_SCALE = np.float32(32768.0)


_F32 = np.dtype("<f4")  # parsed once: a dtype string costs a parse per call

#: The largest L2 norm a message of float32 samples may have (so every sample's magnitude).
MAX_NORM = 32768.0
_MAX_ENERGY = MAX_NORM * MAX_NORM


class SampleRangeError(FormatError):
    """Float32 samples no audio holds: NaN, an infinity, or a norm above ``MAX_NORM``."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason  # "non_finite" or "too_large": the metric's label


def f32_view(data: bytes | memoryview) -> np.ndarray:
    """The received bytes seen as float32 samples, without copying them; refused when they
    are not audio (module docstring)."""
    if len(data) % 4:
        raise FormatError(f"pcm_f32le audio must be a multiple of 4 bytes, got {len(data)}")
    samples = np.frombuffer(data, dtype=_F32)
    if not np.vdot(samples, samples) <= _MAX_ENERGY:  # NaN compares False: refused too
        raise _out_of_range(samples)
    return samples


def _out_of_range(samples: np.ndarray) -> SampleRangeError:
    """What is wrong with samples ``f32_view`` refused (the error path only)."""
    finite = np.isfinite(samples)
    if not finite.all():
        bad = samples[~finite]
        kinds = ", ".join(name for name, hit in (("NaN", np.isnan(bad).any()), ("+inf", (bad > 0).any()),
                                                 ("-inf", (bad < 0).any())) if hit)  # fmt: skip
        return SampleRangeError(f"pcm_f32le audio must be finite samples, got {kinds}", "non_finite")
    peak = float(np.abs(samples.astype(np.float64)).max())
    return SampleRangeError(
        f"pcm_f32le audio must be samples in [-1, 1], at most an L2 norm of {MAX_NORM:g} a message; "
        f"got a peak of {peak:.3g}", "too_large",
    )  # fmt: skip


def s16_to_f32(data: bytes | memoryview) -> np.ndarray:
    if len(data) % 2:
        raise FormatError(f"pcm_s16le audio must be a multiple of 2 bytes, got {len(data)}")
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / _S16_SCALE


def f32_to_s16_array(samples: np.ndarray) -> np.ndarray:
    """Round to the nearest step and clip, so a round trip stays within one LSB."""
    scaled = np.rint(samples * _S16_SCALE)
    np.clip(scaled, -32768, 32767, out=scaled)
    return scaled.astype("<i2")


def f32_to_s16(samples: np.ndarray) -> bytes:
    return f32_to_s16_array(samples).tobytes()
