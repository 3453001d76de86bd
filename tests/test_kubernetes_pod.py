"""The rendered pod spec's semantics, run as the kubelet would run it, on loopback.

The container of deploy/kubernetes/overlays/hibiki-zero-3b is started from its own command,
args and env (the engine settings swapped for the synthetic engine on the CPU, the port for a
free loopback one, the spec's writable volumes for temporary folders). Its startup, readiness
and liveness probes are driven at their periods; then what a rollout or a scale-down does:
the preStop hook, SIGTERM, the grace. A live call completes, a new one is refused with 503
during the drain, and the server exits by itself long before terminationGracePeriodSeconds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import SERVER_PYTHON, free_port
from tests.test_kubernetes import KUBE, ROOT, SECRETS, container_env, one, render, secret_files
from tests.test_nginx import Live, refused_status

#: The spec's engine settings, replaced: no GPU and no checkpoint here.
CPU_ENGINE = {"DUPLEXSERVE_ENGINE": "synthetic", "DUPLEXSERVE_DEVICE": "cpu", "DUPLEXSERVE_MAX_SESSIONS": "2"}


def probe(port: int, spec: dict[str, Any]) -> bool:
    """One probe as the kubelet runs it: an HTTP GET, success on 200-399 within timeoutSeconds."""
    try:
        r = httpx.get(f"http://127.0.0.1:{port}{spec['httpGet']['path']}", timeout=spec["timeoutSeconds"])
    except httpx.HTTPError:
        return False
    return 200 <= r.status_code < 400


def start_container(pod: dict[str, Any], tmp: Path) -> tuple[subprocess.Popen[bytes], int, Path]:
    """Run the pod's container's command + args with its env, as a process on this machine
    (the Secrets it mounts written into temporary folders)."""
    container = pod["containers"][0]
    port = free_port()
    secret_mounts = {path.rpartition("/")[0] for path in secret_files(pod)}
    mounts = {m["mountPath"]: tmp / m["name"] for m in container["volumeMounts"]
              if not m.get("readOnly") or m["mountPath"] in secret_mounts}
    for folder in mounts.values():
        folder.mkdir()
    for path, text in secret_files(pod).items():
        mount, _, name = path.rpartition("/")
        (mounts[mount] / name).write_text(text)
    env = {}
    for name, value in container_env(container).items():
        for path, folder in mounts.items():
            if value == path or value.startswith(path + "/"):
                value = str(folder) + value[len(path):]
        env[name] = value
    env = {k: v for k, v in env.items() if not k.startswith("DUPLEXSERVE_MOSHI_")}
    env.update(CPU_ENGINE, DUPLEXSERVE_HOST="127.0.0.1", DUPLEXSERVE_PORT=str(port))
    # `duplexserve` on PATH is this checkout's, run by the tests' server Python.
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "duplexserve"
    shim.write_text(f'#!/bin/sh\nexec "{SERVER_PYTHON}" -m duplexserve "$@"\n')
    shim.chmod(0o755)
    env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH=str(ROOT))
    log = tmp / "container.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([*container["command"], *container["args"]], env=env, cwd=tmp,
                                stdout=out, stderr=subprocess.STDOUT)
    return proc, port, log


def test_pod_starts_probes_and_drains_as_its_spec_says(tmp_path) -> None:
    objects = render(KUBE / "overlays" / "hibiki-zero-3b")
    pod = one(objects, "StatefulSet")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    grace = pod["terminationGracePeriodSeconds"]
    proc, port, log = start_container(pod, tmp_path)
    try:
        # Startup probe: at its period until it succeeds, within periodSeconds x failureThreshold.
        startup = container["startupProbe"]
        for _ in range(startup["failureThreshold"]):
            if probe(port, startup):
                break
            assert proc.poll() is None, log.read_text()
            time.sleep(startup["periodSeconds"])
        else:
            pytest.fail("the startup probe never succeeded: " + log.read_text())
        assert probe(port, container["readinessProbe"]) and probe(port, container["livenessProbe"])

        async def rollout() -> None:
            assert "DUPLEXSERVE_API_KEYS" not in container_env(container)  # from the mounted Secret
            key = SECRETS["duplexserve-api-keys"]["api-keys"].splitlines()[-1]
            url = f"ws://127.0.0.1:{port}/v1/duplex?token={key}"
            live = await Live.open(url)
            await live.exchange(3)
            # Full (2 slots): not ready, so out of the Service's endpoints, yet alive.
            other = await Live.open(url)
            assert not probe(port, container["readinessProbe"])
            assert probe(port, container["livenessProbe"])
            assert (await other.finish())["reason"] == "completed"
            assert probe(port, container["readinessProbe"])

            # The pod is deleted: preStop first; the server still admits while it runs.
            started = time.monotonic()
            hook = container["lifecycle"]["preStop"]["exec"]["command"]
            pre_stop = await asyncio.create_subprocess_exec(*hook)
            assert probe(port, container["readinessProbe"])
            assert await pre_stop.wait() == 0
            proc.send_signal(signal.SIGTERM)  # then SIGTERM to PID 1 (sh exec'd the server)
            deadline = time.monotonic() + 10
            while probe(port, container["readinessProbe"]):
                assert time.monotonic() < deadline, "readiness never failed after SIGTERM"
                await asyncio.sleep(0.1)
            assert probe(port, container["livenessProbe"])  # draining is not dead: no restart
            assert await refused_status(url) == 503  # retryable, before the upgrade
            await live.exchange(5)  # the live call goes on
            closed = await live.finish()
            assert closed["reason"] == "completed" and closed["frames_out"] == live.sent == 8
            code = await asyncio.to_thread(proc.wait, grace)
            assert code == 0 and time.monotonic() - started < grace

        asyncio.run(rollout())
        # The server drained for the grace less the preStop sleep and the margin.
        assert f"for up to {grace - 15} s" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
