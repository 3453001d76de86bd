"""The LM's KV cache in pages taken as a call ages, not a whole context reserved at open.

With ``--moshi-kv-layout ring`` every slot holds a ring as long as the context (3000 frames,
four minutes) from its first frame, so the slot count is what full rings fit. Paged, each
layer holds one pool of pages ``[2, pages, KV heads, PAGE, D]`` (int8: and scales ``[2,
pages, KV heads, PAGE]``) shared by every row, and one block table ``[rows, context pages]``
int32 (shared by the layers: all of them write the same slot of a row at a step) says which
page holds slots ``[i * PAGE, (i + 1) * PAGE)`` of a row. ``PAGE`` is the decode kernel's
chunk (512), so each program of the kernel reads exactly one page (live_attention.py).

The bookkeeping is the host's (``PageTable``, on the engine thread, no device read): before a
step, a row about to write its first slot of a page it does not hold takes one from the free
list; a closed or reopened row gives its pages back. A row's capacity is the context while it
may still grow: it writes slot ``offset % context``, as the ring does, so while it fits its
keys sit at the ring's slots and its answers are the ring's bit for bit. When the free list
runs dry (beyond what the other live rows' floors still need) the row stops growing: its
capacity becomes the pages it holds, at least the floor (``--moshi-kv-floor-s``) the memory
plan reserved for every slot, and it goes on as a ring of that length (RoPE is applied before
caching, so slot order does not matter); counted (``stopped``) and logged once per call.

Page 0 is the sink: every table entry a row does not hold points there, so a row stepped
with its exec mask off (it writes the slot its next step would write, as moshi's ring
does) or an idle row writes nowhere that matters. The table and the capacities are fixed
device tensors, rewritten in place from pinned host copies before a step: CUDA graphs
replay. A row moved to another row (row_buckets.py) moves its table row; its pages stay.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

SINK = 0  #: the page every entry a row does not hold points at


class PagedKV:
    """A layer's page pool, in place of moshi's ``RingKVCache``: no per-row tensor (the rows'
    pages are the ``PageTable``'s, ``table``), so a reset or a move touches nothing here."""

    def __init__(
        self, table: PageTable, heads: int, dim: int, device: Any, dtype: Any, quantized: bool
    ) -> None:
        self.table = table
        kv_dtype = torch.int8 if quantized else dtype
        shape = (2, table.pages, heads, table.page)
        self.cache = torch.zeros((*shape, dim), device=device, dtype=kv_dtype)
        self.scale = torch.zeros(shape, device=device, dtype=dtype) if quantized else None

    def reset(self, reset_mask: torch.Tensor) -> None:
        """Nothing to clear: a reset row's length drops to 0 and it holds no page."""


class PageTable:
    """Which pages each row holds, the free list, and the device tensors the step reads."""

    def __init__(
        self, rows: int, pages: int, page: int, context: int, floor: int, device: Any, pinned: bool = False
    ) -> None:
        self.page = page
        self.context = context
        self.per_row = math.ceil(context / page)
        #: pages a slot is promised (the memory plan reserves them): a call stops growing no shorter
        self.floor = min(self.per_row, max(1, math.ceil(floor / page)))
        if pages < 1 + rows * self.floor:
            raise ValueError(f"{pages} KV pages cannot hold the sink and {rows} floors of {self.floor} pages")
        self.pages = pages
        self.free = list(range(pages - 1, SINK, -1))  # popped from the end: the lowest first
        self.held = np.zeros(rows, dtype=np.int64)
        self.live = np.zeros(rows, dtype=bool)  # rows whose call is open (their floor reserved)
        self.stopped = np.zeros(rows, dtype=bool)  # rows whose call stopped growing
        self.stops = 0  #: calls that stopped growing for want of pages (a metric)
        self._table = torch.full((rows, self.per_row), SINK, dtype=torch.int32, pin_memory=pinned)
        self._caps = torch.full((rows,), context, dtype=torch.int64, pin_memory=pinned)
        self.table_np, self.caps_np = self._table.numpy(), self._caps.numpy()
        on_host = torch.device(device).type == "cpu"
        self.table = self._table if on_host else self._table.to(device)
        self.caps = self._caps if on_host else self._caps.to(device)
        self._dirty = False

    @property
    def spare(self) -> int:
        """Free pages beyond what the live rows still need to reach their floors."""
        owed = np.maximum(0, self.floor - self.held[self.live]).sum()
        return len(self.free) - int(owed)

    def open(self, row: int) -> None:
        """A call starts in ``row``: it holds nothing yet, its floor is reserved."""
        self.release(row)
        self.live[row] = True

    def release(self, row: int) -> None:
        """``row``'s pages back to the free list (a call's end, or a reopen)."""
        held = int(self.held[row])
        if held:
            self.free.extend(int(p) for p in self.table_np[row, :held][::-1])
            self.table_np[row, :held] = SINK
            self._dirty = True
        if self.caps_np[row] != self.context:
            self.caps_np[row] = self.context
            self._dirty = True
        self.held[row] = 0
        self.live[row] = False
        self.stopped[row] = False

    def grow(self, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray | None = None) -> None:
        """Before a step: each of ``rows`` writes position ``positions[i]``; one about to write
        into a page it does not hold takes one, within its floor always, past it while the free
        list has pages the other rows' floors do not need; else it stops growing there."""
        need = (positions < self.context) & (positions // self.page >= self.held[rows]) & ~self.stopped[rows]
        for i in np.flatnonzero(need).tolist():
            row = int(rows[i])
            held = int(self.held[row])
            self.live[row] = True  # a row stepped without an open reserves its floor too
            if not self.free or (held >= self.floor and self.spare <= 0):
                self._stop(row, held, None if slots is None else int(slots[i]))
                continue
            self.table_np[row, held] = self.free.pop()
            self.held[row] = held + 1
            self._dirty = True

    def hold(self, row: int, length: int, slot: int | None = None) -> int:
        """Pages for slots ``[0, length)`` of ``row``, taken as its steps would have taken them (a
        call imported with ``write_row``); the slots it holds (fewer where it stopped growing)."""
        self.live[row] = True
        for position in range(0, min(length, self.context), self.page):
            self.grow(np.array([row]), np.array([position]), None if slot is None else np.array([slot]))
        return int(self.caps_np[row]) if self.stopped[row] else min(length, self.context)

    def _stop(self, row: int, held: int, slot: int | None) -> None:
        self.stopped[row] = True
        self.caps_np[row] = held * self.page
        self.stops += 1
        self._dirty = True
        log.warning(
            "moshi engine: KV pages ran out: the call in slot %s keeps a context of %d frames (%d pages) and "
            "goes on; %d calls stopped growing so far", slot, held * self.page, held, self.stops,
        )  # fmt: skip

    def move(self, dst: np.ndarray, src: np.ndarray) -> None:
        """Rows ``src`` moved to ``dst`` (row_buckets.py): their pages go with them; ``src`` holds none."""
        for array in (self.table_np, self.caps_np, self.held, self.live, self.stopped):
            array[dst] = array[src]
        self.table_np[src] = SINK
        self.caps_np[src] = self.context
        self.held[src] = 0
        self.live[src] = self.stopped[src] = False
        self._dirty = True

    def sync(self) -> None:
        """The host's table and capacities into the device tensors the step reads (in stream
        order, from pinned memory: no wait for the GPU; the engine's step ends synchronized, so
        the host copies are not rewritten while a copy of them is queued)."""
        if self._dirty and self.table is not self._table:
            self.table.copy_(self._table, non_blocking=True)
            self.caps.copy_(self._caps, non_blocking=True)
        self._dirty = False


def row_slots(table: PageTable, row: int, length: int) -> torch.Tensor:
    """The (page, offset) of each of slots ``[0, length)`` of ``row``, as a flat index into a
    pool's ``pages * PAGE`` axis (int64, on the host)."""
    slots = torch.arange(length)
    pages = torch.from_numpy(table.table_np[row]).long()[slots // table.page]
    return pages * table.page + slots % table.page


def read_row(pool: PagedKV, table: PageTable, row: int, length: int) -> list[torch.Tensor]:
    """Slots ``[0, length)`` of one row of one layer, laid out as a ring's row: K/V ``[2, KV, length,
    D]`` (and int8 scales ``[2, KV, length]``). What a migration exports of a row (with
    ``write_row`` to import it), and what a ring's ``cache[:, row, :, :length]`` holds."""
    flat = row_slots(table, row, length).to(pool.cache.device)
    cache = pool.cache.transpose(2, 3).flatten(1, 2)  # [2, pages * PAGE, KV, D]
    out = [cache.index_select(1, flat).transpose(1, 2).contiguous()]
    if pool.scale is not None:
        scale = pool.scale.transpose(2, 3).flatten(1, 2)  # [2, pages * PAGE, KV]
        out.append(scale.index_select(1, flat).transpose(1, 2).contiguous())
    return out


def write_row(pool: PagedKV, table: PageTable, row: int, data: list[torch.Tensor]) -> None:
    """Write ``read_row``'s tensors into ``row``'s slots ``[0, length)``, which it must hold
    (``PageTable.hold`` first)."""
    length = data[0].shape[2]
    assert table.held[row] * table.page >= min(length, table.context), "the row holds too few pages"
    flat = row_slots(table, row, length).to(pool.cache.device)
    pages, offsets = flat // table.page, flat % table.page
    pool.cache[:, pages, :, offsets] = data[0].permute(2, 0, 1, 3)  # [length, 2, KV, D]
    if pool.scale is not None:
        pool.scale[:, pages, :, offsets] = data[1].permute(2, 0, 1)
