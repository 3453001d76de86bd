"""A step that costs what the live sessions need, not what the server could hold.

The engine's streaming state is allocated for every slot at start (admission never fails
later for memory), but a step runs only the first ``n`` rows of it, ``n`` the smallest
of a few bucket sizes that covers the highest row with a frame: as vLLM pads a decode
batch to a captured CUDA-graph size, with one set of graphs per bucket (moshi's
``CUDAGraphed`` captures one shape and refuses any other).

- **Views, not copies.** A bucket's streaming states are the full states with every
  per-row tensor narrowed to its first ``n`` rows along that tensor's batch axis, so a
  step at any bucket reads and writes the one full-size state and changing buckets
  copies nothing. Two library fields are replaced by new tensors instead of being
  written in place (a streaming conv's ``first``, ``LMGen``'s ``offsets``); their states
  get a class whose property writes the new value into the shared tensor.
- **Rows, not slots.** The frontend's slot numbers never change: the engine maps each
  slot to a row (``RowMap``), a new session takes the lowest free row, and when the live
  rows no longer fit the bucket of their count (sessions ended and left holes below the
  highest) the highest live rows move down into the holes: every per-row tensor of every
  state (KV rings, Mimi's and the depformer's streaming state, offsets, LMGen's token
  cache) is copied row to row, so the moved session goes on exactly where it was. A step
  moves at most about ``MOVE_BYTES`` of state, the rest in the steps after it: when many
  sessions end together, moving every row at once makes one step longer than a frame.

Which tensors are per row, and their batch axis, is slot_state.py's one list; a model whose
state holds a row twice (classifier-free guidance) or has cross-attention steps its full
batch.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from moshi.modules.streaming import StreamingModule
from moshi.utils import compile as moshi_compile
from moshi.utils.compile import CUDAGraphed

from .slot_state import RING_SLOTS, SlotState, per_row, ring_of, set_field

log = logging.getLogger(__name__)

#: The state a step moves at most (one row at least). H200, Hibiki-Zero int8 at 60 s: 128 rows
#: moved at once, about 9 GB, made an 81 ms step of a 34 ms one; 1 GiB costs a step about 5 ms.
MOVE_BYTES = 1 << 30


class GraphPool:
    """One CUDA memory pool for the graphs of one function at every bucket size.

    A step replays one bucket's graphs, so the same function's graphs of two buckets
    never run in the same step, and what one leaves in the pool is read before the next
    step (a graph's outputs are consumed within its step; its inputs are copies made
    outside the pool). Sharing the pool, the buckets together hold about what the largest
    capture needs instead of the sum of all of them (vLLM shares one pool across its
    decode batch sizes the same way).
    """

    def __init__(self) -> None:
        self._handle: Any = None

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """moshi's ``CUDAGraphed`` captures with ``cuda.graph(g)``: give it this pool."""
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        saved = moshi_compile.cuda
        moshi_compile.cuda = types.SimpleNamespace(  # type: ignore[assignment]
            CUDAGraph=torch.cuda.CUDAGraph, graph=functools.partial(torch.cuda.graph, pool=self._handle)
        )
        try:
            yield
        finally:
            moshi_compile.cuda = saved


class PooledGraphed(CUDAGraphed):
    """moshi's ``CUDAGraphed``, its capture allocating from a shared :class:`GraphPool`."""

    def __init__(self, func: Callable[..., Any], pool: GraphPool, disable: bool = False) -> None:
        super().__init__(func, disable=disable)
        self.pool = pool

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._graph is not None or self.disable or not torch.cuda.is_available():
            return super().__call__(*args, **kwargs)
        with self.pool.capturing():  # the engine thread alone captures: the swap is not seen
            return super().__call__(*args, **kwargs)


class Unbucketable(Exception):
    """A streaming state whose per-row tensors are not known: step the full batch."""


def streaming_modules(*roots: torch.nn.Module) -> list[StreamingModule]:
    return [m for root in roots for m in root.modules() if isinstance(m, StreamingModule)]


def bucket_sizes(rows: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, 24, ... below ``rows``, then ``rows``: a step pads its
    rows by at most half, and a 384-row engine captures 17 sets of graphs."""
    sizes, k = set(), 1
    while k < rows:
        sizes.update(x for x in (k, 3 * k // 2) if 0 < x < rows)
        k *= 2
    return [*sorted(sizes), rows]


class RowMap:
    """Frontend slot -> row of the batched state, live rows kept low."""

    def __init__(self, rows: int, sizes: Sequence[int]) -> None:
        self.sizes = np.asarray(sizes)
        self.row_of = np.full(rows, -1)  # by slot
        self.slot_of = np.full(rows, -1)  # by row
        self.reset = np.zeros(rows, dtype=bool)  # rows to reset before they next step

    def open(self, slot: int) -> None:
        row = self.row_of[slot] if self.row_of[slot] >= 0 else self._take(slot)
        self.reset[row] = True

    def close(self, slot: int) -> None:
        row = self.row_of[slot]
        if row >= 0:
            self.row_of[slot] = self.slot_of[row] = -1
            self.reset[row] = False

    def clear(self) -> None:
        """Every row free and due for a reset (after the warm-up)."""
        self.row_of[:] = self.slot_of[:] = -1
        self.reset[:] = True

    def rows(self, slots: np.ndarray) -> np.ndarray:
        """The rows of ``slots``; a slot stepped without an open takes a row as it is."""
        rows = self.row_of[slots]
        if (rows < 0).any():
            for slot in slots[rows < 0].tolist():
                self._take(slot)
            rows = self.row_of[slots]
        return rows

    def bucket(self, top: int) -> int:
        """The smallest bucket size that holds ``top`` rows."""
        return int(self.sizes[np.searchsorted(self.sizes, top)])

    def overflow(self) -> np.ndarray:
        """The live rows past the bucket of the live count: to move down."""
        live = np.flatnonzero(self.slot_of >= 0)
        return live[live >= self.bucket(len(live))] if len(live) else live

    def compaction(self, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Rows to move (to, from) so that the live rows fit the bucket of their count, at
        most ``limit`` of them (the highest first) into the lowest free rows (all below that
        bucket); the map already says where they went."""
        src = self.overflow()
        if limit is not None:
            src = src[max(0, len(src) - limit) :]
        dst = np.flatnonzero(self.slot_of < 0)[: len(src)]
        slots = self.slot_of[src]
        self.slot_of[dst], self.slot_of[src] = slots, -1
        self.row_of[slots] = dst
        self.reset[dst], self.reset[src] = self.reset[src], False
        return dst, src

    def _take(self, slot: int) -> int:
        row = int(np.argmax(self.slot_of < 0))  # the lowest free row
        self.row_of[slot], self.slot_of[row] = row, slot
        return row


class StateViews:
    """Streaming states of ``modules`` for every bucket size, as views of the full ones; a
    move copies every tensor of ``slots`` (slot_state.py), the one list a reset clears."""

    def __init__(
        self, modules: Iterable[StreamingModule], slots: SlotState, sizes: Sequence[int]
    ) -> None:
        rows = slots.rows
        self.modules = [m for m in modules if m._streaming_state is not None]
        for module in self.modules:
            if getattr(module, "cross_attention", False) or getattr(module, "cfg_coef", 1.0) != 1.0:
                raise Unbucketable(f"{type(module).__name__} with cross-attention or CFG")
        if self.modules and slots.doubled:
            raise Unbucketable("a state holds each row twice")
        full = [m._streaming_state for m in self.modules]
        for state in full:  # every bucket's graphs of one function share one pool
            for name, value in list(vars(state).items()):
                if isinstance(value, CUDAGraphed):
                    setattr(state, name, PooledGraphed(value.func, GraphPool(), value.disable))
        self.by_size = {n: full if n == rows else [_view(s, rows, n) for s in full] for n in sizes}
        self.size = rows
        self.slots = slots
        #: Rings whose row holds valid slots only in ``[0, min(steps, capacity))`` (the LM's: its
        #: ring is as long as its context), by tensor id, and how many of a moved row's slots
        #: are valid (``live_prefix``): set by the engine, so that a move copies no dead slot.
        self.prefixed: set[int] = set()
        self.live_prefix: Callable[[np.ndarray], int] | None = None

    @property
    def tensors(self) -> list[tuple[torch.Tensor, int]]:
        """Every per-row tensor and its batch axis (``SlotState``'s list)."""
        return [(e.tensor, e.axis) for e in self.slots.entries]

    def use(self, size: int) -> None:
        """Point every module at its state for ``size`` rows."""
        if size != self.size:
            for module, state in zip(self.modules, self.by_size[size], strict=True):
                module._streaming_state = state
            self.size = size

    def _moved(self, src: np.ndarray) -> Iterator[tuple[torch.Tensor, int]]:
        """Each per-row tensor and its batch axis, as a move of the rows ``src`` copies it: of
        a prefixed ring only the slots the longest-lived of them has filled."""
        live = self.live_prefix(src) if self.prefixed and self.live_prefix is not None else None
        for tensor, axis in self.tensors:
            if live is not None and id(tensor) in self.prefixed:
                tensor = tensor.narrow(RING_SLOTS, 0, live)
            yield tensor, axis

    def row_bytes(self, src: np.ndarray) -> int:
        """The bytes a move of one of the rows ``src`` copies."""
        return sum(t.numel() // t.shape[axis] * t.element_size() for t, axis in self._moved(src))

    def move(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Copy rows ``src`` of every per-row tensor into rows ``dst``; of a prefixed ring
        only the slots the moved rows have filled (H200, PersonaPlex: 32 whole rows of the
        int8 ring took 164 ms, a step every live session felt)."""
        device = self.tensors[0][0].device
        to, frm = (torch.from_numpy(x).to(device) for x in (dst, src))
        for tensor, axis in self._moved(src):
            tensor.index_copy_(axis, to, tensor.index_select(axis, frm))


class RowBuckets:
    """The engine's rows: which slot is where, moves, and the states of a step's bucket."""

    def __init__(self, modules: Iterable[StreamingModule], slots: SlotState, sizes: Sequence[int]) -> None:
        rows = slots.rows
        try:
            self.views = StateViews(modules, slots, sizes)
        except Unbucketable as exc:
            log.warning("moshi engine: every step runs all %d rows (%s)", rows, exc)
            sizes = [rows]
            self.views = StateViews((), slots, sizes)
        self.sizes = list(sizes)
        self.map = RowMap(rows, sizes)
        self.moves = 0
        self.move_bytes = MOVE_BYTES
        #: Called with (dst, src) after each move: the engine's own per-row bookkeeping (paged KV's
        #: page table, paged_kv.py) follows the rows.
        self.on_move: Callable[[np.ndarray, np.ndarray], None] | None = None

    def prepare(
        self, slots: np.ndarray, fit: Callable[[int], int] | None = None
    ) -> tuple[np.ndarray, int, np.ndarray | None]:
        """Before a step of ``slots``: move live rows down (``move_bytes`` of them at most),
        point the states at the bucket that holds their rows, or at ``fit`` of it (the
        smallest captured one, capture_plan.py). Returns the rows, the bucket size, and the
        mask of the bucket's rows to reset first (None when there are none)."""
        over = self.map.overflow()
        if len(over):
            limit = max(1, self.move_bytes // max(1, self.views.row_bytes(over)))
            dst, src = self.map.compaction(limit)
            self.views.move(dst, src)
            if self.on_move is not None:
                self.on_move(dst, src)
            self.moves += len(src)
        rows = self.map.rows(slots)
        size = self.map.bucket(int(rows.max()) + 1)
        if fit is not None:
            size = fit(size)
        self.views.use(size)
        reset = self.map.reset[:size]
        if not reset.any():
            return rows, size, None
        mask = reset.copy()
        reset[:] = False
        return rows, size, mask


def _view(state: Any, rows: int, size: int) -> Any:
    """``state`` for the first ``size`` rows: per-row tensors narrowed, fresh CUDA graphs."""
    view = copy.copy(state)
    view.batch_size = size
    view.exec_mask = state.exec_mask[:size]  # the engine's one shared mask
    for name, value in list(vars(view).items()):
        if isinstance(value, PooledGraphed):
            setattr(view, name, PooledGraphed(value.func, value.pool, value.disable))
    view._set_exec_mask_graphed = None
    if ring_of(state) is not None:
        view.kv_cache = copy.copy(state.kv_cache)
    for owner, name, tensor, axis in list(per_row(view, rows)):
        set_field(owner, name, tensor.narrow(axis, 0, size))
    return view
