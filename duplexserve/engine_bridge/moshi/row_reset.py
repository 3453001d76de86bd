"""Resetting rows of the batched streaming state in one launch.

A reset writes a fresh row's content into every per-row tensor of the slot state
(slot_state.py): the one list the row moves use too, so nothing of the previous session
survives that a move would carry. moshi's own ``reset_streaming(mask)`` resets only the
offsets and leaves the rest (LMGen's token cache around the last position, among others)
to be overwritten before it is read, which a prompt's prefill does not do everywhere.

The reset runs a ``torch.where`` per tensor (for PersonaPlex's Mimi and LM a few hundred
small kernels, 8 ms of the engine thread on an H200, added to the next step of every live
session each time one session opens); captured once as a CUDA graph for a mask of every
row, the same kernels replay in one launch. The mask is filled from pinned host memory, so
nothing on the way waits for the GPU. A graph writes the memory its capture saw: the
full tensors, which the bucket states (row_buckets.py) are views of. Where no graph can be
captured (the CPU) the kernels run one by one.

Mimi's KV rings are then zeroed for the reset rows only (``SlotState.clear_rings``: one
``index_fill_`` a ring, the rows' indices copied from pinned memory like the mask), outside
the graph: a masked ``torch.where`` over every row of them would write the whole of them,
gigabytes at a few hundred rows, at every open.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .slot_state import SlotState

log = logging.getLogger(__name__)


class RowReset:
    """``SlotState.reset`` for some rows, with its mask set from the host."""

    def __init__(self, slots: SlotState, device: torch.device, graph: bool) -> None:
        self.slots = slots
        rows = slots.rows
        cuda = device.type == "cuda"
        self.mask = torch.zeros(rows, dtype=torch.bool, device=device)
        self._host = torch.zeros(rows, dtype=torch.bool, pin_memory=cuda)
        self._np = self._host.numpy()
        self.index = torch.zeros(rows, dtype=torch.long, device=device)  # rows whose rings are cleared
        self._index_host = torch.zeros(rows, dtype=torch.long, pin_memory=cuda)
        self._index_np = self._index_host.numpy()
        self._copied = torch.cuda.Event() if cuda else None  # the host mask is free to rewrite
        self.graph = self._capture() if graph and cuda else None

    def __call__(self, rows: np.ndarray) -> None:
        """Reset the rows set in ``rows``, a boolean mask of the first ``len(rows)`` rows."""
        if self._copied is not None:
            self._copied.synchronize()  # the last mask went over long ago: a step ran since
        self._np[:] = False
        self._np[: len(rows)] = rows
        self.mask.copy_(self._host, non_blocking=True)
        reset = np.flatnonzero(rows)
        count = len(reset) if self.slots.rings else 0
        if count:
            self._index_np[:count] = reset
            self.index[:count].copy_(self._index_host[:count], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if self.graph is not None:
            self.graph.replay()
        else:
            self.slots.reset(self.mask)
        if count:
            self.slots.clear_rings(self.index[:count])

    def _capture(self) -> torch.cuda.CUDAGraph | None:
        self._np[:] = False
        self.mask.zero_()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.slots.reset(self.mask)  # the kernels' first run is not captured
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.slots.reset(self.mask)
        except RuntimeError as exc:  # the reset runs kernel by kernel instead
            log.warning("moshi engine: row resets run uncaptured (%s)", exc)
            return None
        return graph
