"""ICE servers: ``--ice-servers`` reaches a real TURN server (Debian's coturn, on loopback),
whose relay the answer then offers, and what browsers are told of it
(``GET /v1/realtime/ice_servers``: STUN only, never a credential)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from duplexserve.server.transports.webrtc.peer import stun_for_browsers
from tests.conftest import free_port

TURNSERVER = shutil.which("turnserver")
LOOPBACK = ("--ice-host-addresses", "127.0.0.1")


def test_browsers_are_told_stun_addresses_only() -> None:
    servers = [
        {"urls": ["turn:turn.example.com:3478?transport=udp", "turns:turn.example.com:5349?transport=tcp"],
         "username": "u", "credential": "secret"},
        {"urls": "stun:stun.example.com:19302"},
        {"urls": "turn:turn.example.com:3478?transport=tcp", "username": "u", "credential": "secret"},
    ]  # fmt: skip
    assert stun_for_browsers(servers) == [
        {"urls": ["stun:turn.example.com:3478", "stun:turn.example.com:5349", "stun:stun.example.com:19302"]}
    ]
    assert stun_for_browsers([]) == []


def test_the_ice_servers_route_names_the_turn_server_as_stun(server_factory) -> None:
    pytest.importorskip("aiortc")
    turn = json.dumps([{"urls": "turn:127.0.0.1:3478", "username": "u", "credential": "secret"}])
    server = server_factory(*LOOPBACK, "--ice-servers", turn)
    answer = httpx.get(server.http + "/v1/realtime/ice_servers", timeout=5)
    assert answer.status_code == 200
    assert answer.json() == {"ice_servers": [{"urls": ["stun:127.0.0.1:3478"]}]}
    assert "secret" not in answer.text


@contextlib.contextmanager
def coturn(port: int, user: str, password: str) -> Iterator[None]:
    """coturn on 127.0.0.1 only, relaying to loopback peers (the test's client)."""
    proc = subprocess.Popen(
        [TURNSERVER or "turnserver", "-n", "--no-cli", "--log-file=stdout", "--simple-log",
         "--pidfile=/tmp/duplexserve-test-turnserver.pid",
         "--listening-ip=127.0.0.1", f"--listening-port={port}", "--relay-ip=127.0.0.1",
         "--min-port=49900", "--max-port=49999", "--realm=duplexserve", "--fingerprint",
         "--lt-cred-mech", f"--user={user}:{password}", "--allow-loopback-peers",
         "--no-tls", "--no-dtls", "--no-multicast-peers"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        time.sleep(0.5)
        assert proc.poll() is None, "turnserver did not start"
        yield
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.skipif(TURNSERVER is None, reason="coturn not installed (Debian package coturn)")
def test_a_turn_server_given_with_ice_servers_relays_for_the_call(server_factory) -> None:
    pytest.importorskip("aiortc")
    from tests.webrtc_client import Peer

    port = free_port()
    turn = json.dumps([{"urls": f"turn:127.0.0.1:{port}", "username": "duplexserve", "credential": "pw"}])
    with coturn(port, "duplexserve", "pw"):
        server = server_factory(*LOOPBACK, "--ice-servers", turn)

        async def call() -> tuple[str, int]:
            t = np.arange(3 * 24000) / 24000
            peer = Peer((0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32))
            assert await peer.connect(server.http) == 201
            await peer.wait_for(lambda: peer.audio().size > 24000)
            await peer.close()
            assert peer.answer is not None
            return peer.answer.text, peer.audio().size

        answer, heard = asyncio.run(call())
    relays = [line for line in answer.splitlines() if line.startswith("a=candidate:") and "typ relay" in line]
    assert relays and all(" 127.0.0.1 " in line for line in relays), answer  # allocated on coturn
    assert heard > 24000
