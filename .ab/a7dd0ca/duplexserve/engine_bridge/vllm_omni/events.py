"""vLLM-Omni duplex events, turned into what duplexserve's sessions take.

The engine speaks OpenAI-Realtime-shaped events per session; the session core takes
80 ms frames of float32 at 24 kHz (output frame i answering input frame i), text
aligned with a frame, errors and a close. :class:`OutputFramer` holds one session's
side of that mapping, on the loop thread:

- ``response.output_audio.delta``: base64 audio in the chunk's own format and rate,
  decoded once (``pcm``/``pcm16``: one vector op), resampled to 24 kHz only when the
  model's rate differs, and cut into whole 1920-sample frames; a partial frame waits.
- ``response.listen`` with ``model_listen``: the model chose to listen for one unit;
  it is answered by one unit of silence, so a frame-locked model that does not speak
  still answers every input frame (the in-flight window never stalls).
- ``response.output_audio_transcript.delta`` / ``response.output_text.delta``: text,
  which the bridge attaches to the frame it belongs with (see ``VllmOmniBridge``).
- ``error``: a non-fatal error event; ``session.closed`` / ``session.expired`` that
  duplexserve did not ask for: a fatal error that closes the session.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from duplexserve import errors
from duplexserve.codecs.formats import FRAME_SAMPLES

MODEL_RATE = 24000
_S16_SCALE = np.float32(32768.0)
_EMPTY = np.zeros(0, dtype=np.float32)

#: vLLM-Omni close reasons that are not failures, and what duplexserve calls them.
_CLOSE_REASONS = {
    "idle_ttl_expired": ("idle_timeout", errors.NORMAL),
    "disconnect_grace_expired": ("idle_timeout", errors.NORMAL),
    "client_close": ("client_closed", errors.NORMAL),
    "shutdown": ("server_shutdown", errors.GOING_AWAY),
}
#: vLLM-Omni error codes that end a duplexserve session, with its close code.
FATAL_CODES = {
    "resource_exhausted": errors.TRY_AGAIN,
    "engine_backpressure": errors.TRY_AGAIN,
    "engine_dead": errors.INTERNAL,
    "engine_error": errors.INTERNAL,
    "timeout": errors.TRY_AGAIN,
}


@dataclass(slots=True)
class Issue:
    """An error or close the session must hear about (close_code None: it goes on)."""

    code: str
    message: str
    close_code: int | None


@dataclass(slots=True)
class Decoded:
    """What one event means for its session: whole frames and text, or an issue."""

    frames: list[np.ndarray] = field(default_factory=list)
    text: str = ""
    issue: Issue | None = None


def decode_audio(delta: str, fmt: str) -> np.ndarray:
    """Base64 audio of an ``AudioDelta`` as float32 samples at its own rate."""
    try:
        raw = base64.b64decode(delta, validate=False)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"audio delta is not base64: {exc}") from None
    fmt = fmt.lower()
    if fmt in ("pcm", "pcm16", "pcm_s16le", "s16le"):
        return np.frombuffer(raw[: len(raw) // 2 * 2], dtype="<i2").astype(np.float32) / _S16_SCALE
    if fmt == "pcm_f32le":
        return np.frombuffer(raw[: len(raw) // 4 * 4], dtype="<f4")
    if fmt == "wav":
        return _wav_samples(raw)
    raise ValueError(f"audio delta format {fmt!r} is not one duplexserve decodes")


def _wav_samples(raw: bytes) -> np.ndarray:
    """The samples of a 16-bit PCM WAV chunk (the only WAV vLLM-Omni's encoder writes)."""
    pos = 12
    while pos + 8 <= len(raw):
        size = int.from_bytes(raw[pos + 4 : pos + 8], "little")
        if raw[pos : pos + 4] == b"data":
            body = raw[pos + 8 : pos + 8 + size]
            return np.frombuffer(body[: len(body) // 2 * 2], dtype="<i2").astype(np.float32) / _S16_SCALE
        pos += 8 + size + (size & 1)
    raise ValueError("WAV audio delta has no data chunk")


class OutputFramer:
    """One session's engine events in, whole 24 kHz output frames and text out."""

    def __init__(self, unit_ms: int = 80) -> None:
        self._partial = _EMPTY
        self._unit_samples = MODEL_RATE * unit_ms // 1000
        self._resampler: Any = None
        self._resampler_rate = 0

    def on_event(self, event: Any) -> Decoded:
        kind = event.type
        if kind == "response.output_audio.delta":
            return self._audio(event)
        if kind in ("response.output_audio_transcript.delta", "response.output_text.delta"):
            return Decoded(text=event.delta or "")
        if kind == "response.listen":
            details = getattr(event, "details", None) or {}
            if details.get("model_listen") is True and not details.get("buffering"):
                return self._push(np.zeros(self._unit_samples, dtype=np.float32))
            return Decoded()
        if kind == "error":
            code = str(event.code or "engine_error")
            return Decoded(issue=Issue(code, str(event.message), FATAL_CODES.get(code)))
        if kind in ("session.closed", "session.expired"):
            reason = str(getattr(event, "reason", "") or "closed")
            code, close_code = _CLOSE_REASONS.get(reason, ("engine_error", errors.INTERNAL))
            return Decoded(issue=Issue(code, f"vLLM-Omni closed the session: {reason}", close_code))
        return Decoded()

    def _audio(self, event: Any) -> Decoded:
        try:
            samples = decode_audio(event.delta, str(event.format or "pcm16"))
        except ValueError as exc:
            return Decoded(issue=Issue("bad_engine_audio", str(exc), None))
        rate = int(event.sample_rate_hz or MODEL_RATE)
        if rate != MODEL_RATE:
            samples = self._resample(samples, rate)
        return self._push(samples)

    def _resample(self, samples: np.ndarray, rate: int) -> np.ndarray:
        if self._resampler is None or self._resampler_rate != rate:
            import soxr

            self._resampler = soxr.ResampleStream(rate, MODEL_RATE, 1, dtype="float32", quality="HQ")
            self._resampler_rate = rate
        return self._resampler.resample_chunk(np.ascontiguousarray(samples, dtype=np.float32))

    def _push(self, samples: np.ndarray) -> Decoded:
        if len(self._partial):
            samples = np.concatenate((self._partial, samples))
        whole = len(samples) // FRAME_SAMPLES
        frames = list(samples[: whole * FRAME_SAMPLES].reshape(whole, FRAME_SAMPLES)) if whole else []
        rest = samples[whole * FRAME_SAMPLES :]
        self._partial = rest.copy() if len(rest) else _EMPTY
        return Decoded(frames=frames)


class InputFramer:
    """24 kHz frames in, the model's own 80 ms units out (1280 samples at 16 kHz), for one session.

    soxr's streaming resampler hands out uneven blocks (979 or 1468 samples per 80 ms
    at 24 -> 16 kHz); models such as Nemotron VoiceChat take at most one unit per
    append, so the output is cut into whole units and the rest waits for the next frame.
    """

    def __init__(self, rate: int, unit_ms: int = 80) -> None:
        import soxr

        self._stream = soxr.ResampleStream(MODEL_RATE, rate, 1, dtype="float32", quality="HQ")
        self._unit = rate * unit_ms // 1000
        self._partial = _EMPTY

    def push(self, frame: np.ndarray) -> list[np.ndarray]:
        out = self._stream.resample_chunk(np.ascontiguousarray(frame, dtype=np.float32))
        if len(self._partial):
            out = np.concatenate((self._partial, out))
        whole = len(out) // self._unit
        units = list(out[: whole * self._unit].reshape(whole, self._unit)) if whole else []
        rest = out[whole * self._unit :]
        self._partial = rest.copy() if len(rest) else _EMPTY
        return units
