"""The last output frames of a session as they were sent, kept for a resume.

One buffer allocated when the session opens, written in a ring: keeping each sent
``bytes`` object alive instead (a deque of 256 of them per session) made the allocator
churn and cost about 20% of the burst's server CPU per frame (docs/benchmarks.md); a
copy into a buffer whose pages stay mapped costs a ``memcpy``.
"""

from __future__ import annotations

import numpy as np


class ReplayRing:
    """Frames ``first`` … ``next - 1`` (at most ``capacity``), each ``frame_bytes`` long."""

    __slots__ = ("_buf", "_view", "capacity", "first", "frame_bytes", "next")

    def __init__(self, capacity: int, frame_bytes: int) -> None:
        self.capacity = capacity
        self.frame_bytes = frame_bytes
        self._buf = np.empty(capacity * frame_bytes, dtype=np.uint8)  # pages mapped as they fill
        self._view = memoryview(self._buf)
        self.first = 0
        self.next = 0

    def add(self, index: int, data: bytes | memoryview) -> None:
        """Output frame ``index`` is being handed to the socket."""
        n = self.frame_bytes
        if index != self.next or len(data) != n:  # a gap (a frame never sent): start again here
            self.first = index
            if len(data) != n:
                self.first = self.next = index + 1
                return
        offset = (index % self.capacity) * n
        self._view[offset : offset + n] = data
        self.next = index + 1

    def after(self, last: int) -> list[tuple[int, bytes]]:
        """The kept frames after output frame ``last``, oldest first."""
        n, cap = self.frame_bytes, self.capacity
        start = max(last + 1, self.first, self.next - cap)
        return [(i, bytes(self._view[(i % cap) * n : (i % cap) * n + n])) for i in range(start, self.next)]
