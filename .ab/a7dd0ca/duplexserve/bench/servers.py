"""Start and stop the servers a benchmark measures, each pinned to its own core.

The server under test runs on core 0 (``taskset -c 0``) and the load generator on the
other cores, so the server's CPU per frame and its latency are not shared with the
client's. Pinning is skipped where ``taskset`` or a second core is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass

SERVER_CPU = 0

#: The module each server kind runs with ``python -m``; the echoes take no ``serve`` subcommand.
MODULES = {
    "duplexserve": "duplexserve",
    "echo": "duplexserve.loadgen.echo",
    "picows-echo": "duplexserve.loadgen.echo_picows",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_tree(
    tree: str, flags: list[str], pin: bool = False, cpus: str = ""
) -> tuple[subprocess.Popen[bytes], int]:
    """``duplexserve serve`` from the checkout at ``tree`` (its package, not this one) on a
    free port, optionally pinned to the server's core (or to ``cpus``, a taskset list, with
    every process it starts); returns once ``/health`` answers.
    For A/B runs of two source trees in one machine minute."""
    port = free_port()
    cpus = cpus or (str(SERVER_CPU) if pin else "")
    taskset = ["taskset", "-c", cpus] if cpus and can_pin() else []
    command = [*taskset, sys.executable, "-m", "duplexserve", "serve", "--port", str(port),
               "--log-level", "warning", *flags]  # fmt: skip
    path = os.environ.get("PYTHONPATH")  # the tree first; what else the host needs stays
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (os.path.abspath(tree), path))))
    proc = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server from {tree} did not start")


def can_pin() -> bool:
    """Two cores or more: the client's own affinity may already be narrowed by :func:`pin_client`."""
    return shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2


def raise_priority(nice: int) -> str:
    """Run this process (and what it starts) ahead of other work on a shared machine."""
    if not nice:
        return "default priority"
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except OSError as exc:
        return f"priority unchanged ({exc.strerror})"
    return f"nice {nice} for client and servers"


def pin_client(server_cpu: int = 0) -> str:
    """Move this process (and the children it starts later) off the server's core."""
    global SERVER_CPU
    if not can_pin():
        return "not pinned (one core or no taskset)"
    SERVER_CPU = server_cpu
    others = os.sched_getaffinity(0) - {SERVER_CPU}
    os.sched_setaffinity(0, others)
    return f"client on cores {','.join(map(str, sorted(others)))}, server on core {SERVER_CPU}"


@dataclass
class Server:
    """A server subprocess; ``url`` is its WebSocket base address."""

    name: str
    kind: str  # a key of MODULES: duplexserve | echo | picows-echo
    args: list[str]
    port: int = 0
    pinned: bool = False
    proc: subprocess.Popen[bytes] | None = None
    log_path: str = ""
    nice: int = 0  # scheduling priority (negative: ahead of other work on a shared machine)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/duplex"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, pin: bool = True, timeout: float = 60.0) -> Server:
        self.port = free_port()
        command = [sys.executable, "-m", MODULES[self.kind]]
        if self.kind == "duplexserve":
            command.append("serve")
        command += ["--port", str(self.port), "--log-level", "warning", *self.args]
        self.pinned = pin and can_pin()
        if self.pinned:
            command = ["taskset", "-c", str(SERVER_CPU), *command]
        adjust = self.nice - os.getpriority(os.PRIO_PROCESS, 0)  # children inherit ours
        if self.nice and adjust:
            command = ["nice", "-n", str(adjust), *command]
        fd, self.log_path = tempfile.mkstemp(prefix=f"bench-{self.kind}-", suffix=".log")
        log = os.fdopen(fd, "wb")
        self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        health = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(health, timeout=1) as r:
                if r.status == 200:
                    if self.pinned and os.sched_getaffinity(self.pid) != {SERVER_CPU}:
                        self.stop()
                        raise RuntimeError(f"{self.name} is not pinned to core {SERVER_CPU}")
                    return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} did not start:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(OSError):
            if self.log_path:
                os.unlink(self.log_path)


@contextlib.contextmanager
def running(*servers: Server, pin: bool = True, nice: int = 0):  # type: ignore[no-untyped-def]
    started: list[Server] = []
    try:
        for server in servers:
            server.nice = nice
            started.append(server.start(pin))
        yield servers
    finally:
        for server in started:
            server.stop()
