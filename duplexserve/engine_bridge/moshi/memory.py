"""How many sessions fit on the GPU: the KV ring of every slot, sized before it is allocated.

Each slot holds the LM's ring for the whole context in every layer (K and V, all heads),
so the ring decides how many sessions one card takes: hibiki-2b-class at 3000 frames is
0.59 GB a slot in bf16 and 0.30 GB in int8, Moshi 7B 1.57 GB and 0.79 GB. Everything
else a slot holds is nearly the same for every shape: Mimi's conv and transformer state
(its two float32 rings alone 15.6 MiB), the depformer's ring, the step's activations and
the row buckets' CUDA graph pools. Measured on the H200 as the device memory an engine
uses once started, less its rings (logged at each start): 16-19 MiB a slot at 32 slots,
24-26 at 128 and 192, 28.8 at 448 and 27.6 at 512, for hibiki-2b, hibiki-2b-class and
hibiki-zero-3b in bf16 and moshi-7b and hibiki-zero-3b in int8; personaplex-7b 31.4 at 144
(int8) and 33.2 at 78 (bf16) beside its prefill's row (docs/benchmarks.md, "Memory a slot").
``OTHER_PER_SLOT`` allows 32 MiB and ``RESERVE`` 2 GiB for what does not scale.

Paged KV (``--moshi-kv-layout paged``, paged_kv.py) reserves a slot only its floor
(``--moshi-kv-floor-s``, in pages of ``KV_PAGE`` frames): the slot count is what floors fit
beside the rest of each slot, and the pool of pages is every byte left (less the reserve),
from which calls take pages as they age; never more than every slot's full context.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
OTHER_PER_SLOT = 32 * 2**20
RESERVE = 2 * GIB
#: Frames a KV page holds: the decode kernel's chunk (live_attention.DEFAULT), so that each of its
#: programs reads one page.
KV_PAGE = 512
FRAME_HZ = 12.5


@dataclass(frozen=True)
class Paging:
    """Paged KV's sizes: bytes of one page (every layer), pages a slot's floor and full context take."""

    page_bytes: int
    floor_pages: int
    context_pages: int
    page: int = KV_PAGE

    @classmethod
    def of(cls, kv_per_context: int, context: int, floor_s: float, page: int = 0) -> Paging:
        """From a full context's bytes (``kv_bytes_per_slot``) and the floor in seconds; ``page``:
        0 is ``page_frames(context)``."""
        page = page or page_frames(context)
        context_pages = -(-context // page)
        floor = min(context_pages, max(1, -(-round(floor_s * FRAME_HZ) // page)))
        return cls(kv_per_context * page // context, floor, context_pages, page)


def page_frames(context: int) -> int:
    """A page's frames: ``KV_PAGE``, or for a context shorter than that the power of two that holds
    it (the kernel's chunk is a power of two), so that a short context is one page, not a longer one."""
    return min(KV_PAGE, 1 << max(0, context - 1).bit_length())


@dataclass(frozen=True)
class MemoryPlan:
    slots: int
    kv_dtype: str
    kv_per_slot: int  # bytes of LM ring per slot (paged: of its floor's pages)
    free: int  # bytes free on the device once the weights are loaded
    fixed: int = 0  # bytes held whatever the slot count (``fixed_bytes``)
    paging: Paging | None = None  # paged KV; None: a ring a slot

    @property
    def per_slot(self) -> int:
        return self.kv_per_slot + OTHER_PER_SLOT

    @property
    def _sink(self) -> int:  # paged: the pool's page 0, which no row holds (paged_kv.py)
        return self.paging.page_bytes if self.paging else 0

    @property
    def needed(self) -> int:
        return self.slots * self.per_slot + RESERVE + self.fixed + self._sink

    @property
    def max_slots(self) -> int:
        return max(0, (self.free - RESERVE - self.fixed - self._sink) // self.per_slot)

    @property
    def pool_pages(self) -> int:
        """Paged: the pages of the pool, the sink included: every byte the slots' other memory
        and the reserve leave, never more than every slot's full context."""
        if self.paging is None:
            return 0
        spare = self.free - RESERVE - self.fixed - self.slots * OTHER_PER_SLOT
        return min(1 + self.slots * self.paging.context_pages, max(0, spare) // self.paging.page_bytes)

    @property
    def full_contexts(self) -> int:
        """Paged: how many calls the pool holds at their full context."""
        return 0 if self.paging is None else max(0, self.pool_pages - 1) // self.paging.context_pages

    def describe(self) -> str:
        if self.paging is not None:
            p = self.paging
            kv = (
                f"{self.kv_dtype} paged KV floor {p.floor_pages} x {p.page} frames, "
                f"{self.kv_per_slot / GIB:.2f} GiB"
            )
        else:
            kv = f"{self.kv_dtype} KV ring {self.kv_per_slot / GIB:.2f} GiB"
        text = (
            f"{self.slots} slots x {self.per_slot / GIB:.2f} GiB ({kv} + "
            f"{OTHER_PER_SLOT / 2**20:.0f} MiB other) + "
            f"{RESERVE / GIB:.0f} GiB reserve"
            + (f" + {self.fixed / GIB:.2f} GiB prompt cache and prefill row" if self.fixed else "")
            + f" = {self.needed / GIB:.1f} GiB "
            f"of {self.free / GIB:.1f} GiB free; at most {self.max_slots} slots fit"
        )
        if self.paging is not None:
            p = self.paging
            pool = self.pool_pages * p.page_bytes
            text += (
                f"; KV pool {self.pool_pages} pages of {p.page_bytes / 2**20:.1f} MiB = "
                f"{pool / GIB:.1f} GiB, "
                f"the full context ({p.context_pages} pages) for {self.full_contexts} calls at once"
            )
        return text

    def check(self) -> None:
        """Refuse, with the numbers, a slot count that cannot fit."""
        if self.needed > self.free:
            raise MemoryError(
                f"--max-sessions {self.slots} does not fit: {self.describe()}; lower --max-sessions, "
                + ("lower --moshi-kv-floor-s" if self.paging else "shorten --moshi-context")
                + " or use --moshi-kv-dtype int8"
            )


def fixed_bytes(prompted: bool, prompt_cache_bytes: int, kv_per_slot: int) -> int:
    """What a prompted family (PersonaPlex) holds whatever the slot count: the prompt cache
    (``--prompt-cache-mb``) and the prefill's scratch row, one slot's ring (prefill.py)."""
    return prompt_cache_bytes + kv_per_slot if prompted else 0


def kv_bytes_per_slot(
    layers: int, dim: int, heads: int, context: int, kv_dtype: str, element: int, kv_repeat: int = 1,
    branches: int = 1,
) -> int:
    """K and V for every layer and slot of the ring; int8 adds one scale per slot and head.

    With grouped KV heads (``kv_repeat`` query heads share one KV head) the ring holds
    ``heads / kv_repeat`` heads, ``dim / kv_repeat`` values a position. Classifier-free
    guidance (``--moshi-cfg-coef``) runs a conditioned and an unconditioned row for every
    session, each with its ring: ``branches=2``.
    """
    dim, heads = dim // kv_repeat, heads // kv_repeat
    if kv_dtype == "int8":
        return branches * layers * 2 * context * (dim + heads * element)
    return branches * layers * 2 * context * dim * element
