"""``ring_attention``, the CUDA path of Mimi's transformers and of the lean depformer, run
by Triton's interpreter on the CPU: against an explicit mask, inside a streaming Mimi
against stock moshi (idle rows, resets, a ring that wraps), and in the depformer's
codebook loop against stock moshi's logits."""

from __future__ import annotations

import textwrap

import pytest

from tests.triton_interpreter import run_interpreted

CHECKS = textwrap.dedent(
    """
    import torch
    from moshi.models import LMGen, loaders
    from duplexserve.engine_bridge.moshi.lean_depformer import install_lean_depformer
    from duplexserve.engine_bridge.moshi.live_mimi import install_ring_attention
    from duplexserve.engine_bridge.moshi.presets import TINY_LM, TINY_MIMI, TINY_ZERO_LM
    from duplexserve.engine_bridge.moshi.ring_attention import default_tile, reference, ring_attention

    torch.manual_seed(0)
    # The kernel alone: Mimi's shape (250 slots, 2 queries), the depformer's (8, 1, bf16), odd
    # ones; query heads per KV head last (Hibiki-Zero's depformer: 2).
    shapes = [(250, 2, 64, torch.float32, 1), (8, 1, 64, torch.bfloat16, 1), (7, 3, 16, torch.float32, 1),
              (8, 1, 64, torch.bfloat16, 2), (7, 2, 16, torch.float32, 2)]  # fmt: skip
    for c, t, d, dtype, group in shapes:
        before = torch.tensor([0, 1, 5, c - 2, c - 1, c, c + 1, 3 * c + 5])
        b, h = len(before), 3
        ring = torch.randn(2, b, h, c, d).to(dtype)
        q = torch.randn(b, t, 3, h * group, d).to(dtype)[:, :, 0].permute(0, 2, 1, 3)  # strided, as projected
        ref = reference(q.float(), ring[0].float(), ring[1].float(), before + t)
        for ends, want in [(before, ref), (torch.tensor([c + 3]), None)]:
            if want is None:  # one end for every row (the depformer's ring)
                want = reference(q.float(), ring[0].float(), ring[1].float(), ends.expand(b) + t)
            block, _, rows = default_tile(c)
            for tile in (None, (block, 2, not rows)):  # the kernel's choice; the other form
                got = ring_attention(q, ring[0], ring[1], ends, tile).float()
                err = (got - want).abs().max().item()
                assert err < (1e-6 if dtype == torch.float32 else 2e-2), (c, t, dtype, group, tile, err)
                print("kernel max error", c, t, dtype, group, tile, err)

    # Mimi, streaming: encoder transformer (via the latent) and decoder; a ring of 6 (wraps at step
    # 3; a tile of 8 slots) and of 20 (wraps at step 10; a tile of 32, most of it past the ring).
    for context in (6, 20):
        cfg = {**TINY_MIMI, "transformer": {**TINY_MIMI["transformer"], "context": context}}
        stock = loaders.get_mimi(None, cfg, device="cpu", num_codebooks=4)
        ring = loaders.get_mimi(None, cfg, device="cpu", num_codebooks=4)
        ring.load_state_dict(stock.state_dict())
        assert install_ring_attention(ring) and not install_ring_attention(ring)
        batch = 5
        rng = torch.Generator().manual_seed(1)
        schedule = [
            (torch.randn(batch, 1, 1920, generator=rng) * 0.1,
             torch.randint(0, 64, (batch, 4, 1), generator=rng),
             torch.rand(batch, generator=rng) < 0.8, torch.rand(batch, generator=rng) < 0.1)
            for _ in range(14)
        ]
        results = []
        for mimi in (stock, ring):
            outs = []
            with torch.no_grad(), mimi.streaming(batch):
                for pcm, codes, active, reset in schedule:
                    mimi.reset_streaming(reset)
                    mimi.set_exec_mask(active)
                    latent = mimi._encode_to_unquantized_latent(pcm)
                    outs.append(torch.cat([latent.flatten(1), mimi.decode(codes).flatten(1)], 1)[active])
            results.append(torch.cat(outs))
        err = ((results[0] - results[1]).abs().max() / results[0].abs().max()).item()
        assert err < 1e-5, err
        print("mimi max error", context, err)

    # The depformer's codebook loop (16 steps over a ring of 8 wrap it, as hibiki-2b-class's do);
    # tiny-zero's: grouped KV heads, a weight schedule, per-step output norms.
    plain = {**TINY_LM, "dep_q": 16, "delays": [0] * 17, "n_q": 16}
    for kwargs in (plain, {**TINY_ZERO_LM, "depformer_context": 8}):
        stock = loaders.get_moshi_lm(None, lm_kwargs=kwargs, device="cpu", dtype=torch.float32)
        lean = loaders.get_moshi_lm(None, lm_kwargs=kwargs, device="cpu", dtype=torch.float32)
        lean.load_state_dict(stock.state_dict())
        assert install_lean_depformer(lean, use_kernel=True)
        results = []
        for lm in (stock, lean):
            logits = []
            forward = lm.forward_depformer
            lm.forward_depformer = lambda *a, f=forward, out=logits: out.append(f(*a)) or out[-1]
            gen = LMGen(lm, use_sampling=False)
            rng = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for _ in range(3):
                    text = torch.randint(0, kwargs["text_card"], (5,), generator=rng)
                    gen.depformer_step(text, torch.randn(5, 1, kwargs["dim"], generator=rng))
            results.append(torch.stack(logits))
        err = ((results[0] - results[1]).abs().max() / results[0].abs().max()).item()
        assert err < 1e-5, err
        print("depformer max error", kwargs["kv_repeat"] if "kv_repeat" in kwargs else 1, err)
    """
)


def test_ring_attention_equals_moshis_masked_attention():
    pytest.importorskip("triton")
    stdout = run_interpreted(CHECKS, timeout=300)
    assert stdout.count("kernel max error") == 20, stdout
    assert stdout.count("mimi max error") == 2 and stdout.count("depformer max error") == 2, stdout


LIVE_MMA_CHECK = textwrap.dedent(
    """
    import torch
    from duplexserve.engine_bridge.moshi.live_attention import (
        KernelConfig, dequantize, live_attention, prefix_mask, quantize, reference_attention)

    torch.manual_seed(0)
    # (b, KV heads, capacity, head dim), query heads per KV head (Hibiki-Zero's 2); rows of length
    # 0, 1, a partial tile, a partial chunk and the whole ring (300: the last chunk partial too)
    # (the last: keys that grow along the ring, so that the scores climb by tens of e-folds from
    # tile to tile and the lazily rescaled maximum moves again and again)
    cases = [(torch.float32, (5, 2, 300, 64), 1, 0.0), (torch.float32, (5, 2, 300, 128), 2, 0.0),
             (torch.bfloat16, (5, 1, 300, 128), 2, 0.0),
             (torch.float32, (5, 2, 300, 128), 2, 0.05)]  # fmt: skip
    for dtype, (b, h, c, d), group, climb in cases:
        ring = torch.randn(2, b, h, c, d)
        ring[0] *= (1 + climb * torch.arange(c)).view(1, 1, -1, 1)
        q = torch.randn(b, h * group, 1, d)
        if climb:
            q, ring[0] = q.abs(), ring[0].abs()
        ring, q = ring.to(dtype), q.to(dtype)
        lengths = torch.tensor([0, 1, 40, 65, c], dtype=torch.int32)
        ring8, scale = quantize(ring)
        deq = dequantize(ring8, scale, torch.float32)
        ref = reference_attention(q.float(), deq[0], deq[1], prefix_mask(lengths.clamp(min=1), c))
        ref[lengths == 0] = 0.0
        for config in ("64/16/1/3/mma", "256/32/1/3/mma"):
            kernel = KernelConfig.parse(config)
            got = live_attention(q, ring8[0], ring8[1], lengths, (scale[0], scale[1]), kernel)
            assert got[lengths == 0].eq(0).all()
            # float16 query and weights on the tensor cores: about 1e-4 of the largest value
            err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
            assert err < (1e-3 if dtype == torch.float32 else 1e-2), (dtype, group, config, err)
            print("mma max error", dtype, group, config, err)

    # every int8 value through ``_half`` (each byte of an int32 word to float16, the int8
    # tensor-core kernel's read): exact
    import triton
    import triton.language as tl
    from duplexserve.engine_bridge.moshi.live_attention import _half

    @triton.jit
    def halves(W, OUT, N: tl.constexpr):
        w = tl.load(W + tl.arange(0, N))
        for i in tl.static_range(4):
            tl.store(OUT + 4 * tl.arange(0, N) + i, _half(w, i))

    every = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)[torch.randperm(256)]
    out = torch.empty(256, dtype=torch.float16)
    halves[(1,)](every.view(torch.int32), out, N=64)
    assert torch.equal(out, every.to(torch.float16)), (out - every.to(torch.float16)).abs().max()
    print("every byte exact")

    # a 16-bit ring on the tensor cores (``read="mma"``), against float32 SDPA over its live prefix:
    # float16 here, since the interpreter's tl.dot of bf16 operands is wrong (numpy has no bf16:
    # 2e10 off on a 16 x 16 product); the kernel is the same for both, only the MMA's type differs
    for (b, h, c, d), group in [((5, 2, 300, 128), 2), ((5, 1, 300, 64), 1), ((5, 1, 300, 128), 3)]:
        ring = torch.randn(2, b, h, c, d).to(torch.float16)
        q = torch.randn(b, h * group, 1, d).to(torch.float16)
        lengths = torch.tensor([0, 1, 40, 65, c], dtype=torch.int32)
        ref = reference_attention(q.float(), ring[0].float(), ring[1].float(),
                                  prefix_mask(lengths.clamp(min=1), c))
        ref[lengths == 0] = 0.0
        for config in ("64/16/1/3/mma", "256/32/1/3/mma"):
            got = live_attention(q, ring[0], ring[1], lengths, None, KernelConfig.parse(config))
            assert got.dtype == torch.float16 and got[lengths == 0].eq(0).all()
            # the weights rounded to float16 for p . v (bf16: 3 bits fewer), the output too
            err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-2, (group, d, config, err)
            print("16-bit mma max error", group, d, config, err)
    """
)


def test_live_attention_on_the_tensor_cores_equals_the_reference():
    """``live_attention``'s tensor-core kernels (``read="mma"``): over an int8 ring, grouped KV
    heads or not, against SDPA over the dequantized ring; over a 16-bit ring, against float32 SDPA."""
    pytest.importorskip("triton")
    stdout = run_interpreted(LIVE_MMA_CHECK, timeout=300)
    assert stdout.count("mma max error") == 14 and stdout.count("16-bit mma max error") == 6, stdout
    assert "every byte exact" in stdout, stdout
