"""WebRTC calls as an attacker makes them: a peer that stops acknowledging the data channel
(beside an honest call), calls made and hung up by the hundred, offers refused by a full
server, offers naming other hosts' addresses as ICE candidates; and a call that ends however
its session ends. Real aiortc peers (tests/webrtc_client.py), a real server on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket

import httpx
import numpy as np
import pytest

pytest.importorskip("aiortc")

from aiortc import RTCSessionDescription

from duplexserve.server.transports.webrtc.peer import new_peer, peer_candidates
from tests.webrtc_client import Peer, best_lag

KEY = "k"
SDP = {"Content-Type": "application/sdp", "Authorization": f"Bearer {KEY}"}
SLOTS = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the file (each test leaves it as it found it): loopback ICE, a small
    reply budget, a connect timer long enough that it would hold every call made here."""
    from tests.conftest import start_server

    srv = start_server(str(tmp_path_factory.mktemp("webrtc-limits")), "--ice-host-addresses", "127.0.0.1",
                       "--api-keys", KEY, "--max-sessions", str(SLOTS), "--max-output-event-bytes",
                       str(1 << 20), "--webrtc-connect-timeout-s", "120")  # fmt: skip
    yield srv
    srv.stop()


def speech(seconds: float, seed: int = 0) -> np.ndarray:
    t = np.arange(int(seconds * 24000)) / 24000
    rng = np.random.default_rng(seed)
    x = 0.3 * np.sin(2 * np.pi * (180 + 120 * t) * t) + 0.02 * rng.standard_normal(len(t))
    return x.astype(np.float32)


def candidate(n: int, address: str, port: int) -> str:
    return f"a=candidate:{n} 1 udp 2130706431 {address} {port} typ host"


def test_only_candidates_on_the_offers_own_address_are_kept_and_at_most_a_few() -> None:
    lines = ["v=0", "m=audio 9 UDP/TLS/RTP/SAVPF 111", candidate(1, "203.0.113.5", 5000),
             candidate(2, "198.51.100.7", 5001), candidate(3, "::ffff:203.0.113.5", 5002),
             candidate(4, "peer.example", 5003), "a=end-of-candidates",
             "m=application 9 UDP/DTLS/SCTP webrtc-datachannel",
             candidate(1, "203.0.113.5", 5000)]  # fmt: skip
    sdp = "\r\n".join(lines) + "\r\n"
    kept = peer_candidates(sdp, "203.0.113.5", 8)
    assert [line.split()[4] for line in kept.splitlines() if line.startswith("a=candidate")] == [
        "203.0.113.5", "::ffff:203.0.113.5", "203.0.113.5"]  # fmt: skip
    assert "a=end-of-candidates" not in kept  # ICE waits for the peer's own checks
    assert peer_candidates(sdp, "::ffff:203.0.113.5", 8) == kept  # the mapped form is the same host
    assert peer_candidates(sdp, "192.0.2.1", 8).count("a=candidate") == 0
    behind_turn = peer_candidates(sdp, None, 2)  # no address filter, the count still capped
    assert behind_turn.count("a=candidate") == 3 and "198.51.100.7" in behind_turn
    everything = "\r\n".join(lines[:3] + lines[6:]) + "\r\n"
    assert peer_candidates(everything, "203.0.113.5", 8) == everything


def test_stun_checks_go_only_to_the_address_the_offer_came_from(server) -> None:
    """Before: an offer naming 31 candidates made the server send 155 STUN packets to the ports
    it named. And a peer whose candidates are not on the address its offer came from (a proxy
    in between) is still reached: its checks come in (peer-reflexive)."""
    sockets = []
    for n in range(2, 12):  # other hosts' ports, on addresses of loopback (127/8) the offer names
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((f"127.0.0.{n}", 0))
        s.setblocking(False)
        sockets.append(s)

    async def main() -> Peer:
        peer = Peer(np.zeros(24000, np.float32))
        offer = await peer.offer()
        extra = "".join(candidate(100 + i, *s.getsockname()) + "\r\n" for i, s in enumerate(sockets))
        offer = offer.replace("a=ice-ufrag", extra + "a=ice-ufrag", 1)
        async with httpx.AsyncClient(timeout=20) as http:  # an attacker's: it never does ICE
            answer = await http.post(server.http + "/v1/realtime/calls", content=offer, headers=SDP)
            assert answer.status_code == 201, answer.text
            await asyncio.sleep(2.0)  # aioice checks a pair every 20 ms and retransmits
            hangup = server.http + answer.headers["location"] + "/hangup"
            assert (await http.post(hangup, headers=SDP)).status_code == 200
        await peer.close()
        proxied = Peer(speech(4.0))  # its offer comes from 127.0.0.2, its candidates are 127.0.0.1
        offer = await proxied.offer()
        transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        async with httpx.AsyncClient(timeout=20, transport=transport) as http:
            answer = await http.post(server.http + "/v1/realtime/calls", content=offer, headers=SDP)
        assert answer.status_code == 201, answer.text
        await proxied.accept(answer.text)
        await proxied.wait_for(lambda: proxied.audio().size > 24000)
        await proxied.close()
        return proxied

    try:
        proxied = asyncio.run(main())
        packets = 0
        for s in sockets:
            while True:
                try:
                    s.recv(2048)
                except BlockingIOError:
                    break
                packets += 1
    finally:
        for s in sockets:
            s.close()
    assert packets == 0, f"{packets} STUN packets to addresses the offer named"
    assert proxied.audio().size > 24000


def test_a_peer_that_stops_acknowledging_the_channel_is_closed_slow_consumer(server) -> None:
    """Before: aiortc queued the replies without end (+457 MB in 15 s), no slow_consumer."""
    sent = speech(6.0, seed=1)
    big = "x" * 30_000  # echoed in each session.updated

    async def main() -> tuple[Peer, Peer]:
        honest = Peer(np.concatenate([sent, np.zeros(24000 * 4, np.float32)]))
        assert await honest.connect(server.http, KEY) == 201
        slow = Peer(np.zeros(24000 * 30, np.float32))
        assert await slow.connect(server.http, KEY) == 201
        await slow.wait_for(lambda: slow.channel_open.is_set() and "session.created" in slow.kinds())

        async def acknowledge_nothing() -> None:
            return None

        slow.pc.sctp._send_sack = acknowledge_nothing  # the peer's SCTP acknowledges nothing more
        loop = asyncio.get_running_loop()
        update = {"type": "session.update", "session": {"type": "realtime", "instructions": big}}
        for _ in range(12):  # 72 replies, 2.2 MB: past the 1 MiB the server may hold for it
            if slow.channel.readyState != "open":  # the server ended the call
                break
            for _ in range(6):
                slow.send(update)
            await asyncio.sleep(0.1)
        deadline = loop.time() + 20
        while (await asyncio.to_thread(server.metrics))["duplexserve_webrtc_calls_active"] > 1:  # 2 before
            assert loop.time() < deadline, "the call that reads nothing was not ended"
            await asyncio.sleep(0.1)
        await honest.wait_for(lambda: honest.audio().size > 24000 * 5, 20)
        await slow.close()
        await honest.close()
        return honest, slow

    honest, _ = asyncio.run(main())
    metrics = server.metrics()
    assert metrics['duplexserve_connections_over_budget_total{budget="slow_consumer"}'] == 1
    assert server.log().count("closed slow_consumer") == 1
    _, corr = best_lag(sent[24000:72000], honest.audio(), 24000 * 3)
    assert corr > 0.9  # the call beside it was served


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_calls_hung_up_free_their_memory_at_once(server) -> None:
    """Before: the connect timer held each hung-up call (its peer connection, codecs, jitter
    buffer) until it fired, and the call's cycles waited for a full collection after that;
    3,282 calls in 15 s took the server from 104 to 752 MB."""

    async def calls(n: int, offer: str) -> None:
        for _ in range(n // 40):  # a connection for 80 requests: within its HTTP budget
            async with httpx.AsyncClient(timeout=20) as http:
                for _ in range(40):
                    answer = await http.post(server.http + "/v1/realtime/calls", content=offer, headers=SDP)
                    assert answer.status_code == 201, answer.text
                    hangup = server.http + answer.headers["location"] + "/hangup"
                    assert (await http.post(hangup, headers=SDP)).status_code == 200

    async def main() -> tuple[int, int]:
        peer = Peer(np.zeros(24000, np.float32))
        offer = await peer.offer()  # the same offer each time: it never connects
        await calls(40, offer)  # the allocator's and aiortc's first allocations
        await asyncio.sleep(0.5)
        before = _rss_kb(server.proc.pid)
        await calls(120, offer)
        await asyncio.sleep(0.5)
        after = _rss_kb(server.proc.pid)
        await peer.close()
        return before, after

    before, after = asyncio.run(main())
    assert server.metrics()["duplexserve_webrtc_calls_active"] == 0
    # Before: 28 MB (240 KB a call); the timer gone but no collection: 12 MB; now about 1 MB.
    assert after - before < 6_000, f"RSS {before} -> {after} kB over 120 calls hung up"


def test_an_offer_a_full_server_refuses_costs_what_a_wrong_key_costs(server) -> None:
    """Before: the server built a peer connection (a certificate, the offer applied) for an
    offer it then refused."""
    unkeyed = {"Content-Type": "application/sdp"}

    async def main() -> tuple[float, float]:
        holders = [Peer(speech(30.0, seed=n)) for n in range(SLOTS)]
        for holder in holders:  # every slot taken
            assert await holder.connect(server.http, KEY) == 201
        peer = Peer(np.zeros(24000, np.float32))
        offer = await peer.offer()
        url = server.http + "/v1/realtime/calls"
        spent = {"unauthorized": 0.0, "full": 0.0}
        for _ in range(3):  # interleaved, so that both see the same load
            for name, headers, status in (("unauthorized", unkeyed, 401), ("full", SDP, 503)):
                async with httpx.AsyncClient(timeout=20) as http:  # within a connection's HTTP budget
                    started = _cpu_s(server.proc.pid)
                    for _ in range(40):
                        assert (await http.post(url, content=offer, headers=headers)).status_code == status
                    spent[name] += _cpu_s(server.proc.pid) - started
        for closing in [peer, *holders]:
            await closing.close()
        return spent["unauthorized"], spent["full"]

    counted = 'duplexserve_webrtc_calls_total{outcome="refused",protocol="webrtc"}'
    refused = server.metrics()[counted]
    unauthorized, full = asyncio.run(main())
    # The refused offer reads and checks the offer as well: a little more, never a peer connection.
    assert full < 2.0 * unauthorized + 0.1, (unauthorized, full)  # before: 3.5 times
    assert server.metrics()[counted] == refused + 120


def endings(events: list[dict]) -> list[str]:
    """The codes of the error events and the reasons of ``session.closed``, in order."""
    return [e.get("reason") or e["error"]["code"] for e in events if e["type"] in ("error", "session.closed")]


def test_a_call_ends_however_its_session_ends(server_factory) -> None:
    """The session idle, then the server draining: each time ``session.closed`` with the
    reason, then the peer connection closed and the call no longer counted."""
    server = server_factory("--ice-host-addresses", "127.0.0.1", "--idle-timeout-s", "2",
                            "--drain-grace-s", "1")  # fmt: skip

    async def main() -> tuple[list[str], list[str]]:
        mute = new_peer([])  # hears, says nothing: idle
        mute.addTransceiver("audio", direction="recvonly")
        channel = mute.createDataChannel("oai-events")
        events: list[dict] = []
        channel.on("message", lambda message: events.append(json.loads(message)))
        await mute.setLocalDescription(await mute.createOffer())
        async with httpx.AsyncClient(timeout=20) as http:
            answer = await http.post(server.http + "/v1/realtime/calls", content=mute.localDescription.sdp,
                                     headers={"Content-Type": "application/sdp"})  # fmt: skip
        await mute.setRemoteDescription(RTCSessionDescription(answer.text, "answer"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        while mute.connectionState != "closed":
            assert loop.time() < deadline, f"the idle call was not ended: {events}"
            await asyncio.sleep(0.05)
        assert (await asyncio.to_thread(server.metrics))["duplexserve_webrtc_calls_active"] == 0
        await mute.close()
        idle = endings(events)
        live = Peer(np.full(24000 * 30, 0.1, np.float32))
        assert await live.connect(server.http) == 201
        await live.wait_for(lambda: live.audio().size > 4800)
        server.proc.send_signal(signal.SIGTERM)
        await live.wait_for(lambda: live.pc.connectionState == "closed", 15)
        await live.close()
        return idle, endings(live.events)

    idle, drained = asyncio.run(main())
    assert idle == ["idle_timeout", "idle_timeout"]  # the error, then session.closed
    assert drained == ["server_shutdown", "server_shutdown"]
