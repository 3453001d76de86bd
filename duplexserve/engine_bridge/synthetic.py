"""The embedded default engine: deterministic, so any client can check what comes back.

``echo`` answers input frame i with input frame i - delay_frames (silence before),
``silence`` answers with zeros. Its cost per step follows the step model of
docs/benchmarks.md: ``base_ms + per_session_ms * batch`` waited with the GIL released, as a
GPU kernel wait would, and ``host_ms_per_session * batch`` of Python work holding it,
as a per-request preprocess loop does.
"""

from __future__ import annotations

import json
import struct
import time
from typing import Any

import numpy as np

from duplexserve.engine_bridge.engine import Engine, MoveRefused, StepResult, Tail

#: The export's header: a length, then JSON naming what the state fits (``_fits``).
_HEADER = struct.Struct("<I")
FAIL_MARK = np.float32(1000.0)  # within the edge's bound (codecs/pcm.py), far outside real audio
WORDS = (" hello", " from", " the", " duplex", " echo", " engine.")


class SyntheticEngine(Engine):
    name = "synthetic"

    def __init__(
        self,
        num_slots: int,
        mode: str = "echo",
        delay_frames: int = 0,
        text_every: int = 5,
        base_ms: float = 0.0,
        per_session_ms: float = 0.0,
        host_ms_per_session: float = 0.0,
        faults: bool = False,
    ) -> None:
        super().__init__(num_slots)
        if mode not in ("echo", "silence"):
            raise ValueError(f"unknown synthetic mode {mode!r}")
        self.mode = mode
        self.delay = delay_frames
        self.text_every = text_every
        self.base_s = base_ms / 1000.0
        self.per_session_s = per_session_ms / 1000.0
        self.host_s_per_session = host_ms_per_session / 1000.0
        self.faults = faults
        self.tail = Tail(frames=delay_frames)  # the echo of the last input frames, after input.end
        self.frame_index = np.zeros(num_slots, dtype=np.int64)
        depth = delay_frames + 1
        self._history = (
            np.zeros((num_slots, depth, self.frame_samples), np.float32) if delay_frames else None
        )

    def open(self, slot: int, params: dict[str, Any]) -> None:
        self.frame_index[slot] = 0
        if self._history is not None:
            self._history[slot] = 0.0

    def close(self, slot: int) -> None:
        self.frame_index[slot] = 0

    def _fits(self) -> dict[str, Any]:
        """What an imported state must have been made by: the same mode, delay and frame size."""
        return {"engine": self.name, "mode": self.mode, "delay": self.delay, "frame": self.frame_samples}

    def export_slot(self, slot: int) -> bytes:
        """The slot's frame index (the text cadence) and, with a delay, the frames not yet
        echoed, oldest first: all an echo needs to go on exactly elsewhere."""
        head = json.dumps({**self._fits(), "index": int(self.frame_index[slot])}).encode()
        history = b""
        if self._history is not None:
            depth = self.delay + 1
            order = (int(self.frame_index[slot]) + np.arange(depth)) % depth  # oldest first
            history = self._history[slot, order].tobytes()
        return _HEADER.pack(len(head)) + head + history

    def import_slot(self, slot: int, state: bytes) -> None:
        try:
            (size,) = _HEADER.unpack_from(state)
            head = json.loads(state[_HEADER.size : _HEADER.size + size])
            index = int(head.pop("index"))
        except (struct.error, ValueError, KeyError, TypeError) as exc:
            raise MoveRefused("move_corrupt", f"not a synthetic engine's state: {exc}") from None
        if head != self._fits():
            raise MoveRefused("move_mismatch", f"state of {head}, this engine is {self._fits()}")
        history = state[_HEADER.size + size :]
        if self._history is None:
            if history:
                raise MoveRefused("move_corrupt", "history given to an engine without delay")
        else:
            depth = self.delay + 1
            if len(history) != depth * self.frame_samples * 4:
                raise MoveRefused("move_corrupt", f"history of {len(history)} bytes")
            frames = np.frombuffer(history, np.float32).reshape(depth, self.frame_samples)
            self._history[slot, (index + np.arange(depth)) % depth] = frames
        self.frame_index[slot] = index

    def step(self, slots: np.ndarray, frames: np.ndarray) -> StepResult:
        if self.faults:
            self._inject(frames)
        index = self.frame_index[slots]
        self.frame_index[slots] = index + 1
        if self.mode == "silence":
            audio = np.zeros_like(frames)
        elif self._history is None:
            audio = frames
        else:
            depth = self.delay + 1
            self._history[slots, index % depth] = frames
            audio = self._history[slots, (index - self.delay) % depth]
        text: dict[int, str] = {}
        if self.text_every:
            for row in np.flatnonzero(index % self.text_every == 0).tolist():
                text[row] = WORDS[(int(index[row]) // self.text_every) % len(WORDS)]
        self._spend(len(slots))
        return StepResult(audio, text)

    @staticmethod
    def _inject(frames: np.ndarray) -> None:
        """Test hook: a frame starting with FAIL_MARK makes the step raise, -FAIL_MARK makes it hang."""
        first = frames[:, 0]
        if (first == FAIL_MARK).any():
            raise RuntimeError("injected engine fault")
        if (first == -FAIL_MARK).any():
            time.sleep(3600)  # a stuck kernel: only the watchdog notices

    def _spend(self, batch: int) -> None:
        wait = self.base_s + self.per_session_s * batch
        if wait > 0:
            time.sleep(wait)  # releases the GIL, like waiting on a GPU
        burn = self.host_s_per_session * batch
        if burn > 0:
            end = time.perf_counter() + burn
            while time.perf_counter() < end:  # Python work: holds the GIL between switches
                pass
