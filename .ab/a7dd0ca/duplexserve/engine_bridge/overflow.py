"""The slow path into a bounded queue that another thread drains, with order kept.

``put`` tries ``put_nowait`` first. When the queue is full the item goes to an overflow
FIFO instead, and one executor task empties that FIFO with blocking puts; while the FIFO
holds anything, every later item queues behind it, and an item leaves the FIFO only once
it is in the queue. So items reach the consumer in the order they were put, the loop
never blocks, and one executor submission serves a whole full-queue episode rather than
an item. Both engine bridges (ours and the one into vLLM-Omni) go through this.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, Generic, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class OrderedPutter(Generic[T]):
    def __init__(
        self,
        put_nowait: Callable[[T], None],
        put_blocking: Callable[[T], None],
        full: type[BaseException],
        counts: Any,
        executor: Executor,
        timed_out: type[BaseException] | None = None,
        on_timeout: Callable[[T], None] | None = None,
    ) -> None:
        """``full``: what ``put_nowait`` raises on a full queue. ``put_blocking`` may raise
        ``timed_out`` (then ``on_timeout(item)`` is told, and the put is tried again); any
        other error (the queue was closed) drops what the FIFO holds.

        ``counts`` gets ``slow_puts`` and ``executor_submissions`` added to it.
        """
        self._put_nowait = put_nowait
        self._put_blocking = put_blocking
        self._full = full
        self._timed_out = timed_out
        self._on_timeout = on_timeout
        self.counts = counts
        self._executor = executor
        self._fifo: collections.deque[T] = collections.deque()
        self._lock = threading.Lock()
        self._draining = False

    @property
    def backed_up(self) -> bool:
        """True while items wait in the overflow FIFO: later items must wait behind them."""
        return bool(self._fifo)

    def __len__(self) -> int:
        return len(self._fifo)

    def put(self, item: T, weight: int = 1) -> bool:
        """Put without blocking, keeping order; True when it went straight into the queue."""
        if not self._fifo:
            try:
                self._put_nowait(item)
            except self._full:
                pass
            else:
                return True
        self.counts.slow_puts += weight
        with self._lock:
            self._fifo.append(item)
            if self._draining:
                return False
            self._draining = True
        self.counts.executor_submissions += 1
        self._executor.submit(self._drain)
        return False

    def _drain(self) -> None:
        """On the executor: blocking puts until the FIFO is empty."""
        while True:
            with self._lock:
                if not self._fifo:
                    self._draining = False
                    return
                item = self._fifo[0]
            try:
                self._put_blocking(item)
            except Exception as exc:
                if self._timed_out is not None and isinstance(exc, self._timed_out):
                    if self._on_timeout is not None:
                        self._on_timeout(item)
                    continue
                log.debug("queue closed; %d queued items dropped", len(self._fifo), exc_info=True)
                with self._lock:
                    self._fifo.clear()
                    self._draining = False
                return
            with self._lock:  # removed only once it is in the queue: later items wait until then
                self._fifo.popleft()
