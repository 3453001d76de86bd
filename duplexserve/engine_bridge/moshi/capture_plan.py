"""Which bucket a step runs in, and when each bucket's CUDA graphs are captured.

A bucket's first step with moshi's ``CUDAGraphed`` runs eagerly, its second captures: on an
H100, Hibiki-Zero 3B at 336 rows, 250-350 ms a step, every live session late by four frames.
So no step ever runs a bucket that is not captured yet: it runs in the smallest *captured*
bucket that holds its rows, the rows past its own masked off as idle slots already are
(a step of n rows in a larger bucket answers as the one of n rows, bit for bit; it costs
the larger bucket's step, no more than the full batch the server is sized for).

When: every bucket before ready by default (``--moshi-warm-rows 0``: 13 buckets beyond 4 rows
took 0.04-0.4 s each on the H100, a couple of seconds of a start). With ``--moshi-warm-rows N``
the buckets of up to N rows *and the largest* are captured before ready, so that every step
has a captured bucket from the first; the others while no session is open (``Engine.warm``).
Never between two live steps: capturing a bucket records a step's every kernel launch on
the engine thread, as long as an eager step (100+ ms at large buckets), which no frame's
slack holds. Pure: no torch here, so the policy is tested as it is on a CPU.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence


class CapturePlan:
    """The buckets ``sizes`` (ascending), which are captured, and which to capture next."""

    def __init__(self, sizes: Sequence[int], warm_rows: int = 0, graphed: bool = True) -> None:
        self.sizes = sorted(sizes)
        self.graphed = graphed
        if not graphed:  # nothing to capture: every bucket runs as it is (the CPU)
            self.before_ready: list[int] = []
            self.captured = set(self.sizes)
            return
        early = [n for n in self.sizes if n <= warm_rows] if warm_rows > 0 else self.sizes
        #: Captured before ready, smallest first: the largest always, so a step always fits one.
        self.before_ready = sorted({*early, self.sizes[-1]})
        self.captured: set[int] = set()

    def fit(self, bucket: int) -> int:
        """The bucket a step whose rows need ``bucket`` runs in: the smallest captured one
        that holds them (``bucket`` itself once captured)."""
        ready = sorted(self.captured)
        at = bisect.bisect_left(ready, bucket)
        if at == len(ready):
            raise RuntimeError(f"no captured bucket holds {bucket} rows (captured: {ready})")
        return ready[at]

    def mark(self, size: int) -> None:
        """``size``'s graphs are captured: steps that need it run in it from now on."""
        self.captured.add(size)

    @property
    def cold(self) -> list[int]:
        """The buckets not captured yet, smallest first (captured while no session is open)."""
        return [n for n in self.sizes if n not in self.captured]

    def next_idle(self) -> int | None:
        """The bucket to capture now, while no session is open (None: every one is)."""
        cold = self.cold
        return cold[0] if cold else None
