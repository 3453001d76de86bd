"""Per-session converters between a wire format and the model's float32 at 24 kHz.

A decoder turns received bytes into model samples, an encoder turns one model frame
into the bytes of one output message. Every codec is a wire conversion (pass-through,
int16, G.711 or Ogg/Opus) composed with a streaming resampler when the wire rate is not
24 kHz. Where each runs was measured (docs/codecs.md, ``duplexserve bench codec-costs``):

- ``inline`` True: run where called, on the event-loop thread. Pass-through, int16 and
  G.711 (a few microseconds a frame), resampling up to 96 kHz (9-35 us, less than the
  thread hop it would need), and Opus when no codec process is configured (libopus
  through ctypes, ``libopus.py`` and ``opus_reader.py``; it releases the GIL, but its
  Ogg framing does not, and a thread's CPU would still be the loop process's).
- ``inline`` False, ``remote`` False: the connection runs it on the codec thread pool.
  Resampling above 96 kHz: soxr releases the GIL and a frame costs over two hops.
- ``remote`` True: the codec's state lives in a codec worker process; the connection
  awaits ``decode_async`` / ``encode_async``. Opus when ``codec_processes`` > 0.

A session awaits each of its own conversions before the next, so codec state is never
used by two threads at once and frames keep their order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import numpy as np

from duplexserve.codecs import g711, pcm
from duplexserve.codecs.formats import MODEL_RATE, AudioFormat, FormatError
from duplexserve.codecs.libopus import DEFAULT_COMPLEXITY
from duplexserve.codecs.opus_choice import make_opus_decoder, make_opus_encoder
from duplexserve.codecs.resample import FrameResampler, StreamResampler, runs_inline

if TYPE_CHECKING:
    from duplexserve.codecs.procpool import CodecProcesses


class Decoder(Protocol):
    inline: bool
    remote: bool  # True: ``async decode_async(data)`` instead of ``decode`` (codec process)

    def decode(self, data: bytes) -> np.ndarray:
        """Samples at the model rate (possibly none yet); raises FormatError on bad input."""
        ...

    def flush(self) -> np.ndarray:
        """Whatever the decoder still holds, at the end of the input."""
        ...


class Encoder(Protocol):
    inline: bool
    remote: bool  # True: ``async encode_async(frame)`` instead of ``encode``

    def encode(self, frame: np.ndarray) -> bytes:
        """One model frame (1920 float32 samples) as the bytes of one output message."""
        ...


_EMPTY = np.zeros(0, dtype=np.float32)


def _f32_bytes(samples: np.ndarray) -> bytes:
    return np.asarray(samples, dtype="<f4").tobytes()


#: Wire bytes to float32 samples at the wire rate, and back.
TO_F32: dict[str, Callable[[bytes | memoryview], np.ndarray]] = {
    "pcm_f32le": pcm.f32_view,
    "pcm_s16le": pcm.s16_to_f32,
    "g711_ulaw": g711.ulaw_to_f32,
    "g711_alaw": g711.alaw_to_f32,
}
FROM_F32: dict[str, Callable[[np.ndarray], bytes]] = {
    "pcm_f32le": _f32_bytes,
    "pcm_s16le": pcm.f32_to_s16,
    "g711_ulaw": g711.f32_to_ulaw,
    "g711_alaw": g711.f32_to_alaw,
}


class F32Passthrough:
    """Native format: the bytes are the samples. No copy, no conversion."""

    inline = True
    remote = False

    def decode(self, data: bytes) -> np.ndarray:
        return pcm.f32_view(data)

    def flush(self) -> np.ndarray:
        return _EMPTY

    def encode(self, frame: np.ndarray) -> bytes:
        return frame.tobytes()


class PcmDecoder:
    """Linear or G.711 samples at any rate: one vector conversion, then soxr if needed."""

    remote = False

    def __init__(self, fmt: AudioFormat) -> None:
        self._to_f32 = TO_F32[fmt.format]
        rate = fmt.sample_rate
        self._resampler = StreamResampler(rate, MODEL_RATE) if rate != MODEL_RATE else None
        self.inline = runs_inline(rate)

    def decode(self, data: bytes) -> np.ndarray:
        samples = self._to_f32(data)
        return samples if self._resampler is None else self._resampler.process(samples)

    def flush(self) -> np.ndarray:
        return _EMPTY if self._resampler is None else self._resampler.flush()


class PcmEncoder:
    """One model frame to one 80 ms message of linear or G.711 samples at any rate."""

    remote = False

    def __init__(self, fmt: AudioFormat) -> None:
        self._from_f32 = FROM_F32[fmt.format]
        rate = fmt.sample_rate
        self._resampler = FrameResampler(rate) if rate != MODEL_RATE else None
        self.inline = runs_inline(rate)

    def encode(self, frame: np.ndarray) -> bytes:
        if self._resampler is not None:
            frame = self._resampler.process(frame)
        return self._from_f32(frame)


def make_decoder(fmt: AudioFormat, procs: CodecProcesses | None = None) -> Decoder:
    """The decoder for one session's input; ``procs`` hosts GIL-bound codecs (Opus)."""
    if fmt.is_model_native:
        return F32Passthrough()
    if fmt.format == "opus":
        if fmt.sample_rate != MODEL_RATE:
            raise FormatError("opus is always 24000 Hz")
        if procs is not None and procs.enabled:
            return procs.opus_decoder()
        # A server's sessions are held to its budget (opus_budget.py); a client's own audio is not.
        return make_opus_decoder(procs.opus_limits if procs is not None else None)  # type: ignore[return-value]
    if fmt.format not in TO_F32:
        raise FormatError(f"input {fmt.format} at {fmt.sample_rate} Hz is not supported")
    return PcmDecoder(fmt)


def make_encoder(fmt: AudioFormat, procs: CodecProcesses | None = None) -> Encoder:
    """The encoder for one session's output; one ``encode`` call per 80 ms model frame."""
    if fmt.is_model_native:
        return F32Passthrough()
    if fmt.format == "opus":
        if fmt.sample_rate != MODEL_RATE:
            raise FormatError("opus is always 24000 Hz")
        if procs is not None and procs.enabled:
            return procs.opus_encoder()
        # libopus at the configured complexity (libopus.py); sphn when libopus cannot load.
        return make_opus_encoder(procs.opus_complexity if procs is not None else DEFAULT_COMPLEXITY)
    if fmt.format not in FROM_F32:
        raise FormatError(f"output {fmt.format} at {fmt.sample_rate} Hz is not supported")
    return PcmEncoder(fmt)
