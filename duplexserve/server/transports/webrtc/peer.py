"""aiortc as this server uses it: ICE settings, the audio taps, and the internals read.

aiortc (with PyAV) is the optional ``webrtc`` extra: without it, :data:`PROBLEM` says so
and the WebRTC routes answer 501, while every other route works.

What is taken from aiortc and what is not:

- ICE, DTLS, SCTP (the ``oai-events`` data channel), SRTP and RTP are aiortc's.
- Incoming audio is **not** aiortc's: its receiver reassembles packets in its own jitter
  buffer and decodes them with PyAV in a thread per track, with no loss concealment.
  :func:`tap_audio` replaces the receiver's RTP handler on the instance, so each Opus
  payload goes straight to the call's own jitter buffer (server/transports/webrtc/jitter.py) and
  libopus decoder (codecs/opus_rtp.py), which conceal and recover lost packets. And
  ``rtp.fast_audio`` takes those packets even earlier, as the ICE connection
  receives them (server/transports/webrtc/rtp.py).
- Outgoing audio is encoded by libopus here, at the model's 24 kHz, and sent by
  ``rtp.RtpSendStream`` as RTP of our own; :class:`OutgoingAudio` hands the same
  packets to aiortc's sender, which only packetizes them, where that stream cannot.

:func:`internals_problem` checks the one aiortc internal this reads
(``RTCRtpReceiver._handle_rtp_packet``) at start-up, as transports/websocket/protocol.py does for uvicorn's;
server/transports/webrtc/rtp.py checks its own on each call and leaves the call to aiortc's path
where one is missing.
"""

from __future__ import annotations

import asyncio
import collections
import fractions
import ipaddress
import json
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

try:
    import aioice.ice
    import av
    from aiortc import (
        MediaStreamTrack,
        RTCConfiguration,
        RTCIceServer,
        RTCPeerConnection,
        RTCRtpReceiver,
        RTCSessionDescription,
    )
    from aiortc.sdp import SessionDescription

    PROBLEM: str | None = None
except ImportError as exc:  # the optional extra is not installed
    PROBLEM = f"WebRTC needs aiortc, the [webrtc] extra: pip install -e '.[webrtc]' ({exc})"
    MediaStreamTrack = object  # type: ignore[assignment,misc]

__all__ = [
    "PROBLEM",
    "RTCPeerConnection",
    "RTCSessionDescription",
    "SessionDescription",
    "new_peer",
]

_TIME_BASE = fractions.Fraction(1, 48000)
PACKET_TS = 960  # 20 ms at the RTP clock
#: Packets kept for the sender at most (2.5 s of 20 ms ones): past it the oldest go, the call
#: stays real time.
OUT_QUEUE = 128


def internals_problem() -> str | None:
    """What this aiortc lacks of what :func:`tap_audio` replaces; None when all is there."""
    if PROBLEM is not None:
        return PROBLEM
    if not callable(getattr(RTCRtpReceiver, "_handle_rtp_packet", None)):
        return "aiortc's RTCRtpReceiver has no _handle_rtp_packet: this aiortc is not one tested (1.16)"
    return None


def parse_ice_servers(spec: str) -> list[dict[str, Any]]:
    """``--ice-servers``: a JSON list of RTCIceServer objects (``urls``, ``username``,
    ``credential``), as browsers take them, or plain comma-separated STUN/TURN URLs."""
    spec = spec.strip()
    if not spec:
        return []
    if spec.startswith("["):
        servers = json.loads(spec)
        if not isinstance(servers, list) or not all(isinstance(s, dict) and "urls" in s for s in servers):
            raise ValueError("--ice-servers: a JSON list of objects with 'urls'")
        return servers
    return [{"urls": url.strip()} for url in spec.split(",") if url.strip()]


def stun_for_browsers(servers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a browser calling this server should ask (``GET /v1/realtime/ice_servers``):
    the STUN URLs of ``servers``, and every TURN server's address as a STUN one (coturn,
    as most TURN servers, answers STUN on the same port), never a credential.

    A server behind TURN offers relay candidates, and the TURN server relays only from
    peers the server asked it to let in: the addresses of the browser's candidates. A
    browser that hides its host addresses (mDNS) and asks no STUN server has no address
    the server could name, so it needs its reflexive one."""
    urls: list[str] = []
    for server in servers:
        for url in [server["urls"]] if isinstance(server["urls"], str) else server["urls"]:
            scheme, _, rest = url.partition(":")
            if scheme in ("stun", "stuns"):
                stun = url
            elif scheme in ("turn", "turns"):
                stun = "stun:" + rest.split("?", 1)[0]
            else:
                continue
            if stun not in urls:
                urls.append(stun)
    return [{"urls": urls}] if urls else []


def relays(servers: list[dict[str, Any]]) -> bool:
    """Whether ``servers`` name a TURN server (the server's calls may go through a relay)."""
    return any(
        url.startswith(("turn:", "turns:"))
        for server in servers
        for url in ([server["urls"]] if isinstance(server["urls"], str) else server["urls"])
    )


def restrict_host_addresses(addresses: tuple[str, ...]) -> None:
    """Offer only ``addresses`` as host candidates (every ICE connection of this process).

    aioice gathers every interface's address and never 127.0.0.1, and has no setting
    for either; a server in a container may want only its public address, and a test
    only loopback. Empty: aioice's own gathering."""
    if PROBLEM is not None:
        return
    original = getattr(aioice.ice, "_duplexserve_original", None) or aioice.ice.get_host_addresses
    aioice.ice._duplexserve_original = original  # type: ignore[attr-defined]
    if not addresses:
        aioice.ice.get_host_addresses = original
        return

    def host_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
        return [a for a in addresses if (":" in a and use_ipv6) or (":" not in a and use_ipv4)]

    aioice.ice.get_host_addresses = host_addresses


def new_peer(ice_servers: list[dict[str, Any]]) -> RTCPeerConnection:
    """A peer connection that asks only the ICE servers it is given (never aiortc's
    default public STUN server)."""
    servers = [
        RTCIceServer(urls=s["urls"], username=s.get("username"), credential=s.get("credential"))
        for s in ice_servers
    ]
    return RTCPeerConnection(RTCConfiguration(iceServers=servers))


def without_mdns_candidates(sdp: str) -> str:
    """Drop ``.local`` candidates (browsers hide their addresses behind mDNS names): a
    server cannot resolve a remote browser's name, and trying sends multicast queries
    onto the local network. The browser's checks still reach us (peer-reflexive)."""
    kept = [line for line in sdp.splitlines() if not _mdns_candidate(line)]
    return "\r\n".join(kept) + "\r\n"


def candidate_count(sdp: str) -> int:
    """The distinct ICE candidates ``sdp`` names: transport, address and port of its
    ``a=candidate:`` lines (a browser repeats a bundled transport's in every media section)."""
    seen = set()
    for line in sdp.splitlines():
        if line.startswith("a=candidate:"):
            fields = line.split()
            seen.add((fields[2].lower(), fields[4], fields[5]) if len(fields) > 5 else line)
    return len(seen)


def peer_candidates(sdp: str, peer: str | None, most: int) -> str:
    """``sdp`` with no more than ``most`` distinct ICE candidates, and with ``peer`` (the
    address the offer came from over HTTP) only those on that address: the server sends
    STUN checks to every candidate an offer names, and an offer may name anyone's
    address and ports. A browser's own address is among its candidates (host, or
    server-reflexive); where it is not (a proxy in between), its checks still reach the
    server, which answers them and learns the address from them (peer-reflexive).

    ``a=end-of-candidates`` goes with any candidate dropped, so that ICE waits for those
    checks instead of failing on an empty list. ``peer`` None: no address filter (a
    server behind TURN, whose relay lets in only the addresses of the candidates)."""
    kept: list[str] = []
    seen: set[tuple[str, ...]] = set()
    dropped = False
    own = _address(peer) if peer is not None else None
    for line in sdp.splitlines():
        if line.startswith("a=candidate:"):
            fields = line.split()
            key = tuple(fields[2:6]) if len(fields) > 5 else (line,)
            address = _address(fields[4]) if len(fields) > 5 else None
            foreign = peer is not None and (address is None or address != own)
            if key not in seen and (foreign or len(seen) >= most):
                dropped = True
                continue
            seen.add(key)
        kept.append(line)
    if dropped:
        kept = [line for line in kept if line != "a=end-of-candidates"]
    return "\r\n".join(kept) + "\r\n"


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``text`` as an address, an IPv4-mapped IPv6 one as IPv4; None where it is none (a name)."""
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _mdns_candidate(line: str) -> bool:
    fields = line.split()
    return line.startswith("a=candidate:") and len(fields) > 4 and fields[4].endswith(".local")


def tap_audio(receiver: Any, payload_types: set[int], on_packet: Callable[[int, bytes], None]) -> None:
    """Hand every RTP packet of ``payload_types`` reaching ``receiver`` to ``on_packet``
    (RTP timestamp, payload) instead of aiortc's jitter buffer and decoder thread."""

    async def handle(packet: Any, arrival_time_ms: int = 0) -> None:
        if packet.payload_type in payload_types and packet.payload:
            on_packet(packet.timestamp, packet.payload)

    receiver._handle_rtp_packet = handle


def audio_attribute(sdp: str, name: str) -> str | None:
    """The value of ``a=name:...`` in the audio section of ``sdp`` (or in the session part
    before it), None where there is none."""
    prefix, value, audio = f"a={name}:", None, None
    for line in sdp.splitlines():
        if line.startswith("m="):
            if audio is not None:
                break  # the audio section is over
            audio = line.startswith("m=audio")
        elif line.startswith(prefix) and audio is not False:
            value = line[len(prefix) :].strip()
    return value


def with_audio_attribute(sdp: str, name: str, value: object) -> str:
    """``sdp`` with ``a=name:value`` first among the audio section's attributes."""
    lines = sdp.split("\r\n")
    audio = next(i for i, line in enumerate(lines) if line.startswith("m=audio"))
    at = next((i for i in range(audio + 1, len(lines)) if lines[i].startswith(("a=", "m="))), len(lines))
    return "\r\n".join([*lines[:at], f"a={name}:{value}", *lines[at:]])


def packet_ms(sdp: str, longest: int) -> int:
    """The Opus packets to send a peer whose offer is ``sdp``: ``longest`` ms (20, 40 or
    80, whole fractions of a model frame), less where its audio section's ``a=maxptime``
    asks for less. Without one, any length up to 120 ms is allowed (RFC 7587: a receiver
    decodes every Opus packet), so an 80 ms frame goes as one."""
    return _packet_ms(audio_attribute(sdp, "maxptime"), longest, otherwise=longest)


def asked_ms(sdp: str) -> int:
    """The packets a peer's description asks to receive (``a=ptime``, as libwebrtc reads
    it): 20, 40 or 80 ms, the longest not above it; 20 ms, browsers' own, where none or
    unreadable (a browser ignores a malformed one)."""
    return _packet_ms(audio_attribute(sdp, "ptime"), 80, otherwise=20)


def _packet_ms(value: str | None, longest: int, otherwise: int) -> int:
    """20, 40 or 80 ms, the longest not above ``value`` nor ``longest``; ``otherwise``
    where ``value`` is absent or no number."""
    try:
        most = min(int(float(value)), longest)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return otherwise
    return max((ms for ms in (20, 40, 80) if ms <= most), default=20)


class OutgoingAudio(MediaStreamTrack):  # type: ignore[misc,valid-type]
    """The model's voice as the call's audio track: Opus packets encoded elsewhere, handed
    to aiortc's sender as they come (one per 80 ms model frame, or four of 20 ms)."""

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self._packets: collections.deque[tuple[bytes, int]] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._pts = 0
        self.dropped = 0

    def push(self, packets: list[bytes], duration: int = PACKET_TS) -> None:
        """Packets of ``duration`` RTP units (48 kHz) each, to send in order."""
        queue = self._packets
        queue.extend((p, duration) for p in packets)
        while len(queue) > OUT_QUEUE:
            _, gone = queue.popleft()
            self.dropped += 1
            self._pts += gone  # the receiver hears a gap where it was
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def recv(self) -> Any:
        while not self._packets:
            if self.readyState != "live":
                from aiortc.mediastreams import MediaStreamError

                raise MediaStreamError
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
            self._waiter = None
        data, duration = self._packets.popleft()
        packet = av.Packet(data)
        packet.pts, packet.time_base = self._pts, _TIME_BASE
        self._pts += duration
        return packet

    def stop(self) -> None:
        super().stop()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
