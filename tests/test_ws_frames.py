"""The fast frame reader against websockets' own parser, on random and hostile streams.

The same bytes, cut into the same random chunks, go into websockets' ``ServerProtocol``
alone (the reference) and into :class:`FrameReader` in front of another one. Both must
deliver the same messages in the same order, write the same bytes back (pongs, the
close frame with its code) and end in the same state: every rule of RFC 6455 that the
library enforces still holds on the fast path.
"""

from __future__ import annotations

import itertools
import struct

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.client import ClientProtocol
from websockets.frames import Opcode
from websockets.server import ServerProtocol
from websockets.uri import parse_uri

from duplexserve.server.transports.websocket.frames import FIN_BINARY, HANDED, FrameReader, Oversized, header
from tests.raw_ws import frame

MAX_SIZE = 70_000  # small enough to test both sides of the limit, above 65535


def _open_server() -> ServerProtocol:
    client = ClientProtocol(parse_uri("ws://localhost/v1/duplex"))
    client.send_request(client.connect())
    server = ServerProtocol(max_size=MAX_SIZE)
    server.receive_data(b"".join(client.data_to_send()))
    (request,) = server.events_received()
    server.send_response(server.accept(request))
    server.data_to_send()
    return server


def _payload(draw: st.DrawFn) -> bytes:
    size = draw(st.sampled_from([0, 1, 125, 126, 1000, 7680, 65535, 65536, MAX_SIZE, MAX_SIZE + 1]))
    return bytes(draw(st.integers(0, 255)) for _ in range(min(size, 8))) * (size // 8) + b"x" * (size % 8)


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from([
        "binary", "binary", "binary", "text", "bad_utf8", "fragmented", "ping", "pong", "close",
        "bad_close", "unmasked", "rsv", "long_ping", "reserved_opcode", "stray_cont",
        "data_inside_fragments", "lying_length",
    ]))
    if kind == "binary":
        return frame(0x82, _payload(draw))
    if kind == "text":
        return frame(0x81, draw(st.text(max_size=200)).encode())
    if kind == "bad_utf8":
        return frame(0x81, b"ok \xff\xfe")
    if kind == "fragmented":
        first = draw(st.sampled_from([0x01, 0x02]))
        parts = [frame(first, b"part-1")]
        if draw(st.booleans()):
            parts.append(frame(0x89, b"in between"))  # a control frame between fragments
        parts.append(frame(0x00, "ü2".encode()))
        parts.append(frame(0x80, b"-end"))
        return b"".join(parts)
    if kind == "ping":
        return frame(0x89, draw(st.binary(max_size=125)))
    if kind == "pong":
        return frame(0x8A, draw(st.binary(max_size=125)))
    if kind == "close":
        return frame(0x88, struct.pack("!H", 1000) + b"bye")
    if kind == "bad_close":
        return frame(0x88, draw(st.sampled_from([b"\x03\xe7", b"\x01", struct.pack("!H", 1000) + b"\xff"])))
    if kind == "unmasked":
        return frame(0x82, b"not masked", masked=False)
    if kind == "rsv":
        return frame(0x82 | draw(st.sampled_from([0x40, 0x20, 0x10])), b"reserved bits")
    if kind == "long_ping":
        return frame(0x89, b"p" * 126)
    if kind == "reserved_opcode":
        return frame(0x80 | draw(st.sampled_from([0x3, 0x7, 0xB, 0xF])), b"?")
    if kind == "stray_cont":
        return frame(0x80, b"continuation of nothing")
    if kind == "data_inside_fragments":
        return frame(0x02, b"start") + frame(0x82, b"a new message too early")
    # a header announcing more than the limit, with little behind it
    return frame(FIN_BINARY, b"tiny", length=MAX_SIZE + 10)[:20]


def _messages(
    conn: ServerProtocol, pending: list[bytes], kinds: list[str], out: list[tuple[str, bytes]]
) -> None:
    """The library's frames assembled into messages the way uvicorn does."""
    for event in conn.events_received():
        if event.opcode in (Opcode.TEXT, Opcode.BINARY):
            kinds[:] = ["text" if event.opcode is Opcode.TEXT else "bytes"]
            pending[:] = [bytes(event.data)]
        elif event.opcode is Opcode.CONT:
            pending.append(bytes(event.data))
        else:
            out.append((event.opcode.name, bytes(event.data)))
            continue
        if event.fin:
            out.append((kinds[0], b"".join(pending)))


def _reference(chunks: list[bytes]) -> tuple[list[tuple[str, bytes]], bytes, object]:
    conn, out, pending, kinds = _open_server(), [], [], ["bytes"]
    for chunk in chunks:
        conn.receive_data(chunk)
        _messages(conn, pending, kinds, out)
    return out, b"".join(conn.data_to_send()), conn.state


def _fast(chunks: list[bytes]) -> tuple[list[tuple[str, bytes]], bytes, object]:
    conn, out, pending, kinds = _open_server(), [], [], ["bytes"]
    reader = FrameReader(conn, MAX_SIZE)
    for chunk in chunks:
        reader.feed(chunk)
        while (item := reader.next()) is not None:
            if item is HANDED:
                _messages(conn, pending, kinds, out)
            else:
                payload, is_text = item  # type: ignore[misc]
                out.append(("text" if is_text else "bytes", bytes(payload)))
    return out, b"".join(conn.data_to_send()), conn.state


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stream=st.lists(frames(), min_size=1, max_size=12),
    cuts=st.lists(st.integers(0, 200_000), max_size=12),
)
def test_fast_reader_agrees_with_websockets(stream: list[bytes], cuts: list[int]) -> None:
    data = b"".join(stream)
    bounds = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    chunks = [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]
    assert _fast(chunks) == _reference(chunks)


def test_common_frames_take_the_fast_path() -> None:
    """The hot path must not hand audio frames to the library: count the handoffs."""
    conn = _open_server()
    reader = FrameReader(conn, MAX_SIZE)
    audio = bytes(range(256)) * 30
    reader.feed(frame(0x82, audio) * 3 + frame(0x81, b'{"type":"ping"}') + frame(0x89, b"p"))
    items = []
    while (item := reader.next()) is not None:
        items.append(item)
    assert items[:4] == [(audio, False)] * 3 + [(b'{"type":"ping"}', True)]
    assert items[4] is HANDED and conn.events_received()[0].opcode is Opcode.PING


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(0, 120_000), max_size=10))
def test_a_frame_over_the_apps_limit_is_refused_from_its_header(cuts: list[int]) -> None:
    """Its length comes out in its place, its payload is dropped however it is cut up, and
    the frames after it parse as before; a fragment is the library's to judge."""
    conn = _open_server()
    reader = FrameReader(conn, MAX_SIZE)
    reader.refuse_over = 1000
    big = bytes(range(256)) * 400  # 102 400 bytes: past the app's limit and the library's
    data = (frame(0x82, b"a" * 1000) + frame(0x82, big) + frame(0x81, b'{"type":"ping"}')
            + frame(0x02, b"b" * 2000) + frame(0x80, b"c"))
    bounds = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    items = []
    for a, b in itertools.pairwise(bounds):
        reader.feed(data[a:b])
        while (item := reader.next()) is not None:
            items.append(item)
    refused = [i for i in items if isinstance(i, Oversized)]
    assert [len(i) for i in refused] == [len(big)]
    assert items[0] == (b"a" * 1000, False) and items[1] is refused[0]
    assert items[2] == (b'{"type":"ping"}', True)
    assert all(i is HANDED for i in items[3:])  # the fragmented message: websockets' own
    assert [e.data for e in conn.events_received()] == [b"b" * 2000, b"c"]
    assert reader.buffered == 0


def test_written_headers_parse_back_with_websockets() -> None:
    from websockets.frames import Frame
    from websockets.streams import StreamReader

    for size in (0, 125, 126, 65535, 65536, 100_000):
        payload = b"a" * size
        stream = StreamReader()
        stream.feed_data(header(FIN_BINARY, size) + payload)
        parser = Frame.parse(stream.read_exact, mask=False)
        try:
            next(parser)
        except StopIteration as done:
            parsed = done.value
        assert parsed.opcode is Opcode.BINARY and parsed.fin and parsed.data == payload
