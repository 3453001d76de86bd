"""Shared fixtures: a real server process on a loopback port, a native client, and the Docker
images (built once per test run for every test file that asks for them)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests import docker_images

#: The Python that runs the servers under test: this one, or (scripts/test-lowest.sh) a venv
#: holding the lowest versions pyproject.toml admits, while the clients stay this venv's.
SERVER_PYTHON = os.environ.get("DUPLEXSERVE_TEST_SERVER_PYTHON") or sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    port: int
    proc: subprocess.Popen[bytes]
    log_path: str

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def ws(self, path: str = "/v1/duplex", query: str = "") -> str:
        return f"ws://127.0.0.1:{self.port}{path}" + (f"?{query}" if query else "")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.http + "/metrics", timeout=5).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


#: What a test's server gets unless the test says otherwise. The overload manager sheds new
#: sessions past 50 ms of loop lag sustained 200 ms: on this 2-core machine, with a CPU model
#: and other servers in the same run, a loaded loop is the machine's, not an attack's, so the
#: tests that are not about overload give it 1 s (tests/test_overload.py sets its own).
TEST_ENV = {"DUPLEXSERVE_OVERLOAD_LAG_MS": "1000"}


def start_server(
    tmp_dir: str, *args: str, env: dict[str, str] | None = None, timeout: float = 60.0
) -> ServerProcess:
    """Start ``duplexserve serve`` with ``args`` and wait until /health answers (a server
    whose engine imports a large library, vLLM, may take longer than the default)."""
    port = free_port()
    log_path = os.path.join(tmp_dir, f"server-{port}.log")
    with open(log_path, "wb") as log:  # the child keeps its own handle
        proc = subprocess.Popen(
            [SERVER_PYTHON, "-m", "duplexserve", "serve", "--port", str(port),
             "--log-level", "warning", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**TEST_ENV, **os.environ, **(env or {})},
        )
    server = ServerProcess(port, proc, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.http + "/health", timeout=1).status_code == 200:
                return server
        time.sleep(0.1)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server did not start:\n{server.log()}")


@pytest.fixture
def server_factory(tmp_path) -> Iterator[Callable[..., ServerProcess]]:
    """Start servers with any flags; all are stopped at the end of the test."""
    started: list[ServerProcess] = []

    def make(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        server = start_server(str(tmp_path), *args, env=env)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """One default server (synthetic echo) shared by a test module."""
    server = start_server(str(tmp_path_factory.mktemp("echo")), "--max-sessions", "64")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def personaplex_checkpoint(tmp_path_factory) -> Path:
    """A tiny PersonaPlex checkpoint with its voices (tests/personaplex_checkpoint.py), built
    once a test session."""
    pytest.importorskip("moshi")
    from tests.personaplex_checkpoint import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("personaplex"))


# ------------------------------------------ the Docker images, built once per test run
# Here, not in a test file, so that every file of the `docker` marker shares one build of
# each image (tests/docker_images.py has the steps; each image is built only if asked for).

@pytest.fixture(scope="session")
def base(request) -> Iterator[docker_images.Base]:
    """The base from Debian packages, made once per run (or DUPLEXSERVE_DOCKER_BASE)."""
    docker_images.require_docker()
    given = os.environ.get("DUPLEXSERVE_DOCKER_BASE")
    made = docker_images.Base(given or f"duplexserve-ci:base-{docker_images.RUN}")
    try:
        if not given:
            docker_images.build_timed(made.report, "base", made.name,
                                      "scripts/docker-base.sh", "--tag", made.name)
            docker_images.record(request, made.report, ["base"])
        yield made
    finally:
        docker_images.remove_images([] if given else [made.name], docker_images.dangling())


def _built(request, base: docker_images.Base, label: str, context: str, *build_args: str) -> Iterator[str]:
    """docker build of image ``label`` on the base; removed at the end of the run, and with
    it the untagged first stage that the legacy builder leaves of a multi-stage build."""
    name = f"duplexserve-ci:{label}-{docker_images.RUN}"
    dangling_before = docker_images.dangling()
    built: list[str] = []
    try:
        docker_images.build_timed(base.report, label, name, "docker", "build", "--network", "host",
                                  "--quiet", *build_args, "-t", name, context)
        built.append(name)
        docker_images.record(request, base.report, [label])
        yield name
    finally:
        docker_images.remove_images(built, dangling_before)


@pytest.fixture(scope="session")
def cpu_image(request, base) -> Iterator[str]:
    yield from _built(request, base, "cpu", ".", "-f", "docker/Dockerfile",
                      "--build-arg", f"PYTHON_IMAGE={base.name}")


@pytest.fixture(scope="session")
def loadgen_image(request, base) -> Iterator[str]:
    yield from _built(request, base, "loadgen", ".", "-f", "docker/Dockerfile",
                      "--build-arg", f"PYTHON_IMAGE={base.name}", "--build-arg", "EXTRAS=loadgen")


@pytest.fixture(scope="session")
def nginx_image(request, base) -> Iterator[str]:
    yield from _built(request, base, "nginx", "docker/nginx", "--build-arg", f"BASE_IMAGE={base.name}")


@pytest.fixture(scope="session")
def images(base, cpu_image, loadgen_image, nginx_image) -> docker_images.Images:
    return docker_images.Images(base=base.name, cpu=cpu_image, loadgen=loadgen_image, nginx=nginx_image,
                                report=base.report)
