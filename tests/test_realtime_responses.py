"""The mapping of continuous model speech onto Realtime responses, without sockets."""

from __future__ import annotations

import itertools

from duplexserve.server.protocols.realtime.responses import Mode, Responses

SILENCE = 3


def make() -> Responses:
    counter = itertools.count()
    return Responses(lambda prefix: f"{prefix}_{next(counter)}", SILENCE)


def kinds(events):
    return [e["type"] for e in events]


def feed(r: Responses, pattern: str) -> tuple[list[dict], int]:
    """'v' voiced frame, '.' silent frame; returns every event and the frames sent."""
    events, sent = [], 0
    for c in pattern:
        before, target, after = r.audio(c == "v")
        events += before + after
        sent += target is not None
    return events, sent


def test_silence_alone_sends_nothing_and_speech_opens_one_response():
    r = make()
    events, sent = feed(r, "....")
    assert events == [] and sent == 0
    events, sent = feed(r, "vv.v...")
    assert kinds(events)[:4] == [
        "response.created",
        "response.output_item.added",
        "conversation.item.added",
        "response.content_part.added",
    ]
    assert kinds(events)[-1] == "response.done" and events[-1]["response"]["status"] == "completed"
    assert sent == 7 and r.mode is Mode.IDLE  # a pause shorter than SILENCE frames stays inside


def test_text_just_before_speech_opens_the_transcript_and_stale_text_is_dropped():
    r = make()
    r.text("stale")
    feed(r, "." * (SILENCE + 1))
    r.text("hel")
    r.text("lo")
    events, _ = feed(r, "v")
    deltas = [e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"]
    assert deltas == ["hello"]
    assert r.text(" there")[0]["delta"] == " there"
    events, _ = feed(r, "...")
    assert events[-1]["response"]["output"][0]["content"][0]["transcript"] == "hello there"


def test_cancel_mutes_until_silence_then_speech_opens_a_new_response():
    r = make()
    feed(r, "vv")
    first = r.current.id
    events = r.cancel(None, "c1")
    assert events[-1]["response"]["status"] == "cancelled" and r.mode is Mode.MUTED
    assert r.cancel(None, "c2")[0]["error"]["code"] == "response_cancel_not_active"
    events, sent = feed(r, "vvv..v.." + ".")
    assert sent == 0 and events == []  # the pause was too short to end the muted stretch
    events, sent = feed(r, "..v")
    assert sent == 1 and events[0]["response"]["id"] != first


def test_truncate_checks_the_item_and_its_length():
    r = make()
    events, _ = feed(r, "vv...")
    item = events[-1]["response"]["output"][0]["id"]
    assert r.truncate(item, 0, 400, None)[0]["type"] == "conversation.item.truncated"
    assert r.truncate(item, 0, 401, None)[0]["error"]["param"] == "audio_end_ms"
    assert r.truncate("item_x", 0, 0, "e")[0]["error"]["event_id"] == "e"


def test_a_session_ending_mid_response_ends_it_incomplete():
    r = make()
    assert r.finish() == []
    feed(r, "v")
    events = r.finish()
    assert events[-1]["response"]["status"] == "incomplete"
    assert events[-1]["response"]["status_details"] == {"type": "incomplete", "reason": None}
