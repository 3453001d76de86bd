"""Linear PCM: float32 passes through as a view, int16 converts with one vector op."""

from __future__ import annotations

import numpy as np

from duplexserve.codecs.formats import FormatError

_S16_SCALE = np.float32(32768.0)


_F32 = np.dtype("<f4")  # parsed once: a dtype string costs a parse per call


def f32_view(data: bytes | memoryview) -> np.ndarray:
    """The received bytes seen as float32 samples, without copying them."""
    if len(data) % 4:
        raise FormatError(f"pcm_f32le audio must be a multiple of 4 bytes, got {len(data)}")
    return np.frombuffer(data, dtype=_F32)


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
