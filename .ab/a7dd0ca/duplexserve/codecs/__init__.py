"""Audio formats and the converters between them and the model's time base."""

from duplexserve.codecs.formats import FRAME_SAMPLES, MODEL_RATE, AudioFormat, FormatError
from duplexserve.codecs.pipeline import Decoder, Encoder, make_decoder, make_encoder

__all__ = [
    "FRAME_SAMPLES",
    "MODEL_RATE",
    "AudioFormat",
    "Decoder",
    "Encoder",
    "FormatError",
    "make_decoder",
    "make_encoder",
]
