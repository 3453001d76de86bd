"""One slot's streaming state as bytes and back: a conversation's live move to another
replica serving the same model (issue 76; ``Engine.export_slot`` / ``import_slot``).

What a row holds is slot_state.py's one list: every per-row tensor of Mimi, LMGen, the LM
and the depformer, and the engine's own (PersonaPlex's held user codes), each with every
copy of the row (two under guidance). The LM's KV rings are the exception: of a ring as
long as the context only the slots the row has filled, ``min(offset, capacity)``, travel
(``kv_layout``, ``row_kv``, ``put_row_kv``: the one place that reads or writes a row's KV), so a young
session's state is small. The engine adds its per-slot bookkeeping as JSON.

The bytes: ``MAGIC``, the SHA-256 of the rest, then safetensors (tensors by name, and a
string metadata map: ``format``, ``identity``, ``slot``, ``kv_slots``). Nothing is
unpickled: a state from elsewhere is data, parsed by safetensors and ``json`` only. A
state whose digest or parse fails is ``move_corrupt``; one of another model, format or
shape is ``move_mismatch``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from duplexserve.engine_bridge.engine import MoveRefused

from . import paged_kv
from .live_lm import ring_prefix, write_ring_prefix
from .paged_kv import PagedKV
from .slot_state import SlotState

#: Bumped whenever what the bytes hold or mean changes: another version is ``move_mismatch``.
FORMAT_VERSION = 1
MAGIC = b"DSMOVE\x00\x01"
DIGEST = 32  # SHA-256


def kv_layout(rings: list[Any], slots: int) -> tuple[int, int]:
    """The LM rings' capacity (slots a row holds) and copies of each row (two under guidance:
    all the conditioned rows, then all the unconditioned ones), of ``slots`` rows."""
    kv = rings[0].kv_cache
    if isinstance(kv, PagedKV):  # pages (paged_kv.py): a row's capacity is the context, one copy
        return kv.table.context, 1
    return kv.cache.shape[3], kv.cache.shape[1] // slots  # [2, copies * slots, heads, capacity, dim]


def row_kv(rings: list[Any], rows: Iterable[int], n: int) -> list[torch.Tensor]:
    """Slots ``[0, n)`` of each batch row in ``rows`` (a slot's copies) of every LM layer's
    ring (``rings``: the layers' attention states), and of its int8 scales: the one reader
    of a row's KV. Paged KV (paged_kv.py) reads a row's pages into the very same layout, so a
    state moves between a paged engine and a ring one alike."""
    if isinstance(rings[0].kv_cache, PagedKV):
        pools = [state.kv_cache for state in rings]
        return [t for row in rows for pool in pools for t in paged_kv.read_row(pool, pool.table, row, n)]
    return [t for row in rows for t in ring_prefix(rings, row, n)]


def put_row_kv(rings: list[Any], rows: Iterable[int], kv: list[torch.Tensor]) -> None:
    """Write ``row_kv``'s tensors back, into batch rows ``rows`` of this engine's rings."""
    rows = list(rows)
    per_row = len(kv) // max(1, len(rows))
    paged = rings[0].kv_cache if isinstance(rings[0].kv_cache, PagedKV) else None
    for i, row in enumerate(rows):
        mine = kv[i * per_row : (i + 1) * per_row]
        if paged is None:
            write_ring_prefix(rings, row, mine)
            continue
        n = mine[0].shape[2]
        if paged.table.hold(row, n) < min(n, paged.table.context):  # the pool ran short: no room here
            paged.table.release(row)
            raise MoveRefused("move_not_now", f"the KV pages ran short: {n} frames of context do not fit now")
        per_layer = len(mine) // len(rings)
        for j, state in enumerate(rings):
            paged_kv.write_row(state.kv_cache, paged.table, row, mine[j * per_layer : (j + 1) * per_layer])


def ring_tensors(rings: list[Any]) -> set[int]:
    """The ids of the LM rings' tensors: ``row_kv`` carries them, not the generic list."""
    caches = [state.kv_cache for state in rings]
    return {id(t) for ring in caches for t in (ring.cache, getattr(ring, "scale", None)) if t is not None}


def read_row(slots: SlotState, row: int, skip: set[int]) -> dict[str, torch.Tensor]:
    """Row ``row`` (each of its copies) of every per-row tensor but those in ``skip``."""
    out = {}
    for i, entry in enumerate(slots.entries):
        if id(entry.tensor) not in skip:
            out[f"row.{i}"] = entry.by_copy(slots.rows).select(entry.axis + 1, row)
    return out


def write_row(slots: SlotState, row: int, skip: set[int], tensors: dict[str, torch.Tensor]) -> None:
    """``read_row``'s tensors back into row ``row``; ``move_mismatch`` for a shape or dtype
    that differs (checked for every tensor before any is written)."""
    targets = []
    for i, entry in enumerate(slots.entries):
        if id(entry.tensor) in skip:
            continue
        target = entry.by_copy(slots.rows).select(entry.axis + 1, row)
        got = tensors.get(f"row.{i}")
        _check_like(f"row.{i}", got, target.shape, target.dtype)
        targets.append((target, got))
    if len(targets) != sum(k.startswith("row.") for k in tensors):
        raise MoveRefused("move_mismatch", "the state holds per-row tensors this model has not")
    for target, got in targets:
        target.copy_(got)


def check_kv(kv: list[torch.Tensor], like: list[torch.Tensor], n: int) -> None:
    """``move_mismatch`` unless ``kv`` are ``n`` slots of tensors shaped as ``like`` (this
    engine's ``row_kv`` of one slot)."""
    if len(kv) != len(like):
        raise MoveRefused("move_mismatch", f"the state has {len(kv)} KV tensors, this model {len(like)}")
    for i, (got, want) in enumerate(zip(kv, like, strict=True)):
        shape = (*want.shape[:2], n, *want.shape[3:])
        _check_like(f"kv.{i}", got, torch.Size(shape), want.dtype)


def _check_like(name: str, got: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype) -> None:
    if got is None:
        raise MoveRefused("move_mismatch", f"the state lacks {name}")
    if got.shape != shape or got.dtype != dtype:
        raise MoveRefused(
            "move_mismatch",
            f"{name} is {tuple(got.shape)} {got.dtype} in the state, {tuple(shape)} {dtype} in this model",
        )


def pack(
    identity: dict[str, Any], slot: dict[str, Any], tensors: dict[str, torch.Tensor], kv_slots: int
) -> bytes:
    """The bytes of a slot's state (module docstring)."""
    metadata = {
        "format": str(FORMAT_VERSION),
        "identity": json.dumps(identity, sort_keys=True),
        "slot": json.dumps(slot, sort_keys=True),
        "kv_slots": str(kv_slots),
    }
    host = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
    body = save_tensors(host, metadata=metadata)
    return MAGIC + hashlib.sha256(body).digest() + body


def unpack(data: bytes, identity: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor], int]:
    """The slot's JSON state, its tensors (on the CPU) and its KV slot count, from ``pack``'s
    bytes; ``MoveRefused`` unless they parse and were made by a model like ``identity``."""
    head = len(MAGIC) + DIGEST
    if len(data) < head or data[: len(MAGIC)] != MAGIC:
        raise MoveRefused("move_corrupt", "not a duplexserve slot state (its first bytes differ)")
    body = memoryview(data)[head:]
    if hashlib.sha256(body).digest() != data[len(MAGIC) : head]:
        raise MoveRefused("move_corrupt", "the slot state's checksum does not match: damaged on the way")
    try:
        tensors = load_tensors(bytes(body))
        metadata = _metadata(body)
        version = int(metadata["format"])
        theirs = json.loads(metadata["identity"])
        slot = json.loads(metadata["slot"])
        kv_slots = int(metadata["kv_slots"])
    except (SafetensorError, KeyError, ValueError, TypeError) as exc:
        raise MoveRefused("move_corrupt", f"the slot state does not parse: {exc}") from exc
    if version != FORMAT_VERSION:
        raise MoveRefused("move_mismatch", f"slot state format {version}; this server reads {FORMAT_VERSION}")
    differ = sorted(k for k in identity.keys() | theirs.keys() if identity.get(k) != theirs.get(k))
    if differ:
        said = ", ".join(f"{k} {theirs.get(k)!r} (here {identity.get(k)!r})" for k in differ)
        raise MoveRefused("move_mismatch", f"the slot state is another model's: {said}")
    return slot, tensors, kv_slots


def _metadata(body: memoryview) -> dict[str, str]:
    """safetensors' ``__metadata__``: its header is an 8-byte little-endian length and JSON."""
    size = int.from_bytes(body[:8], "little")
    header = json.loads(bytes(body[8 : 8 + size]))
    metadata = header.get("__metadata__")
    if not isinstance(metadata, dict):
        raise ValueError("no metadata")
    return metadata
