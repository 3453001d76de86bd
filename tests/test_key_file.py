"""``--api-keys-file``: keys rotated without a restart (issue 75), and /v1/models behind the key.

The file is laid out as Kubernetes mounts a Secret volume: ``keys`` is a symlink through
``..data``, itself a symlink to a directory of the current version, swapped atomically for a
new one on an update. A real server watches it; a live session opened with key A goes on
streaming after A is taken out, while a new one with A is refused as docs/protocol.md says for
a bad key (close 1008, ``unauthorized``) and B is let in.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import websockets
import websockets.asyncio.client

from tests.conftest import free_port
from tests.test_nginx import Live
from tests.test_reliability import echo_ok

A, B = "sk-rotate-a-0123456789", "sk-rotate-b-9876543210"


def secret_volume(root: Path, text: str, version: int) -> Path:
    """``root/keys`` as kubelet writes a Secret volume: ``keys -> ..data/keys``, ``..data ->
    ..vN``; a new version is a new directory and an atomic rename of a new ``..data`` link."""
    version_dir = root / f"..v{version}"
    version_dir.mkdir()
    (version_dir / "keys").write_text(text)
    (root / "..data_tmp").symlink_to(version_dir.name)
    os.replace(root / "..data_tmp", root / "..data")
    if not (root / "keys").is_symlink():
        (root / "keys").symlink_to("..data/keys")
    return root / "keys"


async def refused(url: str) -> bool:
    """Whether a new session is refused as for a bad key (a session opened is closed at once)."""
    async with websockets.asyncio.client.connect(url, compression=None) as ws:
        first = json.loads(await asyncio.wait_for(ws.recv(), 10))
        if first["type"] == "session.created":
            return False
        with contextlib.suppress(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 10)
    return ws.close_code == 1008 and first["code"] == "unauthorized"


def test_a_key_taken_out_of_the_file_is_refused_within_seconds_and_live_sessions_go_on(
        server_factory, tmp_path) -> None:
    keys = secret_volume(tmp_path, f"# the fleet's keys\n{A}\n\n", 1)
    server = server_factory("--api-keys-file", str(keys), "--max-session-s", "600")
    bearer = {"Authorization": f"Bearer {A}"}
    assert httpx.get(server.http + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(server.http + "/v1/models", headers=bearer, timeout=10).status_code == 200

    async def main() -> None:
        live = await Live.open(server.ws(query=f"token={A}"))
        await live.exchange(3)
        assert await refused(server.ws(query=f"token={B}"))
        secret_volume(tmp_path, f"{B}\n", 2)  # A revoked, B issued
        deadline = time.monotonic() + 30
        while not await refused(server.ws(query=f"token={A}")):
            assert time.monotonic() < deadline, "A still let in 30 s after it left the file"
            await live.exchange(1)  # the live session streams on meanwhile
            await asyncio.sleep(0.2)
        assert await echo_ok(server.ws(query=f"token={B}"))
        # A file that names no key (half-written, emptied by mistake) keeps the last keys: it
        # never opens the server to anyone.
        secret_volume(tmp_path, "# nothing yet\n", 3)
        deadline = time.monotonic() + 30
        while "names no key" not in server.log():  # the server has read it, and said so
            assert time.monotonic() < deadline, "the emptied file was never read"
            await asyncio.sleep(0.2)
        assert await refused(server.ws())
        assert await echo_ok(server.ws(query=f"token={B}"))
        await live.exchange(3)  # opened with A: checked at its start, it goes on to its end
        closed = await live.finish()
        assert closed["reason"] == "completed" and closed["frames_out"] == live.sent

    asyncio.run(main())
    assert httpx.get(server.http + "/v1/models", headers=bearer, timeout=10).status_code == 401
    assert httpx.get(server.http + "/v1/models", params={"token": B}, timeout=10).status_code == 200
    log = server.log()
    assert "names no key" in log and "keeping the 1 keys" in log
    assert A not in log and B not in log


def test_sighup_reads_the_file_again_even_when_its_stamp_did_not_change(server_factory, tmp_path) -> None:
    """An edit in place that keeps the size and the modification time escapes the poll;
    SIGHUP re-reads the file whatever its stamp."""
    assert len(A) == len(B)
    keys = tmp_path / "keys"
    keys.write_text(f"{A}\n")
    stamp = keys.stat()
    server = server_factory("--api-keys-file", str(keys))

    async def main() -> None:
        assert await echo_ok(server.ws(query=f"token={A}"))
        with open(keys, "r+") as f:  # the same inode, size and mtime: the poll sees no change
            f.write(B)
        os.utime(keys, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
        await asyncio.sleep(3)
        assert await echo_ok(server.ws(query=f"token={A}"))
        server.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while not await refused(server.ws(query=f"token={A}")):
            assert time.monotonic() < deadline, "A still let in 30 s after SIGHUP"
            await asyncio.sleep(0.2)
        assert await echo_ok(server.ws(query=f"token={B}"))

    asyncio.run(main())
    assert server.proc.poll() is None  # SIGHUP no longer ends the server


def test_v1_models_needs_the_key_when_keys_are_set(server_factory) -> None:
    server = server_factory("--api-keys", A)
    assert httpx.get(server.http + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(server.http + "/v1/models", params={"token": "wrong"}, timeout=10).status_code == 401
    assert httpx.get(server.http + "/v1/models", headers={"Authorization": f"Bearer {A}"},
                     timeout=10).json()["data"]
    assert httpx.get(server_factory().http + "/v1/models", timeout=10).status_code == 200  # no keys: open


def test_a_key_file_that_cannot_be_read_or_names_no_key_stops_the_server_at_start(tmp_path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("# no key yet\n\n")
    comma = tmp_path / "comma"
    comma.write_text("a,b\n")
    for path, says in ((tmp_path / "missing", "cannot read"), (empty, "names no key"), (comma, "line 1")):
        done = subprocess.run(
            [sys.executable, "-m", "duplexserve", "serve", "--port", str(free_port()),
             "--api-keys-file", str(path)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert "--api-keys-file" in line and says in line, line
