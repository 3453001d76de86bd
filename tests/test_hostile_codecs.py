"""Hostile Opus input (issue 58, items 4 and 5): what a client's bytes may decode to.

Real codecs on real round trips: the honest sessions' Ogg/Opus comes from the server's
own encoder and their answers are checked byte for byte against the server's codecs
replayed (tests/test_formats_server.py); the attacks are Ogg streams built here, page by
page. The servers run ``--codec-processes 1`` so that every session's Opus shares the one
codec worker with the attack (and ``0``: Opus inline on the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal

import numpy as np
import pytest
import websockets.asyncio.client

from duplexserve.codecs import MODEL_RATE, AudioFormat, make_decoder
from duplexserve.codecs import libopus as lo
from duplexserve.codecs.formats import FormatError
from duplexserve.codecs.opus import OpusStreamDecoder
from duplexserve.codecs.opus_budget import (
    MAX_PACKET_SAMPLES,
    OpusBudget,
    OpusLimits,
    OverBudget,
    packet_samples,
)
from duplexserve.codecs.opus_reader import (
    MAX_PACKET_BYTES,
    LibopusStreamDecoder,
    OggOpusReader,
)
from duplexserve.codecs.opus_rtp import OPUS as RTP_LIBOPUS
from duplexserve.codecs.procpool import OK, RECV_SIZE, REPLY, Reassembler
from tests.native_client import Result, converse
from tests.native_client import signal as noise
from tests.test_formats_server import expected_answer, query, speechlike, wire_messages

OPUS = AudioFormat("opus")
#: TOC byte of an Opus packet of two empty 60 ms SILK frames (config 3, code 1): one
#: byte that decodes to 120 ms of concealment, 2880 samples.
TOC_120_MS = 0x19
_OVER = 'duplexserve_connections_over_budget_total{budget="%s"}'


# ------------------------------------------------------------------- Ogg by hand
def page(lacing: bytes, body: bytes, seq: int, flags: int = 0) -> bytes:
    """One Ogg page with the lacing values given (the CRC right, as a real muxer's)."""
    data = bytearray(lo._PAGE_HEADER.pack(b"OggS", 0, flags, 0, lo.SERIAL, seq, 0))
    data += bytes([len(lacing)]) + lacing + body
    data[22:26] = lo.ogg_crc(bytes(data)).to_bytes(4, "little")
    return bytes(data)


def head_pages() -> bytes:
    """OpusHead (BOS) and OpusTags, as every stream starts."""
    tags = lo.opus_tags()
    return page(b"\x13", lo.opus_head(312), 0, flags=0x02) + page(bytes([len(tags)]), tags, 1)


def one_byte_pages(count: int, per_page: int = 10, seq: int = 2) -> bytes:
    """``count`` pages of ``per_page`` one-byte packets of 120 ms each (sphn's reader
    decodes at most a few hundred milliseconds a page, libopus's any number)."""
    return b"".join(page(b"\x01" * per_page, bytes([TOC_120_MS]) * per_page, seq + i) for i in range(count))


def endless_packet_pages(count: int, seq: int = 2) -> list[bytes]:
    """Pages of 255 lacing values of 255 each: one packet that never ends."""
    return [page(b"\xff" * 255, bytes(255 * 255), seq + i, flags=0x01 if i else 0) for i in range(count)]


# ---------------------------------------------------------------- in process
@pytest.mark.skipif(RTP_LIBOPUS is None, reason="no libopus at all (system or PyAV's)")
def test_the_toc_byte_says_what_libopus_decodes_a_packet_to():
    """Every TOC byte, and code 3 with every frame count: our reading of RFC 6716 3.1
    against libopus's own ``opus_packet_get_nb_samples``."""
    for toc in range(256):
        counts = range(64) if toc & 3 == 3 else [None]
        for count in counts:
            packet = bytes([toc]) if count is None else bytes([toc, count]) + bytes(8)
            want = RTP_LIBOPUS.opus_packet_get_nb_samples(packet, len(packet), MODEL_RATE)
            if want <= 0 or want > MAX_PACKET_SAMPLES:
                with pytest.raises(FormatError):
                    packet_samples(packet)
            else:
                assert packet_samples(packet) == want, (toc, count)
    with pytest.raises(FormatError, match="empty"):
        packet_samples(b"")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_one_byte_packets_are_refused_before_they_are_decoded():
    """Ten seconds ahead is the allowance: 2 s of 120 ms packets in one go pass, a
    message that would take the connection past it is refused whole."""
    clock = Clock()
    reader = OggOpusReader(OpusBudget(OpusLimits(ahead_s=10.0, ms_per_byte=20.0), clock))
    reader.packets(head_pages())
    assert len(reader.packets(one_byte_pages(2, per_page=8))) == 16  # 1.92 s: inside the allowance
    assert reader.sizes == [2880] * 16
    with pytest.raises(OverBudget, match="ahead of real time") as refused:
        reader.packets(one_byte_pages(8, per_page=10, seq=4))  # 9.6 s more, in no time
    assert refused.value.budget == "opus_samples"


def test_audio_worth_more_than_its_bytes_is_refused_even_in_real_time():
    """Paced at real time, one-byte packets ten a page still claim 25 ms a byte: past the
    allowance the connection is over its bytes' worth (20 ms a byte)."""
    clock = Clock()
    reader = OggOpusReader(OpusBudget(OpusLimits(ahead_s=2.0, ms_per_byte=20.0), clock))
    reader.packets(head_pages())
    with pytest.raises(OverBudget, match="ms a byte") as refused:
        for i in range(40):  # 1.2 s a page, 1.2 s of wall clock each
            clock.now += 1.2
            reader.packets(one_byte_pages(1, per_page=10, seq=2 + i))
    assert refused.value.budget == "opus_samples"


def test_an_honest_stream_is_within_its_budget_paced_or_all_at_once():
    """The server's encoder's own Ogg/Opus, 8 s: message by message at real time, and all
    in the same instant (under the 10 s allowance; a second a message, as sphn's reader
    takes at most about 4 s a call); the samples are those of an unbudgeted decoder."""
    messages = wire_messages(speechlike(MODEL_RATE, seed=3, seconds=8.0), OPUS, 80)
    unbudgeted = make_decoder(OPUS)
    want = np.concatenate([unbudgeted.decode(m) for m in messages])
    clock = Clock()
    decoder = LibopusStreamDecoder if lo.LIBOPUS is not None else OpusStreamDecoder
    paced = decoder(OpusBudget(OpusLimits(), clock))
    got = []
    for m in messages:
        got.append(paced.decode(m))
        clock.now += 0.08
    assert np.array_equal(np.concatenate(got), want)
    at_once = decoder(OpusBudget(OpusLimits(), clock))
    seconds = [b"".join(messages[i : i + 12]) for i in range(0, len(messages), 12)]
    assert np.array_equal(np.concatenate([at_once.decode(m) for m in seconds]), want)
    with pytest.raises(OverBudget, match="ahead of real time"):  # 2 s past the allowance
        for m in seconds + seconds[:4]:
            at_once.decode(m)


def test_an_ogg_packet_that_never_ends_is_cut_off_at_the_cap():
    reader = OggOpusReader()
    reader.packets(head_pages())
    pages = endless_packet_pages(4)
    reader.packets(pages[0])  # 65,025 bytes: under the cap, kept
    with pytest.raises(OverBudget, match="Ogg packet over") as refused:
        reader.packets(pages[1])
    assert refused.value.budget == "ogg_packet" and MAX_PACKET_BYTES < 2 * 255 * 255


def test_a_long_reply_is_joined_once_not_rebuilt_on_every_read():
    """The loop's reader of a codec worker's replies: a reply that takes many reads comes
    out once, whole, when its last byte has come; before, each 256 KiB read re-copied the
    reply's growing start (30 s of loop time for three replies of 294 MB)."""
    replies = [REPLY.pack(OK, n) + bytes([n % 251]) * n for n in (5, 3 << 20, 0, 700_000, 9)]
    stream = b"".join(replies)
    reader, got, handed = Reassembler(), [], 0
    for at in range(0, len(stream), RECV_SIZE):
        data = reader.take(memoryview(stream[at : at + RECV_SIZE]))
        if data is None:
            continue
        handed += 1
        pos = 0
        while len(data) - pos >= REPLY.size:
            end = pos + REPLY.size + REPLY.unpack_from(data, pos)[1]
            if end > len(data):
                break
            got.append(data[pos:end])
            pos = end
        whole = REPLY.size + REPLY.unpack_from(data, pos)[1] if len(data) - pos >= REPLY.size else REPLY.size
        reader.keep(data, pos, whole)
    assert got == replies
    assert handed <= 4 < len(stream) // RECV_SIZE  # 16 reads; bytes to parse 4 times, not 16


# ------------------------------------------------------------------ a server
async def moshi(url: str, messages: list[bytes], gap: float) -> tuple[list[bytes], list[str], int | None]:
    """Kyutai's client at /api/chat: the handshake, ``0x01`` + each message, then read
    until as many answers as messages came or the server closed."""
    audio: list[bytes] = []
    errors: list[str] = []
    async with websockets.asyncio.client.connect(url, compression=None, max_size=None) as ws:
        assert (await asyncio.wait_for(ws.recv(), 10))[0] == 0x00

        async def reader() -> None:
            with contextlib.suppress(websockets.ConnectionClosed):
                while len(audio) < len(messages) or errors:  # after an error: until the close
                    msg = await asyncio.wait_for(ws.recv(), 30)
                    if msg[0] == 0x01:
                        audio.append(msg[1:])
                    elif msg[0] == 0x05:
                        errors.append(msg[1:].decode())

        task = asyncio.create_task(reader())
        with contextlib.suppress(websockets.ConnectionClosed):
            for m in messages:
                await ws.send(b"\x01" + m)
                await asyncio.sleep(gap)
        await asyncio.wait_for(task, 60)
    return audio, errors, ws.close_code


async def attack(url: str, messages: list[bytes], prefix: bytes = b"") -> tuple[list[str], int | None]:
    """Send every message as fast as the socket takes it; what came back, and the close."""
    texts: list[str] = []
    async with websockets.asyncio.client.connect(url, compression=None, max_size=None) as ws:
        await asyncio.wait_for(ws.recv(), 10)  # session.created, or Moshi's handshake

        async def reader() -> None:
            with contextlib.suppress(websockets.ConnectionClosed):
                async for msg in ws:
                    if isinstance(msg, str):
                        texts.append(msg)
                    elif msg[:1] == b"\x05":
                        texts.append(msg[1:].decode())

        task = asyncio.create_task(reader())
        with contextlib.suppress(websockets.ConnectionClosed):
            for m in messages:
                await ws.send(prefix + m)
        await asyncio.wait_for(task, 60)
    return texts, ws.close_code


def check_honest(res: Result, messages: list[bytes], inp: AudioFormat = OPUS, late_ms: float = 2000) -> None:
    """Exactly the answer the server's codecs give, completed, and never far behind."""
    assert res.closed is not None and res.closed["reason"] == "completed", res.events
    assert res.frames == expected_answer(messages, inp, inp)
    assert res.closed["turnaround_ms"]["max"] < late_ms, res.closed


def native_error(texts: list[str]) -> dict:
    errors = [json.loads(t) for t in texts if json.loads(t).get("type") == "error"]
    assert errors, texts
    return errors[0]


@pytest.mark.parametrize("processes", ["1", "0"])
def test_one_byte_packets_close_the_attacker_and_spare_the_sessions_beside_it(server_factory, processes):
    """Issue 58, item 4: 16 KB of one-byte 120 ms packets (408 s of audio, 39 MB of PCM;
    3.6 s a message, as sphn's reader takes no more in one call) on /v1/duplex and on
    /api/chat, while two Opus sessions, a Moshi one and a PCM one stream at real time on
    the same codec worker: each attacker is closed invalid_audio (1003) and counted; the
    others get every frame exactly and never late."""
    server = server_factory("--codec-processes", processes)
    honest = [wire_messages(speechlike(MODEL_RATE, seed=40 + i, seconds=3.0), OPUS, 80) for i in range(3)]
    pcm = noise(38, seed=7).tobytes()
    pcm_messages = [pcm[i : i + 7680] for i in range(0, len(pcm), 7680)]
    pages = one_byte_pages(339)
    flood = [head_pages()] + [pages[i : i + 141] for i in range(0, len(pages), 141)]  # 3 pages each
    assert 15_000 < sum(map(len, flood)) < 17_000

    async def scenario():
        url = server.ws(query=query(OPUS, OPUS))
        sessions = [converse(url, honest[0], gap=0.08), converse(url, honest[1], gap=0.08),
                    moshi(server.ws("/api/chat"), honest[2], gap=0.08),
                    converse(server.ws(), pcm_messages, gap=0.08)]
        tasks = [asyncio.create_task(s) for s in sessions]
        await asyncio.sleep(0.5)  # every honest session streaming
        attacks = await asyncio.gather(attack(url, flood), attack(server.ws("/api/chat"), flood, b"\x01"))
        return attacks, await asyncio.gather(*tasks)

    (native_attack, moshi_attack), (a, b, (audio, moshi_errors, _), plain) = asyncio.run(scenario())
    texts, code = native_attack
    assert code == 1003 and native_error(texts)["code"] == "invalid_audio", texts
    assert "ahead of real time" in native_error(texts)["message"]
    texts, code = moshi_attack
    assert code == 1003 and any("budget" in t for t in texts), texts
    check_honest(a, honest[0])
    check_honest(b, honest[1])
    assert not moshi_errors and audio == expected_answer(honest[2], OPUS, OPUS)
    assert plain.frames == pcm_messages and plain.closed["turnaround_ms"]["max"] < 2000
    assert server.metrics()[_OVER % "opus_samples"] == 2
    assert server.log().count("opus_samples budget") == 2  # one line a connection


def worker_rss_kb(server) -> int:
    with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
        (pid,) = [int(p) for p in f.read().split()]
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_an_ogg_packet_that_never_ends_is_cut_off_and_the_worker_stays_small(server_factory):
    """Issue 58, item 5: 20 MB of pages that continue one packet, sent beside an Opus
    session on the same codec worker: the attacker is closed invalid_audio (1003) at the
    cap, counted as ogg_packet; the worker's memory stays put; the session is exact."""
    server = server_factory("--codec-processes", "1")
    honest = wire_messages(speechlike(MODEL_RATE, seed=50, seconds=3.0), OPUS, 80)
    pages = endless_packet_pages(300)
    messages = [head_pages()] + [b"".join(pages[i : i + 10]) for i in range(0, len(pages), 10)]

    async def scenario():
        url = server.ws(query=query(OPUS, OPUS))
        session = asyncio.create_task(converse(url, honest, gap=0.08))
        await asyncio.sleep(0.5)
        before = worker_rss_kb(server)
        texts, code = await attack(url, messages)
        grown = worker_rss_kb(server) - before
        return texts, code, grown, await session

    texts, code, grown, res = asyncio.run(scenario())
    assert code == 1003 and native_error(texts)["code"] == "invalid_audio", texts
    assert "Ogg packet over" in native_error(texts)["message"]
    assert grown < 8 * 1024, f"the codec worker grew by {grown} kB"
    check_honest(res, honest)
    assert server.metrics()[_OVER % "ogg_packet"] == 1



@pytest.mark.parametrize("path", ["/v1/duplex", "/api/chat"])
def test_a_worker_dying_under_a_session_that_only_waits_for_answers_closes_it(server_factory, path):
    """Its input all decoded, a session only has encodes in the worker when the worker
    dies (a slow engine, 40 ms a step, keeps answers coming): it still gets its error,
    ``session.closed`` where the protocol has one, and 1011, never a silent end."""
    server = server_factory("--codec-processes", "1", "--step-base-ms", "40")
    messages = wire_messages(speechlike(MODEL_RATE, seed=60, seconds=2.4), OPUS, 80)
    moshi_kind = path == "/api/chat"

    async def scenario():
        url = server.ws(path, "" if moshi_kind else query(OPUS, OPUS))
        async with websockets.asyncio.client.connect(url, compression=None, max_size=None) as ws:
            await ws.recv()
            for m in messages:
                await ws.send(b"\x01" + m if moshi_kind else m)
            answers = 0
            while answers < 3:  # the worker answers: its decodes are long done
                msg = await asyncio.wait_for(ws.recv(), 10)
                answers += isinstance(msg, bytes) and msg[:1] != b"\x05"
            with open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children") as f:
                (worker,) = [int(pid) for pid in f.read().split()]
            os.kill(worker, signal.SIGKILL)
            said = []
            with contextlib.suppress(websockets.ConnectionClosed):
                while True:
                    msg = await asyncio.wait_for(ws.recv(), 20)
                    if isinstance(msg, str):
                        said.append(json.loads(msg))
                    elif msg[:1] == b"\x05":
                        said.append(msg[1:].decode())
            return said, ws.close_code

    said, code = asyncio.run(scenario())
    assert code == 1011, said
    if moshi_kind:
        assert said and "internal_error" in said[-1]
    else:
        assert said[-1]["type"] == "session.closed" and said[-1]["reason"] == "internal_error", said
