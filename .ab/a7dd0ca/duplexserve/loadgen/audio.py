"""What the load generator sends, and what the echo engine must send back.

One base signal (a WAV file or a generated one) is shared by every session of a
process; session *s* plays it rotated by a session-specific number of frames, so no
two sessions send the same frame at the same position and a server that swapped two
sessions' answers fails the content guard. Messages in the native format are views of
the base buffer (no copy per message); other formats are encoded per session with the
server's own codecs, and the expected answer is computed by running the server's
decoder, the echo, and the server's encoder on the client, in the same order.
"""

from __future__ import annotations

import collections
import wave
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from duplexserve.codecs import FRAME_SAMPLES, MODEL_RATE, AudioFormat, make_decoder, make_encoder

FRAME_MS = 80
_ROTATION_STEP = 7919  # a prime: session rotations spread over the whole signal


def generated_signal(frames: int, seed: int = 0) -> np.ndarray:
    """Speech-band tones under a little noise, about -12 dBFS: every 80 ms frame differs."""
    rng = np.random.default_rng(seed)
    n = frames * FRAME_SAMPLES
    t = np.arange(n, dtype=np.float64) / MODEL_RATE
    signal = np.zeros(n, dtype=np.float64)
    for _ in range(4):
        freq = rng.uniform(120.0, 3400.0)
        wobble = rng.uniform(0.2, 3.0)
        signal += 0.06 * np.sin(2 * np.pi * freq * t + 3.0 * np.sin(2 * np.pi * wobble * t))
    signal += 0.02 * rng.standard_normal(n)
    return np.clip(signal, -1.0, 1.0).astype(np.float32)


def read_wav(path: str) -> np.ndarray:
    """A PCM WAV file as mono float32 at 24 kHz (channels averaged, linear resampling)."""
    with wave.open(path, "rb") as w:
        channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
        raw = w.readframes(w.getnframes())
    if width == 1:
        samples = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        samples = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    elif width == 3:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        ints = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        ints = np.where(ints >= 1 << 23, ints - (1 << 24), ints)
        samples = ints.astype(np.float32) / float(1 << 23)
    elif width == 4:
        samples = np.frombuffer(raw, "<i4").astype(np.float32) / float(1 << 31)
    else:
        raise ValueError(f"{path}: {8 * width}-bit samples are not supported")
    samples = samples.reshape(-1, channels).mean(axis=1)
    if rate != MODEL_RATE and len(samples):
        n_out = round(len(samples) * MODEL_RATE / rate)
        samples = np.interp(np.arange(n_out) * (rate / MODEL_RATE), np.arange(len(samples)), samples)
    return np.ascontiguousarray(samples, dtype=np.float32)


class BaseSignal:
    """``frames`` frames of model audio, stored twice over so any rotation is one slice."""

    def __init__(self, frames: int, wav: str | None = None, seed: int = 0) -> None:
        if frames < 1:
            raise ValueError("a session sends at least one frame")
        if wav:
            source = read_wav(wav)
            if not len(source):
                raise ValueError(f"{wav} holds no audio")
            source = np.resize(source, frames * FRAME_SAMPLES)  # loop or cut to length
        else:
            source = generated_signal(frames, seed)
        self.frames = frames
        self.samples = np.concatenate((source, source))
        self.bytes = memoryview(self.samples.tobytes())

    def offset(self, session_index: int) -> int:
        """First frame of session ``session_index``'s rotation."""
        return (session_index * _ROTATION_STEP) % self.frames


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """What one session streams: formats, length and message size."""

    input: AudioFormat = field(default_factory=AudioFormat)
    output: AudioFormat = field(default_factory=AudioFormat)
    frames: int = 50
    message_ms: int = 80

    @property
    def frames_per_message(self) -> float:
        return self.message_ms / FRAME_MS

    @property
    def messages(self) -> int:
        """Messages per session; the last one may be shorter."""
        samples = self.frames * FRAME_SAMPLES
        per = self.message_ms * MODEL_RATE // 1000
        return -(-samples // per)


class SessionAudio:
    """The wire messages of one session, and (``expect``) the echo engine's answer to each."""

    def __init__(self, base: BaseSignal, spec: StreamSpec, session_index: int,
                 expect: str = "echo", delay_frames: int = 0) -> None:
        if spec.message_ms <= 0 or (spec.message_ms * MODEL_RATE) % 1000:
            raise ValueError("message_ms must be a positive whole number of milliseconds")
        self.base = base
        self.spec = spec
        self.start = base.offset(session_index) * FRAME_SAMPLES
        self.native = spec.input.is_model_native
        self.expect = expect
        self.delay = delay_frames
        self._encoder = None if self.native else make_encoder(spec.input)
        # The server's side, replayed here to know the exact answer.
        self._sim_decoder = make_decoder(spec.input) if expect != "none" else None
        self._sim_encoder = make_encoder(spec.output) if expect != "none" else None
        self._sim_partial = np.zeros(0, dtype=np.float32)
        self._sim_frames = 0
        self._history: collections.deque[np.ndarray] = collections.deque(maxlen=delay_frames + 1)
        self._silence = np.zeros(FRAME_SAMPLES, dtype=np.float32)

    def messages(self) -> Iterator[tuple[bytes | memoryview, int]]:
        """(wire message, model frames it completes at the server) for every message."""
        per = self.spec.message_ms * MODEL_RATE // 1000
        total = self.spec.frames * FRAME_SAMPLES
        sent = 0
        while sent < total:
            n = min(per, total - sent)
            lo = self.start + sent
            if self.native:
                chunk: bytes | memoryview = self.base.bytes[4 * lo: 4 * (lo + n)]
            else:
                assert self._encoder is not None
                chunk = self._encode_input(self.base.samples[lo: lo + n])
            sent += n
            yield chunk, n

    def _encode_input(self, samples: np.ndarray) -> bytes:
        """Encode model samples for the wire; encoders take whole frames, so cut to frames."""
        assert self._encoder is not None
        parts = []
        for i in range(0, len(samples), FRAME_SAMPLES):
            frame = samples[i: i + FRAME_SAMPLES]
            if len(frame) < FRAME_SAMPLES:
                frame = np.concatenate((frame, np.zeros(FRAME_SAMPLES - len(frame), np.float32)))
            parts.append(self._encoder.encode(frame))
        return b"".join(parts)

    def expected_after(self, chunk: bytes | memoryview) -> list[bytes]:
        """The output frames the server owes once it has ``chunk``, in order."""
        if self._sim_decoder is None:
            return []
        return self._cut(self._sim_decoder.decode(bytes(chunk) if not self.native else chunk))

    def expected_at_end(self) -> list[bytes]:
        """What input.end releases: the decoder's tail and the partial frame padded with silence."""
        if self._sim_decoder is None:
            return []
        out = self._cut(self._sim_decoder.flush())
        if len(self._sim_partial):
            frame = np.zeros(FRAME_SAMPLES, dtype=np.float32)
            frame[: len(self._sim_partial)] = self._sim_partial
            self._sim_partial = self._sim_partial[:0]
            out.append(self._answer(frame))
        return out

    def _cut(self, samples: np.ndarray) -> list[bytes]:
        if len(self._sim_partial):
            samples = np.concatenate((self._sim_partial, samples))
        whole = len(samples) // FRAME_SAMPLES
        out = [self._answer(samples[i * FRAME_SAMPLES: (i + 1) * FRAME_SAMPLES]) for i in range(whole)]
        self._sim_partial = samples[whole * FRAME_SAMPLES:].copy()
        return out

    def _answer(self, frame: np.ndarray) -> bytes:
        """The synthetic engine's output for this input frame, encoded as the server will."""
        assert self._sim_encoder is not None
        index = self._sim_frames
        self._sim_frames += 1
        if self.expect == "silence":
            return self._sim_encoder.encode(self._silence)
        if not self.delay:
            return self._sim_encoder.encode(frame)
        self._history.append(np.array(frame, dtype=np.float32))
        answer = self._history[0] if index >= self.delay else self._silence  # frame index - delay
        return self._sim_encoder.encode(answer)
