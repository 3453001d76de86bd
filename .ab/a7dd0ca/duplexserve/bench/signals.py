"""What the codec benchmarks feed: espeak-ng speech where it is installed, else a tone mix."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import wave

import numpy as np
import soxr

from duplexserve.codecs import MODEL_RATE


def speechlike(seconds: float, rate: int = MODEL_RATE, seed: int = 0) -> np.ndarray:
    """Four wobbling tones under a little noise (Opus's cheap path: see :func:`model_signal`)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(rate * seconds)) / rate
    tones = (np.sin(2 * np.pi * rng.uniform(150, 3500) * t + 3 * np.sin(2 * np.pi * t)) for _ in range(4))
    x = 0.1 * sum(tones)
    return (x + 0.01 * rng.standard_normal(len(t))).astype(np.float32)


SPEECH_TEXT = (
    "Full duplex speech models listen and talk at the same time. Every eighty milliseconds the "
    "server takes one frame from each conversation, runs the model once for all of them, and "
    "sends one frame back to each. The frontend must keep up with every session at once."
)


def espeak_speech(seconds: float) -> np.ndarray | None:
    """Real speech from espeak-ng at 24 kHz, looped to ``seconds``; None without espeak-ng.

    A host without espeak-ng (the GPU machine) reads the same speech from the 16-bit mono
    WAV named by ``DUPLEXSERVE_SPEECH_WAV`` (``espeak-ng -w speech.wav TEXT`` elsewhere)."""
    wav = os.environ.get("DUPLEXSERVE_SPEECH_WAV")
    if wav:
        return _looped(wav, seconds)
    if shutil.which("espeak-ng") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "speech.wav")
        subprocess.run(["espeak-ng", "-w", path, SPEECH_TEXT], check=True, capture_output=True)
        return _looped(path, seconds)


def _looped(path: str, seconds: float) -> np.ndarray:
    with wave.open(path) as w:
        rate = w.getframerate()
        raw = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768
    x = soxr.resample(raw, rate, MODEL_RATE).astype(np.float32)
    return np.resize(x, int(seconds * MODEL_RATE))


def model_signal(seconds: float) -> tuple[np.ndarray, str]:
    """What the benchmarks feed: speech when espeak-ng is there, else the tone mix.

    The signal matters for Opus only, and much: libopus (through sphn) takes its cheap
    CELT path for steady tones (about 0.35 ms a frame) and its SILK path for speech, noise
    and silence (about 1.3 ms a frame), so tones would understate a real session's cost.
    """
    speech = espeak_speech(seconds)
    if speech is not None:
        return speech, "espeak-ng speech"
    return speechlike(seconds), "tone mix (espeak-ng missing: Opus costs are understated)"
