"""``duplexserve serve --engine vllm-omni`` over real sockets, on every protocol it speaks.

The server process hosts vLLM-Omni's real duplex engine with the model stood in by an
echo (``--vllm-omni-standin``); clients are the same ones the other protocol tests use.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest
import websockets.asyncio.client

from tests.vllm_omni.conftest import assert_text_follows_its_audio, require_vllm_omni

require_vllm_omni()

from tests import test_moshi_protocol as moshi  # noqa: E402
from tests import test_realtime_protocol as rt  # noqa: E402
from tests.conftest import ServerProcess, start_server  # noqa: E402
from tests.native_client import converse  # noqa: E402

FRAME = 1920
#: The app starts vLLM-Omni's engine before /health answers: vLLM's import alone took 16-50 s
#: on the 2-core CI machine.
STARTUP_S = 180.0


def wait_ready(server: ServerProcess, timeout: float = 180.0) -> None:
    """/ready once vLLM-Omni's engine is up and the bridge running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(server.http + "/ready", timeout=2).status_code == 200:
            return
        assert server.proc.poll() is None, server.log()
        time.sleep(0.2)
    raise AssertionError("vllm-omni engine did not become ready:\n" + server.log())


@pytest.fixture(scope="module")
def vo_server(tmp_path_factory):
    server = start_server(
        str(tmp_path_factory.mktemp("vo")),
        "--engine",
        "vllm-omni",
        "--vllm-omni-standin",
        "--max-sessions",
        "16",
        "--model",
        "moshi-test",  # the name the Realtime SDK asks for (rt.sdk_session)
        "--api-keys",
        rt.KEY,
        "--allowed-origins",
        "",
        timeout=STARTUP_S,
    )
    try:
        wait_ready(server)
        yield server
    finally:
        server.stop()


def grid_frames(n: int, seed: int) -> np.ndarray:
    """Float32 samples on the 16-bit grid, which vLLM-Omni's pcm16 output returns exactly."""
    rng = np.random.default_rng(seed)
    return (rng.integers(-16000, 16000, n * FRAME) / 32768).astype(np.float32)


def test_native_sessions_get_every_frame_back_in_order(vo_server):
    sessions, n = 8, 30  # the last frame (29) is a text unit: its text may trail it
    url = vo_server.ws(query=f"token={rt.KEY}")
    before = vo_server.metrics()

    async def go():
        sent = [grid_frames(n, seed) for seed in range(sessions)]
        # 160 ms messages, as the RTF workload sends them: the server cuts 80 ms frames
        msgs = [[pcm[i : i + 2 * FRAME].tobytes() for i in range(0, len(pcm), 2 * FRAME)] for pcm in sent]
        results = await asyncio.gather(*(converse(url, m) for m in msgs))
        return sent, results

    sent, results = asyncio.run(go())
    for pcm, res in zip(sent, results, strict=True):
        assert res.created["engine"] == "vllm-omni"
        assert b"".join(res.frames) == pcm.tobytes()  # the echo, through vLLM-Omni, bit-exact
        assert all(len(f) == FRAME * 4 for f in res.frames)
        assert_text_follows_its_audio([(e["frame"], e["text"]) for e in res.of_type("text.delta")], n)
        assert {k: v for k, v in res.closed.items() if k not in ("turnaround_ms", "late_frames")} == {
            "type": "session.closed",
            "reason": "completed",
            "frames_in": n,
            "frames_out": n,
            "frames_dropped": 0,
        }
        assert set(res.closed["turnaround_ms"]) == {"p50", "p99", "max"} and res.closed["late_frames"] >= 0
        assert res.of_type("error") == []
    after = vo_server.metrics()
    frames = sessions * n
    assert after["duplexserve_queue_fast_puts_total"] - before["duplexserve_queue_fast_puts_total"] == frames
    # one hop per control operation (open, close), none per frame
    hops = after["duplexserve_executor_submissions_total"] - before["duplexserve_executor_submissions_total"]
    assert hops == 2 * sessions


def test_moshi_clients_hear_their_voice_back_with_the_models_text(vo_server):
    sent = moshi.voice(25)
    res = asyncio.run(moshi.converse(vo_server.ws("/api/chat", f"token={rt.KEY}&" + moshi.WEB_QUERY), sent))
    moshi.assert_same_voice(sent, res.pcm)
    assert "".join(res.text).startswith("w5")
    assert res.errors == []


def test_openai_realtime_clients_get_a_response_with_the_echo(vo_server):
    speech = rt.tone(10, seed=1)

    async def plan(conn, events):
        for b64 in rt.chunks(speech + rt.silence(rt.SILENCE_FRAMES + 2)):
            await conn.input_audio_buffer.append(audio=b64)

    events = asyncio.run(
        rt.sdk_session(vo_server.http + "/v1", plan, lambda ev: "response.done" in rt.kinds(ev))
    )
    (group,) = rt.responses(events)
    rt.check_order(group)
    assert rt.audio_of(group) == speech + rt.silence(rt.SILENCE_FRAMES)  # pcm16 in, pcm16 out, exact
    transcript = group[-1]["response"]["output"][0]["content"][0]["transcript"]
    assert transcript.startswith("w5")


def test_a_session_refused_by_vllm_omni_is_told_so(tmp_path):
    # duplexserve has two slots, vLLM-Omni's deployment admits one session.
    server = start_server(
        str(tmp_path),
        "--engine",
        "vllm-omni",
        "--vllm-omni-standin",
        "--max-sessions",
        "2",
        "--vllm-omni-args",
        json.dumps({"max_sessions": 1}),
        "--vllm-omni-session",
        json.dumps({"instructions": "be brief"}),
        timeout=STARTUP_S,
    )
    try:
        wait_ready(server)

        async def go():
            async with websockets.asyncio.client.connect(server.ws(), max_size=None) as first:
                assert json.loads(await first.recv())["type"] == "session.created"
                await first.send(grid_frames(1, 1).tobytes())
                assert isinstance(await first.recv(), bytes)  # an answer: its vLLM-Omni session is open
                second = await converse(server.ws(), [grid_frames(1, 2).tobytes()])
                await first.send(json.dumps({"type": "input.end"}))
                closed = [json.loads(m) for m in [await first.recv()] if isinstance(m, str)]
            return closed, second

        closed, second = asyncio.run(go())
        assert closed[0]["type"] == "session.closed" and closed[0]["reason"] == "completed"
        assert [e["code"] for e in second.of_type("error")] == ["resource_exhausted"]
        assert second.closed["reason"] == "resource_exhausted" and second.close_code == 1013
    finally:
        server.stop()
