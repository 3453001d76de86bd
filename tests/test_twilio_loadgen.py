"""The load generator's twilio driver against a real server: calls pass every guard."""

from __future__ import annotations

from duplexserve.loadgen.runner import LoadSpec, run_load


def test_twilio_driver_calls_pass_their_guards_byte_for_byte(server_factory):
    server = server_factory("--api-keys", "k1")
    spec = LoadSpec(
        url=server.ws("/", "token=k1"), protocol="twilio", concurrency=4, sessions=6, frames=12,
        message_ms=80, ramp_s=0.0, timeout_s=20.0, input_format="g711_ulaw", input_rate=8000,
        output_format="g711_ulaw", output_rate=8000,
    )
    result = run_load(spec)
    summary = result.summary()
    assert result.guards_ok, result.failures  # every frame back, in order, equal to the replayed echo
    assert summary["sessions"] == 6 and summary["frames"] == 6 * 12
    assert summary["server"]["executor_submissions_per_frame"] == 0  # G.711 and soxr at 8 kHz inline
    metrics = server.metrics()
    assert metrics["duplexserve_twilio_calls_total"] == 6
    assert metrics["duplexserve_twilio_marks_echoed_total"] > 0
