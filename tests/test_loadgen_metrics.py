"""The load generator's arithmetic on constructed timelines: metrics, guards, expected audio."""

from __future__ import annotations

import math

import numpy as np
import pytest

from duplexserve.codecs import FRAME_SAMPLES, AudioFormat
from duplexserve.loadgen import metrics
from duplexserve.loadgen.audio import BaseSignal, SessionAudio, StreamSpec
from duplexserve.loadgen.guards import FrameChecker
from duplexserve.loadgen.recorder import SessionRecorder
from duplexserve.loadgen.results import ClientStats, RunResult
from duplexserve.loadgen.scrape import cost, metrics_url, parse


# ------------------------------------------------------------------ percentiles
def test_percentile_is_nearest_rank():
    values = list(range(1, 101))  # 1..100
    assert metrics.percentile(values, 50) == 50
    assert metrics.percentile(values, 99) == 99
    assert metrics.percentile(values, 100) == 100
    assert metrics.percentile(values, 0) == 1
    assert metrics.percentile([7.0, 1.0, 3.0], 50) == 3.0  # unsorted input
    assert metrics.percentile([5.0], 99) == 5.0
    assert math.isnan(metrics.percentile([], 50))
    # 10 values: p99 needs rank ceil(9.9) = 10, the maximum, not an interpolation.
    assert metrics.percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 1000], 99) == 1000
    with pytest.raises(ValueError):
        metrics.percentile([1.0], 101)


# ------------------------------------------------------------------------ RTF
def test_rtf_real_time_session():
    # 762 output frames (60.96 s); the last arrives 60.96 s after the first input left.
    assert metrics.rtf(100.0, 160.96, 762) == pytest.approx(1.0)


def test_rtf_behind_real_time():
    # vLLM-Omni at 96 sessions: 92.3 s of wall time for 60.96 s of audio.
    assert metrics.rtf(0.0, 92.3, 762) == pytest.approx(92.3 / 60.96)
    assert math.isnan(metrics.rtf(0.0, 1.0, 0))


# ----------------------------------------------------------------- round trip
def test_round_trips_pair_frames_by_index():
    sent = [0.0, 0.08, 0.16, 0.24]
    received = [0.010, 0.095, 0.200]  # the fourth never came: not a latency
    rt = metrics.round_trips(sent, received)
    assert rt == pytest.approx([0.010, 0.015, 0.040])


# ------------------------------------------------------------------- lateness
def test_lateness_against_first_output_plus_i_frames():
    t0 = 5.0
    arrived = [t0, t0 + 0.08, t0 + 0.16 + 0.030, t0 + 0.24 - 0.010, t0 + 0.32 + 0.100]
    late = metrics.lateness(arrived)
    assert late == pytest.approx([0.0, 0.0, 0.030, -0.010, 0.100])


def test_underruns_by_playback_buffer():
    late = [0.0, 0.030, -0.010, 0.100, 0.081, 0.200]
    # No buffer at all: every positive lateness is heard.
    assert metrics.underruns(late, buffer_frames=0) == 4
    # One frame (80 ms) of buffer: only what is later than that.
    assert metrics.underruns(late, buffer_frames=1) == 3
    assert metrics.underruns(late, buffer_frames=2) == 1
    assert metrics.underruns([], buffer_frames=1) == 0
    with pytest.raises(ValueError):
        metrics.underruns(late, buffer_frames=-1)


def test_paced_timeline_on_time_has_no_underruns():
    # 160 ms messages, two frames each, constant 12 ms round trip: lateness of frame 2k+1 is -80 ms.
    sent = np.repeat(np.arange(50) * 0.16, 2)
    received = sent + 0.012
    late = metrics.lateness(received)
    assert late.max() == pytest.approx(0.0)
    assert metrics.underruns(late) == 0


def test_per_frame():
    assert metrics.per_frame(0.5, 10000) == pytest.approx(50e-6)
    assert math.isnan(metrics.per_frame(1.0, 0))


# ---------------------------------------------------------------------- guards
def _frames(n: int) -> list[bytes]:
    return [bytes([i]) * 8 for i in range(n)]


def _check(received: list[bytes], expected: list[bytes]) -> FrameChecker:
    checker = FrameChecker()
    for frame in expected:
        checker.expect(frame)
    for frame in received:
        checker.receive(frame)
    checker.finish()
    return checker


def test_guard_passes_every_frame_in_order():
    frames = _frames(10)
    report = _check(frames, frames).report
    assert report.ok and report.describe() == []


def test_guard_names_a_dropped_frame():
    frames = _frames(10)
    report = _check(frames[:3] + frames[4:], frames).report
    assert not report.ok
    assert report.dropped == [3] and not report.reordered and not report.altered
    assert report.describe() == ["frame 3 dropped"]


def test_guard_names_a_reordered_frame():
    frames = _frames(10)
    report = _check([*frames[:3], frames[4], frames[3], *frames[5:]], frames).report
    assert report.reordered == [3] and not report.dropped and not report.altered
    assert "frame 3 reordered" in report.describe()


def test_guard_names_an_altered_frame():
    frames = _frames(10)
    bad = list(frames)
    bad[6] = b"\xff" * 8
    report = _check(bad, frames).report
    assert report.altered == [6] and not report.dropped and not report.reordered


def test_guard_counts_missing_and_extra_frames():
    frames = _frames(6)
    assert _check(frames[:4], frames).report.missing == 2
    assert _check([*frames, b"zz"], frames).report.extra == 1


def test_guard_without_content_still_counts():
    checker = FrameChecker(check_content=False)
    for _ in range(5):
        checker.expect(b"")
    for frame in _frames(4):
        checker.receive(frame)
    assert checker.finish().missing == 1


# ------------------------------------------------------------ session recorder
def test_recorder_turns_a_timeline_into_a_result():
    rec = SessionRecorder(0, AudioFormat(), check_content=True, recent=[])
    rec.on_ready({"session_id": "s1", "output": {"format": "pcm_f32le", "sample_rate": 24000}})
    frame = bytes(4 * FRAME_SAMPLES)
    for k in range(5):  # five 160 ms messages
        rec.sent_frames([frame, frame], 2, 10.0 + 0.16 * k)
    for i in range(10):
        rec.on_audio(frame, 10.0 + 0.16 * (i // 2) + 0.010 + (0.2 if i == 7 else 0.0))
    rec.on_closed("completed", {"frames_dropped": 0})
    rec.on_disconnect(1000, "")
    r = rec.result()
    assert r.guards.ok, r.guards.describe()
    assert r.frames_sent == r.frames_received == 10
    assert r.rtf == pytest.approx((0.64 + 0.010) / 0.80)
    assert r.rt[0] == pytest.approx(0.010) and r.rt[7] == pytest.approx(0.210)
    assert r.underruns == 1  # frame 7 is 120 ms behind its deadline: past the one-frame buffer
    assert r.lateness_max == pytest.approx(0.16 * 3 + 0.2 - 7 * 0.08, abs=1e-6)


def test_recorder_flags_wrong_format_and_errors():
    rec = SessionRecorder(0, AudioFormat(), check_content=False, recent=[])
    rec.on_ready({"session_id": "s", "output": {"format": "pcm_s16le", "sample_rate": 24000}})
    rec.sent_frames([], 1, 0.0)
    rec.on_audio(b"\x00" * 100, 0.01)
    rec.on_error("engine_error", "boom", True)
    rec.on_disconnect(1011, "")
    describe = " ".join(rec.result().guards.describe())
    assert "server announced output" in describe and "100 bytes" in describe
    assert "engine_error" in describe and "1011" in describe


# ---------------------------------------------------------------------- audio
def test_native_messages_are_views_and_echo_expects_the_same_bytes():
    base = BaseSignal(7, seed=1)
    spec = StreamSpec(frames=7, message_ms=160)
    audio = SessionAudio(base, spec, session_index=3)
    chunks, expected = [], []
    for chunk, samples in audio.messages():
        assert isinstance(chunk, memoryview)
        chunks.append(bytes(chunk))
        expected += audio.expected_after(chunk)
        assert samples in (2 * FRAME_SAMPLES, FRAME_SAMPLES)
    expected += audio.expected_at_end()
    assert spec.messages == len(chunks) == 4  # 3 x 160 ms + one 80 ms
    assert b"".join(chunks) == b"".join(expected)
    assert len(expected) == 7 and len(set(expected)) == 7  # every frame differs


def test_sessions_send_different_audio():
    base = BaseSignal(20, seed=0)
    spec = StreamSpec(frames=20)
    first = [bytes(c) for c, _ in SessionAudio(base, spec, 0).messages()]
    second = [bytes(c) for c, _ in SessionAudio(base, spec, 1).messages()]
    assert all(a != b for a, b in zip(first, second, strict=True))


def test_expected_answer_with_delay_and_silence():
    base = BaseSignal(5, seed=2)
    spec = StreamSpec(frames=5)
    sent = [bytes(c) for c, _ in SessionAudio(base, spec, 0).messages()]
    delayed = SessionAudio(base, spec, 0, delay_frames=2)
    answers = [a for c, _ in delayed.messages() for a in delayed.expected_after(c)]
    silence = bytes(4 * FRAME_SAMPLES)
    assert answers == [silence, silence, sent[0], sent[1], sent[2]]
    quiet = SessionAudio(base, spec, 0, expect="silence")
    assert all(a == silence for c, _ in quiet.messages() for a in quiet.expected_after(c))


def test_s16_input_is_encoded_and_its_echo_predicted():
    fmt = AudioFormat("pcm_s16le", 24000)
    audio = SessionAudio(BaseSignal(3, seed=0), StreamSpec(fmt, fmt, frames=3), 0)
    for chunk, _ in audio.messages():
        assert len(chunk) == 2 * FRAME_SAMPLES
        (answer,) = audio.expected_after(chunk)
        assert answer == chunk  # s16 -> f32 -> s16 is exact


# --------------------------------------------------------------------- scrape
def test_scrape_parsing_and_cost_per_frame():
    before = parse("# HELP x\nduplexserve_cpu_seconds_total 1.5\nduplexserve_frames_out_total 1000\n"
                   "duplexserve_voluntary_context_switches_total 10\n"
                   "duplexserve_executor_submissions_total 0\n"
                   'h_bucket{le="1"} 2\nh_bucket{le="2"} 3\n')
    after = {**before, "duplexserve_cpu_seconds_total": 2.0, "duplexserve_frames_out_total": 11000,
             "duplexserve_voluntary_context_switches_total": 60}
    assert before["h_bucket"] == 5
    c = cost(before, after)
    assert c is not None
    assert c.cpu_us_per_frame == pytest.approx(50.0)
    assert c.switches_per_frame == pytest.approx(0.005)
    assert c.executor_per_frame == 0
    assert metrics_url("ws://127.0.0.1:9/v1/duplex?x=1") == "http://127.0.0.1:9/metrics"


def test_client_ceiling_from_its_cpu():
    stats = ClientStats(processes=2, cpu_s=1.0, wall_s=4.0, frames=40000)
    assert stats.cpu_us_per_frame == pytest.approx(25.0)
    assert stats.ceiling_frames_per_s == pytest.approx(40000)
    assert stats.ceiling_paced_sessions == pytest.approx(2 * 40000 / 12.5)
    assert stats.busy == pytest.approx(0.125)
    run = RunResult("x", {}, [], stats)
    assert not run.guards_ok  # no sessions: nothing was shown to work


def _recorded(index: int, start: float, rt: list[float]) -> SessionRecorder:
    """A session that sent a frame every 80 ms from ``start``, frame i answered ``rt[i]`` later."""
    rec = SessionRecorder(index, AudioFormat(), check_content=False, recent=[])
    rec.on_ready({"session_id": str(index)})
    for i, delay in enumerate(rt):
        rec.sent_frames([], 1, start + 0.08 * i)
        rec.on_audio(b"", start + 0.08 * i + delay)
    rec.on_closed("completed", {})
    return rec


def test_steady_window_leaves_out_the_ramp_and_the_tail():
    # Session 0 starts at 0 s, session 1 at 0.4 s; both send 10 frames. The window is
    # [0.4, 0.72]: session 0's frames 5..9 and session 1's frames 0..4.
    slow_start = [0.5] * 5 + [0.010] * 5  # session 0: slow while the other was connecting
    slow_tail = [0.020] * 5 + [0.9] * 5  # session 1: slow once session 0 was gone
    results = [_recorded(0, 0.0, slow_start).result(), _recorded(1, 0.4, slow_tail).result()]
    run = RunResult("x", {}, results, ClientStats(1, 0.0, 1.0, 20))
    steady = run.steady()
    assert steady["window_s"] == pytest.approx(0.32)
    assert steady["frames"] == 10
    assert steady["rt_max_ms"] == pytest.approx(20.0, abs=1e-3)
    assert steady["rt_p50_ms"] == pytest.approx(10.0, abs=1e-3)
    assert run.summary()["rt_max_ms"] == pytest.approx(900.0, abs=1e-3)  # the whole run sees both


def test_underruns_are_counted_by_the_second_of_the_run_they_arrived_in():
    # Session 0 (from 0 s): frame 20, 0.18 s late, arrives at 1.6 + 0.2 = 1.8 s. Session 1
    # (from 2.5 s): frames 30 and 31, 0.2 s late, arrive at 5.12 and 5.2 s.
    rt0 = [0.02] * 40
    rt0[20] = 0.02 + 0.18
    rt1 = [0.02] * 40
    rt1[30] = rt1[31] = 0.02 + 0.2
    results = [_recorded(0, 0.0, rt0).result(), _recorded(1, 2.5, rt1).result()]
    run = RunResult("x", {"playback_buffer_frames": 1}, results, ClientStats(1, 0.0, 1.0, 20))
    by_s = run.underruns_by_second(1)
    assert sum(by_s) == run.summary()["underruns"] == 3
    assert by_s[1] == 1 and by_s[5] == 2 and by_s == run.summary()["underruns_by_s"]
    assert run.underruns_by_second(4) == []  # a four-frame buffer hides them all
