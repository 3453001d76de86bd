"""The sans-I/O session core, driven directly: no sockets, no threads."""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import pytest

from duplexserve.engine_bridge.batcher import FifoBatcher, SlotBatcher
from duplexserve.engine_bridge.engine import Tail
from duplexserve.engine_bridge.synthetic import SyntheticEngine
from duplexserve.errors import SessionError
from duplexserve.server.core.events import AudioOut, ClosedOut, TextOut
from duplexserve.server.core.session import Limits, Session, State

F = 1920
CLOCKED = functools.partial(SlotBatcher, frame_s=0.08)  # the step clock's batcher


def make(limits: Limits | None = None) -> Session:
    return Session("s", 0, 1, limits or Limits())


def drain(session: Session) -> list:
    out = []
    while (item := session.pop_outgoing()) is not None:
        out.append(item)
    return out


def test_whole_frames_are_views_of_the_received_buffer():
    s = make()
    buf = np.arange(3 * F, dtype=np.float32)
    assert s.receive_audio(buf) == 3
    frames = s.frames_ready()
    assert len(frames) == 3
    assert all(np.shares_memory(f, buf) for f in frames)
    assert s.state is State.STREAMING and s.frames_in == 3


def test_partial_frames_are_joined_across_messages():
    s = make()
    data = np.arange(2 * F, dtype=np.float32)
    assert s.receive_audio(data[: F // 2]) == 0
    assert s.receive_audio(data[F // 2 : F + 100]) == 1
    assert s.receive_audio(data[F + 100 :]) == 1
    frames = s.frames_ready()
    assert np.array_equal(np.concatenate(frames), data)


def test_window_limits_frames_in_flight_and_deliver_frees_room():
    s = make(Limits(inflight_frames=2, max_pending_frames=4))
    s.receive_audio(np.zeros(5 * F, np.float32))
    assert len(s.frames_ready()) == 2 and s.frames_ready() == []
    assert s.input_paused is False
    s.receive_audio(np.zeros(F, np.float32))
    assert s.input_paused  # 4 pending, the bound
    s.deliver(np.zeros(F, np.float32))
    assert len(s.frames_ready()) == 1 and not s.input_paused


def test_input_end_completes_after_the_last_answer():
    s = make()
    s.receive_audio(np.ones(F + 10, np.float32))
    s.end_input()
    assert s.state is State.ENDING and s.frames_in == 2
    frames = s.frames_ready()
    assert frames[1][:10].all() and not frames[1][10:].any()
    for f in frames:
        s.deliver(f, "hi" if f is frames[0] else None)
    items = drain(s)
    assert [type(i) for i in items] == [AudioOut, TextOut, AudioOut, ClosedOut]
    assert items[-1] == ClosedOut("completed", 1000, 2, 2, 0)
    assert s.closed


def test_text_after_its_frame_went_out_keeps_that_frames_index():
    s = make()
    s.receive_audio(np.ones(2 * F, np.float32))
    frames = s.frames_ready()
    s.deliver(frames[0])
    assert [type(i) for i in drain(s)] == [AudioOut]  # frame 0 is on its way
    s.deliver_text(" late")  # the engine's text for frame 0, after its audio
    s.deliver(frames[1], " on time")
    assert [(type(i), i.index) for i in drain(s)] == [(TextOut, 0), (AudioOut, 1), (TextOut, 1)]
    s.close("client_closed", 1000)
    s.deliver_text(" gone")
    assert [type(i) for i in drain(s)] == [ClosedOut]


def test_a_completion_grace_keeps_a_finished_session_open_for_its_last_text():
    s = make()
    s.completion_grace_s = 0.05
    s.receive_audio(np.ones(F, np.float32))
    s.end_input()
    s.deliver(s.frames_ready()[0])
    assert s.complete_due and not s.closed  # the orchestrator closes it after the grace
    s.deliver_text(" last")
    s.close("completed", 1000)
    items = drain(s)
    assert [type(i) for i in items] == [AudioOut, TextOut, ClosedOut] and items[1].index == 0
    assert items[-1] == ClosedOut("completed", 1000, 1, 1, 0)


def test_close_counts_unanswered_frames_as_dropped():
    s = make()
    s.receive_audio(np.ones(4 * F, np.float32))
    s.frames_ready()
    s.deliver(np.zeros(F, np.float32))
    s.close("client_closed", 1000)
    assert drain(s)[-1] == ClosedOut("client_closed", 1000, 4, 1, 3)
    s.deliver(np.zeros(F, np.float32))  # a late answer changes nothing
    assert s.frames_out == 1


def test_audio_after_input_end_is_refused_not_lost():
    s = make()
    s.receive_audio(np.ones(F, np.float32))
    s.end_input()
    with pytest.raises(SessionError) as err:
        s.receive_audio(np.ones(F, np.float32))
    assert err.value.code == "input_ended" and not err.value.fatal


def test_a_client_that_does_not_read_is_closed_when_its_queue_is_full():
    s = make(Limits(inflight_frames=8, max_output_frames=3))
    s.receive_audio(np.ones(5 * F, np.float32))
    for f in s.frames_ready():
        s.deliver(f)
    assert s.closed and s.closed_event.reason == "slow_consumer"


def test_fatal_error_closes_with_its_code():
    s = make()
    s.error(SessionError("invalid_audio", "odd", 1003))
    items = drain(s)
    assert items[0].code == "invalid_audio" and items[0].fatal
    assert items[-1].reason == "invalid_audio" and items[-1].close_code == 1003


@pytest.mark.parametrize("make_batcher", [CLOCKED, FifoBatcher])
def test_batcher_gathers_one_frame_per_slot_in_order(make_batcher):
    b = make_batcher(4, window=3)
    b.open(1, 10)
    b.open(3, 30)
    for k in range(3):
        assert b.push(1, 10, np.full(F, k, np.float32))
    assert not b.push(1, 10, np.zeros(F, np.float32))  # window full
    assert b.push(3, 30, np.full(F, 9, np.float32))
    assert b.push(2, 99, np.zeros(F, np.float32))  # closed slot: ignored, not queued
    slots, gens, batch = b.gather()
    assert slots.tolist() == [1, 3] and gens.tolist() == [10, 30]
    assert batch[:, 0].tolist() == [0, 9]
    slots, _, batch = b.gather()
    assert slots.tolist() == [1] and batch[0, 0] == 1
    assert b.push(3, 30, np.full(F, 8, np.float32)) and b.pending == 2
    b.close(1)
    assert b.pending == 1
    b.open(1, 11)  # a new session in the slot: nothing of the old one is left
    assert b.push(1, 11, np.full(F, 5, np.float32))
    slots, gens, batch = b.gather()
    assert slots.tolist() == [1, 3] and gens.tolist() == [11, 30] and batch[:, 0].tolist() == [5, 8]
    assert b.pending == 0


@pytest.mark.parametrize("make_batcher", [CLOCKED, FifoBatcher])
def test_batcher_gathers_into_the_engines_buffer(make_batcher):
    b = make_batcher(4, window=2)
    for slot in (0, 2, 3):
        b.open(slot, 1)
        b.push(slot, 1, np.full(F, slot, np.float32))
    buffer = np.full((4, F), -1.0, np.float32)
    slots, _, batch = b.gather(out=buffer)
    assert slots.tolist() == [0, 2, 3] and batch.base is buffer
    assert buffer[:, 0].tolist() == [0, 2, 3, -1]  # the first rows, in slot order
    np.testing.assert_array_equal(batch, np.stack([np.full(F, s, np.float32) for s in (0, 2, 3)]))
    b.push(0, 1, np.full(F, 1, np.int32))  # the same bytes a frame, another format: refused
    with pytest.raises(TypeError, match="int32"):
        b.gather(out=buffer)
    later = make_batcher(4, window=2)  # the same behind a first frame of the right format
    for slot, dtype in ((0, np.float32), (2, np.int32)):
        later.open(slot, 1)
        later.push(slot, 1, np.zeros(F, dtype))
    with pytest.raises(TypeError, match="int32"):
        later.gather(out=buffer)
    # float32 however a buffer spells its format (a ctypes-backed one reads '<f', the frames
    # 'f'; 316aee8 compared the spellings and refused the server's own frames), while a
    # big-endian frame is refused.
    spelled = np.ctypeslib.as_array((ctypes.c_float * (4 * F))()).reshape(4, F)
    assert memoryview(spelled).format != memoryview(np.zeros(F, np.float32)).format

    def holding(slot: int, frame: np.ndarray) -> SlotBatcher | FifoBatcher:
        batcher = make_batcher(4, window=2)
        batcher.open(slot, 1)
        batcher.push(slot, 1, frame)
        return batcher

    assert holding(1, np.full(F, 1, np.float32)).gather(out=spelled)[2].tolist() == [[1.0] * F]
    with pytest.raises(TypeError, match=">f4"):
        holding(3, np.full(F, 3, ">f4")).gather(out=spelled)


def test_process_engine_answers_from_its_shared_buffer_and_from_any_array():
    from duplexserve.config import ServerConfig
    from duplexserve.engine_bridge.process_engine import ProcessEngine

    proxy = ProcessEngine(ServerConfig(engine="synthetic", engine_process=True, max_sessions=4, text_every=0))
    proxy.start()
    try:
        b = FifoBatcher(4, window=2)
        for slot in range(4):
            b.open(slot, 1)
            proxy.open(slot, {})
        frames = [np.random.default_rng(slot).standard_normal(F).astype(np.float32) for slot in range(4)]
        for slot in (1, 3):
            b.push(slot, 1, frames[slot])
        slots, _, batch = b.gather(out=proxy.input_buffer)
        assert batch.base is proxy.input_buffer
        np.testing.assert_array_equal(proxy.step(slots, batch).audio, np.stack([frames[1], frames[3]]))
        other = np.stack([frames[0], frames[2]])  # a batch gathered elsewhere is copied in
        np.testing.assert_array_equal(proxy.step(np.array([0, 2]), other).audio, other)
    finally:
        proxy.stop()


def test_process_engine_sends_opens_and_closes_with_the_next_step():
    """A step is one round trip to the child however many sessions opened or closed before
    it; a posted command that fails fails that step and leaves the engine lost."""
    from duplexserve.config import ServerConfig
    from duplexserve.engine_bridge.process_engine import EngineProcessError, ProcessEngine

    proxy = ProcessEngine(ServerConfig(engine="synthetic", engine_process=True, max_sessions=4, text_every=0))
    proxy.start()
    try:
        conn = proxy._conn
        sent = []

        class Counting:
            def send(self, message):
                sent.append(message)
                conn.send(message)

            def fileno(self):
                return conn.fileno()  # the reply is read from the descriptor

        proxy._conn = Counting()
        for slot in range(4):
            proxy.open(slot, {})
        proxy.close(2)
        proxy.end_input(3, 7)
        frames = np.arange(2 * F, dtype=np.float32).reshape(2, F)
        np.testing.assert_array_equal(proxy.step(np.array([0, 1]), frames).audio, frames)
        assert len(sent) == 1
        posted, message = sent[0]
        assert [c[0] for c in posted] == ["open"] * 4 + ["close", "end_input"] and message[0] == "step"
        proxy.step(np.array([0]), frames[:1])
        assert sent[1][0] == []  # sent once

        proxy.open(9, {})  # no such slot: the child's books fail
        with pytest.raises(EngineProcessError, match="IndexError"):
            proxy.step(np.array([0]), frames[:1])
        assert not proxy.alive()
        proxy._conn = conn
        proxy.stop()

        proxy.start()  # a child killed with commands still waiting: its successor never gets them
        proxy.open(1, {})
        proxy._proc.kill()
        proxy._proc.join()
        proxy.stop()
        proxy.start()
        proxy.open(0, {})
        np.testing.assert_array_equal(proxy.step(np.array([0]), frames[:1]).audio, frames[:1])
    finally:
        proxy.stop()


def test_synthetic_echo_with_delay_keeps_slots_apart():
    e = SyntheticEngine(3, delay_frames=1, text_every=2)
    e.open(0, {})
    e.open(2, {})
    slots = np.array([0, 2])
    a = e.step(slots, np.stack([np.full(F, 1, np.float32), np.full(F, 2, np.float32)]))
    b = e.step(slots, np.stack([np.full(F, 3, np.float32), np.full(F, 4, np.float32)]))
    assert not a.audio.any() and a.text == {0: " hello", 1: " hello"}
    assert b.audio[:, 0].tolist() == [1, 2] and b.text == {}
    e.open(2, {})  # a new occupant starts fresh
    c = e.step(np.array([2]), np.full((1, F), 5, np.float32))
    assert not c.audio.any()


# --------------------------------------------------------------------- input.end's tail
def answer_all(s: Session, finished_at: int | None = None) -> int:
    """Act as the engine until nothing is in flight: answer every frame handed over;
    the answer with index ``finished_at`` says the model ended. Returns frames stepped."""
    stepped = 0
    while frames := s.frames_ready():
        for _ in frames:
            s.deliver(np.zeros(F, np.float32), finished=s.frames_out == finished_at)
            stepped += 1
    return stepped


def test_a_fixed_tail_steps_silence_after_the_last_input_frame():
    s = make()
    s.tail = Tail(frames=2)
    s.receive_audio(np.ones(3 * F + 10, np.float32))  # 3 whole frames and a partial
    s.end_input()
    assert not s.end_due  # the engine needs no signal: the tail is plain silence
    assert answer_all(s) == 6  # 4 input frames (the partial padded), then 2 of silence
    closed = drain(s)[-1]
    assert isinstance(closed, ClosedOut) and closed.reason == "completed"
    assert (closed.frames_in, closed.frames_out, closed.frames_tail, closed.frames_dropped) == (4, 6, 2, 0)


def test_a_tail_until_done_goes_one_frame_at_a_time_until_the_model_ends():
    s = make(Limits(max_tail_frames=50))
    s.tail = Tail(until_done=True)
    s.receive_audio(np.ones(2 * F, np.float32))
    s.end_input()
    assert s.end_due  # the engine is told first, so it marks frame 2 as the end of input
    assert len(s.frames_ready()) == 2
    s.deliver(np.zeros(F, np.float32))
    s.deliver(np.zeros(F, np.float32))
    for index in range(2, 6):
        (frame,) = s.frames_ready()
        assert not frame.any() and s.frames_ready() == []  # one in flight: the next waits
        s.deliver(np.zeros(F, np.float32), finished=index == 5)
    assert s.frames_ready() == []
    closed = drain(s)[-1]
    assert (closed.reason, closed.frames_out, closed.frames_tail) == ("completed", 6, 4)


def test_a_tail_until_done_stops_at_its_limit_and_a_close_counts_input_frames_only():
    s = make(Limits(max_tail_frames=3))
    s.tail = Tail(until_done=True)
    s.receive_audio(np.ones(2 * F, np.float32))
    s.end_input()
    assert answer_all(s) == 5  # the model never ends: 3 tail frames at most
    assert drain(s)[-1].frames_tail == 3
    t = make()
    t.tail = Tail(frames=4)
    t.receive_audio(np.ones(3 * F, np.float32))
    t.end_input()
    ready = t.frames_ready() + t.frames_ready()  # the input frames, then the tail's
    assert len(ready) == 7
    for _ in ready[:4]:  # 3 input frames and 1 of the tail answered
        t.deliver(np.zeros(F, np.float32))
    t.close("client_closed", 1000)
    closed = drain(t)[-1]
    assert (closed.frames_in, closed.frames_out, closed.frames_tail, closed.frames_dropped) == (3, 4, 1, 0)
