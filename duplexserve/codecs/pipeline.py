"""Per-session converters between a wire format and the model's float32 at 24 kHz.

A decoder turns received bytes into model samples, an encoder turns one model frame
into the bytes of one output message. ``inline`` says whether the work is cheap enough
to run on the event-loop thread; only real transcoding is not.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from duplexserve.codecs import pcm
from duplexserve.codecs.formats import AudioFormat, FormatError


class Decoder(Protocol):
    inline: bool

    def decode(self, data: bytes) -> np.ndarray:
        """Samples at the model rate (possibly none yet); raises FormatError on bad input."""
        ...

    def flush(self) -> np.ndarray:
        """Whatever the decoder still holds, at the end of the input."""
        ...


class Encoder(Protocol):
    inline: bool

    def encode(self, frame: np.ndarray) -> bytes:
        """One model frame (1920 float32 samples) as wire bytes."""
        ...


_EMPTY = np.zeros(0, dtype=np.float32)


class F32Passthrough:
    """Native format: the bytes are the samples. No copy, no conversion."""

    inline = True

    def decode(self, data: bytes) -> np.ndarray:
        return pcm.f32_view(data)

    def flush(self) -> np.ndarray:
        return _EMPTY

    def encode(self, frame: np.ndarray) -> bytes:
        return frame.tobytes()


class S16:
    inline = True

    def decode(self, data: bytes) -> np.ndarray:
        return pcm.s16_to_f32(data)

    def flush(self) -> np.ndarray:
        return _EMPTY

    def encode(self, frame: np.ndarray) -> bytes:
        return pcm.f32_to_s16(frame)


def make_decoder(fmt: AudioFormat) -> Decoder:
    if fmt.is_model_native:
        return F32Passthrough()
    if fmt.format == "pcm_s16le" and fmt.sample_rate == 24000:
        return S16()
    raise FormatError(f"input {fmt.format} at {fmt.sample_rate} Hz is not supported")


def make_encoder(fmt: AudioFormat) -> Encoder:
    if fmt.is_model_native:
        return F32Passthrough()
    if fmt.format == "pcm_s16le" and fmt.sample_rate == 24000:
        return S16()
    raise FormatError(f"output {fmt.format} at {fmt.sample_rate} Hz is not supported")
