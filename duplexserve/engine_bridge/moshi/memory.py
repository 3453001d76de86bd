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
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
OTHER_PER_SLOT = 32 * 2**20
RESERVE = 2 * GIB


@dataclass(frozen=True)
class MemoryPlan:
    slots: int
    kv_dtype: str
    kv_per_slot: int  # bytes of LM ring per slot
    free: int  # bytes free on the device once the weights are loaded
    fixed: int = 0  # bytes held whatever the slot count (``fixed_bytes``)

    @property
    def per_slot(self) -> int:
        return self.kv_per_slot + OTHER_PER_SLOT

    @property
    def needed(self) -> int:
        return self.slots * self.per_slot + RESERVE + self.fixed

    @property
    def max_slots(self) -> int:
        return max(0, (self.free - RESERVE - self.fixed) // self.per_slot)

    def describe(self) -> str:
        return (
            f"{self.slots} slots x {self.per_slot / GIB:.2f} GiB ({self.kv_dtype} KV ring "
            f"{self.kv_per_slot / GIB:.2f} GiB + {OTHER_PER_SLOT / 2**20:.0f} MiB other) + "
            f"{RESERVE / GIB:.0f} GiB reserve"
            + (f" + {self.fixed / GIB:.2f} GiB prompt cache and prefill row" if self.fixed else "")
            + f" = {self.needed / GIB:.1f} GiB "
            f"of {self.free / GIB:.1f} GiB free; at most {self.max_slots} slots fit"
        )

    def check(self) -> None:
        """Refuse, with the numbers, a slot count that cannot fit."""
        if self.needed > self.free:
            raise MemoryError(
                f"--max-sessions {self.slots} does not fit: {self.describe()}; lower --max-sessions, "
                "shorten --moshi-context or use --moshi-kv-dtype int8"
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
