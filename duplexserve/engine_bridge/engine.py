"""The seam between the frontend and a model: fixed slots, one batched step per frame.

An engine knows nothing of sockets, sessions or threads. It is driven from one
thread (the engine thread), so it needs no locks of its own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class StepResult:
    """One output frame per row of the batch, plus text tokens for some rows."""

    audio: np.ndarray  # (batch, 1920) float32 at 24 kHz
    text: dict[int, str] = field(default_factory=dict)  # batch row -> text token


class Engine(ABC):
    """A model that owns the streaming state of ``num_slots`` sessions."""

    name: str = "engine"
    frame_samples: int = 1920
    #: (num_slots x frame_samples) float32 that the bridge may gather a step's frames into
    #: and pass as ``frames`` (its first rows): an engine whose step copies its input into
    #: a buffer of its own offers that buffer and skips the copy. None: a new array a step.
    #: An engine offering it must not return views of it (the next step overwrites it).
    input_buffer: np.ndarray | None = None

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots

    def start(self) -> None:  # noqa: B027 - optional hook
        """Load weights, allocate state, warm up. Runs on the engine thread."""

    def alive(self) -> bool:
        """False once the engine cannot go on (its process died): the bridge then ends
        every session it held and starts it again. Checked when idle and after a failure."""
        return True

    @abstractmethod
    def open(self, slot: int, params: dict[str, Any]) -> None:
        """Give ``slot`` a fresh state for a new session."""

    @abstractmethod
    def close(self, slot: int) -> None:
        """The session in ``slot`` is gone; its state may be dropped."""

    @abstractmethod
    def step(self, slots: np.ndarray, frames: np.ndarray) -> StepResult:
        """Advance the sessions in ``slots`` (int array) by one frame each.

        ``frames`` is (len(slots), frame_samples) float32; row i belongs to slots[i].
        """

    def stop(self) -> None:  # noqa: B027 - optional hook
        """Release resources. Runs on the engine thread."""
