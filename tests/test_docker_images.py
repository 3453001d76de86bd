"""The images built and run for real (docs/deploy.md): a base image from Debian packages
(scripts/docker-base.sh), the CPU image, the loadgen image and the nginx image on it,
then the CPU image alone and compose's ``scale`` and ``loadgen`` profiles with
docker/compose.cpu.yaml, all driven from outside the containers through ports published
on 127.0.0.1. Last, the GPU image (docker/Dockerfile.gpu, PyPI's CUDA torch, about 5 GB)
on the same base: its moshi engine serves a tiny checkpoint in the released layout on the
CPU, mounted read-only as a folder and as a Hugging Face cache, compared with the same
checkpoint served outside the container; and a code change rebuilds it from its cached layers.

Needs a running Docker engine (Debian's docker.io; .ci/run starts dockerd), mmdebstrap
and docker-compose, and the Debian mirror and the package index that the builds install
from. Without them these tests skip, except under CI (``CI=true``), where they fail: a
missing install step must not pass as a skip. The GPU image alone also skips where Docker's
disk has less than ``GPU_BUILD_GB`` free: that is the machine's size, not a missing step.

The base and each image are built once per test run (tests/conftest.py's fixtures, shared with
tests/test_fleet_images.py; the steps in tests/docker_images.py), the base in about a minute on
an idle machine; ``DUPLEXSERVE_DOCKER_BASE=IMAGE``
uses an existing one instead, ``DUPLEXSERVE_DOCKER_KEEP=1`` keeps the images afterwards.
The build times and image sizes are printed and written to build/docker-images.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.docker_images import (
    BUILD_ENV,
    DOCKER_DIR,
    ROOT,
    RUN,
    Images,
    Stopper,
    build_timed,
    compose_env,
    dangling,
    draining,
    inspect,
    published,
    ready,
    record,
    remove_images,
    require_room,
    sessions,
    sh,
    wait_for,
)
from tests.native_client import converse, signal
from tests.test_nginx import FAIL_TIMEOUT_WAIT_S, Live, refused_status

CPU_GRACE_S = 30

# The first test also waits for the builds (3.5 min idle, 10 under load): a generous limit.
pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]


# ------------------------------------------------------------------ helpers

def frames_of(count: int, seed: int) -> list[bytes]:
    audio = signal(count, seed)
    return [audio[i * 1920:(i + 1) * 1920].tobytes() for i in range(count)]


# -------------------------------------------------- the CPU image on its own

@contextlib.contextmanager
def container(image: str, *env: str, run_args: tuple[str, ...] = (),
              start_s: float = 60) -> Iterator[tuple[str, str]]:
    """Run ``image`` detached with ``env`` (NAME=VALUE) and more ``docker run`` arguments;
    yields (container, host:port) once its /health answers."""
    args = [a for e in env for a in ("-e", e)]
    name = f"duplexserve-ci-{RUN}-{time.monotonic_ns()}"
    sh("docker", "run", "--detach", "--name", name, "--publish", "127.0.0.1::8998", *args, *run_args, image)
    try:
        http = published(name, 8998)
        wait_for("/health", lambda: httpx.get(f"http://{http}/health", timeout=2).status_code == 200,
                 timeout=start_s)
        yield name, http
    finally:
        logs = sh("docker", "logs", "--tail", "40", name, check=False)
        sh("docker", "rm", "--force", name, check=False)
        print(logs.stdout, logs.stderr)


def cpu_container(images: Images, *env: str) -> contextlib.AbstractContextManager[tuple[str, str]]:
    """Run the CPU image detached; yields (container, host:port)."""
    return container(images.cpu, *env)


def pid1_uids(name: str) -> set[str]:
    """The real, effective, saved and file-system uids of the container's PID 1."""
    status = sh("docker", "exec", name, "cat", "/proc/1/status").stdout
    return set(next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:")))


def test_cpu_image_serves_from_outside_as_non_root_and_turns_healthy(images) -> None:
    with cpu_container(images, f"DUPLEXSERVE_DRAIN_GRACE_S={CPU_GRACE_S}") as (name, http):
        health = httpx.get(f"http://{http}/health", timeout=5)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        r = ready(http)
        assert r.status_code == 200, r.text
        assert r.json()["ready"] is True and r.json()["engine"] == "synthetic"

        # An exact native echo session: every frame comes back byte for byte.
        sent = frames_of(25, seed=17)
        result = asyncio.run(converse(f"ws://{http}/v1/duplex", list(sent)))
        assert result.created["protocol"] == "duplex/1"
        assert result.frames == sent
        closed = result.closed
        assert closed is not None and closed["reason"] == "completed", result.events
        assert (closed["frames_in"], closed["frames_out"], closed["frames_dropped"]) == (25, 25, 0)
        assert result.close_code == 1000

        page = httpx.get(f"http://{http}/", timeout=5)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "Start talking" in page.text and "static/app.js" in page.text
        assert httpx.get(f"http://{http}/static/app.js", timeout=5).status_code == 200

        metrics = httpx.get(f"http://{http}/metrics", timeout=5)
        assert metrics.status_code == 200
        values = {line.rpartition(" ")[0]: float(line.rpartition(" ")[2])
                  for line in metrics.text.splitlines() if line and not line.startswith("#")}
        assert values["duplexserve_sessions_accepted_total"] >= 1
        assert values["duplexserve_frames_out_total"] >= 25
        assert values["duplexserve_ready"] == 1

        # Non-root: the image says so, and the server (PID 1) runs as 10001.
        assert inspect(name, "{{.Config.User}}") == "10001"
        assert pid1_uids(name) == {"10001"}
        assert "duplexserve" in sh("docker", "exec", name, "cat", "/proc/1/cmdline").stdout

        # Debian's libopus is in the image and loads: Opus is not left to sphn (issue 72).
        report = sh("docker", "exec", name, "duplexserve", "check", timeout=120, check=False).stdout
        libopus = next(line for line in report.splitlines() if line.startswith("libopus"))
        assert libopus.split() == ["libopus", "loaded"], report

        # The image's HEALTHCHECK (every 10 s) turns the container healthy.
        wait_for("healthy", lambda: inspect(name, "{{.State.Health.Status}}") == "healthy", timeout=45)


def test_docker_stop_drains_a_live_session_within_the_grace(images) -> None:
    with cpu_container(images, f"DUPLEXSERVE_DRAIN_GRACE_S={CPU_GRACE_S}") as (name, http):
        url = f"ws://{http}/v1/duplex"

        async def main() -> tuple[dict[str, Any], Stopper]:
            live = await Live.open(url)
            await live.exchange(4)
            stopper = Stopper("docker", "stop", "--time", str(CPU_GRACE_S + 30), name)
            stopper.start()
            # SIGTERM: /ready says draining and new sessions are turned away (1013)...
            await asyncio.to_thread(wait_for, "draining", lambda: draining(http), 15)
            refused = await converse(url, [], timeout=10)
            assert refused.close_code == 1013, refused
            # ...while the live one streams on and ends normally.
            await live.exchange(6)
            assert stopper.is_alive(), "the container stopped before its session ended"
            return await live.finish(), stopper

        closed, stopper = asyncio.run(main())
        assert closed["reason"] == "completed", closed
        assert (closed["frames_in"], closed["frames_out"], closed["frames_dropped"]) == (10, 10, 0)
        stopper.join(CPU_GRACE_S + 40)
        assert stopper.result is not None and stopper.result.returncode == 0, stopper.result
        # It exited by itself once its last session ended: well inside the grace period,
        # with status 0, not killed by docker.
        assert stopper.seconds < CPU_GRACE_S, stopper.seconds
        assert inspect(name, "{{.State.ExitCode}} {{.State.OOMKilled}}") == "0 false"


def test_docker_stop_closes_what_outlives_the_grace_with_counts(images) -> None:
    grace = 2
    with cpu_container(images, f"DUPLEXSERVE_DRAIN_GRACE_S={grace}") as (name, http):

        async def main() -> tuple[dict[str, Any], int | None, Stopper]:
            live = await Live.open(f"ws://{http}/v1/duplex")
            await live.exchange(3)
            stopper = Stopper("docker", "stop", "--time", "30", name)
            stopper.start()
            closed: dict[str, Any] = {}
            with contextlib.suppress(Exception):
                while True:  # the session outlives the grace: the server ends it
                    msg = await asyncio.wait_for(live.ws.recv(), 15)
                    if isinstance(msg, str) and json.loads(msg)["type"] == "session.closed":
                        closed = json.loads(msg)
            return closed, live.ws.close_code, stopper

        closed, code, stopper = asyncio.run(main())
        assert closed.get("reason") == "server_shutdown", closed
        assert closed["frames_in"] == 3 == closed["frames_out"] + closed["frames_dropped"]
        assert code == 1001
        stopper.join(40)
        assert stopper.result is not None and stopper.result.returncode == 0
        assert stopper.seconds < 15, stopper.seconds  # its own grace, not docker's 30 s
        assert inspect(name, "{{.State.ExitCode}}") == "0"


# ------------------------------------- compose: scale profile, CPU overrides

@dataclass
class Stack:
    compose: list[str]
    env: dict[str, str]
    lb: str  # host:port of nginx
    replicas: tuple[str, str]  # host:port of duplexserve and duplexserve-1
    results: Path

    def container(self, service: str) -> str:
        return sh(*self.compose, "ps", "-q", service, env=self.env).stdout.strip()

    def run(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        return sh(*self.compose, *args, env=self.env, timeout=timeout, check=check)


MAX_SESSIONS = 4


@pytest.fixture(scope="module")
def stack(images, tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("compose")
    results = tmp / "results"
    results.mkdir()
    results.chmod(0o777)  # loadgen writes as its own user, 10001
    env = compose_env(
        tmp, 2, IMAGE=images.cpu, LOADGEN_IMAGE=images.loadgen, NGINX_IMAGE=images.nginx,
        MAX_SESSIONS=str(MAX_SESSIONS), DRAIN_GRACE_S="30", RESULTS_DIR=str(results),
        MAX_SESSIONS_PER_CLIENT="0",  # every client here is this host: one address to the servers
    )
    compose = ["docker-compose", "--project-name", f"duplexserve-ci-{RUN}",
               "-f", str(DOCKER_DIR / "compose.yaml"), "-f", str(DOCKER_DIR / "compose.cpu.yaml")]
    up = [*compose, "--profile", "scale"]
    try:
        # `up` waits for both replicas to be healthy before it starts nginx (depends_on).
        sh(*up, "up", "--detach", "--no-build", env=env, timeout=300)
        ports = [sh(*up, "port", s, str(p), env=env).stdout.strip()
                 for s, p in (("lb", 8080), ("duplexserve", 8998), ("duplexserve-1", 8998))]
        yield Stack(up, env, ports[0], (ports[1], ports[2]), results)
    finally:
        logs = sh(*up, "logs", "--no-color", "--tail", "30", env=env, check=False)
        print(logs.stdout[-8000:])
        sh(*up, "--profile", "loadgen", "down", "--volumes", "--remove-orphans", "--timeout", "5",
           env=env, check=False, timeout=120)


def counts(stack: Stack) -> tuple[int, int]:
    return sessions(stack.replicas[0]), sessions(stack.replicas[1])


def lb_url(stack: Stack) -> str:
    return f"ws://{stack.lb}/v1/duplex"


def test_compose_scale_spreads_sessions_over_both_replicas(stack) -> None:
    assert [ready(r).json()["max_sessions"] for r in stack.replicas] == [MAX_SESSIONS] * 2

    async def main() -> None:
        live = [await Live.open(lb_url(stack)) for _ in range(6)]
        await asyncio.gather(*(s.exchange(3) for s in live))
        assert counts(stack) == (3, 3)  # least_conn: each new session to the emptier replica
        for s in live:
            closed = await s.finish()
            assert closed["reason"] == "completed"
            assert closed["frames_in"] == closed["frames_out"] == 3 and closed["frames_dropped"] == 0

    asyncio.run(main())
    wait_for("sessions to close", lambda: counts(stack) == (0, 0), timeout=10)


def test_compose_replicas_share_a_writable_compiler_cache(stack) -> None:
    """torch.compile's, Triton's and CUDA's caches point at /cache, a named volume both
    replicas mount, writable by the server's user: a restarted engine compiles nothing again."""
    probe = ("import os; d = [os.environ[k] for k in ('TORCHINDUCTOR_CACHE_DIR', 'TRITON_CACHE_DIR', "
             "'CUDA_CACHE_PATH')]; assert all(p.startswith('/cache/') for p in d), d; "
             "[os.makedirs(p, exist_ok=True) for p in d]; open(d[0] + '/probe', 'w').write(str(os.getuid()))")
    stack.run("exec", "-T", "duplexserve", "python3", "-c", probe)
    seen = stack.run("exec", "-T", "duplexserve-1", "cat", "/cache/inductor/probe").stdout
    assert seen == "10001"


def test_compose_scale_sends_sessions_past_a_full_replica(stack) -> None:
    async def main() -> None:
        # Fill duplexserve directly, where nginx cannot see it: only its 503 tells nginx.
        direct = [await Live.open(f"ws://{stack.replicas[0]}/v1/duplex") for _ in range(MAX_SESSIONS)]
        assert await refused_status(f"ws://{stack.replicas[0]}/v1/duplex") == 503
        via_lb = [await Live.open(lb_url(stack)) for _ in range(MAX_SESSIONS)]
        await asyncio.gather(*(s.exchange(2) for s in direct + via_lb))
        assert counts(stack) == (MAX_SESSIONS, MAX_SESSIONS)  # every one went to duplexserve-1
        for _ in range(2):  # both full: the client hears 503 from nginx
            assert await refused_status(lb_url(stack)) == 503
        for s in direct + via_lb:
            closed = await s.finish()
            assert closed["reason"] == "completed" and closed["frames_out"] == 2 == closed["frames_in"]

    asyncio.run(main())
    wait_for("sessions to close", lambda: counts(stack) == (0, 0), timeout=10)
    time.sleep(FAIL_TIMEOUT_WAIT_S)  # nginx's fail_timeout for the replicas that said 503


def test_compose_loadgen_profile_against_nginx(stack) -> None:
    # The lb's own HEALTHCHECK has turned it healthy by now (every 10 s).
    wait_for("lb healthy", lambda: inspect(stack.container("lb"), "{{.State.Health.Status}}") == "healthy",
             timeout=40)
    env = {**stack.env, "DUPLEXSERVE_LOADGEN_URL": "ws://lb:8080", "DUPLEXSERVE_LOADGEN_CONCURRENCY": "4",
           "DUPLEXSERVE_LOADGEN_SECONDS": "2", "DUPLEXSERVE_LOADGEN_EXPECT": "echo"}
    out = sh(*stack.compose, "--profile", "loadgen", "run", "-T", "--rm", "loadgen", env=env,
             timeout=300, check=False)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    run = json.loads((stack.results / "rtf.json").read_text())["runs"][0]
    assert run["summary"]["guards_ok"] and run["failures"] == []
    assert len(run["per_session"]) == 8 and run["warmup_sessions"] == 4
    for s in run["per_session"]:  # 2 s of audio, every frame back exact (--expect echo)
        assert s["frames_sent"] == s["frames_received"] == 25 and s["closed_reason"] == "completed", s
    assert {p.name for p in stack.results.glob("*.png")} >= {"latency_cdf.png", "rtf_per_session.png"}


def test_compose_scale_a_stopped_replica_drains_while_new_sessions_go_elsewhere(stack) -> None:
    replica = stack.container("duplexserve-1")

    async def main() -> tuple[list[dict[str, Any]], Stopper]:
        old = [await Live.open(lb_url(stack)) for _ in range(4)]
        await asyncio.gather(*(s.exchange(2) for s in old))
        assert counts(stack) == (2, 2)

        stopper = Stopper(*stack.compose, "stop", "duplexserve-1")
        stopper.start()
        await asyncio.to_thread(wait_for, "duplexserve-1 draining", lambda: draining(stack.replicas[1]), 15)
        new = [await Live.open(lb_url(stack)) for _ in range(2)]
        await asyncio.gather(*(s.exchange(2) for s in new))
        assert counts(stack) == (4, 2)  # every new session went to duplexserve

        # duplexserve-1's sessions stream on through nginx while it drains.
        await asyncio.gather(*(s.exchange(3) for s in old))
        assert stopper.is_alive() and inspect(replica, "{{.State.Running}}") == "true"
        closed = [await s.finish() for s in old + new]
        return closed, stopper

    closed, stopper = asyncio.run(main())
    for c, sent in zip(closed, [5] * 4 + [2] * 2, strict=True):
        assert c["reason"] == "completed", c
        assert c["frames_in"] == c["frames_out"] == sent and c["frames_dropped"] == 0
    stopper.join(60)
    assert stopper.result is not None and stopper.result.returncode == 0, stopper.result
    assert stopper.seconds < 30, stopper.seconds  # drained by itself, not at the grace or a kill
    assert inspect(replica, "{{.State.Running}} {{.State.ExitCode}}") == "false 0"
    assert httpx.get(f"http://{stack.lb}/lb-health", timeout=5).status_code == 200


# ------------------------- the GPU image: the moshi engine, on the CPU here

# The engine's settings in the container and in the reference server outside it: greedy
# decoding in float64 on one thread, so that a session's answer is a function of its input
# alone, whichever torch build (CUDA in the image, CPU here) computes it.
MOSHI_ENV = {
    "DUPLEXSERVE_ENGINE": "moshi", "DUPLEXSERVE_DEVICE": "cpu", "DUPLEXSERVE_MOSHI_GREEDY": "true",
    "DUPLEXSERVE_MOSHI_DTYPE": "float64", "DUPLEXSERVE_MOSHI_THREADS": "1", "DUPLEXSERVE_MAX_SESSIONS": "4",
}
GPU_GRACE_S = 30
NATIVE_FRAMES = 25
HF_REPO = "duplexserve-ci/tiny-pytorch-bf16"
HF_REVISION = "0123456789abcdef0123456789abcdef01234567"
# The CUDA torch is several GB: what the build and the image need on Docker's disk.
GPU_BUILD_GB = 15


@dataclass
class Checkpoint:
    folder: Path  # a released repository's layout (config.json, safetensors, tokenizer)
    hf_home: Path  # the same files as a Hugging Face cache: hub/models--OWNER--NAME/...


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Checkpoint:
    """The tiny preset with random weights, written as tests/test_moshi_checkpoints.py
    writes a released checkpoint, readable by the container's user (10001)."""
    from tests.test_moshi_checkpoints import write_checkpoint
    from tests.test_moshi_engine import _tokenizer

    tmp = tmp_path_factory.mktemp("gpu-checkpoint")
    _tokenizer(tmp / "spm.model")
    folder = tmp / "tiny-pytorch-bf16"
    write_checkpoint(folder, "tiny", tmp / "spm.model")
    hf_home = tmp / "hf"
    repo = hf_home / "hub" / f"models--{HF_REPO.replace('/', '--')}"
    shutil.copytree(folder, repo / "snapshots" / HF_REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HF_REVISION)
    for path in [tmp, *tmp.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return Checkpoint(folder, hf_home)


@dataclass
class Reference:
    native: Any  # tests.native_client.Result of NATIVE_FRAMES frames
    chat_text: list[str]  # the text of the /api/chat session


@pytest.fixture(scope="module")
def host_reference(tiny_checkpoint, tmp_path_factory) -> Iterator[Reference]:
    """The same checkpoint with the same settings, served outside any container."""
    from tests.conftest import start_server

    env = {**MOSHI_ENV, "DUPLEXSERVE_MOSHI_WEIGHTS": str(tiny_checkpoint.folder)}
    server = start_server(str(tmp_path_factory.mktemp("gpu-reference")), env=env, timeout=120)
    try:
        native = native_session(f"127.0.0.1:{server.port}")
        chat = chat_session(f"127.0.0.1:{server.port}")
        yield Reference(native, chat.text)
    finally:
        server.stop()


def native_session(http: str, frames: int = NATIVE_FRAMES) -> Any:
    """A duplex/1 session of ``frames`` frames (20 ms apart), checked to end completed."""
    sent = frames_of(frames, seed=23)
    result = asyncio.run(converse(f"ws://{http}/v1/duplex", sent, gap=0.02, timeout=120))
    assert result.created["engine"] == "moshi", result.created
    closed = result.closed
    assert closed is not None and closed["reason"] == "completed", result.events
    # Every frame answered; after input.end a model with a tail may add frames (frames_tail).
    tail = closed.get("frames_tail", 0)
    assert (closed["frames_in"], closed["frames_out"], closed["frames_dropped"]) == (frames, frames + tail, 0)
    assert [len(f) for f in result.frames] == [1920 * 4] * (frames + tail)  # float32, 80 ms each
    return result


def texts(result: Any) -> list[tuple[int, str]]:
    return [(e["frame"], e["text"]) for e in result.of_type("text.delta")]


def chat_session(http: str) -> Any:
    """Kyutai's protocol at /api/chat with a client that behaves like Kyutai's (Ogg/Opus)."""
    from tests.test_moshi_protocol import WEB_QUERY, voice
    from tests.test_moshi_protocol import converse as kyutai_converse

    sent = voice(NATIVE_FRAMES)
    chat = asyncio.run(kyutai_converse(f"ws://{http}/api/chat?{WEB_QUERY}", sent))
    assert chat.handshake == b"\x00" + bytes(8) and chat.errors == []
    assert chat.first_audio.startswith(b"OggS") and b"OpusHead" in chat.first_audio
    assert len(chat.pcm) >= len(sent) - 1920
    return chat


def assert_same_answer(got: Any, reference: Any) -> None:
    """Frame for frame the reference's audio, token for token its text."""
    assert texts(got) == texts(reference)
    assert len(got.frames) == len(reference.frames)
    # Same input, same weights, same greedy float64 computation; the torch builds differ
    # (CUDA's in the image, the CPU one outside), hence a tolerance far below one LSB of
    # 16-bit audio (measured here: identical to the bit).
    audio, expected = (np.frombuffer(b"".join(r.frames), np.float32) for r in (got, reference))
    np.testing.assert_allclose(audio, expected, rtol=0, atol=1e-6)


@pytest.fixture(scope="session")
def gpu_image(base, request) -> Iterator[str]:
    """docker/Dockerfile.gpu on the same Debian base, its time and size in the report."""
    require_room(GPU_BUILD_GB, "the GPU image")
    name = f"duplexserve-ci:gpu-{RUN}"
    before = dangling()
    built: list[str] = []
    try:
        build_timed(base.report, "gpu", name, "docker", "build", "--network", "host", "--quiet",
                    "-f", "docker/Dockerfile.gpu", "--build-arg", f"BASE_IMAGE={base.name}",
                    "-t", name, ".", timeout=1800)
        built.append(name)
        record(request, base.report, [k for k in ("base", "gpu") if k in base.report])
        yield name
    finally:
        remove_images(built, before)


def test_gpu_image_has_cuda_torch_and_moshi_as_install_moshi_pins_them(gpu_image) -> None:
    script = (ROOT / "scripts" / "install-moshi.sh").read_text()
    torch_pin = script.split('DUPLEXSERVE_TORCH_VERSION:-', 1)[1].split("}", 1)[0]
    moshi_pin = script.split('"moshi==', 1)[1].split('"', 1)[0]
    dockerfile = (DOCKER_DIR / "Dockerfile.gpu").read_text()
    assert f"ARG TORCH_VERSION={torch_pin}\n" in dockerfile
    # pip compiled the venv's bytecode: the server may not write it, and a process compiling
    # some 2,000 modules from source takes seconds more to start (docs/moshi-engine.md).
    probe = ("import json, os, importlib.util, torch, torch._dynamo.utils as u, moshi, "
             "duplexserve.engine_bridge.moshi.engine; from duplexserve.codecs.libopus import LIBOPUS; "
             "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
             "'moshi': moshi.__version__, 'libopus': LIBOPUS is not None, "
             "'bytecode': os.path.exists(importlib.util.cache_from_source(u.__file__))}))")
    out = sh("docker", "run", "--rm", "--entrypoint", "python", gpu_image, "-c", probe, timeout=120)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["torch"].split("+")[0] == torch_pin and found["moshi"] == moshi_pin, found
    assert found["cuda"], f"torch {found['torch']} in the image is not a CUDA build"  # e.g. 13.0
    assert found["bytecode"] and found["libopus"], found
    assert inspect(gpu_image, "{{.Config.User}}") == "10001"


def test_gpu_image_serves_a_read_only_checkpoint_as_non_root_healthy_and_drains(
    gpu_image, tiny_checkpoint, host_reference
) -> None:
    env = [f"{k}={v}" for k, v in MOSHI_ENV.items()] + [f"DUPLEXSERVE_DRAIN_GRACE_S={GPU_GRACE_S}"]
    mount = ("--volume", f"{tiny_checkpoint.folder}:/models:ro")  # the image's DUPLEXSERVE_MOSHI_WEIGHTS
    with container(gpu_image, *env, run_args=mount, start_s=180) as (name, http):
        r = ready(http)
        assert r.status_code == 200 and r.json()["engine"] == "moshi", r.text
        assert inspect(name, "{{range .Mounts}}{{.Destination}} {{.RW}};{{end}}") == "/models false;"
        assert inspect(name, "{{.Config.User}}") == "10001" and pid1_uids(name) == {"10001"}

        # Exact: two sessions of the same audio give the same bytes, and both the answer of
        # the server outside the container (same checkpoint, same settings).
        first, second = native_session(http), native_session(http)
        assert second.frames == first.frames and texts(second) == texts(first)
        assert texts(first), "the tiny checkpoint's tokenizer turns some tokens into text"
        assert_same_answer(first, host_reference.native)

        # Kyutai's protocol: Ogg/Opus both ways, the same text as outside the container.
        assert chat_session(http).text == host_reference.chat_text

        wait_for("healthy", lambda: inspect(name, "{{.State.Health.Status}}") == "healthy", timeout=45)

        # docker stop drains: the live session streams on and ends completed, new ones are
        # turned away, and the server exits 0 by itself well inside the grace period.
        url = f"ws://{http}/v1/duplex"
        sent = frames_of(NATIVE_FRAMES, seed=23)

        async def stream(live: Live, frames: list[bytes]) -> list[bytes]:
            for frame in frames:
                await live.ws.send(frame)
            got: list[bytes] = []
            while len(got) < len(frames):
                msg = await asyncio.wait_for(live.ws.recv(), 30)
                if isinstance(msg, bytes):
                    got.append(msg)
            return got

        async def main() -> tuple[list[bytes], dict[str, Any], Stopper]:
            live = await Live.open(url)
            got = await stream(live, sent[:4])
            stopper = Stopper("docker", "stop", "--time", str(GPU_GRACE_S + 30), name)
            stopper.start()
            await asyncio.to_thread(wait_for, "draining", lambda: draining(http), 15)
            refused = await converse(url, [], timeout=10)
            assert refused.close_code == 1013, refused
            got += await stream(live, sent[4:10])
            assert stopper.is_alive(), "the container stopped before its session ended"
            return got, await live.finish(), stopper

        got, closed, stopper = asyncio.run(main())
        assert closed["reason"] == "completed", closed
        tail = closed.get("frames_tail", 0)
        assert (closed["frames_in"], closed["frames_out"], closed["frames_dropped"]) == (10, 10 + tail, 0)
        assert got == first.frames[:10]  # a causal model: the first 10 frames of the same answer
        stopper.join(GPU_GRACE_S + 40)
        assert stopper.result is not None and stopper.result.returncode == 0, stopper.result
        assert stopper.seconds < GPU_GRACE_S, stopper.seconds
        assert inspect(name, "{{.State.ExitCode}} {{.State.OOMKilled}}") == "0 false"


def test_gpu_image_serves_a_repository_from_a_read_only_hugging_face_cache(
    gpu_image, tiny_checkpoint, host_reference
) -> None:
    # As docker/compose.yaml runs it: the host's cache read-only at the image's HF_HOME,
    # the repository by name, offline (HF_HUB_OFFLINE=1 in the image), no folder.
    env = [f"{k}={v}" for k, v in MOSHI_ENV.items()]
    env += [f"DUPLEXSERVE_MOSHI_HF_REPO={HF_REPO}", "DUPLEXSERVE_MOSHI_WEIGHTS="]
    mount = ("--volume", f"{tiny_checkpoint.hf_home}:/huggingface:ro")
    with container(gpu_image, *env, run_args=mount, start_s=180) as (name, http):
        answer = native_session(http)
        assert answer.created["model"] == host_reference.native.created["model"] == "tiny-pytorch-bf16"
        assert_same_answer(answer, host_reference.native)
        assert pid1_uids(name) == {"10001"}


def test_gpu_image_rebuilds_a_code_change_from_its_cached_layers(gpu_image, base, tmp_path, request) -> None:
    """torch and moshi sit in layers before the package: a change to a .py file reinstalls
    the package alone, in seconds."""
    context = tmp_path / "context"
    context.mkdir()
    for item in (".dockerignore", "pyproject.toml", "README.md", "duplexserve", "scripts", "docker"):
        source = ROOT / item
        if source.is_dir():
            shutil.copytree(source, context / item, ignore=shutil.ignore_patterns("__pycache__", "results"))
        else:
            shutil.copy2(source, context / item)
    with (context / "duplexserve" / "__init__.py").open("a") as f:
        f.write(f"\n# a change ({RUN})\n")
    name = f"duplexserve-ci:gpu-rebuild-{RUN}"
    before = dangling()
    start = time.monotonic()
    try:
        out = sh("docker", "build", "--network", "host", "-f", "docker/Dockerfile.gpu",
                 "--build-arg", f"BASE_IMAGE={base.name}", "-t", name, ".", env=BUILD_ENV, cwd=context,
                 timeout=900).stdout
        seconds = time.monotonic() - start
    finally:
        remove_images([name], before)
    steps = {step.split("\n", 1)[0]: step for step in out.split("\nStep ")[1:]}
    cached = {head: "Using cache" in body for head, body in steps.items()}
    assert any("install-moshi.sh" in h and c for h, c in cached.items()), out[-3000:]
    assert any("requirements.txt" in h and c for h, c in cached.items()), out[-3000:]
    assert any("--no-deps --no-build-isolation" in h and not c for h, c in cached.items()), out[-3000:]
    base.report["gpu-rebuild"] = {"seconds": round(seconds, 1), "mb": base.report["gpu"]["mb"]}
    record(request, base.report, ["gpu-rebuild"])
    assert seconds < 120, seconds
