"""The load generator's WebRTC driver: aiortc peers on loopback against the echo server,
answers checked byte for byte by replaying the server's Opus; loss and jitter made on the
client side and counted by the server. ICE on 127.0.0.1 only, on both sides."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("aiortc")

from duplexserve.bench.webrtc_cost import scrape
from duplexserve.codecs.opus_rtp import RtpOpusDecoder, RtpOpusEncoder
from duplexserve.loadgen.runner import LoadSpec, run_load
from duplexserve.loadgen.webrtc_audio import EchoReplay, FrameAssembler, Piece
from duplexserve.server.transports.webrtc.peer import asked_ms, packet_ms, with_audio_attribute

CALLS = "/v1/realtime/calls"
#: A deep jitter buffer (500 ms): client and server share a loaded machine, and a stall of
#: either past the buffer has the server conceal (it keeps real time), which the exact
#: guards count as altered answers. Latency is not what these tests check.
LOOPBACK = ("--ice-host-addresses", "127.0.0.1", "--max-sessions", "16", "--webrtc-jitter-frames", "25")


def _spec(url: str, **kw) -> LoadSpec:
    base = {"protocol": "webrtc", "concurrency": 3, "sessions": 4, "frames": 25, "message_ms": 20,
            "ramp_s": 0.2, "timeout_s": 30.0}  # fmt: skip
    return LoadSpec(url=url, **{**base, **kw})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.conftest import start_server

    srv = start_server(str(tmp_path_factory.mktemp("loadgen-webrtc")), *LOOPBACK)
    yield srv
    srv.stop()


def test_paced_calls_pass_the_guards_byte_for_byte(server):
    _, before = scrape(server.http)
    result = run_load(_spec(server.ws(CALLS)))
    _, after = scrape(server.http)
    summary = result.summary()
    assert result.guards_ok, result.failures
    assert summary["sessions"] == 4 and summary["frames"] == 4 * 25
    assert summary["rt_p50_ms"] > 0 and summary["rtf_median"] > 0
    assert summary["server"]["frames"] >= 4 * 25  # the server's clock runs on until the hang-up
    # The answer asked for 40 ms packets (a=ptime:40): two a frame, from 20 ms messages.
    assert after["packets"] - before["packets"] == 4 * 25 * 2


def test_a_server_asking_for_20_ms_packets_gets_them(server_factory):
    twenty = server_factory(*LOOPBACK, "--webrtc-ptime-ms", "20")
    _, before = scrape(twenty.http)
    result = run_load(_spec(twenty.ws(CALLS), message_ms=80, sessions=2, concurrency=2, frames=10))
    _, after = scrape(twenty.http)
    assert result.guards_ok, result.failures
    assert after["packets"] - before["packets"] == 2 * 10 * 4


def test_80_ms_messages_send_their_packets_back_to_back(server):
    result = run_load(_spec(server.ws(CALLS), message_ms=80, sessions=2, concurrency=2))
    assert result.guards_ok, result.failures


def test_a_peer_asking_for_20_ms_packets_gets_them(server):
    # The offer's a=maxptime:20: the server sends four packets a frame, the replay expects them.
    result = run_load(_spec(server.ws(CALLS), webrtc_packet_ms=20, sessions=2, concurrency=2))
    assert result.guards_ok, result.failures


def test_a_wrong_prediction_fails_the_content_guard(server_factory):
    delayed = server_factory(*LOOPBACK, "--delay-frames", "2")
    right = run_load(_spec(delayed.ws(CALLS), delay_frames=2, sessions=2, concurrency=2))
    assert right.guards_ok, right.failures
    wrong = run_load(_spec(delayed.ws(CALLS), delay_frames=0, sessions=2, concurrency=2))
    assert not wrong.guards_ok
    assert all("altered" in failure for failure in wrong.failures), wrong.failures


def test_loss_and_jitter_are_concealed_and_counted(server):
    _, before = scrape(server.http)
    result = run_load(_spec(server.ws(CALLS), loss=0.05, jitter_ms=40, expect="none", frames=50, seed=3))
    _, after = scrape(server.http)
    assert result.guards_ok, result.failures  # every frame answered, on time
    assert result.summary()["frames"] == 4 * 50
    lost = (after["recovered"] - before["recovered"]) + (after["concealed"] - before["concealed"])
    assert lost > 0, (before, after)  # 5% of 800 packets: the server rebuilt or concealed them


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"protocol": "native", "loss": 0.05}, "runs over TCP"),
        ({"paced": False}, "paced only"),
        ({"loss": 0.05}, "--expect none"),
        ({"input_format": "pcm_s16le"}, "pcm_f32le"),
    ],
)
def test_options_only_where_they_apply(change, says):
    with pytest.raises(ValueError, match=says):
        _spec("ws://127.0.0.1:9", **change).validate()


# ------------------------------------------------------------------ sans-I/O parts
OFFER = "\r\n".join([
    "v=0", "o=- 1 1 IN IP4 0.0.0.0", "s=-", "t=0 0", "m=audio 9 UDP/TLS/RTP/SAVPF 96", "c=IN IP4 0.0.0.0",
    "a=rtpmap:96 opus/48000/2", "m=application 9 UDP/DTLS/SCTP webrtc-datachannel", "a=maxptime:10", "",
])  # fmt: skip


@pytest.mark.parametrize(
    ("maxptime", "longest", "sent"),
    [(None, 80, 80), (None, 20, 20), (120, 80, 80), (60, 80, 40), (40, 80, 40), (20, 80, 20), (10, 80, 20),
     (79, 40, 40), ("x", 80, 80), ("inf", 80, 80)],
)  # fmt: skip
def test_the_server_sends_the_longest_packets_the_offer_allows(maxptime, longest, sent):
    offer = OFFER if maxptime is None else with_audio_attribute(OFFER, "maxptime", maxptime)
    assert packet_ms(offer, longest) == sent  # another section's maxptime (10) is not the audio's


@pytest.mark.parametrize(
    ("ptime", "sent"),
    [(None, 20), (20, 20), (40, 40), (60, 40), (80, 80), (120, 80), ("x", 20), ("inf", 20), ("nan", 20)],
)
def test_the_load_generator_sends_the_packets_the_answer_asks_for(ptime, sent):
    answer = OFFER if ptime is None else with_audio_attribute(OFFER, "ptime", ptime)
    assert asked_ms(answer) == sent



def _length(payload: bytes) -> int:
    return 3840 if payload == b"long" else 960


def test_the_assembler_makes_frames_from_packets_and_fills_gaps():
    a = FrameAssembler(_length)
    base = 1000
    assert [a.push(base + 960 * k, b"p%d" % k) for k in range(3)] == [[], [], []]
    assert a.push(base + 2880, b"p3") == [[Piece(b"p0", 960), Piece(b"p1", 960), Piece(b"p2", 960),
                                           Piece(b"p3", 960)]]  # fmt: skip
    a.push(base + 3840, b"q0")  # the next frame lacks its second and last packets
    a.push(base + 3840 + 1920, b"q2")
    frames = a.push(base + 7680, b"long")  # a packet of the frame after closes it; 80 ms completes its own
    assert frames == [[Piece(b"q0", 960), Piece(None, 960), Piece(b"q2", 960), Piece(None, 960)],
                      [Piece(b"long", 3840)]]  # fmt: skip
    assert a.push(base + 3840 + 960, b"q1") == [] and a.late == 1 and a.missing == 2


def test_the_assembler_follows_the_timestamp_around_the_32_bit_circle():
    a = FrameAssembler(_length)
    start = (1 << 32) - 1920
    frames = [f for k in range(4) for f in a.push((start + 960 * k) & 0xFFFFFFFF, b"x")]
    assert len(frames) == 1 and a.late == 0


def test_the_replay_predicts_what_the_client_decodes():
    rng = np.random.default_rng(0)
    frame = (0.2 * rng.standard_normal(1920)).astype(np.float32)
    encoder = RtpOpusEncoder(0, fec=True)
    packets = encoder.encode(frame)
    replay = EchoReplay(complexity=5)
    replay.sent(frame[:960], packets[:2])  # 40 ms messages: the frame completes with the second
    replay.sent(frame[960:], packets[2:])
    # The server hears its decode of the packets, echoes it, encodes it; the client decodes.
    server_in, server_out, client = RtpOpusDecoder(), RtpOpusEncoder(5), RtpOpusDecoder()
    heard = np.concatenate([server_in.decode(p) for p in packets])
    expected = np.concatenate([client.decode(p) for p in server_out.encode(heard)])
    assert replay.answer(frame.tobytes()) == expected.astype("<f4").tobytes()
    # Silence (a delayed echo's first frames) is encoded as it is, continuing the stream.
    silence = np.zeros(1920, np.float32)
    after = np.concatenate([client.decode(p) for p in server_out.encode(silence)])
    assert replay.answer(silence.tobytes()) == after.astype("<f4").tobytes()


def test_impairment_takes_rtp_packets_only_and_lets_rtcp_through():
    """aiortc sends RTCP through the same transport call as RTP: a dropped sender report
    would have been counted as an audio packet lost (and left no gap to conceal)."""
    import asyncio
    from types import SimpleNamespace

    from aiortc.rtp import RtcpSenderInfo, RtcpSrPacket, RtpPacket

    from duplexserve.loadgen.drivers.webrtc import impair

    async def main() -> tuple[list[bytes], dict[str, int], list[int], bytes]:
        passed: list[bytes] = []

        async def send_rtp(data: bytes) -> None:
            passed.append(data)

        sender = SimpleNamespace(transport=SimpleNamespace(_send_rtp=send_rtp))
        dropped_at: list[int] = []
        counts = impair(sender, loss=1.0, jitter_ms=0, dropped_at=dropped_at)
        report = bytes(RtcpSrPacket(ssrc=1, sender_info=RtcpSenderInfo(
            ntp_timestamp=0, rtp_timestamp=0, packet_count=0, octet_count=0)))  # fmt: skip
        for seq in range(3):
            audio = RtpPacket(payload_type=111, sequence_number=seq, payload=b"x").serialize()
            await sender.transport._send_rtp(audio)
            await sender.transport._send_rtp(report)
        return passed, counts, dropped_at, report

    passed, counts, dropped_at, report = asyncio.run(main())
    assert counts == {"sent": 3, "dropped": 3} and dropped_at == [0, 1, 2]  # the RTP packets' places
    assert passed == [report] * 3  # every sender report sent, none counted
