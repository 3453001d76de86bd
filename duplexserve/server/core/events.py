"""What a session says toward its client, before any protocol gives it a wire form.

The session core queues these; each protocol adapter renders them (raw PCM and JSON
for duplex/1, kind-prefixed Ogg/Opus for Moshi, base64 JSON for OpenAI Realtime).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(slots=True)
class AudioOut:
    index: int  # output frame i answers input frame i
    audio: np.ndarray  # 1920 float32 samples at 24 kHz


@dataclass(slots=True)
class TextOut:
    index: int  # aligned with output frame ``index``
    text: str


@dataclass(slots=True)
class ErrorOut:
    code: str
    message: str
    fatal: bool


@dataclass(slots=True)
class ClosedOut:
    reason: str
    close_code: int
    frames_in: int
    frames_out: int
    frames_dropped: int
    frames_tail: int | None = None  # after input.end, for a model with a tail (Session.frames_tail)


@dataclass(slots=True)
class Notice:
    """A protocol-specific message (pong, session.updated, ...) kept in order with the rest."""

    payload: Any


Outgoing = AudioOut | TextOut | ErrorOut | ClosedOut | Notice
