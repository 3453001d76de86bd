"""Audio formats on the wire and the model's own time base."""

from __future__ import annotations

from dataclasses import dataclass

MODEL_RATE = 24000
FRAME_MS = 80
FRAME_SAMPLES = MODEL_RATE * FRAME_MS // 1000  # 1920: one Mimi / Moshi frame

#: Bytes per sample of the formats that have a fixed sample size (Opus has none).
SAMPLE_BYTES = {"pcm_f32le": 4, "pcm_s16le": 2, "g711_ulaw": 1, "g711_alaw": 1}
FORMATS = (*SAMPLE_BYTES, "opus")
MIN_RATE, MAX_RATE = 8000, 192000


class FormatError(ValueError):
    """An audio format or rate the server cannot take; the message is safe to show."""


@dataclass(frozen=True, slots=True)
class AudioFormat:
    format: str = "pcm_f32le"
    sample_rate: int = MODEL_RATE

    @classmethod
    def parse(cls, fmt: object, rate: object) -> AudioFormat:
        """Validate a client's choice; ``rate`` may be None, a number or a numeric string."""
        if fmt is None:
            fmt = "pcm_f32le"
        if not isinstance(fmt, str) or fmt not in FORMATS:
            raise FormatError(f"unsupported audio format {fmt!r}; one of {', '.join(FORMATS)}")
        if fmt == "opus":
            if rate not in (None, MODEL_RATE, str(MODEL_RATE)):
                raise FormatError("opus is always 24000 Hz")
            return cls(fmt, MODEL_RATE)
        if rate is None:
            return cls(fmt, MODEL_RATE)
        try:
            value = int(rate)
        except (TypeError, ValueError):
            raise FormatError(f"sample_rate must be an integer, got {rate!r}") from None
        if (isinstance(rate, float) and rate != value) or isinstance(rate, bool):
            raise FormatError(f"sample_rate must be an integer, got {rate!r}")
        if not MIN_RATE <= value <= MAX_RATE:
            raise FormatError(f"sample_rate must be within {MIN_RATE}..{MAX_RATE}, got {value}")
        return cls(fmt, value)

    @property
    def frame_samples(self) -> int:
        """Samples in one 80 ms frame at this side's rate."""
        return self.sample_rate * FRAME_MS // 1000

    @property
    def is_model_native(self) -> bool:
        """True when bytes on the wire are already what the engine eats: no conversion."""
        return self.format == "pcm_f32le" and self.sample_rate == MODEL_RATE

    def describe(self) -> dict[str, object]:
        return {"format": self.format, "sample_rate": self.sample_rate,
                "frame_samples": self.frame_samples}
