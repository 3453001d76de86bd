"""Python's cyclic garbage collector, kept off the frame path, and its pauses measured.

Why: a full (generation 2) collection walks every object the collector tracks and stops
the event loop, every session's frames with it, for as long as it takes. Measured on the
2-core development machine: with the startup's 60 000 objects (FastAPI, uvicorn, numpy)
in the walk, a full collection took 40-160 ms, and with 200 sessions ending it also had
their reference cycles to free (16 000 objects). Two measures: connections break their own
cycles when they end (``WebSocketTransport._release``), and what exists once the server has
started is frozen (``gc.freeze``: collections skip it), so a full collection walks only
what live sessions hold: 6 ms in the same run. The pauses that remain are exported as
``duplexserve_gc_pause_seconds{generation}``.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

PAUSE_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)


def freeze() -> None:
    """Collect once, then keep everything alive now out of every later collection."""
    gc.collect()
    gc.freeze()


class GcPauses:
    """A ``gc.callbacks`` hook timing each collection (from any thread)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        hist = Histogram(
            "duplexserve_gc_pause_seconds", "cyclic garbage collector pauses (every thread waits)",
            ["generation"], buckets=PAUSE_BUCKETS, registry=registry,
        )  # fmt: skip
        self._by_generation = [hist.labels(str(g)) for g in range(3)]
        self._started = 0.0

    def start(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self._by_generation[info["generation"]].observe(time.perf_counter() - self._started)
