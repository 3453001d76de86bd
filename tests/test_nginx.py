"""Scale-out: the shipped nginx configuration in front of two real server processes.

nginx (Debian's package) runs in the foreground on loopback with docker/nginx/duplexserve.conf,
its two upstream names replaced by the two servers' ports. The replicas run with
``--refuse-with-http-503``, as docs/deploy-compose.md tells operators to.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import websockets.asyncio.client

from tests.conftest import ServerProcess, free_port

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
SHIPPED_CONF = Path(__file__).resolve().parent.parent / "docker" / "nginx" / "duplexserve.conf"
TLS_CONF = SHIPPED_CONF.with_name("tls.conf")
FRAME_BYTES = 1920 * 4
REPLICA = ("--refuse-with-http-503",)
#: How long to wait for nginx to try again a replica that said 503 (``max_fails=1
#: fail_timeout=2s``): nginx keeps its clock in whole seconds, so "2 s" can last up to 3.
FAIL_TIMEOUT_WAIT_S = 3.2

pytestmark = pytest.mark.skipif(
    not os.path.exists(NGINX), reason=f"nginx not installed at {NGINX} (Debian package nginx)"
)


@dataclass(frozen=True)
class TLS:
    """docker/nginx/tls.conf's listeners on loopback: its port, certificate files and the
    plain-HTTP port that redirects to it (a free one if 0)."""

    port: int
    cert: Path
    key: Path
    http_port: int = 0


def nginx_conf(tmp: Path, listen: int, upstreams: list[int], tls: TLS | None = None) -> Path:
    """The shipped site config (or the one SHIPPED_CONF names) on loopback ports, inside a
    minimal main config of our own: replica i (``duplexserve``, ``duplexserve-i``) on
    ``upstreams[i]``, in the pool and in its own upstream (the one a resume goes to). With
    ``tls``, docker/nginx/tls.conf too, on ``tls.port`` with ``tls``'s certificate."""
    site = SHIPPED_CONF.read_text()
    for index, port in enumerate(upstreams):
        name = "duplexserve" if index == 0 else f"duplexserve-{index}"
        line = re.compile(rf"server {name}:8998(?=[ ;])")
        assert len(line.findall(site)) == 2, f"{SHIPPED_CONF}: not one pool line and one upstream for {name}"
        site = line.sub(f"server 127.0.0.1:{port}", site)
    assert site.count("listen 8080;") == 1
    site = site.replace("listen 8080;", f"listen 127.0.0.1:{listen};")
    (tmp / "duplexserve.conf").write_text(site)
    if tls is not None:
        front = TLS_CONF.read_text()
        for shipped, here in (("listen 8443 ssl;", f"listen 127.0.0.1:{tls.port} ssl;"),
                              ("/etc/nginx/tls/tls.crt", str(tls.cert)),
                              ("/etc/nginx/tls/tls.key", str(tls.key)),
                              ("http://127.0.0.1:8080;", f"http://127.0.0.1:{listen};"),
                              ("listen 8081;", f"listen 127.0.0.1:{tls.http_port or free_port()};")):
            assert front.count(shipped) == 1, f"{TLS_CONF}: no single {shipped!r}"
            front = front.replace(shipped, here)
        (tmp / "tls.conf").write_text(front)
    user = "user root;" if os.geteuid() == 0 else ""  # workers must reach the 0700 tmp dir
    main = f"""
{user}
daemon off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log info;
events {{ worker_connections 1024; }}
http {{
    log_format upstreams '$request_uri $status $upstream_addr $upstream_status "$http_cookie"';
    access_log {tmp}/access.log upstreams;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    include {tmp}/duplexserve.conf;
    {f"include {tmp}/tls.conf;" if tls else ""}
}}
"""
    path = tmp / "nginx.conf"
    path.write_text(main)
    return path


@contextlib.contextmanager
def nginx_in_front(tmp: Path, *replicas: ServerProcess, tls: TLS | None = None) -> Iterator[str]:
    """Start nginx before the replicas, in order; yields its ws:// base address (wss:// on
    the TLS listener with ``tls``)."""
    tmp = tmp / "nginx"
    tmp.mkdir()
    port = free_port()
    conf = nginx_conf(tmp, port, [r.port for r in replicas], tls)
    with open(tmp / "stderr.log", "wb") as log:
        proc = subprocess.Popen([NGINX, "-p", str(tmp), "-c", str(conf), "-e", str(tmp / "error.log")],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 15
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"nginx exited: {(tmp / 'stderr.log').read_text()}"
                                   f"{(tmp / 'error.log').read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/lb-health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "nginx did not start"
            time.sleep(0.1)
        yield f"wss://127.0.0.1:{tls.port}/v1/duplex" if tls else f"ws://127.0.0.1:{port}/v1/duplex"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def sessions(server: ServerProcess) -> int:
    return int(httpx.get(server.http + "/ready", timeout=5).json()["sessions"])


class Live:
    """One open duplex/1 session that exchanges echo frames on demand."""

    def __init__(self, ws: Any, created: dict[str, Any]) -> None:
        self.ws, self.created, self.sent = ws, created, 0

    @classmethod
    async def open(cls, url: str) -> Live:
        ws = await websockets.asyncio.client.connect(url, compression=None, max_size=None, open_timeout=10)
        created = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert created["type"] == "session.created", created
        return cls(ws, created)

    async def exchange(self, frames: int) -> None:
        """Send ``frames`` frames and check that the same bytes come back, in order."""
        rng = np.random.default_rng(self.sent)
        audio = [(rng.random(1920, dtype=np.float32) - 0.5).tobytes() for _ in range(frames)]
        for frame in audio:
            await self.ws.send(frame)
        self.sent += frames
        got: list[bytes] = []
        while len(got) < frames:
            msg = await asyncio.wait_for(self.ws.recv(), 10)
            if isinstance(msg, bytes):
                got.append(msg)
        assert got == audio

    async def finish(self) -> dict[str, Any]:
        """input.end, then read to the close; returns session.closed."""
        await self.ws.send(json.dumps({"type": "input.end"}))
        closed: dict[str, Any] = {}
        with contextlib.suppress(websockets.ConnectionClosed):
            while True:
                msg = await asyncio.wait_for(self.ws.recv(), 10)
                if isinstance(msg, str) and json.loads(msg)["type"] == "session.closed":
                    closed = json.loads(msg)
        return closed


async def refused_status(url: str) -> int:
    """The HTTP status of a refused upgrade (fails if the session is accepted)."""
    with pytest.raises(websockets.InvalidStatus) as info:
        await Live.open(url)
    return info.value.response.status_code


def test_sessions_spread_over_both_replicas(server_factory, tmp_path) -> None:
    a = server_factory("--max-sessions", "8", *REPLICA)
    b = server_factory("--max-sessions", "8", *REPLICA)

    async def main(url: str) -> None:
        live = [await Live.open(url) for _ in range(6)]
        await asyncio.gather(*(s.exchange(3) for s in live))
        # least_conn: each new session went to the replica holding fewer.
        assert (sessions(a), sessions(b)) == (3, 3)
        for s in live:
            closed = await s.finish()
            assert closed["reason"] == "completed" and closed["frames_out"] == 3

    with nginx_in_front(tmp_path, a, b) as url:
        asyncio.run(main(url))


def test_a_full_replica_gets_no_sessions(server_factory, tmp_path) -> None:
    a = server_factory("--max-sessions", "2", *REPLICA)
    b = server_factory("--max-sessions", "6", *REPLICA)

    async def main(url: str) -> None:
        # Fill A directly: nginx cannot know, only A's 503 can tell it.
        direct = [await Live.open(a.ws()) for _ in range(2)]
        assert await refused_status(a.ws()) == 503  # the upgrade itself is refused
        via_lb = [await Live.open(url) for _ in range(6)]
        await asyncio.gather(*(s.exchange(2) for s in via_lb))
        assert (sessions(a), sessions(b)) == (2, 6)
        # Every replica full: the client is told 503, also once nginx has marked both
        # replicas unavailable for a moment ("no live upstreams", a 502 of nginx's own).
        for _ in range(3):
            assert await refused_status(url) == 503
        for s in direct + via_lb:
            await s.finish()

    with nginx_in_front(tmp_path, a, b) as url:
        asyncio.run(main(url))


def test_a_draining_replica_finishes_its_sessions(server_factory, tmp_path) -> None:
    a = server_factory("--max-sessions", "8", "--drain-grace-s", "60", *REPLICA)
    b = server_factory("--max-sessions", "8", *REPLICA)

    async def main(url: str) -> None:
        old = [await Live.open(url) for _ in range(4)]
        await asyncio.gather(*(s.exchange(2) for s in old))
        assert (sessions(a), sessions(b)) == (2, 2)

        a.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while True:  # A stops admitting: /ready says draining (or A stopped listening)
            with contextlib.suppress(httpx.HTTPError):
                ready = httpx.get(a.http + "/ready", timeout=2)
                if ready.status_code == 503 and ready.json()["draining"]:
                    break
            assert time.monotonic() < deadline, "A never started draining"
            await asyncio.sleep(0.1)

        new = [await Live.open(url) for _ in range(3)]
        await asyncio.gather(*(s.exchange(2) for s in new))
        assert sessions(b) == 2 + 3  # every new session went to B

        # A's own sessions go on streaming while it drains, and end normally.
        await asyncio.gather(*(s.exchange(3) for s in old))
        assert a.proc.poll() is None, "A exited before its sessions finished"
        for s in old + new:
            closed = await s.finish()
            assert closed["reason"] == "completed", closed
            assert closed["frames_in"] == closed["frames_out"] == s.sent and closed["frames_dropped"] == 0

    with nginx_in_front(tmp_path, a, b) as url:
        asyncio.run(main(url))
    # With its last session gone, A exits by itself, long before its grace period ends.
    assert a.proc.wait(15) == 0, a.log()
