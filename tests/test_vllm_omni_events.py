"""The mapping of vLLM-Omni's duplex events onto duplexserve's sessions (no vLLM-Omni needed).

The events here carry the attributes of vLLM-Omni's event classes (``type``, ``delta``,
``format``, ``sample_rate_hz``, ``details``, ``code``, ``reason``); tests/vllm_omni drives
the same mapping with the real classes out of the real engine.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import os
import re
import subprocess
import wave
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from duplexserve import errors
from duplexserve.engine_bridge.vllm_omni.events import InputFramer, OutputFramer, decode_audio

FRAME = 1920


def pcm16(samples: np.ndarray) -> str:
    return base64.b64encode(np.rint(samples * 32768).astype("<i2").tobytes()).decode()


def grid(n: int, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).integers(-20000, 20000, n) / 32768).astype(np.float32)


def delta(samples: np.ndarray, rate: int = 24000, fmt: str = "pcm16") -> SimpleNamespace:
    return SimpleNamespace(
        type="response.output_audio.delta", delta=pcm16(samples), format=fmt, sample_rate_hz=rate
    )


def test_audio_deltas_become_whole_frames_whatever_their_size():
    framer = OutputFramer()
    x = grid(3 * FRAME, seed=1)
    got = []
    for part in (x[:1000], x[1000:2500], x[2500:5000], x[5000:]):  # not aligned with frames
        got += framer.on_event(delta(part)).frames
    assert len(got) == 3
    assert np.array_equal(np.concatenate(got), x)  # pcm16 on the 16-bit grid comes back exact


def test_every_format_vllm_omni_encodes_decodes_to_the_same_samples():
    x = grid(FRAME, seed=2)
    as_f32 = base64.b64encode(x.astype("<f4").tobytes()).decode()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(24000)
        w.writeframes(np.rint(x * 32768).astype("<i2").tobytes())
    as_wav = base64.b64encode(buf.getvalue()).decode()
    for fmt, payload in (("pcm", pcm16(x)), ("pcm16", pcm16(x)), ("pcm_f32le", as_f32), ("wav", as_wav)):
        assert np.array_equal(decode_audio(payload, fmt), x), fmt


def test_audio_at_another_rate_is_resampled_to_24k_frames():
    framer = OutputFramer()
    t = np.arange(22050) / 22050  # one second of a 440 Hz tone at 22.05 kHz
    tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    frames = []
    for i in range(0, len(tone), 1764):  # 80 ms chunks at 22.05 kHz
        frames += framer.on_event(delta(tone[i : i + 1764], rate=22050)).frames
    assert 10 <= len(frames) <= 12.5 and all(len(f) == FRAME for f in frames)
    mid = np.concatenate(frames)[4800:19200]
    peak = np.argmax(np.abs(np.fft.rfft(mid)))
    assert abs(peak * 24000 / len(mid) - 440) < 5


def test_a_unit_the_model_listened_through_is_answered_with_silence():
    framer = OutputFramer()
    listen = SimpleNamespace(type="response.listen", details={"model_listen": True})
    (frame,) = framer.on_event(listen).frames
    assert len(frame) == FRAME and not frame.any()
    buffering = SimpleNamespace(type="response.listen", details={"model_listen": False, "buffering": True})
    assert framer.on_event(buffering).frames == []


def test_text_errors_and_closes():
    framer = OutputFramer()
    text = framer.on_event(SimpleNamespace(type="response.output_audio_transcript.delta", delta="hi"))
    assert text.text == "hi" and not text.frames and text.issue is None
    soft = framer.on_event(SimpleNamespace(type="error", code="input_backpressure", message="slow down"))
    assert (soft.issue.code, soft.issue.close_code) == ("input_backpressure", None)
    full = framer.on_event(SimpleNamespace(type="error", code="resource_exhausted", message="full"))
    assert full.issue.close_code == errors.TRY_AGAIN
    idle = framer.on_event(SimpleNamespace(type="session.expired", reason="idle_ttl_expired"))
    assert (idle.issue.code, idle.issue.close_code) == ("idle_timeout", errors.NORMAL)
    odd = framer.on_event(SimpleNamespace(type="session.closed", reason="stage_failed"))
    assert (odd.issue.code, odd.issue.close_code) == ("engine_error", errors.INTERNAL)
    assert "stage_failed" in odd.issue.message
    assert framer.on_event(SimpleNamespace(type="response.created")).frames == []


def test_input_toward_a_16k_model_goes_in_whole_1280_sample_units():
    framer = InputFramer(16000)
    units = [u for _ in range(50) for u in framer.push(grid(FRAME))]
    assert all(len(u) == 1280 and u.dtype == np.float32 for u in units)
    assert 47 <= len(units) <= 50  # all but the resampler's own delay, at most one unit per frame on average


@pytest.mark.skipif(importlib.util.find_spec("vllm_omni") is not None, reason="vLLM-Omni is installed here")
def test_without_vllm_omni_the_server_says_what_to_install(tmp_path):
    from tests.conftest import start_server

    # Where scripts/test-vllm-omni.sh already made its venv, the message names that venv instead.
    how = r"(scripts/test-vllm-omni\.sh|run the server from its venv: \S+/bin/duplexserve serve)"
    with pytest.raises(RuntimeError, match=r"cannot serve --engine vllm-omni: .*" + how):
        start_server(str(tmp_path), "--engine", "vllm-omni", "--vllm-omni-standin")


def test_the_vllm_omni_script_skips_on_a_disk_too_small_for_its_venv(tmp_path):
    """Where a new venv would not fit, scripts/test-vllm-omni.sh installs nothing, says so
    with both figures and exits 0 (rather than fail half-way through a 10 GB install)."""
    root = Path(__file__).resolve().parent.parent
    venv = tmp_path / "venv"
    env = {**os.environ, "DUPLEXSERVE_VLLM_OMNI_VENV": str(venv), "DUPLEXSERVE_VLLM_OMNI_NEED_GB": "1000000"}
    done = subprocess.run(["bash", "scripts/test-vllm-omni.sh"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = r"SKIPPED: the vLLM-Omni tests need about 1000000 GB free for their venv, \d+ GB are\n"
    assert re.fullmatch(said, done.stdout), done.stdout
    assert not venv.exists()


def test_the_bridge_answers_the_loop_as_the_embedded_one_does():
    """The loop reads a step's record and asks its bridge alike for every engine (metrics,
    the overload manager): vLLM-Omni's bridge, tested only in its own venv, must keep up
    with what the embedded bridge offers, or its first step raises on the loop."""
    import dataclasses

    from duplexserve.engine_bridge.bridge import EngineBridge, StepOutput
    from duplexserve.engine_bridge.vllm_omni.bridge import VllmOmniBridge, VllmOmniOutput

    loop_only = {"published"}  # the engine thread's hand-off time: vLLM-Omni has no such thread
    record = {f.name for f in dataclasses.fields(VllmOmniOutput)}
    assert {f.name for f in dataclasses.fields(StepOutput)} - loop_only <= record
    asked = ("take_gil_wait", "qsize", "try_submit", "submit", "submit_offloaded", "open", "close",
             "detach", "start", "stop", "abandon")
    assert [name for name in asked if hasattr(EngineBridge, name) and not hasattr(VllmOmniBridge, name)] == []
