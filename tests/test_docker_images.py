"""The images built and run for real (docs/deploy.md): a base image from Debian packages
(scripts/docker-base.sh), the CPU image, the loadgen image and the nginx image on it,
then the CPU image alone and compose's ``scale`` and ``loadgen`` profiles with
docker/compose.cpu.yaml, all driven from outside the containers through ports published
on 127.0.0.1.

Needs a running Docker engine (Debian's docker.io; .ci/run starts dockerd), mmdebstrap
and docker-compose, and the Debian mirror and the package index that the builds install
from. Without them these tests skip, except under CI (``CI=true``), where they fail: a
missing install step must not pass as a skip.

The base is built once per test run (about a minute on an idle machine); ``DUPLEXSERVE_DOCKER_BASE=IMAGE``
uses an existing one instead, ``DUPLEXSERVE_DOCKER_KEEP=1`` keeps the images afterwards.
The build times and image sizes are printed and written to build/docker-images.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.native_client import converse, signal
from tests.test_nginx import Live, refused_status

ROOT = Path(__file__).resolve().parent.parent
DOCKER_DIR = ROOT / "docker"
RUN = f"{os.getpid()}"
# The legacy builder: it needs nothing from a registry (BuildKit would fetch its
# Dockerfile frontend for a `# syntax=` line, and Debian's docker.io has no buildx).
BUILD_ENV = {**os.environ, "DOCKER_BUILDKIT": "0"}
CPU_GRACE_S = 30

# The first test also waits for the builds (3.5 min idle, 10 under load): a generous limit.
pytestmark = [pytest.mark.docker, pytest.mark.timeout(1800)]


def sh(*args: str, timeout: float = 600, check: bool = True,
       env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout,
                         env=env, cwd=cwd, check=False)
    if check and out.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        )
    return out


def unusable() -> str | None:
    """Why Docker cannot be used here, or None."""
    for tool, package in (("docker", "docker.io"), ("docker-compose", "docker-compose")):
        if shutil.which(tool) is None:
            return f"{tool} not installed (Debian package {package})"
    if not os.environ.get("DUPLEXSERVE_DOCKER_BASE") and shutil.which("mmdebstrap") is None:
        return "mmdebstrap not installed (Debian package mmdebstrap)"
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"],
                          capture_output=True, text=True, check=False)
    if info.returncode != 0:
        return f"no Docker engine (start dockerd, e.g. scripts/dockerd.sh): {info.stderr.strip()[-300:]}"
    return None


def require_docker() -> None:
    reason = unusable()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI must build and run the images: {reason}")
    pytest.skip(reason)


@dataclass
class Images:
    base: str
    cpu: str
    loadgen: str
    nginx: str
    report: dict[str, dict[str, float]] = field(default_factory=dict)


def image_mb(name: str) -> float:
    return int(sh("docker", "image", "inspect", "--format", "{{.Size}}", name).stdout) / 1e6


@pytest.fixture(scope="session")
def images(request) -> Iterator[Images]:
    require_docker()
    names = Images(
        base=os.environ.get("DUPLEXSERVE_DOCKER_BASE") or f"duplexserve-ci:base-{RUN}",
        cpu=f"duplexserve-ci:cpu-{RUN}", loadgen=f"duplexserve-ci:loadgen-{RUN}",
        nginx=f"duplexserve-ci:nginx-{RUN}",
    )
    built: list[str] = []
    # The legacy builder leaves each multi-stage build's first stage as an untagged image:
    # those that appear during this run go too.
    dangling_before = set(sh("docker", "images", "-q", "--filter", "dangling=true").stdout.split())

    def timed(label: str, image: str, *command: str) -> None:
        start = time.monotonic()
        sh(*command, env=BUILD_ENV, timeout=900)
        built.append(image)
        names.report[label] = {"seconds": round(time.monotonic() - start, 1), "mb": round(image_mb(image))}

    try:
        if not os.environ.get("DUPLEXSERVE_DOCKER_BASE"):
            timed("base", names.base, "scripts/docker-base.sh", "--tag", names.base)
        build = ("docker", "build", "--network", "host", "--quiet")
        timed("cpu", names.cpu, *build, "-f", "docker/Dockerfile",
              "--build-arg", f"PYTHON_IMAGE={names.base}", "-t", names.cpu, ".")
        timed("loadgen", names.loadgen, *build, "-f", "docker/Dockerfile",
              "--build-arg", f"PYTHON_IMAGE={names.base}", "--build-arg", "EXTRAS=loadgen",
              "-t", names.loadgen, ".")
        timed("nginx", names.nginx, *build, "--build-arg", f"BASE_IMAGE={names.base}",
              "-t", names.nginx, "docker/nginx")
        summary = ", ".join(f"{k} {v['mb']:.0f} MB in {v['seconds']:.0f} s" for k, v in names.report.items())
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                reporter.write_line(f"\ndocker images built: {summary}")
        (ROOT / "build").mkdir(exist_ok=True)
        (ROOT / "build" / "docker-images.json").write_text(json.dumps(names.report, indent=1) + "\n")
        yield names
    finally:
        if not os.environ.get("DUPLEXSERVE_DOCKER_KEEP") and built:
            sh("docker", "image", "rm", "--force", *built, check=False)
            dangling = set(sh("docker", "images", "-q", "--filter", "dangling=true").stdout.split())
            if dangling - dangling_before:
                sh("docker", "image", "rm", *(dangling - dangling_before), check=False)


# ------------------------------------------------------------------ helpers

def wait_for(what: str, probe, timeout: float = 60.0, every: float = 0.2) -> Any:
    """Call ``probe`` until it returns something true; that value."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError, OSError):
            value = probe()
            if value:
                return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def inspect(container: str, template: str) -> str:
    return sh("docker", "inspect", "--format", template, container).stdout.strip()


def published(container: str, port: int) -> str:
    """host:port on 127.0.0.1 that ``port`` of ``container`` is published on."""
    lines = sh("docker", "port", container, f"{port}/tcp").stdout.split()
    return next(a for a in lines if a.startswith("127.0.0.1:"))


def ready(http: str) -> httpx.Response:
    return httpx.get(f"http://{http}/ready", timeout=5)


def sessions(http: str) -> int:
    return int(ready(http).json()["sessions"])


def draining(http: str) -> bool:
    r = ready(http)
    return r.status_code == 503 and r.json()["draining"]


class Stopper(threading.Thread):
    """``docker stop`` (or any stop command) in the background, timed."""

    def __init__(self, *command: str) -> None:
        super().__init__(daemon=True)
        self.command, self.result, self.seconds = command, None, 0.0

    def run(self) -> None:
        start = time.monotonic()
        self.result = subprocess.run(list(self.command), capture_output=True, text=True, check=False)
        self.seconds = time.monotonic() - start


def frames_of(count: int, seed: int) -> list[bytes]:
    audio = signal(count, seed)
    return [audio[i * 1920:(i + 1) * 1920].tobytes() for i in range(count)]


# -------------------------------------------------- the CPU image on its own

@contextlib.contextmanager
def cpu_container(images: Images, *env: str) -> Iterator[tuple[str, str]]:
    """Run the CPU image detached; yields (container, host:port)."""
    args = [a for e in env for a in ("-e", e)]
    name = f"duplexserve-ci-{RUN}-{time.monotonic_ns()}"
    sh("docker", "run", "--detach", "--name", name, "--publish", "127.0.0.1::8998", *args, images.cpu)
    try:
        http = published(name, 8998)
        wait_for("/health", lambda: httpx.get(f"http://{http}/health", timeout=2).status_code == 200)
        yield name, http
    finally:
        logs = sh("docker", "logs", "--tail", "40", name, check=False)
        sh("docker", "rm", "--force", name, check=False)
        print(logs.stdout, logs.stderr)


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
        status = sh("docker", "exec", name, "cat", "/proc/1/status").stdout
        uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
        assert set(uids) == {"10001"}, status
        assert "duplexserve" in sh("docker", "exec", name, "cat", "/proc/1/cmdline").stdout

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
    (tmp / "models").mkdir()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DUPLEXSERVE_", "COMPOSE_"))}
    env = {
        **clean,
        "DUPLEXSERVE_IMAGE": images.cpu,
        "DUPLEXSERVE_LOADGEN_IMAGE": images.loadgen,
        "DUPLEXSERVE_NGINX_IMAGE": images.nginx,
        "DUPLEXSERVE_MAX_SESSIONS": str(MAX_SESSIONS),
        "DUPLEXSERVE_DRAIN_GRACE_S": "30",
        "DUPLEXSERVE_PUBLISH_PORT": "127.0.0.1:",
        "DUPLEXSERVE_PUBLISH_PORT_1": "127.0.0.1:",
        "DUPLEXSERVE_LB_PORT": "127.0.0.1:",
        "DUPLEXSERVE_WEIGHTS_DIR": str(tmp / "models"),
        "DUPLEXSERVE_RESULTS_DIR": str(results),
        # compose's 65536 open files, or this machine's hard limit where that is lower
        "DUPLEXSERVE_NOFILE": str(min(65536, resource.getrlimit(resource.RLIMIT_NOFILE)[1])),
    }
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
    time.sleep(2.5)  # nginx's fail_timeout for the replicas that said 503


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
