"""moshi's float32 RMSNorm (``rms_norm_f32``, every released LM's norm) as one kernel on CUDA,
and each residual add of a layer with the norm after it as one more.

The library computes the norm op by op: the input made float32, squared, averaged, ``eps``
added, ``rsqrt``, times ``alpha``, times the input, back to the input's type: eight
kernels a norm. A step of Hibiki-Zero runs 57 norms in the temporal transformer and 192
in the depformer (16 codebook steps of 6 layers, two each), so about 2,000 of a step's
kernels are norms, each a launch of its own inside the step's CUDA graphs, one after another.
``rms_norm`` does the same arithmetic in one program a row: the same order of products
(``x * (alpha * rsqrt(var))``), the mean of the squares summed in another order (float32,
so the result moves by a float32 rounding at most before it is rounded to the input's type).

Each residual add of a layer (``x + update``, rounded to the layer's type) is followed at once
by a norm of that sum: the attention's by the feed-forward's, the feed-forward's by the next
layer's first. ``FusedResidualLayer`` takes each pair in one program a row (``add_rms_norm``),
the sum bit for bit torch's: two kernels fewer a layer step but the last layer's one, 231 a
Hibiki-Zero step (55 in the 28 layers, 11 in each of the depformer's 16 codebook steps of 6).
Anywhere else (the CPU, no Triton, another norm type, layer scales, cross-attention) the
library's code runs unchanged.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import torch
from moshi.modules.transformer import (
    RMSNorm,
    StreamingTransformer,
    StreamingTransformerLayer,
    apply_weights_per_step,
)
from moshi.utils.compile import no_compile

from .live_attention import triton, triton_available

if triton is not None:
    import triton.language as tl


class FusedRMSNorm(RMSNorm):
    """moshi's float32 ``RMSNorm`` (``rms_norm_f32``) as one kernel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 3 and x.stride(-1) == 1:
            return rms_norm(x, self.alpha, self.eps)
        return super().forward(x)


class FusedResidualLayer(StreamingTransformerLayer):
    """moshi's transformer layer, each residual add and the norm that follows it one kernel where
    ``install_fused_norms`` found the layer fit (``_fuse_residual``); else moshi's forward.

    The feed-forward's residual is followed by the next layer's ``norm1``: where the next layer
    fuses too (``_next``), this layer hands it its input already normed (``_handed``), and the
    next layer takes it only for that very tensor (the transformer passes one layer's output
    straight to the next)."""

    _fuse_residual = False
    _next: FusedResidualLayer | None = None
    _handed: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, cross_attention_src: torch.Tensor | None = None) -> torch.Tensor:
        handed, self._handed = self._handed, None
        if not self._fuse_residual or cross_attention_src is not None or x.dim() != 3 or x.stride(-1) != 1:
            return super().forward(x, cross_attention_src)
        with contextlib.ExitStack() as stack:
            if x.device.type != "cuda":  # as moshi's forward (Triton's interpreter: the tests)
                stack.enter_context(no_compile())
            normed = handed[1] if handed is not None and handed[0] is x else self.norm1(x)
            update = self.self_attn(normed, normed, normed)
            h, normed = add_rms_norm(x, update, self.norm2.alpha, self.norm2.eps)
            update = self._ff_update(normed)
            if self._next is None:
                x = h + update
            else:
                x, normed = add_rms_norm(h, update, self._next.norm1.alpha, self._next.norm1.eps)
                self._next._handed = x, normed
        state = self._streaming_state
        if state:
            state.offset_cpu += x.shape[1]
        return x

    def _ff_block(self, x: torch.Tensor) -> torch.Tensor:
        """moshi's ``_ff_block``: norm, the update of ``_ff_update``, the residual."""
        update = self._ff_update(self.norm2(x))
        return x.to(update) + self.layer_scale_2(update)

    def _ff_update(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward block's update of the normed ``x``, as moshi's ``_ff_block`` makes it."""
        if self.gating is None:
            return self.linear2(self.activation(self.linear1(x)))
        if self.weights_per_step:
            state = self._streaming_state
            offset = 0 if state is None else state.offset_cpu
            return apply_weights_per_step(self.gating, self.weights_per_step_schedule, x, offset)
        return self.gating(x)


def rms_norm(x: torch.Tensor, alpha: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * (alpha * rsqrt(eps + mean(x**2)))`` over the last dimension, in float32, returned in
    ``x``'s type: moshi's ``_rms_norm`` with ``dtype=float32``. ``x`` is ``[B, T, D]`` with ``D``
    contiguous (any batch and time strides), ``alpha`` ``D`` float32 values."""
    return _norm_rows(x, None, alpha, eps)[1]


def add_rms_norm(
    x: torch.Tensor, update: torch.Tensor, alpha: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x.to(update) + update`` (torch's sum, rounded to ``update``'s type) and ``rms_norm(h)``,
    in one kernel; ``x`` and ``update`` as ``rms_norm``'s ``x``."""
    h, normed = _norm_rows(x, update, alpha, eps)
    assert h is not None
    return h, normed


def _norm_rows(
    x: torch.Tensor, update: torch.Tensor | None, alpha: torch.Tensor, eps: float
) -> tuple[torch.Tensor | None, torch.Tensor]:
    b, t, d = x.shape
    add = update is not None
    source = update if add else x
    assert source.shape == x.shape and source.stride(-1) == 1
    h = torch.empty((b, t, d), device=x.device, dtype=source.dtype) if add else None
    out = torch.empty((b, t, d), device=x.device, dtype=source.dtype)
    if out.numel() == 0:
        return h, out
    block = triton.next_power_of_2(d)
    _rms_norm[(b * t,)](
        x, source, alpha, h if add else out, out, *x.stride()[:2], *source.stride()[:2], t, d, eps,
        ADD=add, BLOCK=block, num_warps=max(1, min(16, block // 256)),
    )  # fmt: skip
    return h, out


def install_fused_norms(module: Any, use_kernel: bool | None = None) -> int:
    """Make every moshi float32 ``RMSNorm`` in ``module`` a ``FusedRMSNorm`` and the layers of every
    transformer whose layers then all fit ``FusedResidualLayer``s; how many norms. ``use_kernel``
    defaults to where Triton runs (CUDA); without it nothing changes (0)."""
    if use_kernel is None:
        use_kernel = triton_available(next(module.parameters()).device)
    if not use_kernel:
        return 0
    norms = [m for m in module.modules() if type(m) is RMSNorm and m.dtype == torch.float32]
    for norm in norms:
        norm.__class__ = FusedRMSNorm
    for transformer in module.modules():
        if type(transformer) is not StreamingTransformer or transformer.checkpointing:
            continue
        layers = [layer for layer in transformer.layers if _fuses(layer)]
        if len(layers) < len(transformer.layers):  # uniform layers (every released LM's): all or none
            continue
        for layer in layers:
            if type(layer) is StreamingTransformerLayer:
                layer.__class__ = FusedResidualLayer
            layer._fuse_residual = True
        for layer, after in itertools.pairwise(layers):
            object.__setattr__(layer, "_next", after)  # a reference, not a submodule of ``layer``
    return len(norms)


def _fuses(layer: Any) -> bool:
    """A layer of moshi's own (or ours) with fused norms, no layer scale and no cross-attention."""
    return (
        type(layer) is StreamingTransformerLayer or isinstance(layer, FusedResidualLayer)
    ) and (
        not layer.skip_self_attn and layer.cross_attention is None
        and isinstance(layer.norm1, FusedRMSNorm) and isinstance(layer.norm2, FusedRMSNorm)
        and isinstance(layer.layer_scale_1, torch.nn.Identity)
        and isinstance(layer.layer_scale_2, torch.nn.Identity)
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _rms_norm(
        X, U, ALPHA, H, OUT, stride_xb, stride_xt, stride_ub, stride_ut, t, d, eps,
        ADD: tl.constexpr, BLOCK: tl.constexpr,
    ) -> None:  # fmt: skip
        """One row (one time step of one batch row): with ``ADD`` the row's sum ``h = x + u`` in
        ``u``'s type (``x`` made that type first, as ``x.to(u)``), stored, then normed; else ``x``
        normed. The mean square first, then each value."""
        row = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        keep = i < d
        at = row.to(tl.int64) * d + i
        b, s = (row // t).to(tl.int64), row % t
        x = tl.load(X + b * stride_xb + s * stride_xt + i, mask=keep, other=0.0)
        if ADD:
            u = tl.load(U + b * stride_ub + s * stride_ut + i, mask=keep, other=0.0)
            h = (x.to(u.dtype).to(tl.float32) + u.to(tl.float32)).to(H.dtype.element_ty)
            tl.store(H + at, h, mask=keep)
            x = h
        x = x.to(tl.float32)
        var = eps + tl.sum(x * x, axis=0) / d
        y = x * (tl.load(ALPHA + i, mask=keep, other=0.0) * tl.math.rsqrt(var))
        tl.store(OUT + at, y.to(OUT.dtype.element_ty), mask=keep)
