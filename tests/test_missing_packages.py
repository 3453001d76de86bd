"""A command that needs an optional package this environment lacks: one line naming the extra
that installs it, exit 2, no traceback (it was ``ModuleNotFoundError: No module named 'rich'``
on the README's install). Real ``python -m duplexserve`` processes, the package made absent
as a fresh venv lacks it (``tests/duplexserve_cli.py``)."""

from __future__ import annotations

import subprocess
import sys

import httpx

from tests.duplexserve_cli import hiding, run


def one_line(done: subprocess.CompletedProcess[str], command: str) -> str:
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert "Traceback" not in out, out
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"duplexserve {command}: needs "), out
    return lines[0]


def test_loadgen_without_rich_names_the_loadgen_extra(tmp_path):
    path, env = hiding(tmp_path, "rich")
    line = one_line(run("loadgen", "ws://127.0.0.1:9", path=path, env=env), "loadgen")
    assert line == f"duplexserve loadgen: needs rich, not installed in {sys.prefix}; " \
                   "pip install -e '.[loadgen]'"


def test_loadgen_plots_without_matplotlib_is_said_before_the_run(tmp_path):
    path, env = hiding(tmp_path, "matplotlib")
    done = run("loadgen", "ws://127.0.0.1:9", "--plots", str(tmp_path), path=path, env=env)
    assert "needs matplotlib" in one_line(done, "loadgen") and "summary" not in done.stdout


def test_bench_names_the_bench_extra_and_a_moshi_benchmark_the_install_script(tmp_path):
    path, env = hiding(tmp_path, "rich", "torch")
    line = one_line(run("bench", "burst", "--short", path=path, env=env), "bench")
    assert line.startswith("duplexserve bench: needs rich") and line.endswith("pip install -e '.[bench]'")
    line = one_line(run("bench", "moshi-steps", path=path, env=env), "bench")
    assert "needs torch" in line and "scripts/install-moshi.sh" in line


def test_webrtc_without_aiortc_names_its_extra_in_the_log_the_501_and_the_loadgen(server_factory, tmp_path):
    path, env = hiding(tmp_path, "aiortc")
    env["PYTHONPATH"] = str(path[0])
    server = server_factory("--log-level", "info", env=env)
    answer = httpx.post(server.http + "/v1/realtime/calls", content="v=0",
                        headers={"Content-Type": "application/sdp"}, timeout=10)
    assert answer.status_code == 501
    assert "the [webrtc] extra: pip install -e '.[webrtc]'" in answer.json()["error"]["message"]
    said = "WebRTC is off: WebRTC needs aiortc, the [webrtc] extra: pip install -e '.[webrtc]'"
    assert said in server.log()
    done = run("loadgen", server.ws(), "--protocol", "webrtc", "-c", "1", "--frames", "2", "--no-progress",
               path=path, env={"DUPLEXSERVE_TEST_HIDE": "aiortc"})
    assert done.returncode == 2 and "pip install -e '.[webrtc]'" in done.stdout, done.stdout + done.stderr
