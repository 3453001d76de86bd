"""Mimi's streaming transformers with ``ring_attention`` instead of a mask and SDPA.

Installed on a built Mimi (``install_ring_attention``) before it streams, without forking
the library: each layer's ``StreamingMultiheadAttention`` becomes a subclass whose
streaming forward writes the step's keys and values into the library's own
``RingKVCache`` at the slots moshi uses, attends with ``ring_attention`` and moves the
ring's end and the layer's offset exactly as moshi does (by ``T`` where the exec mask is
set). Projections, RoPE, the ring, reset and the CUDA graphs stay the library's; only
the position table, the mask and the float32 SDPA kernel go. Outside streaming (the
codec's batch encode) or for more than a few positions at once, the stock forward runs.
"""

from __future__ import annotations

from typing import Any

import torch
from moshi.modules.transformer import StreamingMultiheadAttention

from .live_lm import plain_self_attention, split_heads
from .ring_attention import MAX_QUERIES, ring_attention


class RingAttention(StreamingMultiheadAttention):
    """Causal self-attention over a ring as long as its context (Mimi's transformers)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        state = self._streaming_state
        b, t = query.shape[:2]
        if state is None or t * self.kv_repeat > MAX_QUERIES:  # the same state: stock advances it alike
            return super().forward(query, key, value)
        cache = state.kv_cache
        q, (k, v) = split_heads(self, self.in_projs[0](query))
        if self.rope is not None:
            q, k = self.rope(q, k, state.offset, time_before_heads=False)
        ends = cache.end_offset
        slots = (ends.view(-1, 1) + torch.arange(t, device=ends.device)) % cache.capacity
        slots = slots.view(b, 1, t, 1).expand(*k.shape)
        cache.cache[0].scatter_(2, slots, k)
        cache.cache[1].scatter_(2, slots, v)
        x = ring_attention(q, cache.cache[0], cache.cache[1], ends)
        x = x.transpose(1, 2).reshape(b, t, -1)  # b h t d -> b t (h d)
        ends[:] = torch.where(state.exec_mask, ends + t, ends)
        state.offset[:] = torch.where(state.exec_mask, state.offset + t, state.offset)
        state.offset_cpu += t
        return self.out_projs[0](x)


def install_ring_attention(mimi: Any) -> bool:
    """Give Mimi's encoder and decoder transformers ``RingAttention``; False where a layer
    does not fit (then nothing changes).

    It fits causal self-attention with one set of weights, one KV head per head and a
    ring as long as the context (Mimi as moshi builds it). The kernel is Triton's: call
    it only where ``triton_available`` (or under ``TRITON_INTERPRET=1``, the tests), and
    before Mimi starts streaming.
    """
    transformers = [getattr(mimi, name, None) for name in ("encoder_transformer", "decoder_transformer")]
    attentions = [
        module
        for transformer in transformers
        if transformer is not None
        for module in transformer.modules()
        if isinstance(module, StreamingMultiheadAttention)
    ]
    fits = bool(attentions) and all(
        plain_self_attention(a) and a.context is not None and not a.is_streaming for a in attentions
    )
    if not fits:
        return False
    for attention in attentions:
        attention.__class__ = RingAttention
    return True
