"""Updating replicas behind the shipped nginx without an outage (issue 75; scripts/compose-update.sh).

Two real server processes behind Debian's nginx with docker/nginx/duplexserve.conf and the
shipped main configuration's ``worker_shutdown_timeout``. The update is the script's sequence,
replica by replica: SIGTERM (the drain), a new process on the same address, wait for its
/ready, ``nginx -s reload``. Meanwhile a probe opens a new session through nginx every 100 ms,
and a call on each replica goes on: every probe is admitted, the calls complete with every
frame, and the call on the second replica outlives the reload by more than the 30 s that the
old ``worker_shutdown_timeout`` gave it.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests import conftest, test_nginx
from tests.conftest import ServerProcess, start_server
from tests.test_nginx import NGINX, REPLICA, Live, nginx_in_front, sessions

MAIN_CONF = Path(__file__).resolve().parent.parent / "docker" / "nginx" / "nginx.conf"
#: Past the 30 s the old nginx.conf gave a reloaded worker's calls.
HOLD_PAST_RELOAD_S = 33

pytestmark = pytest.mark.skipif(not Path(NGINX).exists(), reason="nginx not installed (Debian package nginx)")


def shipped_shutdown_timeout() -> str:
    found = re.findall(r"^worker_shutdown_timeout \S+;$", MAIN_CONF.read_text(), re.M)
    assert len(found) == 1, f"{MAIN_CONF}: no single worker_shutdown_timeout"
    return found[0]


def restarted(old: ServerProcess, folder: str, monkeypatch: pytest.MonkeyPatch) -> ServerProcess:
    """A new server process on ``old``'s port (compose's recreated container under its name)."""
    with monkeypatch.context() as m:
        m.setattr(conftest, "free_port", lambda: old.port)
        return start_server(folder, "--max-sessions", "4", *REPLICA)


def wait_ready(server: ServerProcess, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(server.http + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{server.http} not ready")


def test_one_replica_at_a_time_with_nginx_reload(server_factory, tmp_path, monkeypatch) -> None:
    timeout = shipped_shutdown_timeout()
    original = test_nginx.nginx_conf

    def with_shipped_timeout(tmp, listen, upstreams, tls=None):  # type: ignore[no-untyped-def]
        path = original(tmp, listen, upstreams, tls)
        path.write_text(path.read_text().replace("daemon off;", f"daemon off;\n{timeout}", 1))
        return path

    monkeypatch.setattr(test_nginx, "nginx_conf", with_shipped_timeout)
    a = server_factory("--max-sessions", "4", *REPLICA)
    b = server_factory("--max-sessions", "4", *REPLICA)
    folder = str(tmp_path)
    new: list[ServerProcess] = []

    def reload() -> None:
        nginx_dir = tmp_path / "nginx"
        subprocess.run([NGINX, "-p", str(nginx_dir), "-c", str(nginx_dir / "nginx.conf"),
                        "-e", str(nginx_dir / "error.log"), "-s", "reload"], check=True, timeout=30)

    async def probe(url: str, stop: asyncio.Event, failed: list[str], done: list[int]) -> None:
        while not stop.is_set():
            try:
                live = await Live.open(url)
                await live.finish()
                done.append(1)
            except Exception as exc:  # any probe not admitted is the outage this test is about
                failed.append(repr(exc))
            await asyncio.sleep(0.1)

    async def update(server: ServerProcess, call: Live) -> ServerProcess:
        """compose-update.sh's steps for one replica, its call going on through the drain."""
        server.proc.send_signal(signal.SIGTERM)
        await call.exchange(3)
        closed = await call.finish()
        assert closed["reason"] == "completed" and closed["frames_out"] == call.sent
        await asyncio.to_thread(server.proc.wait, 60)
        fresh = await asyncio.to_thread(restarted, server, folder, monkeypatch)
        new.append(fresh)
        await asyncio.to_thread(wait_ready, fresh)
        await asyncio.to_thread(reload)
        return fresh

    async def main(url: str) -> None:
        call_a, call_b = await Live.open(url), await Live.open(url)
        assert (sessions(a), sessions(b)) == (1, 1)  # least_conn: one each
        await asyncio.gather(call_a.exchange(2), call_b.exchange(2))
        stop, failed, done = asyncio.Event(), [], []
        prober = asyncio.create_task(probe(url, stop, failed, done))
        first = a if sessions(a) else b
        first_call = await which_call(first, call_a, call_b)
        other_call = call_b if first_call is call_a else call_a
        await update(first, first_call)
        # The other call outlives the reload past the old 30 s: the old worker still carries it.
        deadline = time.monotonic() + HOLD_PAST_RELOAD_S
        while time.monotonic() < deadline:
            await other_call.exchange(1)
            await asyncio.sleep(1)
        await update(b if first is a else a, other_call)
        await asyncio.sleep(1)
        stop.set()
        await prober
        assert failed == [] and len(done) > 20
        # Both new replicas take calls.
        live = [await Live.open(url) for _ in range(4)]
        assert sorted(sessions(s) for s in new) == [2, 2]
        for s in live:
            await s.finish()

    async def which_call(server: ServerProcess, *calls: Live) -> Live:
        """The call ``server`` holds: end-to-end, the one whose frames raise its frame count."""
        before = frames_in(server)
        await calls[0].exchange(1)
        return calls[0] if frames_in(server) > before else calls[1]

    try:
        with nginx_in_front(tmp_path, a, b) as url:
            asyncio.run(main(url))
    finally:
        for s in new:
            s.stop()


def frames_in(server: ServerProcess) -> int:
    text = httpx.get(server.http + "/metrics", timeout=5).text
    found = re.search(r"^duplexserve_frames_in_total (\S+)$", text, re.M)
    assert found is not None
    return int(float(found.group(1)))
