"""A call's Opus RTP both ways in the datagram callback and the caller's own call,
beside aiortc, which keeps ICE, DTLS, SRTP keys, RTCP and the data channel.

aiortc moves every RTP packet through several coroutines: on the way in aioice's queue,
the DTLS transport's task, its RTP parser and router, the receiver; on the way out the
sender's task waking on the track, its packetizer, header extensions, serializer, and
two more awaits down to the socket. On the 2-core machine the way in alone cost about
35 us a packet more than here, and both ways with the shared clock (clock.py)
about 900 us of a call's 2.8 ms a frame (docs/benchmarks.md, WebRTC). Here:

- :func:`fast_audio`: an Opus packet is SRTP-unprotected and cut out of its RTP header
  in the ICE connection's datagram callback and handed to the call; every other datagram
  (STUN, DTLS, the data channel, RTCP, other payload types) goes aiortc's way.
- :class:`RtpSendStream`: the call's packets get an RTP header of the sender's SSRC (the
  one its SDP announced, with the negotiated payload type and MID extension), are
  SRTP-protected and written to the nominated pair's socket, all in one plain call. The
  sender's counters for its RTCP sender reports are kept as it would keep them.

Both read aiortc and aioice internals (the DTLS transport's ``_rx_srtp``/``_tx_srtp``,
the ICE transport's ``_connection``, aioice's ``Connection.data_received`` and
``_nominated``, the sender's ``send`` and private counters); they check them on each call
and leave it to aiortc's own path where one is missing (the talk stays correct, only
dearer). The pure parts (:func:`rtp_header`, :func:`rtp_payload`) are tested alone.
"""

from __future__ import annotations

import logging
import random
import struct
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

try:
    import aioice.ice
    import pylibsrtp
    from aiortc import clock
except ImportError:  # the optional extra is not installed: nothing here is used then
    pass

MID_URI = "urn:ietf:params:rtp-hdrext:sdes:mid"
_HEADER = struct.Struct("!BBHII")
#: The sender's private counters its RTCP sender reports read (aiortc 1.16).
_SR_FIELDS = ("packet_count", "octet_count", "ntp_timestamp", "rtp_timestamp")


def rtp_header(payload_type: int, sequence: int, timestamp: int, ssrc: int, extension: bytes = b"") -> bytes:
    """A 12-byte RTP header (version 2, no CSRC, marker clear) and ``extension``, a whole
    header extension block (profile, length, elements) or nothing."""
    first = 0x90 if extension else 0x80
    return _HEADER.pack(first, payload_type, sequence & 0xFFFF, timestamp & 0xFFFFFFFF, ssrc) + extension


def one_byte_extension(elements: dict[int, bytes]) -> bytes:
    """An RFC 8285 one-byte header extension block (ids 1..14, values of 1..16 bytes)."""
    body = b"".join(bytes([(ident << 4) | (len(value) - 1)]) + value for ident, value in elements.items())
    body += b"\0" * (-len(body) % 4)
    return struct.pack("!HH", 0xBEDE, len(body) // 4) + body


def rtp_payload(packet: bytes) -> bytes:
    """The payload of a plain RTP packet: after the CSRCs and the header extension, before
    the padding (RFC 3550); empty when the header says more than the packet holds."""
    first = packet[0]
    offset = 12 + 4 * (first & 0x0F)
    if first & 0x10:
        if len(packet) < offset + 4:
            return b""
        offset += 4 + 4 * int.from_bytes(packet[offset + 2 : offset + 4], "big")
    end = len(packet) - (packet[-1] if first & 0x20 else 0)
    return packet[offset:end] if offset < end else b""


def fast_audio(receiver: Any, payload_types: set[int], on_packet: Callable[[int, bytes], None]) -> bool:
    """Hand the receiver's Opus packets to ``on_packet`` (RTP timestamp, payload) from the
    ICE connection's datagram callback, before aiortc sees them; every other datagram
    goes on as before. An SRTP packet that does not authenticate is dropped, as aiortc
    drops it. False (nothing done) where this aiortc lacks what it reads."""
    dtls = receiver.transport
    connection = getattr(getattr(dtls, "transport", None), "_connection", None)
    original = getattr(connection, "data_received", None)
    if original is None or not hasattr(dtls, "_rx_srtp"):
        return False
    types = frozenset(payload_types)

    def data_received(data: bytes, component: int) -> None:
        # RTP (version 2), not RTCP (its packet types 192-223 in the second byte), ours.
        if len(data) > 12 and 127 < data[0] < 192 and (data[1] & 0x7F) in types and not 191 < data[1] < 224:
            srtp = dtls._rx_srtp
            if srtp is not None:
                try:
                    plain = srtp.unprotect(data)
                except pylibsrtp.Error:
                    return
                payload = rtp_payload(plain)
                if payload:
                    on_packet(int.from_bytes(plain[4:8], "big"), payload)
                return
        original(data, component)

    connection.data_received = data_received
    return True


class RtpSendStream:
    """One sender's Opus packets as RTP of our own (module docstring). Made before the
    offer or answer is applied: it takes the negotiated parameters from the sender's
    ``send``, which aiortc calls then."""

    def __init__(self, sender: Any) -> None:
        self.sender = sender
        self.parameters: Any = None
        self._sequence = random.getrandbits(16)
        self._timestamp = random.getrandbits(32)
        self._header: Callable[[int, int], bytes] | None = None
        self.sent = 0
        self.dropped = 0  # packets the call was closing for
        original = sender.send

        async def send(parameters: Any) -> None:
            self.parameters = parameters
            await original(parameters)

        sender.send = send
        self._counters = all(hasattr(sender, f"_RTCRtpSender__{name}") for name in _SR_FIELDS)

    def ready(self) -> bool:
        """True once the call is connected (keys, a nominated pair of plain UDP: a relayed
        one goes aiortc's way, TURN wraps it) and this aiortc is one this was written for;
        otherwise the caller sends through aiortc."""
        sender, parameters = self.sender, self.parameters
        dtls = sender.transport
        connection = getattr(getattr(dtls, "transport", None), "_connection", None)
        pair = (getattr(connection, "_nominated", None) or {}).get(1)
        return (
            parameters is not None and self._counters and getattr(dtls, "_tx_srtp", None) is not None
            and pair is not None and isinstance(pair.protocol, aioice.ice.StunProtocol)
        )  # fmt: skip

    def push(self, packets: list[bytes], duration: int) -> None:
        """Send ``packets`` of ``duration`` RTP units (48 kHz) each, in order; nothing once
        the call is closing (no nominated pair, no socket left)."""
        sender = self.sender
        dtls = sender.transport
        pair = dtls.transport._connection._nominated.get(1)
        transport = pair.protocol.transport if pair is not None else None
        if transport is None or transport.is_closing() or dtls._tx_srtp is None:
            self.dropped += len(packets)
            return
        protect = dtls._tx_srtp.protect
        header = self._header or self._make_header()
        sendto, address = transport.sendto, pair.remote_addr
        octets = 0
        for payload in packets:
            sendto(protect(header(self._sequence, self._timestamp) + payload), address)
            self._sequence = (self._sequence + 1) & 0xFFFF
            self._timestamp = (self._timestamp + duration) & 0xFFFFFFFF
            octets += len(payload)
        self.sent += len(packets)
        # What the sender's RTCP sender reports say: as aiortc's own loop counts.
        sender._RTCRtpSender__packet_count += len(packets)
        sender._RTCRtpSender__octet_count += octets
        sender._RTCRtpSender__ntp_timestamp = clock.current_ntp_time()
        sender._RTCRtpSender__rtp_timestamp = (self._timestamp - duration) & 0xFFFFFFFF

    def _make_header(self) -> Callable[[int, int], bytes]:
        parameters = self.parameters
        payload_type = parameters.codecs[0].payloadType
        ssrc = self.sender._ssrc
        mid = next((e.id for e in parameters.headerExtensions if e.uri == MID_URI), None)
        value = (parameters.muxId or "").encode()
        extension = one_byte_extension({mid: value}) if mid and 0 < len(value) <= 16 else b""

        def header(sequence: int, timestamp: int) -> bytes:
            return rtp_header(payload_type, sequence, timestamp, ssrc, extension)

        self._header = header
        return header
