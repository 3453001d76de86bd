"""Attention of a few new positions per row over a short ring as long as its context.

Mimi's transformers (a ring of 250 slots, two positions a step, float32) and the
depformer (a ring of 8, one position per codebook step) keep their keys in moshi's
``RingKVCache``: position ``p`` at slot ``p % capacity``, and with ``capacity ==
context`` the ring holds exactly the positions ``[max(0, end - capacity), end)``, all
inside the context of the newest. Query ``t`` of a step (position ``end - T + t``)
therefore attends to every held position up to its own, which is what moshi's mask
keeps; moshi builds that mask from an int64 position table in every layer and hands it
to SDPA, whose float32 kernels (``fmha_cutlassF_f32``) tile the two queries into blocks
of 32 or more. Mimi's 16 such calls took 7.2 ms of the step at 384 hibiki-2b-class slots on
the H200, the depformer's 96 another 5.8 ms (docs/benchmarks.md).

``ring_attention`` does it in one small Triton program per (row, KV head): each reads the
row's held slots once, works out each slot's position from the ring's end, and keeps a
running softmax per query, for every query head of the KV head's group (grouped KV
heads: the depformer of Hibiki-Zero). The grid is fixed by the batch, so it replays inside a CUDA
graph. Measured on the H200 (``bench moshi-step ring``, Mimi's 16 calls in a CUDA graph at
512 rows, full ring of 250, data docs/data/released/h200-ring-attention-mimi*.json): SDPA
10.1 ms, the products as ``[T, N, D]`` broadcasts 5.7-6.8 ms by tile, one query at a time
(``[N, D]`` products) 2.1 ms at 32 slots and 2 warps, against a 1.9 ms floor of the ring's
bytes. The broadcast takes 255 registers a thread at 64 slots and 4 warps (ptxas, sm_90a),
two programs an SM, so it had little of the ring in flight; one query at a time takes 80 at
32/4. So a ring of 32 slots or more (Mimi's) is read one query at a time, 32 slots and 2
warps; a shorter one (the depformer's 8) keeps the broadcast, a tile as long as the ring,
where the product is small. ``tl.dot``'s in float32 were no faster than the broadcast at
any tile.
``reference`` is the same computation in plain torch, for the tests.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .live_attention import triton

if triton is not None:
    import triton.language as tl

ROWS_BLOCK_N = 32  # slots an iteration reads, one query at a time (Mimi's ring: eight iterations)
MAX_QUERIES = 4  # queries of a program (positions x heads of a group); Mimi's 2, Hibiki-Zero's depformer's 2


def slot_positions(ends: torch.Tensor, capacity: int) -> torch.Tensor:
    """``[B, capacity]`` the position each slot holds after ``ends[b]`` writes; -1 where none."""
    slots = torch.arange(capacity, device=ends.device).view(1, -1)
    last = ends.view(-1, 1) - 1
    positions = slots + capacity * torch.div(last - slots, capacity, rounding_mode="floor")
    return torch.where(slots <= last, positions, torch.full_like(positions, -1))


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``ring_attention`` with SDPA and an explicit mask (the tests' yardstick)."""
    t = q.shape[2]
    held = slot_positions(ends, keys.shape[2])[:, None, None, :]  # b 1 1 c
    query = (ends.view(-1, 1) - t + torch.arange(t, device=q.device))[:, None, :, None]  # b 1 t 1
    mask = (held >= 0) & (held <= query)
    out = F.scaled_dot_product_attention(q, keys, values, mask, enable_gqa=q.shape[1] != keys.shape[1])
    return torch.where(mask.any(-1, keepdim=True), out, torch.zeros_like(out))


def default_tile(capacity: int) -> tuple[int, int, bool]:
    """(slots an iteration, warps, one query at a time) for a ring (module docstring): a
    tile no longer than a short ring, whose 8 slots do not pay for 32."""
    if capacity >= ROWS_BLOCK_N:
        return ROWS_BLOCK_N, 2, True
    return triton.next_power_of_2(capacity), 1, False


def ring_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    ends: torch.Tensor,
    tile: tuple[int, int, bool] | None = None,
) -> torch.Tensor:
    """Causal attention of the ``T`` newest positions of each row over its ring.

    ``q`` is ``[B, H, T, D]`` (any strides); ``keys`` and ``values`` are ``[B, KV, C, D]``
    views of the ring with ``D`` contiguous (``KV`` dividing ``H``: query head ``h`` reads
    KV head ``h // (H / KV)``), this step's ``T`` positions already written;
    ``ends`` holds, per row, the positions written before this step (moshi's
    ``end_offset``): ``[B]``, or ``[1]`` for a ring shared by every row (the depformer's).
    Returns a contiguous ``[B, H, T, D]`` in ``q``'s dtype. A row with no position held
    gets zeros. ``tile`` (slots per iteration, warps, one query at a time) overrides
    ``default_tile``, for ``bench moshi-step ring``.
    """
    b, h, t, d = q.shape
    kv_heads, capacity = keys.shape[1:3]
    group = h // kv_heads
    assert group * kv_heads == h and group * t <= MAX_QUERIES and d == triton.next_power_of_2(d)
    assert keys.stride(-1) == 1 and values.stride(-1) == 1
    out = torch.empty((b, h, t, d), device=q.device, dtype=q.dtype)
    block_n, warps, rows = tile or default_tile(capacity)
    _ring_attention[(b * kv_heads,)](
        q, keys, values, ends, out,
        *q.stride()[:3], *keys.stride()[:3], *values.stride()[:3], ends.stride(0) if ends.numel() > 1 else 0,
        kv_heads, group, t, capacity, 1.0 / math.sqrt(d),
        T_PAD=max(2, triton.next_power_of_2(group * t)), BLOCK_N=block_n, D=d, ROWS=rows, num_warps=warps,
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _ring_attention(
        Q, K, V, ENDS, OUT,
        stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kc,
        stride_vb, stride_vh, stride_vc, stride_end,
        kv_heads, group, t_len, capacity, scale,
        T_PAD: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
    ) -> None:  # fmt: skip
        """One (row, KV head): every held slot, a running softmax for each of the T queries of
        each query head of the group (query ``i``: head ``i // T`` of the group, position ``i % T``)."""
        row = tl.program_id(0)
        b = row // kv_heads
        g = row % kv_heads
        end = tl.load(ENDS + b * stride_end).to(tl.int32) + t_len  # positions written, this step's too
        held = tl.minimum(end, capacity)
        i = tl.arange(0, T_PAD)
        queries = group * t_len
        h = g * group + i // t_len
        t = i % t_len
        d = tl.arange(0, D)
        q_ptr = Q + b.to(tl.int64) * stride_qb + h[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :]
        q = tl.load(q_ptr, mask=i[:, None] < queries, other=0.0).to(tl.float32) * scale  # [T_PAD, D]
        query_pos = end - t_len + t  # [T_PAD]
        k_base = K + b.to(tl.int64) * stride_kb + g * stride_kh
        v_base = V + b.to(tl.int64) * stride_vb + g * stride_vh
        m_i = tl.full([T_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([T_PAD], dtype=tl.float32)
        acc = tl.zeros([T_PAD, D], dtype=tl.float32)
        for n0 in range(0, held, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            live = n < held
            pos = n + capacity * ((end - 1 - n) // capacity)  # the newest position at slot n
            k = tl.load(k_base + n[:, None] * stride_kc + d[None, :], mask=live[:, None], other=0.0)
            if ROWS:  # one query at a time: [N, D] products, never [T, N, D]
                s = tl.zeros([T_PAD, BLOCK_N], dtype=tl.float32)
                for r in tl.static_range(T_PAD):
                    q_r = tl.sum(tl.where(i[:, None] == r, q, 0.0), axis=0)
                    s_r = tl.sum(k.to(tl.float32) * q_r[None, :], axis=1)
                    s = tl.where(i[:, None] == r, s_r[None, :], s)
            else:
                s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)  # [T, N]
            valid = live[None, :] & (pos[None, :] <= query_pos[:, None])
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            v = tl.load(v_base + n[:, None] * stride_vc + d[None, :], mask=live[:, None], other=0.0)
            if ROWS:
                pv = tl.zeros([T_PAD, D], dtype=tl.float32)
                for r in tl.static_range(T_PAD):
                    p_r = tl.sum(tl.where(i[:, None] == r, p, 0.0), axis=0)
                    pv_r = tl.sum(p_r[:, None] * v.to(tl.float32), axis=0)
                    pv = tl.where(i[:, None] == r, pv_r[None, :], pv)
            else:
                pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptr = OUT + ((row * queries + i[:, None]) * D + d[None, :])  # out [B, H, T, D]: row-major
        tl.store(o_ptr, o.to(OUT.dtype.element_ty), mask=i[:, None] < queries)
