"""The one-kernel RoPE and SiLU gate (``moshi/fused_pointwise.py``), run by Triton's interpreter
on the CPU: against moshi's own ``apply_rope`` and gating alone, then inside whole tiny LMs
(interleaved and concatenated RoPE, the depformer's gates per step) and a streaming Mimi."""

import textwrap

import pytest

from tests.triton_interpreter import run_interpreted

CHECK = textwrap.dedent(
    """
    import torch
    from moshi.models import loaders
    from moshi.modules.gating import ActivationGating, gating_forward_kernel
    from moshi.modules.rope import RotaryEmbedding, apply_rope
    from moshi.utils.compile import no_compile
    from torch.nn import functional as F
    from duplexserve.engine_bridge.moshi.fused_pointwise import (
        FusedGating, FusedRotary, frequencies, install_fused_pointwise, rope, silu_mul,
    )
    from duplexserve.engine_bridge.moshi.presets import TINY_LM, TINY_MIMI, TINY_ZERO_LM

    def close(got, want, what):
        assert got.shape == want.shape and got.dtype == want.dtype, what
        if got.dtype == torch.float32:
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err < 2e-6, (what, err)
        else:  # the float32 value made bf16: one bf16 step at most (the interpreter truncates
            # where the GPU rounds)
            diff = (got.float() - want.float()).abs()
            assert (diff <= want.float().abs() * 2**-7 + 1e-6).all(), (what, diff.max())

    torch.manual_seed(0)
    # [B, H, T, D] queries and [B, KV, T, D] keys as moshi's projection splits them (strided
    # views), one step and several, positions from 0 to far past a ring (a long session)
    with no_compile():
        for interleave in (True, False):
            for b, h, kv, t, d in [(3, 4, 2, 1, 16), (2, 2, 2, 3, 12), (5, 8, 4, 1, 64)]:
                projected = torch.randn(b, t, (h + 2 * kv) * d) * 3
                q = projected[..., : h * d].view(b, t, h, d).transpose(1, 2)
                k = projected[..., h * d :].view(b, t, 2, kv, d).permute(2, 0, 3, 1, 4)[0]
                offset = torch.tensor([0, 7, 5000, 123456, 3][:b])
                for dtype in (torch.float32, torch.bfloat16):
                    want = apply_rope(q.to(dtype), k.to(dtype), offset, 10_000, interleave, False)
                    got = rope(q.to(dtype), k.to(dtype), offset, frequencies(d, 10_000, "cpu"), interleave)
                    for g, w in zip(got, want):
                        assert g.is_contiguous()
                        close(g, w, (interleave, b, h, kv, t, d, dtype))
                    print("rope close", interleave, dtype)
        # silu(a) * b in float32, rounded once (as the compiled kernel; eager rounds the silu too)
        hidden = torch.randn(6, 2, 2 * 104) * 4
        for dtype in (torch.float32, torch.bfloat16):
            x = hidden.to(dtype)
            want = (F.silu(x[..., :104].float()) * x[..., 104:].float()).to(dtype)
            close(silu_mul(x), want, ("silu_mul", dtype))
        gate = ActivationGating(40, 4 * 40, F.silu)
        for shape in [(4, 1, 40), (2, 3, 40)]:
            x = torch.randn(shape) * 4
            for dtype in (torch.float32, torch.bfloat16):
                g = gate.to(dtype)
                want = gating_forward_kernel(g.linear_in.weight, g.linear_out.weight, F.silu, x.to(dtype))
                g.__class__ = FusedGating
                got = g(x.to(dtype))
                g.__class__ = ActivationGating
                if dtype == torch.float32:
                    close(got, want, ("gating", shape))
                else:  # eager rounds the silu to bf16 before the product, the kernel does not
                    err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
                    assert got.dtype == dtype and err < 2**-6, ("gating", shape, err)
                print("gating close", dtype)

    # whole LMs, float32: concatenated RoPE (tiny-zero) and interleaved (tiny), every gate
    for name, kwargs in (("tiny-zero", TINY_ZERO_LM), ("tiny", TINY_LM)):
        stock = loaders.get_moshi_lm(None, lm_kwargs=kwargs, device="cpu", dtype=torch.float32)
        fused = loaders.get_moshi_lm(None, lm_kwargs=kwargs, device="cpu", dtype=torch.float32)
        fused.load_state_dict(stock.state_dict())
        ropes = sum(type(m) is RotaryEmbedding for m in fused.modules())
        gates = sum(type(m) is ActivationGating for m in fused.modules())
        assert ropes > 0 and gates > len(fused.transformer.layers), (ropes, gates)
        assert install_fused_pointwise(fused, use_kernel=True) == (ropes, gates)
        assert sum(type(m) is FusedRotary for m in fused.modules()) == ropes
        assert sum(type(m) is FusedGating for m in fused.modules()) == gates
        tokens = torch.randint(0, 64, (3, stock.num_codebooks, 1), generator=torch.Generator().manual_seed(1))
        outs = []
        for lm in (stock, fused):
            with torch.no_grad(), no_compile(), lm.streaming(3):
                steps = [lm.forward_text(tokens)[0] for _ in range(5)]
                with lm.depformer.streaming(3):  # codebook steps over the last output: a gate each
                    logits = [lm.forward_depformer(k, tokens[:, k : k + 1], steps[-1]) for k in (0, 1, 2)]
            outs.append((torch.stack(steps), torch.stack(logits)))
        for (a, b), what in zip(zip(*outs), ("transformer", "depformer logits")):
            err = ((a - b).abs().max() / a.abs().max()).item()
            assert 0 <= err < 1e-5, (name, what, err)
            print(name, what, "max error", err)

    # Mimi's transformers (interleaved RoPE, no gate), streaming: encode and decode
    stock = loaders.get_mimi(None, TINY_MIMI, device="cpu", num_codebooks=4)
    fused = loaders.get_mimi(None, TINY_MIMI, device="cpu", num_codebooks=4)
    fused.load_state_dict(stock.state_dict())
    assert install_fused_pointwise(fused, use_kernel=True)[0] > 0
    pcm = torch.randn(2, 1, 1920 * 4, generator=torch.Generator().manual_seed(2)) * 0.1
    outs = []
    for mimi in (stock, fused):
        with torch.no_grad(), no_compile(), mimi.streaming(2):
            codes = [mimi.encode(pcm[..., i * 1920 : (i + 1) * 1920]) for i in range(4)]
            audio = [mimi.decode(c) for c in codes]
        outs.append((torch.cat(codes, -1), torch.cat(audio, -1)))
    assert torch.equal(outs[0][0], outs[1][0])  # the same codes, so decoded from the same input
    err = ((outs[0][1] - outs[1][1]).abs().max() / outs[0][1].abs().max()).item()
    assert err < 1e-5, err
    print("mimi max error", err)
    """
)


@pytest.mark.timeout(420)
def test_the_fused_rope_and_gate_equal_moshis():
    """Each kernel against moshi's eager function (float32 to its rounding, bf16 within one step
    of its own), then tiny LMs and a Mimi with every RoPE and gate fused against the stock ones."""
    pytest.importorskip("triton")
    stdout = run_interpreted(CHECK, timeout=400)
    assert stdout.count("rope close") == 12 and stdout.count("gating close") == 4, stdout
    assert stdout.count("max error") == 5, stdout


def test_without_triton_on_cuda_nothing_is_fused():
    """On the CPU (no ``use_kernel``) the library's RoPE and gates stay."""
    import torch
    from moshi.models import loaders

    from duplexserve.engine_bridge.moshi.fused_pointwise import install_fused_pointwise
    from duplexserve.engine_bridge.moshi.presets import get_preset

    lm = loaders.get_moshi_lm(None, lm_kwargs=get_preset("tiny").lm, device="cpu", dtype=torch.float32)
    kinds = sorted({type(m).__name__ for m in lm.modules()})
    assert install_fused_pointwise(lm) == (0, 0)
    assert sorted({type(m).__name__ for m in lm.modules()}) == kinds


@pytest.mark.parametrize("interleave", [True, False])
def test_the_kernels_compile_for_the_h100(interleave: bool):
    """The CUDA path the CPU tests cannot run: both kernels compiled by Triton for sm_90 here,
    with the argument types the engine passes (bf16 heads of 128, int64 offsets)."""
    pytest.importorskip("triton")
    from duplexserve.bench.kernel_sass import compile_sm90
    from duplexserve.engine_bridge.moshi import fused_pointwise

    rope_types = ["*bf16"] * 4 + ["*i64", "*fp32"] + ["i32"] * 10
    rope = {"INTERLEAVE": interleave, "HALF": 64, "BLOCK": 64}
    assert compile_sm90(fused_pointwise._rope, rope_types, rope, {"num_warps": 1}).asm["cubin"]
    gate_types = ["*bf16", "*bf16", "i32", "i32"]
    assert compile_sm90(fused_pointwise._silu_mul, gate_types, {"BLOCK": 1024}, {"num_warps": 4}).asm["cubin"]
