"""The WebRTC jitter buffer, the RTP Opus codec and client secrets, without sockets or clocks."""

from __future__ import annotations

import numpy as np
import pytest

from duplexserve.codecs import opus_rtp
from duplexserve.server.client_secrets import ClientSecrets
from duplexserve.server.transports.webrtc.jitter import (
    CONCEAL,
    DECODE,
    FRAME_TS,
    PACKET_TS,
    RECOVER,
    JitterBuffer,
)

BASE = 0xFFFFF000  # close to the 32-bit wrap: every test crosses it


def ts(i: int) -> int:
    return (BASE + i * PACKET_TS) & 0xFFFFFFFF


def payload(i: int) -> bytes:
    return b"p%d" % i


def kinds(plays) -> list[tuple[str, bytes | None]]:
    return [(p.kind, p.payload) for p in plays]


def test_in_order_packets_play_four_to_a_frame_across_the_timestamp_wrap():
    jb = JitterBuffer(depth=3)
    for i in range(8):
        jb.push(ts(i), payload(i))
    assert kinds(jb.pull()) == [(DECODE, payload(i)) for i in range(4)]
    assert kinds(jb.pull()) == [(DECODE, payload(i)) for i in range(4, 8)]
    assert jb.counts.packets == 8 and jb.counts.concealed == jb.counts.late == 0


def test_a_lost_packet_is_recovered_from_the_next_one_or_concealed_when_there_is_none():
    jb = JitterBuffer()
    for i in (0, 2, 3):  # 1 lost, its successor here: FEC
        jb.push(ts(i), payload(i))
    assert kinds(jb.pull()) == [(DECODE, payload(0)), (RECOVER, payload(2)), (DECODE, payload(2)),
                                (DECODE, payload(3))]  # fmt: skip
    for i in (4, 5):  # 6 and 7 lost: nothing after them yet
        jb.push(ts(i), payload(i))
    assert kinds(jb.pull()) == [(DECODE, payload(4)), (DECODE, payload(5)), (CONCEAL, None), (CONCEAL, None)]
    assert (jb.counts.recovered, jb.counts.concealed) == (1, 2)
    assert sum(p.duration for p in jb.pull()) == FRAME_TS  # nothing left: a whole frame concealed


def test_reordered_packets_within_the_depth_play_in_order_and_duplicates_are_dropped():
    jb = JitterBuffer()
    for i in (1, 0, 3, 2, 3):
        jb.push(ts(i), payload(i))
    assert kinds(jb.pull()) == [(DECODE, payload(i)) for i in range(4)]
    assert jb.counts.duplicate == 1


def test_a_packet_after_its_time_is_late_while_others_wait_but_after_a_stall_playback_resyncs():
    jb = JitterBuffer()
    for i in (0, 1, 2, 3, 5, 6):
        jb.push(ts(i), payload(i))
    jb.pull()
    assert kinds(jb.pull()) == [(RECOVER, payload(5)), (DECODE, payload(5)), (DECODE, payload(6)),
                                (CONCEAL, None)]  # fmt: skip
    jb.push(ts(8), payload(8))
    jb.push(ts(4), payload(4))  # its time was played and 8 already waits: late, dropped
    assert (jb.counts.late, jb.counts.resyncs) == (1, 0)
    assert kinds(jb.pull()) == [(DECODE, payload(8)), (CONCEAL, None), (CONCEAL, None), (CONCEAL, None)]
    # Nothing queued: the sender stalled. Its next packet, behind playback, restarts it there.
    jb.push(ts(9), payload(9))
    assert (jb.counts.late, jb.counts.resyncs) == (1, 1)
    assert kinds(jb.pull())[0] == (DECODE, payload(9))


def test_a_sender_running_ahead_is_trimmed_to_depth_plus_slack():
    jb = JitterBuffer(depth=3, slack=2)
    for i in range(20):
        jb.push(ts(i), payload(i))
    jb.pull()
    assert jb.queued == 5 and jb.counts.overflow == jb.counts.skipped == 11
    assert kinds(jb.pull())[0] == (DECODE, payload(15))  # the newest kept, latency bounded
    # A gap among the trimmed packets is passed over too: skipped, not concealed.
    jb = JitterBuffer(depth=3, slack=2)
    for i in range(20):
        if i != 6:
            jb.push(ts(i), payload(i))
    jb.pull()
    assert (jb.counts.overflow, jb.counts.skipped, jb.counts.concealed + jb.counts.recovered) == (10, 11, 0)


def test_a_clock_catching_up_after_its_loop_stood_still_plays_what_came_meanwhile():
    def stalled(backlogs: tuple[int, ...]) -> tuple[JitterBuffer, list]:
        jb = JitterBuffer(depth=3, slack=8)
        for i in range(7):
            jb.push(ts(i), payload(i))
        jb.pull()
        for i in range(7, 23):  # 320 ms of packets while the loop stood still (one of them lost)
            if i != 12:
                jb.push(ts(i), payload(i))
        return jb, [play for backlog in backlogs for play in jb.pull(backlog=backlog)]

    # The clock plays the 4 frames now due at once, and says so: nothing is dropped, the gap is
    # recovered, the stream goes on where it was.
    jb, plays = stalled((3, 2, 1, 0))
    assert jb.counts.overflow == jb.counts.skipped == 0 and jb.counts.recovered == 1
    assert [p.payload for p in plays if p.kind is DECODE] == [payload(i) for i in range(4, 20) if i != 12]
    # The same queue pulled as one frame on time is a sender running ahead: trimmed to depth + slack.
    jb, _ = stalled((0,))
    assert jb.counts.overflow == jb.counts.skipped == 3 and jb.queued == 11


def test_a_jump_past_the_capacity_starts_over_at_the_new_packet():
    jb = JitterBuffer(capacity=16)
    jb.push(ts(0), payload(0))
    jb.push(ts(100), payload(100))
    assert jb.counts.resyncs == 1 and jb.counts.skipped == 100  # the first packet's included
    assert kinds(jb.pull())[0] == (DECODE, payload(100))


def test_packet_lengths_come_from_the_payload():
    jb = JitterBuffer(duration=lambda p: 2 * PACKET_TS if p.startswith(b"long") else PACKET_TS)
    jb.push(ts(0), b"long0")
    jb.push(ts(2), b"long2")
    assert kinds(jb.pull()) == [(DECODE, b"long0"), (DECODE, b"long2")]
    jb.push(ts(4), b"long4")  # 60 ms of 40 ms packets: the next frame owes 0 ms more than asked
    assert sum(p.duration for p in jb.pull()) == FRAME_TS


def test_a_lost_40_ms_packet_is_concealed_then_rebuilt_from_the_next_ones_fec():
    # libopus keeps the FEC of a packet's last 20 ms in the next packet: the lost packet's
    # first half is concealed, its second rebuilt; the decoder's time base stays whole.
    jb = JitterBuffer(duration=lambda p: 2 * PACKET_TS)
    for i in (0, 4, 6):  # the packet at 2 (40 ms) is lost
        jb.push(ts(i), payload(i))
    plays = jb.pull() + jb.pull()
    assert kinds(plays) == [
        (DECODE, payload(0)), (CONCEAL, None), (RECOVER, payload(4)),
        (DECODE, payload(4)), (DECODE, payload(6)),
    ]  # fmt: skip
    assert [p.duration for p in plays] == [2 * PACKET_TS, PACKET_TS, PACKET_TS, 2 * PACKET_TS, 2 * PACKET_TS]
    assert (jb.counts.concealed, jb.counts.recovered) == (1, 1)


needs_opus = pytest.mark.skipif(opus_rtp.OPUS is None, reason="no libopus (system or PyAV's)")


@needs_opus
def test_rtp_opus_round_trip_concealment_and_fec_keep_the_24_khz_time_base():
    t = np.arange(24000) / 24000
    speech = (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32)
    encoder = opus_rtp.RtpOpusEncoder(fec=True)
    packets = encoder.encode(speech)
    assert len(packets) == 50 and all(opus_rtp.packet_samples(p) == PACKET_TS for p in packets)
    decoder = opus_rtp.RtpOpusDecoder()
    out = []
    for i, packet in enumerate(packets):
        if i % 10 == 5:  # lost: rebuilt from the next packet's FEC
            out.append(decoder.recover(packets[i + 1]))
        elif i % 10 == 8:  # lost, and the next too late: concealed
            out.append(decoder.conceal())
        else:
            out.append(decoder.decode(packet))
    heard = np.concatenate(out)
    assert len(heard) == len(speech)
    a, b = heard[2400:], speech[2400:]  # past the codec's start-up
    corr = np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b))
    assert corr > 0.8
    gaps = [np.sqrt(np.mean(out[i] ** 2)) for i in range(5, 50, 10)] + [
        np.sqrt(np.mean(out[i] ** 2)) for i in range(8, 50, 10)
    ]
    assert min(gaps) > 0.02  # no silence where a packet was missing (the sine's RMS is 0.21)


@needs_opus
def test_the_rtp_encoder_takes_whole_packets_only():
    with pytest.raises(ValueError, match="whole number"):
        opus_rtp.RtpOpusEncoder().encode(np.zeros(100, dtype=np.float32))
    assert opus_rtp.packet_samples(b"") == 0


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_a_client_secret_works_once_and_not_after_it_expires():
    clock = Clock()
    store = ClientSecrets(clock)
    secret = store.mint({"expires_after": {"anchor": "created_at", "seconds": 60},
                         "session": {"instructions": "be brief"}}, "m")  # fmt: skip
    assert secret.value.startswith("ek_") and secret.expires_at == clock.now + 60
    assert store.take(["sk-other", secret.value]).session == {"instructions": "be brief"}
    assert store.take([secret.value]) is None  # single use
    store.give_back(secret)  # a call that was not answered did not use it
    clock.now += 61
    assert store.take([secret.value]) is None  # expired
    response = store.mint({}, "m").response()
    assert response["session"]["type"] == "realtime" and response["expires_at"] == clock.now + 600


@pytest.mark.parametrize("spec", [
    [], {"expires_after": {"seconds": 5}}, {"expires_after": {"seconds": 7201}},
    {"expires_after": {"anchor": "now"}}, {"session": {"type": "transcription"}}, {"session": []},
])  # fmt: skip
def test_a_bad_client_secret_request_says_what_is_wrong(spec):
    with pytest.raises(ValueError):
        ClientSecrets().mint(spec, "m")
