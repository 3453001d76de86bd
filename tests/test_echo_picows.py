"""The echo floors: the load generator's guards hold on the picows echo and on the uvicorn echo's
fast path; each answers as the uvicorn echo does."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from websockets.sync.client import connect

from duplexserve.bench.servers import Server
from duplexserve.loadgen.echo import FRAME_BYTES
from duplexserve.loadgen.runner import LoadSpec, run_load
from duplexserve.loadgen.scrape import metrics_url, parse

if importlib.util.find_spec("picows") is None:  # only when missing: a broken install fails below
    pytest.skip("picows is not installed (pip install -e '.[bench]')", allow_module_level=True)


FLOORS = {"picows-echo": [], "echo": [], "fast-path echo": ["--ws", "fast"]}


@pytest.fixture(scope="module", params=list(FLOORS))
def floor(request):
    """Each floor on a loopback port, all held to the same answers."""
    kind = "picows-echo" if request.param == "picows-echo" else "echo"
    server = Server(request.param, kind, FLOORS[request.param]).start(pin=False)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def picows_floor():
    server = Server("picows echo", "picows-echo", []).start(pin=False)
    yield server
    server.stop()


@pytest.mark.parametrize(("paced", "message_ms"), [(False, 80), (False, 160), (True, 160)],
                         ids=["burst-80", "burst-160", "paced-160"])
def test_the_load_generator_guards_hold_on_each_floor(floor, paced, message_ms):
    """Every frame back, exact and in order (the guards), and counted by /metrics like the uvicorn echo."""
    result = run_load(LoadSpec(url=floor.url, concurrency=4, sessions=6, frames=12, ramp_s=0.0,
                               message_ms=message_ms, paced=paced, warmup=2, timeout_s=20.0))
    assert result.guards_ok, result.failures
    summary = result.summary()
    assert summary["sessions"] == 6 and summary["frames"] == 6 * 12
    server = summary["server"]
    assert server["frames"] == 6 * 12  # the measured phase only: warm-up is outside the scrapes
    assert server["cpu_s"] > 0 and server["executor_submissions_per_frame"] == 0
    assert server["voluntary_switches"] >= 0


def test_metrics_and_health_answer_plain_http(floor):
    base = metrics_url(floor.url).removesuffix("/metrics")
    with urllib.request.urlopen(base + "/health", timeout=5) as r:
        assert r.status == 200 and json.loads(r.read()) == {"status": "ok"}
    with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
        counters = parse(r.read().decode())
    for name in ("cpu_seconds_total", "voluntary_context_switches_total", "executor_submissions_total",
                 "frames_in_total", "frames_out_total", "sessions_accepted_total"):
        assert f"duplexserve_{name}" in counters, name
    assert counters["duplexserve_cpu_seconds_total"] > 0


def test_a_session_by_hand_gets_the_same_answers_from_both_floors(floor):
    """session.created, each whole frame back in one message, a partial one padded at input.end."""
    frames = [bytes([i]) * FRAME_BYTES for i in range(1, 4)]
    with connect(floor.url + "?input_format=pcm_f32le", max_size=None) as ws:
        created = json.loads(ws.recv())
        assert created["type"] == "session.created" and created["protocol"] == "duplex/1"
        assert created["input"] == created["output"] == {
            "format": "pcm_f32le", "sample_rate": 24000, "frame_samples": FRAME_BYTES // 4}
        ws.send(frames[0])
        assert ws.recv() == frames[0]
        ws.send(frames[1] + frames[2][:100])  # one whole frame and the start of the next
        assert ws.recv() == frames[1]
        ws.send(frames[2][100:] + b"\x07" * 8)  # the rest of it, and 8 bytes over
        assert ws.recv() == frames[2]
        ws.send(json.dumps({"type": "input.end"}))
        assert ws.recv() == b"\x07" * 8 + bytes(FRAME_BYTES - 8)
        closed = json.loads(ws.recv())
        assert closed == {"type": "session.closed", "reason": "completed",
                          "frames_in": 4, "frames_out": 4, "frames_dropped": 0}
    assert ws.close_code == 1000


def test_a_plain_get_elsewhere_is_not_found(picows_floor):
    base = metrics_url(picows_floor.url).removesuffix("/metrics")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(base + "/v1/duplex", timeout=5)
    assert err.value.code == 404


def test_bench_short_burst_and_capacity_carry_both_floors(tmp_path):
    """The CI-sized suite: both floors beside duplexserve, the ratios and the client's ceiling in the JSON."""
    proc = subprocess.run(
        [sys.executable, "-m", "duplexserve", "bench", "burst", "capacity", "--short", "--reps", "1",
         "--no-pin", "--no-progress", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "client ceiling" in proc.stdout and "duplexserve / picows echo" in proc.stdout
    (level,) = json.loads((tmp_path / "burst.json").read_text())["summary"].values()
    assert {"echo floor", "fast-path echo floor", "picows floor", "duplexserve", "offload path"} <= set(
        level["costs"])
    assert all(k["guards_ok"] for k in level["costs"].values())
    assert set(level["floor_ratios"]) == {
        "duplexserve / uvicorn echo", "duplexserve / picows echo", "duplexserve / fast-path echo",
        "fast-path echo / uvicorn echo", "picows echo / uvicorn echo"}
    assert level["client"]["cpu_us_per_frame"] > 0 and level["client"]["ceiling_frames_per_s"] > 0
    capacity = json.loads((tmp_path / "capacity.json").read_text())
    assert capacity["judged_against"] == "picows floor" and capacity["bound"] == 2.0
    for row in capacity["levels"].values():
        assert row["floors_guards_ok"] and row["guards_ok"]
        assert row["picows_echo"]["frames"] > 0 and row["server_us_per_frame"]["picows_echo"] > 0
        assert row["fast_echo"]["frames"] > 0 and row["server_us_per_frame"]["fast_echo"] > 0
        assert row["client"]["ceiling_paced_sessions"] > 0
