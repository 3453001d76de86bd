"""The depformer's attention without a mask (``--moshi-depformer lean``).

``LMGen.depformer_step`` opens a fresh streaming state of the depformer for every LM
step and runs its ``dep_q`` codebook steps one after the other, every row in step: at
codebook step ``k`` (the state's ``offset_cpu``, a Python int, so a constant inside the
CUDA graph) each row writes its key and value at ring slot ``k % capacity`` and moshi's
mask keeps the positions ``(k - context, k]``; the ring is as long as the context (or
as the steps, without one), so those are exactly its first ``min(k + 1, capacity)``
slots, in slot order (hibiki-2b-class: 16 steps over a ring of 8, which wraps). Stock moshi
builds that mask from a position table in every layer of every codebook step (about ten
small kernels) and hands it to SDPA, which with a mask takes cuDNN's masked kernel:
5.8 ms of the step at 384 hibiki-2b-class slots on the H200 for 96 calls over at most 8 keys.
Here the slot's key and value are written with one copy and the live slots are read
unmasked: on the CPU by SDPA over the slice (the tests show the depformer's tokens equal to stock
moshi's and its logits equal in float64 up to the order of the sums: without the masked
keys a vectorised kernel may add in another order, 1e-15 on an AVX-512 CPU), on CUDA
by ``ring_attention`` (one small program per row and head; SDPA's flash kernel over the
slice took 142 us a call at 384 slots, more than cuDNN's masked one, docs/benchmarks.md).
Grouped KV heads (moshi gives the depformer the LM's ``kv_repeat``: Hibiki-Zero's 16 heads
read 8) stay grouped in the ring and are read in place (``ring_attention``'s groups,
SDPA's ``enable_gqa``), where stock moshi repeats the ring in every layer of every step.
The rest of Hibiki's depformer (weight schedule, low-rank embeddings, per-step output
norms) is the library's code around these layers, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from moshi.modules.transformer import StreamingMultiheadAttention, StreamingTransformerLayer

from .fused_norm import FusedResidualLayer
from .live_attention import triton_available
from .live_lm import split_heads
from .ring_attention import ring_attention


def at_step(modules: Any, schedule: list[int] | None, x: torch.Tensor, step: int) -> torch.Tensor:
    """moshi's ``apply_weights_per_step`` for one time step: the step's module alone, without
    the library's ``torch.cat`` of its one output (a copy kernel on CUDA)."""
    if len(modules) == 1:
        return modules[0](x)
    return modules[step if schedule is None else schedule[step]](x)


class LeanStepLayer(FusedResidualLayer):
    """The depformer's layer, its feed-forward block's weights of the step applied by ``at_step``
    (and, with the fused norms, its residual and norm as one kernel: ``FusedResidualLayer``)."""

    def _ff_update(self, x: torch.Tensor) -> torch.Tensor:
        state = self._streaming_state
        if state is None or x.shape[1] != 1 or self.gating is None or not self.weights_per_step:
            return super()._ff_update(x)
        return at_step(self.gating, self.weights_per_step_schedule, x, state.offset_cpu)


class LeanStepAttention(StreamingMultiheadAttention):
    """Causal self-attention of a transformer that is restarted for every sequence of
    one-token steps taken by all rows together (the depformer)."""

    _use_kernel: bool
    _steps: torch.Tensor  # 0, 1, ...: one per codebook step, on the LM's device

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        state = self._streaming_state
        if state is None or query.shape[1] != 1:
            return super().forward(query, key, value)
        cache = state.kv_cache
        step = state.offset_cpu
        b = query.shape[0]
        projected = at_step(self.in_projs, self.weights_per_step_schedule, query, step)
        q, kv = split_heads(self, projected)  # no RoPE (install_lean_depformer)
        ring = cache.cache  # [2, B, KV heads, capacity, D]
        slot = step % cache.capacity
        ring[:, :, :, slot] = kv[:, :, :, 0]  # keys and values in one copy
        if self._use_kernel:  # the positions written before this step: the step, a constant's view
            x = ring_attention(q, ring[0], ring[1], self._steps[step : step + 1])
        else:
            live = min(step + 1, cache.capacity)
            keys, values = ring[0, :, :, :live], ring[1, :, :, :live]
            x = F.scaled_dot_product_attention(q, keys, values, enable_gqa=self.kv_repeat > 1)
        x = x.transpose(1, 2).reshape(b, 1, -1)  # b h t d -> b t (h d)
        x = at_step(self.out_projs, self.weights_per_step_schedule, x, step)
        # Of the state only the step moves: the ring's end and the per-row offsets, which the
        # library moves with four kernels a layer and step (384 a Hibiki-Zero step), are read
        # by nothing here (no RoPE), and the state is dropped after the LM step.
        state.offset_cpu += 1
        return x


def install_lean_depformer(lm: Any, use_kernel: bool | None = None) -> bool:
    """Give ``lm``'s depformer ``LeanStepAttention``; False where it cannot apply.

    It applies to a depformer as moshi builds it: causal self-attention with weights per
    step (its ring has one end offset for the whole batch, every row at the same step) and
    no RoPE (no released depformer has it), grouped KV heads or not, a ring as long as the
    context (or as the steps, without one).
    ``use_kernel`` defaults to ``ring_attention`` where Triton runs (CUDA), else SDPA over
    the live slots. Call before the LM starts streaming.
    """
    depformer = getattr(lm, "depformer", None)
    if depformer is None or depformer.is_streaming:
        return False
    layers = list(depformer.layers)
    attentions = [layer.self_attn for layer in layers]
    fits = all(
        a.causal and not a.cross_attention and a.weights_per_step and a.rope is None
        and type(a) is StreamingMultiheadAttention
        and (a.context is None or a.context > 0)
        for a in attentions
    ) and all(type(layer) in (StreamingTransformerLayer, FusedResidualLayer) for layer in layers)  # fmt: skip
    if not fits:
        return False
    device = next(lm.parameters()).device
    if use_kernel is None:
        use_kernel = triton_available(device)
    steps = torch.arange(lm.dep_q, device=device)
    for layer, attention in zip(layers, attentions, strict=True):
        layer.__class__ = LeanStepLayer
        attention.__class__ = LeanStepAttention
        attention._use_kernel = use_kernel
        attention._steps = steps
    return True
