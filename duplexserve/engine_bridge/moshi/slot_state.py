"""Every per-row tensor of the engine's batched state, and what a fresh row holds in each.

One list serves everything that touches a slot's state as a whole: the reset when a
session opens (``SlotState.reset``), a row's move to another row (row_buckets.py) and the
bucket views. A tensor the list knows is reset, moved and viewed alike; one it does not
know stops the start (``UnknownState``), so no path can miss what another one handles.

Every state class moshi 0.2.13 and our live modules build is listed in ``_FIELDS`` with
its per-row tensors and their batch axis; the engine adds its own per-row tensors
(PersonaPlex's held user codes) with :meth:`SlotState.add`. What a fresh row holds is read
off the states as ``streaming_forever`` built them, before any step: a reset row gets
exactly that back, whatever its last session did, so a reused slot starts where a fresh
engine's does: LMGen's token cache, Mimi's convolution buffers, every offset and every
engine-side tensor. One kind is left: a KV ring's keys and values (and their scales). A row
attends only to the ring slots below its own offsets (``end_offset``, the transformer's
clock), which the reset sets to zero, and each step writes the slot it then reads.

"Attends only to" is not "reads only": moshi's attention hands the whole ring to SDPA with
a boolean mask, and a masked slot still enters the arithmetic (a NaN key makes its score
NaN, and a NaN value times its weight 0 is NaN), so a slot the last session filled with
NaN or inf would reach the next one. Whatever a ring may hold from a client's audio is
therefore cleared: the rings of the modules named ``cleared`` (Mimi's: the only rings a
client's samples reach; the LM's take tokens) are zeroed for each reset row by
``clear_rings``, as a fresh row holds them, a few megabytes a row. The LM's rings, a
gigabyte a row on a 7B, are left; the kernels that read them read no slot past a row's
length (live_attention.py; its CPU fallback zeroes them first).

Under classifier-free guidance the LM's modules hold every row twice (conditioned, then
unconditioned); their tensors' batch axis has ``2 * rows`` entries and a row's reset
covers both.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from moshi.models.compression import _MimiState
from moshi.models.lm import _LMGenState
from moshi.modules.conv import _StreamingConv1dState, _StreamingConvTr1dState
from moshi.modules.streaming import State, StreamingModule
from moshi.modules.transformer import RingKVCache, _LayerState, _MHAState, _TransformerState

from .live_lm import QuantRing
from .paged_kv import PagedKV

# Per-row tensors of each state class and their batch axis. Plain ints (``offset_cpu``)
# stay per view: only weights-per-step layers read them, the depformer's, whose state
# lives for one LM step.
_FIELDS: dict[type, tuple[tuple[str, int], ...]] = {
    State: (),
    _LayerState: (),
    _MimiState: (),
    _TransformerState: (("offsets", 0),),
    _MHAState: (("offset", 0),),
    _StreamingConv1dState: (("previous", 0), ("first", 0)),
    _StreamingConvTr1dState: (("partial", 0),),
    _LMGenState: (("cache", 0), ("offsets", 0), ("condition_sum", 0), ("condition_cross", 0)),
}
RING_SLOTS = 3  # the slot axis of a ring's cache ([2, B, heads, capacity, dim]) and scales
_RINGS: dict[type, tuple[tuple[str, int], ...]] = {
    RingKVCache: (("cache", 1), ("end_offset", 0)),  # cache: [2, B, heads, capacity, dim]
    QuantRing: (("cache", 1), ("scale", 1)),
    PagedKV: (),  # a pool shared by the rows: a row's pages are its table row (paged_kv.py)
}
#: A ring's fields read only below the row's offsets: a reset leaves them (module docstring).
_RING_DATA = frozenset({"cache", "scale"})
_REASSIGNED = {_StreamingConv1dState: "first", _LMGenState: "offsets"}  # ``state.x = new tensor``


class UnknownState(Exception):
    """A streaming state whose per-row tensors are not known."""


@dataclass(frozen=True, slots=True)
class RowTensor:
    """One per-row tensor: its batch ``axis`` holds ``copies`` rows a slot (2 under guidance:
    all the conditioned rows, then all the unconditioned ones); ``fresh`` is a fresh slot's
    content, one row of each copy (None: a ring's data, never reset)."""

    tensor: torch.Tensor
    axis: int
    copies: int
    fresh: torch.Tensor | None

    def by_copy(self, rows: int) -> torch.Tensor:
        """The tensor with its batch axis split in two, (copies, rows): a view."""
        return self.tensor.unflatten(self.axis, (self.copies, rows))


class SlotState:
    """The per-row tensors of ``modules`` (``rows`` slots) and of the engine."""

    def __init__(
        self, modules: Iterable[StreamingModule], rows: int, cleared: Iterable[StreamingModule] = ()
    ) -> None:
        self.rows = rows
        self.entries: list[RowTensor] = []
        #: Ring data of the ``cleared`` modules and its batch axis, zeroed by ``clear_rings``.
        self.rings: list[tuple[torch.Tensor, int]] = []
        clear = {id(m) for m in cleared}
        seen: set[int] = set()
        for module in modules:
            state = module._streaming_state
            if state is None:
                continue
            write_in_place(state)
            for owner, name, tensor, axis in per_row(state, rows):
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    data = owner is not state and name in _RING_DATA
                    self._append(tensor, axis, fresh=not data)
                    if data and id(module) in clear:
                        self.rings.append((tensor, axis))

    def add(self, tensor: torch.Tensor, axis: int = 0) -> None:
        """An engine-side per-row tensor, as it is now (every row fresh)."""
        self._append(tensor, axis)

    def _append(self, tensor: torch.Tensor, axis: int, fresh: bool = True) -> None:
        entry = RowTensor(tensor, axis, tensor.shape[axis] // self.rows, None)
        if fresh:  # every row is alike when it is taken: row 0 of each copy
            entry = dataclasses.replace(entry, fresh=entry.by_copy(self.rows).narrow(axis + 1, 0, 1).clone())
        self.entries.append(entry)

    @property
    def doubled(self) -> bool:
        """Whether some tensor holds each row twice (guidance): such a state steps whole."""
        return any(e.copies != 1 for e in self.entries)

    def reset(self, mask: torch.Tensor) -> None:
        """Every row set in ``mask`` (bool, one per slot) back to a fresh row, in place.
        Fixed shapes and no host read: a CUDA graph captures it (row_reset.py)."""
        for entry in self.entries:
            if entry.fresh is None:
                continue
            rows = entry.by_copy(self.rows)
            shape = [1] * rows.dim()
            shape[entry.axis + 1] = self.rows
            rows.copy_(torch.where(mask.view(shape), entry.fresh, rows))


    def clear_rings(self, rows: torch.Tensor) -> None:
        """Zero the cleared rings' data of the rows listed in ``rows`` (int64, on the device):
        one kernel a ring, writing those rows only (module docstring)."""
        for tensor, axis in self.rings:
            tensor.index_fill_(axis, rows, 0)


def per_row(state: Any, rows: int) -> Iterator[tuple[Any, str, torch.Tensor, int]]:
    """Each per-row tensor of ``state`` (``rows`` slots, or twice that under guidance): its
    owner (the state or its ring), its name there, the tensor, its batch axis."""
    ring = ring_of(state)
    for owner, fields in ((state, _FIELDS[library_class(state)]), (ring, _ring_fields(ring))):
        for name, axis in fields:
            tensor = get_field(owner, name)
            if tensor is not None and tensor.shape[axis] in (rows, 2 * rows):
                yield owner, name, tensor, axis


def library_class(state: Any) -> type:
    cls = getattr(type(state), "_library_class", type(state))
    if cls not in _FIELDS:
        raise UnknownState(f"unknown streaming state {cls.__name__}")
    return cls


def ring_of(state: Any) -> Any:
    return getattr(state, "kv_cache", None)


def _ring_fields(ring: Any) -> tuple[tuple[str, int], ...]:
    if ring is None:
        return ()
    if type(ring) not in _RINGS:
        raise UnknownState(f"unknown KV cache {type(ring).__name__}")
    return _RINGS[type(ring)]


def _held(name: str) -> str:
    return "_held_" + name


def get_field(owner: Any, name: str) -> Any:
    return vars(owner).get(_held(name), getattr(owner, name, None))


def set_field(owner: Any, name: str, value: Any) -> None:
    vars(owner)[_held(name) if _held(name) in vars(owner) else name] = value


def write_in_place(state: State) -> None:
    """Make the library's ``state.x = new_tensor`` write into the tensor already there, so
    that the list above (and the bucket views) keep seeing the live tensor."""
    name = _REASSIGNED.get(type(state))
    if name is not None:
        held = vars(state).pop(name)
        state.__class__ = _in_place_class(type(state), name)
        vars(state)[_held(name)] = held


@functools.cache
def _in_place_class(cls: type, name: str) -> type:
    key = _held(name)

    def get(self: Any) -> torch.Tensor:
        return vars(self)[key]

    def put(self: Any, value: torch.Tensor) -> None:
        held = vars(self)[key]
        if value is not held:
            held.copy_(value)

    return type(cls.__name__, (cls,), {name: property(get, put), "_library_class": cls})
