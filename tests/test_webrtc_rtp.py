"""The RTP both ways beside aiortc (server/transports/webrtc/rtp.py): what it writes, aiortc reads as
its own packets would read; what it cuts out of aiortc's packets is their payload."""

from __future__ import annotations

import pytest

pytest.importorskip("aiortc")

from aiortc.rtcrtpparameters import RTCRtpHeaderExtensionParameters, RTCRtpParameters
from aiortc.rtp import HeaderExtensionsMap, RtpPacket

from duplexserve.server.transports.webrtc.rtp import MID_URI, one_byte_extension, rtp_header, rtp_payload


def _extensions_map(mid_id: int) -> HeaderExtensionsMap:
    extensions = HeaderExtensionsMap()
    mid = RTCRtpHeaderExtensionParameters(id=mid_id, uri=MID_URI)
    extensions.configure(RTCRtpParameters(headerExtensions=[mid]))
    return extensions


def test_a_header_of_ours_parses_as_aiortc_parses_its_own() -> None:
    extensions = _extensions_map(9)
    block = one_byte_extension({9: b"0"})
    data = rtp_header(111, 65537, (1 << 32) + 5, 0xDEADBEEF, block) + b"opus"
    packet = RtpPacket.parse(data, extensions)
    assert (packet.payload_type, packet.sequence_number, packet.timestamp) == (111, 1, 5)
    assert packet.ssrc == 0xDEADBEEF and packet.marker == 0 and packet.payload == b"opus"
    assert packet.extensions.mid == "0"
    assert rtp_payload(data) == b"opus"
    plain = rtp_header(96, 7, 8, 9) + b"x"
    assert RtpPacket.parse(plain).payload == b"x" and len(plain) == 13


def test_the_payload_of_aiortc_packets_with_extensions_csrcs_and_padding() -> None:
    extensions = _extensions_map(3)
    packet = RtpPacket(payload_type=111, sequence_number=3, timestamp=960, ssrc=1)
    packet.extensions.mid = "audio-mid"
    packet.csrc = [11, 12]
    packet.payload = b"\x01\x02\x03"
    data = packet.serialize(extensions)
    assert rtp_payload(data) == b"\x01\x02\x03"
    padded = bytearray(rtp_header(111, 1, 2, 3) + b"abc" + b"\0\0\x03")
    padded[0] |= 0x20  # the padding bit: the last byte counts the padding
    assert rtp_payload(bytes(padded)) == b"abc"
    truncated = bytes([0x90]) + rtp_header(111, 1, 2, 3)[1:] + b"\xbe\xde"  # says an extension, has none
    assert rtp_payload(truncated) == b""


def test_one_byte_extension_blocks_are_padded_to_words() -> None:
    assert one_byte_extension({1: b"0"}) == b"\xbe\xde\x00\x01" + b"\x10" + b"0" + b"\0\0"
    assert len(one_byte_extension({2: b"abcd"})) % 4 == 0
