"""Mimi's SEANet convolutions with the elementwise work around them folded into their
neighbours (CUDA, Triton), outputs bit for bit the library's.

At 512 rows Mimi's encode and decode are not their convolutions but what surrounds them
(docs/benchmarks.md, the profile of Mimi at 512 rows): a 512-row activation of 64 channels
at 24 kHz is 252 MB of float32, and each streaming convolution passes over it several times
around the one cuDNN call: torch adds the bias in a kernel of its own after cuDNN (a
broadcast, not vectorized), the ELU before the next convolution reads and writes it all
again, and ``StreamingConv1d`` concatenates its kept samples to the input (``cat``) before
cuDNN reads it. Here each convolution runs without its bias, and the next elementwise step
takes the bias along:

- a convolution's input is written once into the buffer cuDNN reads (``assemble``): the
  kept samples, then ``elu(t + bias)`` of the step before (each part as that step has it);
- a residual block's sum is ``x + (t + bias)`` in one kernel (``residual``), reading the
  input where it lies (the transposed convolutions hand on a strided view);
- a transposed convolution's output is ``(t + bias) + partial`` in one kernel
  (``convtr_output``), contiguous.

Each value is computed by the same float operations in the same order as the library's
(the bias added to cuDNN's output, the ELU as torch's CUDA kernel computes it, ``expm1``
of libdevice), so the codes and the audio are the library's, bit for bit (``bench
moshi-step mimi`` checks it on the GPU). The state (kept samples, partial sums) stays the
library's own tensors, moved as it moves them, so reset and the CUDA graphs are unchanged.
Outside streaming, on the CPU without Triton, or for a layer this does not know, the
library's forward runs.

``channels_last`` (``--moshi-mimi-convs fused-cl``) writes each convolution's input
``[B, T, C]`` in memory and runs the convolution as a 2-D one in that layout, so that cuDNN
converts nothing between layouts around its kernel (about 2 ms of a 512-row step). cuDNN
then picks other kernels, which sum in another order: the codes and audio are no longer the
library's bit for bit, so it is an opt-in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from moshi.modules.conv import StreamingConv1d, StreamingConvTranspose1d
from moshi.modules.seanet import SEANetDecoder, SEANetEncoder, SEANetResnetBlock
from torch import nn

from .live_attention import triton

if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

BLOCK = 1024  # values a program writes: a tile of channel rows x samples (``_tiles``)
# Triton's interpreter (the tests) has no libdevice: there ``expm1`` is ``exp(x) - 1``, a few
# roundings off where |x| is small; on the GPU it is libdevice's, torch's own.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class _Lazy:
    """A value not yet written out: ``elu(t + bias)`` (each part where present)."""

    t: torch.Tensor
    bias: torch.Tensor | None = None
    elu: bool = False

    def value(self, channels_last: bool = False) -> torch.Tensor:
        """The value, written out where a part is pending (channels last if asked: cuDNN's input)."""
        if self.bias is None and not self.elu:
            return self.t
        return assemble(self.t, self.bias, None, self.elu, channels_last)


def _forward(self: SEANetEncoder | SEANetDecoder, x: torch.Tensor) -> torch.Tensor:
    """A SEANet encoder's or decoder's ``forward``, its layers walked by ``_walk`` while streaming."""
    if not _streams(self.model):
        return self.model(x)
    return _walk(self.model, _Lazy(x), self._channels_last).value().contiguous()


class FusedSEANetEncoder(SEANetEncoder):
    forward = _forward
    _channels_last = False


class FusedSEANetDecoder(SEANetDecoder):
    forward = _forward
    _channels_last = False


def install_fused_convs(mimi: Any, channels_last: bool = False) -> bool:
    """Give Mimi's SEANet encoder and decoder the fused forward; False where it has neither.
    ``channels_last``: the convolutions' inputs are written channels last (``[B, T, C]`` in
    memory) and cuDNN runs them as 2-D convolutions in that layout, so that it does not convert
    each input and output between layouts around its kernel. The kernels are Triton's: call it
    only where ``triton_available`` (or under ``TRITON_INTERPRET=1``, the tests)."""
    fused = {SEANetEncoder: FusedSEANetEncoder, SEANetDecoder: FusedSEANetDecoder}
    modules = [m for m in (getattr(mimi, "encoder", None), getattr(mimi, "decoder", None))
               if type(m) in fused]  # fmt: skip
    for module in modules:
        module.__class__ = fused[type(module)]
        module._channels_last = channels_last
    return bool(modules)


def _streams(model: nn.Module) -> bool:
    return any(getattr(m, "_streaming_state", None) is not None for m in model.modules())


def _walk(layers: nn.Sequential, x: _Lazy, cl: bool) -> _Lazy:
    """``layers(x)`` with each bias and ELU carried to the step that can take it along; ``cl``:
    the convolutions run channels last."""
    for layer in layers:
        kind = type(layer)
        if kind is nn.ELU and layer.alpha == 1.0:
            x = _Lazy(x.value(cl), elu=True) if x.elu else _Lazy(x.t, x.bias, True)
        elif kind is StreamingConv1d and _conv_fits(layer):
            x = _conv(layer, x, cl)
        elif kind is StreamingConvTranspose1d and _convtr_fits(layer, x.t):
            x = _Lazy(_convtr(layer, x.value(cl), cl))
        elif kind is SEANetResnetBlock and type(layer.shortcut) is nn.Identity:
            inner = x.value(cl)
            y = _walk(layer.block, _Lazy(inner), cl)
            x = _Lazy(residual(inner, y.t, y.bias, cl) if not y.elu else inner + y.value())
        else:
            x = _Lazy(layer(x.value()))
    return x


def _conv_fits(layer: StreamingConv1d) -> bool:
    state = layer._streaming_state
    return state is not None and layer.pad_mode == "constant" and layer.conv.conv.padding_mode == "zeros"


def _conv(layer: StreamingConv1d, x: _Lazy, cl: bool) -> _Lazy:
    """moshi's ``StreamingConv1d.forward`` (constant padding): the kept samples and the input
    written once into cuDNN's input, the output without its bias (handed on)."""
    state = layer._streaming_state
    conv = layer.conv.conv
    kept = state.previous.shape[-1]
    assert x.t.shape[-1] % conv.stride[0] == 0, "Steps must be multiple of stride"
    cl = cl and conv.in_channels > 1  # cuDNN's channels-last kernel for the audio: 1.35 ms at 512 rows
    joined = assemble(x.t, x.bias, state.previous if kept else None, x.elu, cl)
    if cl:  # torch runs a 3-D input contiguous: a 2-D convolution keeps the layout
        y = nn.functional.conv2d(
            joined.unsqueeze(2), _weight_2d(conv), None, (1, conv.stride[0]), 0, (1, conv.dilation[0]),
            conv.groups,
        ).squeeze(2)  # fmt: skip
    else:
        y = conv._conv_forward(joined, conv.weight, None)
    if kept:
        state.previous[:] = torch.where(state.exec_mask.view(-1, 1, 1), joined[..., -kept:], state.previous)
    return _Lazy(y, conv.bias)


def _weight_2d(conv: nn.Conv1d | nn.ConvTranspose1d) -> torch.Tensor:
    """The weight as a channels-last ``[O, I, 1, K]``, made again only if the weight changed (made
    in the warm-up steps, before Mimi's CUDA graphs are captured)."""
    w = conv.weight
    key = (w.data_ptr(), w._version, w.dtype)
    cached = getattr(conv, "_duplexserve_weight_2d", None)
    if cached is None or cached[0] != key:
        cached = (key, w.detach().unsqueeze(2).contiguous(memory_format=torch.channels_last))
        conv._duplexserve_weight_2d = cached
    return cached[1]


def _convtr_fits(layer: StreamingConvTranspose1d, x: torch.Tensor) -> bool:
    state = layer._streaming_state
    if state is None:
        return False
    tail = state.partial.shape[-1]
    return 0 < tail <= x.shape[-1] * layer._stride  # the kept tail and the carried head apart


def _convtr(layer: StreamingConvTranspose1d, x: torch.Tensor, cl: bool) -> torch.Tensor:
    """moshi's ``StreamingConvTranspose1d.forward``: the partial sums of the last step added and
    this step's kept, as the library does, the output written once."""
    state = layer._streaming_state
    convtr = layer.convtr.convtr
    tail = state.partial.shape[-1]
    if cl:
        t = nn.functional.conv_transpose2d(
            x.unsqueeze(2), _weight_2d(convtr), None, (1, convtr.stride[0]), (0, convtr.padding[0]),
            (0, convtr.output_padding[0]), convtr.groups, (1, convtr.dilation[0]),
        ).squeeze(2)  # fmt: skip
    else:
        t = nn.functional.conv_transpose1d(
            x, convtr.weight, None, convtr.stride, convtr.padding, convtr.output_padding, convtr.groups,
            convtr.dilation,
        )  # fmt: skip
    y = convtr_output(t, convtr.bias, state.partial, cl)
    kept = t[..., -tail:]
    if convtr.bias is not None:  # the library's ``(t + bias) - bias``
        kept = (kept + convtr.bias[:, None]) - convtr.bias[:, None]
    state.partial[:] = torch.where(state.exec_mask.view(-1, 1, 1), kept, state.partial)
    return y


def _empty(b: int, c: int, n: int, like: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """A ``[B, C, n]`` tensor, contiguous or channels last (``[B, n, C]`` in memory)."""
    if channels_last:
        return torch.empty((b, n, c), device=like.device, dtype=like.dtype).transpose(1, 2)
    return torch.empty((b, c, n), device=like.device, dtype=like.dtype)


def assemble(
    t: torch.Tensor, bias: torch.Tensor | None, previous: torch.Tensor | None, elu: bool,
    channels_last: bool = False,
) -> torch.Tensor:  # fmt: skip
    """``cat([previous, f(t)], -1)``, contiguous or channels last, where ``f(t) = elu(t + bias)``
    (the bias over channels; each part where given). ``t`` is ``[B, C, T]`` with any strides."""
    b, c, n = t.shape
    kept = 0 if previous is None else previous.shape[-1]
    out = _empty(b, c, kept + n, t, channels_last)
    if previous is not None:
        assert previous.is_contiguous() and previous.shape[:2] == (b, c)
    grid, tile = _tiles(b, c, kept + n, channels_last)
    _assemble[grid](
        t, t if bias is None else bias, t if previous is None else previous, out, c, kept, n,
        *t.stride(), *out.stride(), HAS_BIAS=bias is not None, ELU=elu, **tile,
    )  # fmt: skip
    return out


def residual(
    x: torch.Tensor, t: torch.Tensor, bias: torch.Tensor | None, channels_last: bool = False
) -> torch.Tensor:
    """``x + (t + bias)``, contiguous or channels last; ``x`` and ``t`` ``[B, C, T]``, any strides."""
    b, c, n = t.shape
    assert x.shape == t.shape
    out = _empty(b, c, n, t, channels_last)
    grid, tile = _tiles(b, c, n, channels_last)
    _residual[grid](
        x, t, t if bias is None else bias, out, c, n, *x.stride(), *t.stride(), *out.stride(),
        HAS_BIAS=bias is not None, **tile,
    )  # fmt: skip
    return out


def convtr_output(
    t: torch.Tensor, bias: torch.Tensor | None, partial: torch.Tensor, channels_last: bool = False
) -> torch.Tensor:
    """``(t + bias)[..., :n]`` with ``partial`` added to its first samples, contiguous or channels
    last, where ``t`` is a transposed convolution's ``[B, C, n + P]`` output (any strides) and
    ``partial`` ``[B, C, P]``."""
    b, c, total = t.shape
    tail = partial.shape[-1]
    n = total - tail
    assert partial.is_contiguous() and partial.shape[:2] == (b, c) and tail <= n
    out = _empty(b, c, n, t, channels_last)
    grid, tile = _tiles(b, c, n, channels_last)
    _convtr_output[grid](
        t, t if bias is None else bias, partial, out, c, tail, n, *t.stride(), *out.stride(),
        HAS_BIAS=bias is not None, **tile,
    )  # fmt: skip
    return out


def _tiles(b: int, c: int, width: int, channels_last: bool) -> tuple[tuple[int, int, int], dict[str, int]]:
    """A grid of ``CH x COLS`` tiles (channels x samples) of about ``BLOCK`` values, a row's
    batch to each program's first axis: the tile runs along the output's contiguous axis first
    (samples, or channels where channels last), so that its stores coalesce."""
    if channels_last:
        ch = min(BLOCK, triton.next_power_of_2(c))
        cols = min(max(1, BLOCK // ch), triton.next_power_of_2(width))
    else:
        cols = min(BLOCK, triton.next_power_of_2(width))
        ch = min(max(1, BLOCK // cols), triton.next_power_of_2(c))
    return (b, triton.cdiv(c, ch), triton.cdiv(width, cols)), {"CH": ch, "COLS": cols}


if triton is not None:

    @triton.jit
    def _at(T, b, c, i, stride_b, stride_c, stride_t):
        """The addresses of a tile (channels ``c`` x samples ``i``) of row ``b`` of a ``[B, C, T]``
        tensor (a stride of 1 is a constant to Triton: the tile's contiguous axis is known)."""
        return T + b.to(tl.int64) * stride_b + c.to(tl.int64) * stride_c + i.to(tl.int64) * stride_t

    @triton.jit
    def _tile(c, CH: tl.constexpr, COLS: tl.constexpr):
        """This program's row, channels (``[CH, 1]``), which of them are the tensor's, and samples
        (``[1, COLS]``)."""
        ch = tl.program_id(1) * CH + tl.arange(0, CH)[:, None]
        i = tl.program_id(2) * COLS + tl.arange(0, COLS)[None, :]
        return tl.program_id(0), ch, ch < c, i

    _EXACT_EXPM1 = tl.constexpr(not _INTERPRETED)

    @triton.jit
    def _elu(v):
        """torch's CUDA ELU (alpha 1): ``x > 0 ? x : expm1(x)``."""
        if _EXACT_EXPM1:  # noqa: SIM108 (a constexpr branch: the other is not compiled)
            e = libdevice.expm1(v)
        else:
            e = tl.exp(v) - 1.0
        return tl.where(v > 0, v, e)

    @triton.jit
    def _plus_bias(v, BIAS, ch, live, HAS_BIAS: tl.constexpr):
        if HAS_BIAS:
            v = v + tl.load(BIAS + ch, mask=live, other=0.0)
        return v

    @triton.jit
    def _assemble(
        T, BIAS, PREV, OUT, c, kept, n, st_b, st_c, st_t, so_b, so_c, so_t,
        HAS_BIAS: tl.constexpr, ELU: tl.constexpr, CH: tl.constexpr, COLS: tl.constexpr,
    ) -> None:  # fmt: skip
        """A tile of the joined input: kept samples, then ``elu(t + bias)``."""
        b, ch, live, i = _tile(c, CH, COLS)
        width = kept + n
        old = live & (i < kept)
        new = live & (i >= kept) & (i < width)
        v = tl.load(_at(T, b, ch, i - kept, st_b, st_c, st_t), mask=new, other=0.0)
        v = _plus_bias(v, BIAS, ch, live, HAS_BIAS)
        if ELU:
            v = _elu(v)
        p = tl.load(_at(PREV, b, ch, i, c * kept, kept, 1), mask=old, other=0.0)
        tl.store(_at(OUT, b, ch, i, so_b, so_c, so_t), tl.where(i < kept, p, v), mask=live & (i < width))

    @triton.jit
    def _residual(
        X, T, BIAS, OUT, c, n, sx_b, sx_c, sx_t, st_b, st_c, st_t, so_b, so_c, so_t,
        HAS_BIAS: tl.constexpr, CH: tl.constexpr, COLS: tl.constexpr,
    ) -> None:  # fmt: skip
        b, ch, live, i = _tile(c, CH, COLS)
        keep = live & (i < n)
        x = tl.load(_at(X, b, ch, i, sx_b, sx_c, sx_t), mask=keep, other=0.0)
        v = tl.load(_at(T, b, ch, i, st_b, st_c, st_t), mask=keep, other=0.0)
        tl.store(_at(OUT, b, ch, i, so_b, so_c, so_t), x + _plus_bias(v, BIAS, ch, live, HAS_BIAS), mask=keep)

    @triton.jit
    def _convtr_output(
        T, BIAS, PART, OUT, c, tail, n, st_b, st_c, st_t, so_b, so_c, so_t,
        HAS_BIAS: tl.constexpr, CH: tl.constexpr, COLS: tl.constexpr,
    ) -> None:  # fmt: skip
        b, ch, live, i = _tile(c, CH, COLS)
        keep = live & (i < n)
        v = tl.load(_at(T, b, ch, i, st_b, st_c, st_t), mask=keep, other=0.0)
        v = _plus_bias(v, BIAS, ch, live, HAS_BIAS)
        p = tl.load(_at(PART, b, ch, i, c * tail, tail, 1), mask=keep & (i < tail), other=0.0)
        tl.store(_at(OUT, b, ch, i, so_b, so_c, so_t), tl.where(i < tail, v + p, v), mask=keep)
