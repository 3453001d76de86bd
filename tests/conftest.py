"""Shared fixtures: a real server process on a loopback port, and a native client."""

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
            env={**os.environ, **(env or {})},
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
