"""The load generator against real servers: guards pass on duplexserve, fail on a faulty echo."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from duplexserve.bench.servers import Server
from duplexserve.loadgen.runner import LoadSpec, run_load


@pytest.fixture
def faulty_echo():
    """Start the bare echo server with one fault; stopped at the end of the test."""
    started: list[Server] = []

    def make(fault: str, frame: int = 3, ws: str = "websockets-sansio") -> Server:
        server = Server(f"echo {fault}", "echo", ["--fault", fault, "--fault-frame", str(frame), "--ws", ws])
        started.append(server.start(pin=False))
        return server

    yield make
    for server in started:
        server.stop()


def _spec(url: str, **kw) -> LoadSpec:
    base = {"concurrency": 4, "sessions": 6, "frames": 12, "message_ms": 160, "ramp_s": 0.0,
            "timeout_s": 20.0}
    return LoadSpec(url=url, **{**base, **kw})


@pytest.mark.parametrize("paced", [True, False], ids=["paced", "burst"])
def test_short_run_against_the_server_passes_its_guards(echo_server, paced):
    result = run_load(_spec(echo_server.ws(), paced=paced, warmup=2))
    summary = result.summary()
    assert result.guards_ok, result.failures
    assert summary["sessions"] == 6 and summary["frames"] == 6 * 12
    assert summary["rt_p50_ms"] > 0 and summary["rtf_median"] > 0
    server = summary["server"]
    # The measured phase only: warm-up frames are outside the two scrapes.
    assert server["frames"] == 6 * 12
    assert server["executor_submissions_per_frame"] == 0  # native PCM never hops threads
    assert summary["client"]["frames"] == 6 * 12


def test_converted_formats_are_checked_byte_for_byte(echo_server):
    result = run_load(_spec(echo_server.ws(), input_format="pcm_s16le", output_format="pcm_s16le",
                            message_ms=80, sessions=2, concurrency=2))
    assert result.guards_ok, result.failures


def test_wrong_expectation_fails_the_content_guard(server_factory):
    server = server_factory("--delay-frames", "2", "--max-sessions", "8")
    right = run_load(_spec(server.ws(), delay_frames=2, sessions=2, concurrency=2))
    assert right.guards_ok, right.failures
    wrong = run_load(_spec(server.ws(), delay_frames=0, sessions=2, concurrency=2))
    assert not wrong.guards_ok
    assert all("altered" in line for line in wrong.failures)


@pytest.mark.parametrize(("fault", "says"), [
    ("drop", "frame 3 dropped"),
    ("reorder", "frame 3 reordered"),
    ("alter", "frame 3 altered"),
])
@pytest.mark.parametrize("ws", ["websockets-sansio", "fast"])
def test_a_faulty_server_fails_the_guard_and_says_which(faulty_echo, fault, says, ws):
    server = faulty_echo(fault, ws=ws)
    result = run_load(_spec(server.url, sessions=2, concurrency=2))
    assert not result.guards_ok
    assert len(result.failures) == 2  # every session saw the fault
    for line in result.failures:
        assert says in line, line


def test_the_bare_echo_floor_passes_and_reports_its_cost():
    floor = Server("echo floor", "echo", []).start(pin=False)
    try:
        result = run_load(_spec(floor.url, paced=False))
    finally:
        floor.stop()
    assert result.guards_ok, result.failures
    assert result.server is not None and result.server.frames == 6 * 12
    assert result.server.cpu_s > 0


def test_refused_sessions_are_guard_failures(server_factory):
    server = server_factory("--max-sessions", "1")
    result = run_load(_spec(server.ws(), sessions=3, concurrency=3))
    assert not result.guards_ok
    assert any("server_unavailable" in line or "could not open" in line for line in result.failures)


def test_loadgen_command_prints_writes_json_and_plots(echo_server, tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.run(
        [sys.executable, "-m", "duplexserve", "loadgen", echo_server.ws(), "-c", "2,3", "-n", "1x",
         "--frames", "6", "--message-ms", "160", "--no-progress", "--json", str(out),
         "--plots", str(tmp_path / "img")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "loadgen summary" in proc.stdout and "ceiling" in proc.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["config"]["concurrency"] for r in runs] == [2, 3]
    assert all(r["summary"]["guards_ok"] for r in runs)
    for name in ("latency_cdf.png", "rtf_per_session.png", "sweep.png"):
        assert (tmp_path / "img" / name).stat().st_size > 1000


def test_bench_short_rtf_run(tmp_path):
    """The CI-sized RTF benchmark: the step model on, paced, warm-up batch; guards hold, JSON and plots."""
    proc = subprocess.run(
        [sys.executable, "-m", "duplexserve", "bench", "rtf", "--short", "--no-pin", "--no-progress",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads((tmp_path / "rtf.json").read_text())
    assert payload["step_model"] == {"base_ms": 21.0, "per_session_ms": 0.184}
    (run,) = payload["runs"]
    assert run["summary"]["guards_ok"] and run["warmup_sessions"] == run["config"]["concurrency"]
    assert run["summary"]["sessions"] == 2 * run["config"]["concurrency"]
    assert (tmp_path / "img" / "rtf_per_session.png").stat().st_size > 1000


@pytest.mark.parametrize("fmt", [("pcm_f32le", 24000), ("pcm_s16le", 16000)], ids=["f32", "s16-16k"])
def test_drop_every_cuts_resumes_and_every_frame_comes_once(echo_server, fmt):
    """--drop-every: connections aborted at random, resumed; the guards see one clean stream."""
    result = run_load(_spec(echo_server.ws(), frames=50, drop_every=0.4, input_format=fmt[0],
                            input_rate=fmt[1], output_format=fmt[0], output_rate=fmt[1]))
    summary = result.summary()
    assert result.guards_ok, result.failures
    assert summary["frames"] == 6 * 50
    assert summary["resumes"] > 0 and summary["frames_lost"] == 0


def test_a_count_only_run_passes_its_guards_and_leaves_the_tail_out(server_factory):
    """``--expect none`` (an engine whose answers cannot be predicted) checks only how many
    frames came back; the frames input.end's tail adds past the input are not answers."""
    server = server_factory("--delay-frames", "2", "--max-sessions", "8")
    result = run_load(_spec(server.ws(), expect="none", sessions=2, concurrency=2))
    assert result.guards_ok, result.failures
    assert result.summary()["frames"] == 2 * 12


def test_arrivals_turn_the_sessions_over_at_the_rate_and_time_to_ready_is_reported(echo_server):
    """--arrivals-per-s: 4 live sessions, 8 joining a second: each joiner lives 4 / 8 s (6
    frames), the first one of slot k (k + 1) / 8 s (2, 3, 5, 6 frames), so they end one
    after another."""
    result = run_load(_spec(echo_server.ws(), concurrency=4, sessions=10, arrivals_per_s=8.0, message_ms=80))
    assert result.guards_ok, result.failures
    first = sorted(s.frames_sent for s in result.sessions if not s.joined)
    assert first == [2, 3, 5, 6] and [s.frames_sent for s in result.sessions if s.joined] == [6] * 6
    summary = result.summary()
    assert 0 < summary["ready_p50_ms"] <= summary["ready_p99_ms"] <= summary["ready_max_ms"]
    assert 0 < summary["ready_joining_p50_ms"] <= summary["ready_joining_max_ms"]
    assert "+8/s" in result.label
    with pytest.raises(ValueError, match="paced"):
        _spec(echo_server.ws(), arrivals_per_s=1.0, paced=False).validate()
    with pytest.raises(ValueError, match="no prompt"):
        _spec(echo_server.ws(), protocol="twilio", text_prompt="be brief").validate()


def test_against_a_real_model_the_answers_are_counted_not_checked_as_an_echo(server_factory):
    """``--expect`` by default asks the server's /ready: a model's answers are no echo, and a
    run that checked them as one failed every session (``frames ... altered``). Piped into a
    file, the summary keeps every value whole (it was cut at 140 columns: ``0.996/0…``), one
    row per figure where a row per run would be wider than the 120 columns it fits."""
    server = server_factory("--engine", "moshi", "--moshi-preset", "tiny", "--device", "cpu",
                            "--moshi-threads", "1", "--max-sessions", "2")
    proc = subprocess.run(
        [sys.executable, "-m", "duplexserve", "loadgen", server.ws(), "-c", "2", "--frames", "6",
         "--no-progress", "--no-metrics"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--expect none: the server runs the moshi engine" in proc.stdout
    lines = proc.stdout.splitlines()
    assert "…" not in proc.stdout and max(map(len, lines)) <= 120
    rtf = next(line for line in lines if line.startswith("│ RTF min/med/max"))
    assert re.search(r"\d\.\d{3}/\d\.\d{3}/\d\.\d{3} │$", rtf), rtf
    wall = next(line for line in lines if line.startswith("│ wall us/frame"))
    assert re.search(r" [\d,]+\.\d │$", wall), wall  # the last figure, whole


def test_against_the_echo_the_answers_are_checked_and_help_shows_the_defaults(echo_server):
    proc = subprocess.run(
        [sys.executable, "-m", "duplexserve", "loadgen", echo_server.ws(), "-c", "1", "--frames", "3",
         "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("--expect echo: the server runs the synthetic echo engine")
    text = " ".join(subprocess.run([sys.executable, "-m", "duplexserve", "loadgen", "--help"],
                                   capture_output=True, text=True, timeout=60).stdout.split())
    for shown in ("sweep (default: 8)", "(default: auto)", "(default: native)", "(default: pcm_f32le)",
                  "(default: 24000)", "(default: paced)"):
        assert shown in text, shown
    assert "(default: None)" not in text and "(default: False)" not in text
