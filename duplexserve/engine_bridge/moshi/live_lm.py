"""The LM's temporal transformer with attention over each row's live prefix.

Installed on a built ``LMModel`` (``install_live_attention``), without forking the
library: a forward pre-hook on the temporal transformer computes, once per step, what
every layer needs (the ring slot to write, each row's live length or mask, the RoPE
offsets, all from the transformer's own per-row offsets, which advance with the exec
mask exactly like every layer's KV end offset), and each layer's
``StreamingMultiheadAttention`` becomes a subclass whose streaming one-step forward
writes K/V into the library's own ring buffer and attends with ``live_attention``.
Stock moshi instead rebuilds an int64 ``[B, capacity]`` position table and mask in
every layer and attends over the whole ring.

A forward of several frames at once on a streaming state (a prompt's prefill,
``prompts.py``) writes all their keys into the ring and attends causally over it.

With a ``PageTable`` on the clock (``paged_kv.py``, ``--moshi-kv-layout paged``) each layer's KV is
a pool of pages instead of a ring a row: the pre-hook also finds each row's page and offset
for this step and its capacity (the context, or the pages it holds once it stopped growing),
and the layer writes there and attends through the block table (``_paged_step``).

Everything else (projections, RoPE, ``rope_concat`` included, the ring's memory with
its grouped KV heads, reset, exec mask, CUDA graphs) is the library's. Mimi's
transformers and the depformer have short rings of their own (``live_mimi.py``,
``lean_depformer.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from moshi.modules.transformer import StreamingMultiheadAttention, StreamingTransformer, _MHAState

from .live_attention import (
    dequantize,
    live_attention,
    prefix_mask,
    quantize,
    reference_attention,
    triton_available,
    write_quantized,
)
from .paged_kv import PagedKV, PageTable


@dataclass
class StepClock:
    """Per-step tensors shared by every layer of one transformer (set by the pre-hook)."""

    capacity: int
    use_kernel: bool
    quantized: bool = False  # int8 ring with a scale per (slot, head)
    active: bool = False
    offsets: torch.Tensor | None = None  # [B] position of this step's token (RoPE)
    slot: torch.Tensor | None = None  # [B, 1, 1, 1] ring slot written this step
    lengths: torch.Tensor | None = None  # [B] int32 live slots after the write; 0 = idle row
    mask: torch.Tensor | None = None  # [B, 1, 1, capacity] the same, for the SDPA fallback
    #: Paged KV (paged_kv.py): the rows' pages; set by the engine before the streaming state is built
    pages: PageTable | None = None
    page: torch.Tensor | None = None  # [B] int64 the page written this step (``slot``: the offset in it)


def _before_layers(transformer: StreamingTransformer, args: tuple[Any, ...]) -> None:
    clock: StepClock = transformer._live_clock
    state = transformer._streaming_state
    clock.active = state is not None and args[0].shape[1] == 1
    if not clock.active:
        clock.offsets = None if state is None else state.offsets  # a prefill's first position
        return
    offsets = state.offsets
    ends = offsets + 1
    clock.offsets = offsets
    pages = clock.pages
    if pages is None:
        clock.slot = (offsets % clock.capacity).view(-1, 1, 1, 1)
        live = torch.clamp(ends, max=clock.capacity)
    else:  # a row's capacity: the context while it may grow, the pages it holds once it stopped
        rows = offsets.shape[0]
        caps = pages.caps[:rows]
        slot = offsets % caps
        clock.page = pages.table[:rows].gather(1, (slot // pages.page).view(-1, 1)).view(-1).long()
        clock.slot = (slot % pages.page).view(-1, 1, 1, 1)
        live = torch.minimum(ends, caps)
    if clock.use_kernel:
        clock.lengths = torch.where(state.exec_mask, live, torch.zeros_like(live)).to(torch.int32)
    else:
        clock.mask = prefix_mask(live, clock.capacity)


def plain_self_attention(a: StreamingMultiheadAttention) -> bool:
    """Causal self-attention with one set of weights: the attention whose ring the live and
    ring kernels read (the LM's, Mimi's)."""
    return (
        type(a) is StreamingMultiheadAttention and a.causal and not a.cross_attention
        and not a.weights_per_step and len(a.in_projs) == 1
    )  # fmt: skip


def split_heads(a: StreamingMultiheadAttention, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The input projection ``[B, T, (H + 2 * KV) * D]`` as moshi splits it: ``q`` of ``H``
    heads ``[B, H, T, D]`` and ``kv``, ``k`` and ``v`` of ``KV = H / kv_repeat`` heads
    ``[2, B, KV, T, D]`` (views; ``k, v = kv``, or both written into a ring at once)."""
    b, t = projected.shape[:2]
    q = projected[..., : a.embed_dim].view(b, t, a.num_heads, -1).transpose(1, 2)
    kv = projected[..., a.embed_dim :].view(b, t, 2, a.num_heads // a.kv_repeat, -1).permute(2, 0, 3, 1, 4)
    return q, kv


class QuantRing:
    """The 8-bit ring that replaces moshi's ``RingKVCache`` with ``--moshi-kv-dtype int8``:
    int8 K/V ``[2, B, H, C, D]`` and one scale per slot and head ``[2, B, H, C]``, ``H`` the
    KV heads (grouped, as in moshi's ring). It keeps no offsets: the live path reads them
    from the transformer's clock."""

    def __init__(self, batch: int, heads: int, dim: int, capacity: int, device: Any, dtype: Any) -> None:
        self.cache = torch.zeros((2, batch, heads, capacity, dim), device=device, dtype=torch.int8)
        self.scale = torch.zeros((2, batch, heads, capacity), device=device, dtype=dtype)

    def reset(self, reset_mask: torch.Tensor) -> None:
        """Nothing to clear: a reset row's length drops to 0, so its old slots go unread."""


class LiveAttention(StreamingMultiheadAttention):
    """Causal self-attention whose one-step streaming forward reads only live slots."""

    _live_clock: StepClock

    def _init_streaming_state(self, batch_size: int) -> _MHAState:
        clock = self._live_clock
        if not clock.quantized and clock.pages is None:
            return super()._init_streaming_state(batch_size)
        weight = self.in_projs[0].weight
        heads, dim = self.num_heads // self.kv_repeat, self.embed_dim // self.num_heads
        if clock.pages is not None:
            ring: Any = PagedKV(clock.pages, heads, dim, weight.device, weight.dtype, clock.quantized)
        else:
            ring = QuantRing(batch_size, heads, dim, self.context, weight.device, weight.dtype)
        offset = torch.zeros(batch_size, device=weight.device, dtype=torch.long)
        return _MHAState(batch_size, weight.device, ring, offset=offset, offset_cpu=0)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        clock = self._live_clock
        state = self._streaming_state
        if state is None:
            return super().forward(query, key, value)
        if not clock.active:
            return self._prefill(query)
        b = query.shape[0]
        q, (k, v) = split_heads(self, self.in_projs[0](query))
        if self.rope is not None:
            q, k = self.rope(q, k, clock.offsets, time_before_heads=False)
        if clock.pages is not None:
            x = self._paged_step(q, k, v)
            state.offset_cpu += 1
            return self.out_projs[0](x.transpose(1, 2).reshape(b, 1, -1))
        ring, scales = state.kv_cache.cache, None
        if clock.quantized and clock.use_kernel:
            scales = state.kv_cache.scale
            write_quantized(k, v, ring, scales, clock.slot.view(-1))
        else:
            slot = clock.slot.expand(*k.shape)
            if clock.quantized:
                (k, k_scale), (v, v_scale) = quantize(k), quantize(v)
                scales = state.kv_cache.scale
                scales[0].scatter_(2, slot[..., 0], k_scale)
                scales[1].scatter_(2, slot[..., 0], v_scale)
            ring[0].scatter_(2, slot, k)
            ring[1].scatter_(2, slot, v)
        if clock.use_kernel:
            x = live_attention(
                q, ring[0], ring[1], clock.lengths, None if scales is None else (scales[0], scales[1])
            )
        elif scales is not None:
            keys, values = dequantize(ring, scales, q.dtype)
            x = masked_attention(q, keys, values, clock.mask)
        else:
            x = masked_attention(q, ring[0], ring[1], clock.mask)
        x = x.transpose(1, 2).reshape(b, 1, -1)  # b h t d -> b t (h d)
        state.offset_cpu += 1
        return self.out_projs[0](x)

    def _paged_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One step on the page pool (paged_kv.py): this step's K/V into slot ``clock.slot`` of
        page ``clock.page`` of each row, then attention over the row's live slots. The kernel
        reads the pages where they are; the fallback gathers each row's pages into a ring's
        layout and makes the ring's very call (``masked_attention``, the same mask), so a call
        that fits answers as on the ring, bit for bit."""
        clock = self._live_clock
        pages = clock.pages
        assert pages is not None and clock.page is not None
        pool = self._streaming_state.kv_cache
        ring, scales, page, slot = pool.cache, pool.scale, clock.page, clock.slot.view(-1)
        if clock.quantized and clock.use_kernel:
            write_quantized(k, v, ring, scales, slot, page=page)
        elif clock.quantized:
            for i, x in enumerate((k, v)):
                x8, scale = quantize(x)
                ring[i][page, :, slot] = x8[:, :, 0]
                scales[i][page, :, slot] = scale[:, :, 0]
        else:
            ring[0][page, :, slot] = k[:, :, 0]
            ring[1][page, :, slot] = v[:, :, 0]
        b = q.shape[0]
        table = pages.table[:b]
        if clock.use_kernel:
            pair = None if scales is None else (scales[0], scales[1])
            lengths, capacity = clock.lengths, clock.capacity
            return live_attention(q, ring[0], ring[1], lengths, pair, table=table, capacity=capacity)
        held = table.long()
        keys, values = (_as_ring(ring[i][held], clock.capacity) for i in (0, 1))
        if scales is not None:
            kv = torch.stack((keys, values))
            capacity = clock.capacity
            scale = torch.stack([_as_ring(scales[i][held, ..., None], capacity)[..., 0] for i in (0, 1)])
            keys, values = dequantize(kv, scale, q.dtype)
        return masked_attention(q, keys, values, clock.mask)

    def _prefill(self, query: torch.Tensor) -> torch.Tensor:
        """``T`` frames of each row at once, from the transformer's offsets: their keys and
        values written into the ring (which they must not wrap: a prefill starts a
        session), each frame attending to the ring up to its own position."""
        clock = self._live_clock
        state = self._streaming_state
        if clock.pages is not None:
            raise NotImplementedError("a prefill on paged KV: prompted models keep the ring")
        b, t = query.shape[:2]
        q, (k, v) = split_heads(self, self.in_projs[0](query))
        if self.rope is not None:
            q, k = self.rope(q, k, clock.offsets, time_before_heads=False)
        positions = clock.offsets.view(-1, 1, 1, 1) + torch.arange(t, device=q.device).view(1, 1, -1, 1)
        ring = state.kv_cache.cache
        slots = positions.expand(*k.shape)
        if clock.quantized:
            scales = state.kv_cache.scale
            for i, x in enumerate((k, v)):
                x8, scale = quantize(x)
                ring[i].scatter_(2, slots, x8)
                scales[i].scatter_(2, slots[..., 0], scale)
            keys, values = dequantize(ring, scales, q.dtype)
        else:
            ring[0].scatter_(2, slots, k)
            ring[1].scatter_(2, slots, v)
            keys, values = ring[0], ring[1]
        mask = torch.arange(clock.capacity, device=q.device).view(1, 1, 1, -1) <= positions
        x = masked_attention(q, keys, values, mask)
        state.offset_cpu += t
        return self.out_projs[0](x.transpose(1, 2).reshape(b, t, -1))


def _as_ring(gathered: torch.Tensor, capacity: int) -> torch.Tensor:
    """Each row's pages ``[B, pages, KV, PAGE, D]`` as a ring's row ``[B, KV, capacity, D]``."""
    b, n, h, page, d = gathered.shape
    return gathered.transpose(1, 2).reshape(b, h, n * page, d)[:, :, :capacity]


def masked_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """``reference_attention`` over a ring whose slots no query may see (``mask`` ``[B, 1, T,
    C]``) are zeroed first. SDPA's boolean mask still lets a masked slot into the arithmetic
    (a NaN key's score stays NaN, a NaN value times its weight 0 is NaN), and the ring's
    slots past a row's length hold whatever its last session left (slot_state.py). Zeroed,
    a slot is what a fresh ring holds, so the results are a fresh row's, bit for bit."""
    seen = mask.any(dim=2, keepdim=True).transpose(2, 3)  # [B, 1, C, 1]
    zero = keys.new_zeros(())
    return reference_attention(q, torch.where(seen, keys, zero), torch.where(seen, values, zero), mask)


def ring_prefix(states: list[_MHAState], row: int, n: int) -> list[torch.Tensor]:
    """A copy of slots ``[0, n)`` of row ``row`` of each layer's ring (and its int8 scales):
    what a prefill of ``n`` frames left there, to be written into another row."""
    out = []
    for state in states:
        ring = state.kv_cache
        out.append(ring.cache[:, row, :, :n].clone())
        if isinstance(ring, QuantRing):
            out.append(ring.scale[:, row, :, :n].clone())
    return out


def write_ring_prefix(states: list[_MHAState], row: int, prefix: list[torch.Tensor]) -> None:
    """Write a ``ring_prefix`` into row ``row``: that row holds the same prefill's keys and values."""
    tensors = iter(prefix)
    for state in states:
        ring = state.kv_cache
        kv = next(tensors)
        ring.cache[:, row, :, : kv.shape[2]] = kv
        if isinstance(ring, QuantRing):
            scale = next(tensors)
            ring.scale[:, row, :, : scale.shape[2]] = scale


def install_live_attention(lm: Any, use_kernel: bool | None = None, kv_dtype: str = "bf16") -> bool:
    """Give ``lm``'s temporal transformer live-prefix attention; False where it cannot apply.

    It applies to causal self-attention with one set of weights and a ring as long as
    the context (every Moshi and Hibiki LM, grouped KV heads or not); ``use_kernel`` defaults
    to the Triton kernel where it can run (CUDA), else the bit-exact SDPA fallback.
    ``kv_dtype="int8"`` stores the ring in 8 bits (``QuantRing``); any other value keeps
    the library's ring in the model's dtype. Call before ``streaming_forever``.
    """
    transformer = lm.transformer
    attentions = [layer.self_attn for layer in transformer.layers]
    contexts = {a.context for a in attentions}
    fits = all(map(plain_self_attention, attentions)) and len(contexts) == 1 and None not in contexts
    if not fits or transformer.is_streaming:
        return False
    if use_kernel is None:
        use_kernel = triton_available(next(lm.parameters()).device)
    clock = StepClock(capacity=contexts.pop(), use_kernel=use_kernel, quantized=kv_dtype == "int8")
    transformer._live_clock = clock
    transformer.register_forward_pre_hook(_before_layers)
    for attention in attentions:
        attention.__class__ = LiveAttention
        attention._live_clock = clock
    return True
