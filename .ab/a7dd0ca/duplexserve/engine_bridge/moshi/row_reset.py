"""Resetting rows of the batched streaming state: moshi's ``reset_streaming(mask)`` in one launch.

moshi resets its streaming state module by module, a few small kernels each (a
``torch.where`` of the mask, a fresh tensor of zeros or ones, a copy back): for
PersonaPlex's Mimi and LM about 700 launches and 8 ms of the engine thread on an H200
(``bench moshi-prompts --profile``), added to the next step of every live session each
time one session opens. Captured once as a CUDA graph for a mask of every row, the same
kernels replay in one launch; the mask is filled from pinned host memory, so nothing on
the way waits for the GPU.

A graph writes the memory its capture saw: the full states. The bucket states
(row_buckets.py) are views of that memory, so a reset replayed while a smaller bucket is
in use writes the same rows. What the library's resets do besides kernels (``offset_cpu
= 0``) is not replayed; only the depformer reads it, whose state lives one LM step.
Where no graph can be captured (the CPU, or a state whose reset is not capturable) the
library's resets run as before.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .row_buckets import StateViews

log = logging.getLogger(__name__)


class RowReset:
    """``reset_streaming`` of ``roots`` for some rows, all their states' rows at once."""

    def __init__(
        self, roots: Sequence[Any], views: StateViews, rows: int, device: torch.device, graph: bool
    ) -> None:
        self.roots, self.views = list(roots), views
        cuda = device.type == "cuda"
        self.mask = torch.zeros(rows, dtype=torch.bool, device=device)
        self._host = torch.zeros(rows, dtype=torch.bool, pin_memory=cuda)
        self._np = self._host.numpy()
        self._copied = torch.cuda.Event() if cuda else None  # the host mask is free to rewrite
        self.graph = self._capture() if graph and cuda else None

    def __call__(self, rows: np.ndarray) -> None:
        """Reset the rows set in ``rows``, a boolean mask of the first ``len(rows)`` rows."""
        if self._copied is not None:
            self._copied.synchronize()  # the last mask went over long ago: a step ran since
        self._np[:] = False
        self._np[: len(rows)] = rows
        self.mask.copy_(self._host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if self.graph is not None:
            self.graph.replay()
        else:
            self._reset()

    def _reset(self) -> None:
        size = self.views.size
        self.views.use(len(self.mask))  # the full states: what a graph writes too
        try:
            for root in self.roots:
                root.reset_streaming(self.mask)
        finally:
            self.views.use(size)

    def _capture(self) -> torch.cuda.CUDAGraph | None:
        self._np[:] = False
        self.mask.zero_()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._reset()  # the kernels' first run is not captured
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._reset()
        except Exception as exc:  # a state of another library version: its own resets, as before
            log.warning("moshi engine: row resets run module by module (%s)", exc)
            return None
        return graph
