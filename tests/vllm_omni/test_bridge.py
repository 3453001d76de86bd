"""VllmOmniBridge against vLLM-Omni's real duplex engine (model stood in), in process.

Each test starts ``StandInDuplexOmniEngine``: vLLM-Omni's own engine, orchestrator
thread, janus queues, session manager and runners; only the model step is an echo.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from tests.vllm_omni.conftest import assert_text_follows_its_audio, require_vllm_omni

require_vllm_omni()

from duplexserve import errors  # noqa: E402
from duplexserve.engine_bridge.vllm_omni.bridge import VllmOmniBridge  # noqa: E402
from duplexserve.engine_bridge.vllm_omni.events import InputFramer  # noqa: E402
from duplexserve.engine_bridge.vllm_omni.setup import session_payload, standin_builder  # noqa: E402
from duplexserve.testing import STANDIN_MODEL  # noqa: E402

FRAME = 1920


def frames(n: int, seed: int) -> list[np.ndarray]:
    """Float32 frames on the 16-bit grid: vLLM-Omni's pcm16 output then returns them exactly."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(-16000, 16000, FRAME) / 32768).astype(np.float32) for _ in range(n)]


class Collector:
    """The orchestrator's side of ``on_outputs``: rows per slot, in arrival order."""

    def __init__(self) -> None:
        self.audio: dict[int, list[np.ndarray]] = {}
        self.text: dict[int, list[tuple[int, str]]] = {}
        self.issues: list[tuple[int, str, int | None]] = []
        self.calls = 0

    def __call__(self, records: list[Any]) -> None:
        self.calls += 1
        for rec in records:
            slots = rec.slots.tolist()
            if rec.error is not None:
                self.issues.extend((s, rec.error, rec.close_code) for s in slots)
                continue
            if rec.audio is None:  # text whose frame already went: it belongs to that frame
                for row, slot in enumerate(slots):
                    self.text.setdefault(slot, []).append((len(self.audio[slot]) - 1, rec.text[row]))
                continue
            for row, slot in enumerate(slots):
                got = self.audio.setdefault(slot, [])
                if rec.text.get(row):
                    self.text.setdefault(slot, []).append((len(got), rec.text[row]))
                got.append(rec.audio[row].copy())

    async def wait(self, predicate, timeout: float = 30.0) -> None:
        async def poll() -> None:
            while not predicate():
                await asyncio.sleep(0.01)

        await asyncio.wait_for(poll(), timeout)


@contextlib.asynccontextmanager
async def bridge(
    max_sessions: int = 8, input_rate: int = 24000
) -> AsyncIterator[tuple[VllmOmniBridge, Collector]]:
    out = Collector()
    b = VllmOmniBridge(
        standin_builder(max_sessions, text_every=5, step_ms=0.0),
        out,
        session_payload=session_payload(STANDIN_MODEL, input_rate, {}),
        model=STANDIN_MODEL,
        input_rate=input_rate,
    )
    await b.start()
    try:
        yield b, out
    finally:
        await b.stop()


def run(coro) -> Any:
    return asyncio.run(coro)


def runners(b: VllmOmniBridge) -> dict[str, Any]:
    return b.engine.orchestrator.session_manager.runners


def test_frames_come_back_in_order_with_text_and_no_thread_hop_per_frame():
    async def go():
        async with bridge() as (b, out):
            sent = {slot: frames(42, seed=slot) for slot in range(4)}
            for slot in sent:
                b.open(slot, 7, {})
            for i in range(42):  # interleaved, as the orchestrator hands them over
                for slot, fs in sent.items():
                    b.submit((slot, 7, fs[i]))
            await out.wait(lambda: all(len(out.audio.get(s, [])) == 42 for s in sent))
            for slot, fs in sent.items():
                assert all(np.array_equal(g, f) for g, f in zip(out.audio[slot], fs, strict=True)), slot
                assert_text_follows_its_audio(out.text[slot], 42)
            assert out.issues == []
            assert b.counts.fast_puts == 168 and b.counts.slow_puts == 0
            # start (1) + four opens: the control path's own hops, none per frame
            assert b.counts.executor_submissions == 5
            assert out.calls < 168  # one loop wake carries many frames
            for slot in sent:
                b.close(slot, 7)
            await out.wait(lambda: not runners(b), timeout=10)

    run(go())


def test_a_full_request_queue_takes_the_slow_path_once_and_keeps_order():
    async def go():
        async with bridge() as (b, out):
            b.open(0, 1, {})
            await out.wait(lambda: b.session_of(0) is not None)
            gate = threading.Event()
            b.engine.orchestrator_loop.call_soon_threadsafe(gate.wait)  # hold vLLM-Omni's orchestrator
            sent = frames(300, seed=9)
            for f in sent:
                b.submit((0, 1, f))
            assert b.counts.fast_puts == 256  # vLLM-Omni's request queue holds 256
            assert b.counts.slow_puts == 44
            assert b.counts.executor_submissions == 3  # start, open, one drain for the episode
            gate.set()
            await out.wait(lambda: len(out.audio.get(0, [])) == 300)
            assert all(np.array_equal(g, f) for g, f in zip(out.audio[0], sent, strict=True))
            assert b.counts.executor_submissions == 3

    run(go())


def test_the_orchestrators_frames_wait_on_the_loop_while_the_queue_is_full():
    async def go():
        async with bridge() as (b, out):
            b.open(0, 1, {})
            await out.wait(lambda: b.session_of(0) is not None)
            gate = threading.Event()
            b.engine.orchestrator_loop.call_soon_threadsafe(gate.wait)
            sent = frames(260, seed=8)
            taken = [b.try_submit((0, 1, f)) for f in sent]
            assert taken == [True] * 256 + [False] * 4  # refused, not queued: the caller keeps them
            assert b.counts.full_waits == 4 and b.counts.executor_submissions == 2  # start, open
            gate.set()
            await out.wait(lambda: len(out.audio.get(0, [])) == 256)
            assert all(b.try_submit((0, 1, f)) for f in sent[256:])  # room again, after results
            await out.wait(lambda: len(out.audio.get(0, [])) == 260)
            assert all(np.array_equal(g, f) for g, f in zip(out.audio[0], sent, strict=True))
            assert b.counts.executor_submissions == 2

    run(go())


def test_frames_sent_before_the_open_answers_wait_and_follow_it():
    async def go():
        async with bridge() as (b, out):
            sent = frames(5, seed=3)
            b.open(2, 4, {})
            assert b.session_of(2) is None  # the open RPC has not answered yet
            for f in sent:
                b.submit((2, 4, f))
            b.submit((2, 3, sent[0]))  # an older generation's frame is not this session's
            await out.wait(lambda: len(out.audio.get(2, [])) == 5)
            assert all(np.array_equal(g, f) for g, f in zip(out.audio[2], sent, strict=True))

    run(go())


def test_close_goes_through_vllm_omnis_control_path_and_late_output_is_dropped():
    async def go():
        async with bridge() as (b, out):
            b.open(0, 1, {})
            await out.wait(lambda: b.session_of(0) is not None)
            sid = b.session_of(0)[0]
            assert sid in runners(b)
            for f in frames(3, seed=1):
                b.submit((0, 1, f))
            b.close(0, 1)  # before the answers: they must not reach the next occupant
            b.open(0, 2, {})
            await out.wait(lambda: sid not in runners(b))
            await out.wait(lambda: b.session_of(0) is not None)
            assert b.session_of(0)[0] != sid
            nxt = frames(2, seed=2)
            for f in nxt:
                b.submit((0, 2, f))
            await out.wait(lambda: len(out.audio.get(0, [])) >= 2)
            await asyncio.sleep(0.2)
            assert len(out.audio[0]) == 2
            assert all(np.array_equal(g, f) for g, f in zip(out.audio[0], nxt, strict=True))

    run(go())


def test_detach_then_resume_keeps_the_vllm_omni_session():
    async def go():
        async with bridge() as (b, out):
            b.open(0, 1, {})
            await out.wait(lambda: b.session_of(0) is not None)
            sid, lease = b.session_of(0)
            b.detach(0, 1)  # vLLM-Omni keeps the session for its disconnect grace
            b.open(5, 2, {"vllm_omni_resume": {"session_id": sid, "lease_generation": lease}})
            await out.wait(lambda: b.session_of(5) is not None)
            new_sid, new_lease = b.session_of(5)
            assert new_sid == sid and new_lease > lease
            sent = frames(3, seed=4)
            for f in sent:
                b.submit((5, 2, f))
            await out.wait(lambda: len(out.audio.get(5, [])) == 3)
            assert all(np.array_equal(g, f) for g, f in zip(out.audio[5], sent, strict=True))
            assert out.issues == []

    run(go())


def test_vllm_omni_refusals_and_closes_become_session_errors():
    async def go():
        async with bridge(max_sessions=1) as (b, out):
            b.open(0, 1, {})
            await out.wait(lambda: b.session_of(0) is not None)
            b.open(1, 1, {})  # vLLM-Omni admits one: the second is refused, try again later
            await out.wait(lambda: out.issues)
            assert out.issues == [(1, "resource_exhausted", errors.TRY_AGAIN)]
            # vLLM-Omni closes a session on its own (here through its control path directly)
            await b.engine.close_session_async(b.session_of(0)[0], reason="shutdown")
            await out.wait(lambda: len(out.issues) == 2)
            assert out.issues[1] == (0, "server_shutdown", errors.GOING_AWAY)

    run(go())


def test_engine_error_events_are_reported_and_the_session_goes_on():
    async def go():
        # The stand-in model takes 24 kHz only; as for a 16 kHz model (Nemotron VoiceChat),
        # the bridge resamples and sends whole 1280-sample units, which PersonaPlex's input
        # buffer refuses with one error event each.
        sent = frames(6, seed=5)
        framer = InputFramer(16000)
        units = [u for f in sent for u in framer.push(f)]
        assert units and all(len(u) == 1280 for u in units)
        async with bridge(input_rate=16000) as (b, out):
            b.open(0, 1, {})
            await out.wait(lambda: b.session_of(0) is not None)
            for f in sent:
                assert b.try_submit((0, 1, f))
            await out.wait(lambda: len(out.issues) == len(units))
            await asyncio.sleep(0.2)
            assert len(out.issues) == len(units)
            assert {(slot, close_code) for slot, _, close_code in out.issues} == {(0, None)}
            assert b.session_of(0) is not None  # not fatal: the session is still open

    run(go())
