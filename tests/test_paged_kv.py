"""Paged KV (paged_kv.py): a call's keys and values in pages taken as it ages.

While a call fits, the paged engine answers as the ring's, bit for bit (float64, greedy):
calls of different ages, a slot taken again by the next call, rows moved between buckets,
calls past the context that wrap. When the pool runs short, a call stops growing at what it
holds (at least the floor) and goes on: no call ends, the stop is counted and logged. The
kernel's paged read (under Triton's interpreter) equals its ring read, and the memory plan
sizes the slots by their floors and the pool by what is left.
"""

from __future__ import annotations

import logging
import textwrap

import numpy as np
import pytest
import torch

from duplexserve.engine_bridge.moshi.engine import MoshiEngine, Sampling
from duplexserve.engine_bridge.moshi.memory import GIB, KV_PAGE, MemoryPlan, Paging, kv_bytes_per_slot
from duplexserve.engine_bridge.moshi.paged_kv import PagedKV, read_row, write_row
from tests.test_moshi_equivalence import CONTEXT, run_sessions
from tests.test_moshi_row_buckets import SESSIONS, same_answers
from tests.triton_interpreter import run_interpreted

PAGE = 4  # frames a page here: the 16-frame context is 4 pages


def make_engine(layout: str, **kwargs) -> MoshiEngine:
    engine = MoshiEngine(
        6, "tiny", context=CONTEXT, sampling=Sampling(greedy=True), threads=1, dtype="float64",
        kv_layout=layout, kv_page=PAGE, **kwargs,
    )  # fmt: skip
    engine.start()
    return engine


def rings(engine: MoshiEngine) -> list:
    return [layer.self_attn._streaming_state.kv_cache for layer in engine.lm_gen.lm_model.transformer.layers]


class Watched:
    """Each step of ``engine`` checked: every live row holds the pages of the positions it wrote."""

    def __init__(self, engine: MoshiEngine) -> None:
        self.engine, self.step, self.held = engine, engine.step, []
        engine.step = self

    def __call__(self, slots, frames):
        result = self.step(slots, frames)
        pages = self.engine.pages
        rows = self.engine.rows_of(slots)
        offsets = self.engine.lm_gen.lm_model.transformer._streaming_state.offsets[rows].numpy()
        assert (pages.held[rows] * PAGE >= np.minimum(offsets, CONTEXT)).all()
        self.held.append(int(pages.held.sum()))
        return result


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_paged_kv_answers_as_the_ring_bit_for_bit(kv_dtype):
    """Seven calls in six slots, ended and started so that rows move down mid-call and a slot
    is taken again; calls of 26-30 frames wrap the 16-frame context. The 8-bit pool too."""
    answers = []
    for layout in ("ring", "paged"):
        engine = make_engine(layout, kv_dtype=kv_dtype)
        try:
            assert engine.paged == (layout == "paged")
            if engine.paged:
                assert all(isinstance(ring, PagedKV) for ring in rings(engine))
                watched = Watched(engine)
            answers.append(run_sessions(engine, SESSIONS)[:2])
            assert engine._rows.moves >= 3
        finally:
            engine.stop()
    same_answers(*answers)
    pages = engine.pages
    assert max(watched.held) > 0 and pages.held.sum() == 0  # every page given back at the calls' ends
    assert len(pages.free) == pages.pages - 1 and pages.stops == 0


def test_a_call_keeps_its_pages_across_moves_and_reads_back_as_the_ring_row():
    """``read_row`` (what a migration exports) gives a paged row's slots as the ring's row holds
    them, after rows moved; ``write_row`` puts them into another row's pages."""
    sessions = [(0, 0, 9, ()), (1, 0, 4, ()), (2, 0, 4, ()), (3, 0, 14, ())]  # slot 3 moves down
    held = []
    for layout in ("ring", "paged"):
        engine = make_engine(layout)
        try:
            closed = engine.close
            engine.close = lambda slot, engine=engine, closed=closed: slot == 3 or closed(slot)  # keep 3 open
            run_sessions(engine, sessions)
            row = int(engine.rows_of(np.array([3]))[0])
            assert row != 3 and engine._rows.moves >= 2
            if layout == "ring":
                held = [ring.cache[:, row, :, :14].clone() for ring in rings(engine)]
                continue
            got = [read_row(pool, engine.pages, row, 14) for pool in rings(engine)]
            for (kv,), want in zip(got, held, strict=True):
                assert torch.equal(kv, want)
            engine.pages.open(4)
            assert engine.pages.hold(4, 14) == 14 and engine.pages.held[4] == 4
            for pool, (kv,) in zip(rings(engine), got, strict=True):
                write_row(pool, engine.pages, 4, [kv])
                assert torch.equal(read_row(pool, engine.pages, 4, 14)[0], kv)
        finally:
            engine.stop()


def test_a_pool_too_small_stops_a_call_growing_and_ends_none(caplog):
    """Six slots with a floor of one page and three pages to spare: calls past their floor
    share the spare pages, the rest stop growing at their floor, wrap inside it and go on to
    their last frame; each stop is counted and logged once."""
    engine = make_engine("paged", kv_floor_s=PAGE / 12.5, kv_pages=1 + 6 + 3)
    try:
        assert engine.pages.floor == 1
        with caplog.at_level(logging.WARNING):
            outputs = run_sessions(engine, SESSIONS)[0]
        assert [len(o) for o in outputs] == [n for _, _, n, _ in SESSIONS]  # every frame answered
        assert all(np.isfinite(o).all() for o in outputs)
        stops = engine.pages.stops
        assert stops >= 2 and caplog.text.count("KV pages ran out") == stops
        assert f"{stops} calls stopped growing so far" in caplog.text
        assert engine.pages.held.sum() == 0 and len(engine.pages.free) == 9
    finally:
        engine.stop()


def test_the_plan_sizes_slots_by_their_floor_and_the_pool_by_the_rest():
    """Hibiki-Zero 3B's shape in int8 on an H200's free memory: a 60 s floor (two pages) fits
    well over twice the slots of a full four-minute ring; a count past the floors is refused
    with the numbers, and the pool never holds more than every slot's full context."""
    full = kv_bytes_per_slot(28, 2048, 16, 3000, "int8", 2, kv_repeat=2)
    free = 130 * GIB
    ring = MemoryPlan(1, "int8", full, free).max_slots
    paging = Paging.of(full, 3000, 60.0)
    assert (paging.floor_pages, paging.context_pages, paging.page) == (2, 6, KV_PAGE)
    floor = paging.floor_pages * paging.page_bytes
    paged = MemoryPlan(1, "int8", floor, free, paging=paging)
    assert paged.max_slots > 2 * ring
    plan = MemoryPlan(paged.max_slots, "int8", floor, free, paging=paging)
    plan.check()
    assert plan.pool_pages >= 1 + plan.slots * paging.floor_pages
    assert plan.pool_pages * paging.page_bytes + plan.slots * (32 * 2**20) <= free - 2 * GIB
    assert "KV pool" in plan.describe() and "floor 2 x 512 frames" in plan.describe()
    with pytest.raises(MemoryError, match=r"does not fit: .*lower --moshi-kv-floor-s"):
        MemoryPlan(paged.max_slots + 1, "int8", floor, free, paging=paging).check()
    few = MemoryPlan(8, "int8", floor, free, paging=paging)
    assert few.pool_pages == 1 + 8 * 6 and few.full_contexts == 8


def test_a_prompted_model_keeps_the_ring(caplog):
    with caplog.at_level(logging.INFO):
        engine = MoshiEngine(
            2, "tiny-personaplex", context=CONTEXT, threads=1, kv_layout="paged", kv_page=PAGE
        )
        engine.start()
    try:
        assert not engine.paged and engine.pages is None
        assert "prompted models prefill a ring" in caplog.text
    finally:
        engine.stop()


KERNEL_CHECK = textwrap.dedent(
    """
    import torch
    from duplexserve.engine_bridge.moshi.live_attention import (
        KernelConfig, live_attention, quantize, write_quantized)
    torch.manual_seed(0)
    page, capacity, d = 16, 50, 32  # 4 pages a row, the last one part used
    b, kv, group = 4, 2, 2
    ring = torch.randn(2, b, kv, capacity, d)
    q = torch.randn(b, kv * group, 1, d)
    lengths = torch.tensor([0, 1, 37, capacity], dtype=torch.int32)
    # the rows' pages, scattered over a pool of 20 (page 0 the sink)
    table = (torch.randperm(19)[: b * 4] + 1).view(b, 4).to(torch.int32)
    pool = torch.zeros(2, 20, kv, page, d)
    padded = torch.nn.functional.pad(ring, (0, 0, 0, 4 * page - capacity))
    for row in range(b):
        for i in range(4):
            pool[:, table[row, i]] = padded[:, row, :, i * page : (i + 1) * page]
    ring8, scale = quantize(ring)
    pool8, pool_scale = quantize(pool)
    for mode in ("cast", "bits"):
        config = KernelConfig(chunk=page, block_n=8, read=mode)
        cases = [(ring, pool, None, None)] if mode == "cast" else []
        cases.append((ring8, pool8, (scale[0], scale[1]), (pool_scale[0], pool_scale[1])))
        for r, p, rs, ps in cases:
            want = live_attention(q, r[0], r[1], lengths, rs, config)
            got = live_attention(q, p[0], p[1], lengths, ps, config, table=table, capacity=capacity)
            assert torch.equal(got, want), (mode, (got - want).abs().max())
            print(mode, "paged equals ring", r.dtype)
    # the fused int8 write into pages: the same bytes as into the ring's rows
    _, k, v = torch.randn(b, 1, 3, kv, d).permute(2, 0, 3, 1, 4)
    slot = torch.tensor([0, 5, 15, 9])
    at = torch.tensor([3, 7, 1, 12])
    pooled = torch.zeros(2, 20, kv, page, d, dtype=torch.int8), torch.zeros(2, 20, kv, page)
    write_quantized(k, v, *pooled, slot, page=at)
    rowed = torch.zeros(2, b, kv, page, d, dtype=torch.int8), torch.zeros(2, b, kv, page)
    write_quantized(k, v, *rowed, slot)
    assert torch.equal(pooled[0][:, at], rowed[0]) and torch.equal(pooled[1][:, at], rowed[1])
    print("paged write equals ring")
    """
)


@pytest.mark.timeout(300)
def test_the_paged_kernel_reads_as_the_ring_kernel():
    """The CUDA path's kernels under Triton's interpreter: a row's chunks read from its pages
    give the partials of the same chunks read from its ring row, bit for bit (float32 and int8,
    a row idle, one slot, part of a page, the whole context); the int8 write lands alike."""
    pytest.importorskip("triton")
    stdout = run_interpreted(KERNEL_CHECK, timeout=280)
    assert stdout.count("paged equals ring") == 3 and "paged write equals ring" in stdout, stdout


@pytest.mark.parametrize("mode", [(), ("--engine-process",)], ids=["engine-thread", "engine-process"])
def test_the_server_keeps_calls_going_when_the_pool_runs_short(server_factory, mode):
    """The real server, two calls and a pool of their two floors (one 512-frame page each, the
    1024-frame context being two): a third call is refused as full (the slots are what the floors
    fit); past 512 frames neither call can grow, both go on to their last frame and complete; the
    stops show in /metrics and the log, once a call."""
    import asyncio
    import contextlib
    import json

    import websockets.asyncio.client
    import websockets.exceptions

    from tests.test_moshi_server import FLAGS, audio, session

    server = server_factory(
        *FLAGS, *mode, "--max-sessions", "2", "--moshi-context", "1024", "--moshi-kv-layout", "paged",
        "--moshi-kv-floor-s", "40", "--moshi-kv-pages", "3",
    )  # fmt: skip

    async def third() -> tuple[dict, int | None]:
        """A call while both slots' floors are taken: the server's usual full answer."""
        await asyncio.sleep(1.0)
        async with websockets.asyncio.client.connect(server.ws()) as ws:
            event = json.loads(await ws.recv())
            with contextlib.suppress(websockets.exceptions.ConnectionClosed):
                await ws.recv()
            return event, ws.close_code

    async def calls() -> list:
        return await asyncio.gather(
            session(server.ws(), audio(1, 560)), session(server.ws(), audio(2, 540)), third()
        )  # fmt: skip

    *outputs, (refusal, code) = asyncio.run(calls())  # ``session`` checks each call completed
    assert refusal["type"] == "error" and refusal["code"] == "server_unavailable" and code == 1013
    assert [len(o) for o in outputs] == [561, 541]
    assert server.metrics()["duplexserve_engine_kv_context_stops_total"] == 2
    assert server.log().count("KV pages ran out") == 2


def test_a_pool_that_cannot_hold_every_floor_is_refused_at_start():
    """Admission never outruns the floors: a pool short of one floor a slot (and the sink) stops
    the start, with the numbers, as the memory plan refuses a slot count the GPU cannot hold."""
    engine = MoshiEngine(
        6, "tiny", context=CONTEXT, threads=1, kv_layout="paged", kv_page=PAGE, kv_floor_s=0.64, kv_pages=12
    )
    with pytest.raises(ValueError, match="12 KV pages cannot hold the sink and 6 floors of 2 pages"):
        engine.start()


def test_a_call_that_stopped_growing_is_not_moved_now():
    """Slot moves (slot_export.py) read a row's pages up to its length; a call that stopped
    growing wraps inside fewer pages than its age, so its export is refused for now."""
    from duplexserve.engine_bridge.engine import MoveRefused
    from tests.test_moshi_equivalence import signal

    engine = make_engine("paged", kv_floor_s=PAGE / 12.5, kv_pages=1 + 6)  # every page a floor
    try:
        for slot in range(6):
            engine.open(slot, {})
        for frame in signal(3, PAGE + 2):
            engine.step(np.array([0]), frame[None])
        assert engine.pages.stops == 1
        with pytest.raises(MoveRefused, match="stopped growing") as refused:
            engine.export_slot(0)
        assert refused.value.code == "move_not_now"
        assert len(engine.export_slot(1)) > 0  # a call that fits moves
    finally:
        engine.stop()
