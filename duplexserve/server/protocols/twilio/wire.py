"""Twilio Media Streams messages, both ways, and the counters the adapter keeps.

Kept apart from the adapter (:mod:`duplexserve.server.protocols.twilio.adapter`) so that the wire shapes
are in one place: what Twilio sends is parsed here into plain values or a
:class:`BadMessage`, and what goes back is written here as JSON text. Facts from
Twilio's "Media Streams - WebSocket Messages" page; Telnyx, Plivo and Vonage use nearly
the same shapes.
"""

from __future__ import annotations

import binascii
import collections
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from duplexserve.server.log_redaction import clip

#: What Twilio streams: mu-law, 8 kHz, mono, 20 ms (160 bytes) a ``media`` message.
ENCODING, SAMPLE_RATE, CHANNELS = "audio/x-mulaw", 8000, 1
#: Tracks that carry the caller: ``inbound`` in media messages (``inbound_track`` in dtmf).
INBOUND = ("inbound", "inbound_track")
_BASE64_ALPHABET = re.compile(r"[A-Za-z0-9+/]*={0,2}")


class BadMessage(Exception):
    """A message the adapter drops: logged and counted under ``reason``; the call goes on."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


@dataclass(frozen=True, slots=True)
class Start:
    """The ``start`` event: who is calling, and how."""

    stream_sid: str
    call_sid: str
    tracks: tuple[str, ...]
    custom: dict[str, str]


def parse(text: str | None) -> dict[str, Any]:
    """A JSON object with a string ``event``, or BadMessage."""
    if text is None:
        raise BadMessage("binary", "a binary message: Twilio sends JSON text only")
    try:
        event = json.loads(text)
    except (ValueError, RecursionError):
        # The text is not logged: a broken start message may hold the key.
        raise BadMessage("invalid_json", f"not JSON ({len(text)} characters)") from None
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        raise BadMessage("invalid_event", "not a JSON object with a string 'event'")
    return event


def parse_start(event: dict[str, Any]) -> Start:
    """The ``start`` event's fields; raises BadMessage for a start the adapter cannot serve."""
    body = event.get("start")
    if not isinstance(body, dict):
        raise BadMessage("invalid_start", "start without a 'start' object")
    sid = event.get("streamSid") or body.get("streamSid")
    if not isinstance(sid, str) or not sid:
        raise BadMessage("invalid_start", "start without a streamSid")
    fmt = body.get("mediaFormat") or {}
    if not isinstance(fmt, dict) or (
        fmt.get("encoding", ENCODING),
        str(fmt.get("sampleRate", SAMPLE_RATE)),
        str(fmt.get("channels", CHANNELS)),
    ) != (ENCODING, str(SAMPLE_RATE), str(CHANNELS)):
        raise BadMessage("unsupported_format", f"mediaFormat {clip(fmt)}: only {ENCODING} at 8000 Hz mono")
    custom = body.get("customParameters") or {}
    if not isinstance(custom, dict):
        raise BadMessage("invalid_start", "customParameters is not an object")
    tracks = body.get("tracks") or ["inbound"]
    call_sid = body.get("callSid")
    return Start(
        sid,
        call_sid if isinstance(call_sid, str) else "",
        tuple(t for t in tracks if isinstance(t, str)) if isinstance(tracks, list) else ("inbound",),
        {str(k): str(v) for k, v in custom.items() if isinstance(v, (str, int, float))},
    )


def media_payload(event: dict[str, Any]) -> bytes | None:
    """The caller's mu-law bytes of a ``media`` event; None for another track."""
    media = event.get("media")
    if not isinstance(media, dict):
        raise BadMessage("invalid_media", "media without a 'media' object")
    if media.get("track", "inbound") not in INBOUND:
        return None  # the call's other leg (<Start><Stream track="both_tracks">): not the caller
    payload = media.get("payload")
    if not isinstance(payload, str):
        raise BadMessage("invalid_media", "media without a string 'payload'")
    try:
        return binascii.a2b_base64(payload, strict_mode=True)
    except (binascii.Error, ValueError):
        if _BASE64_ALPHABET.fullmatch(payload):  # well-formed, but its bits end inside a byte
            raise BadMessage(
                "partial_sample", f"a payload of {len(payload)} base64 characters is not whole mu-law bytes"
            ) from None
        raise BadMessage("invalid_base64", "the payload is not base64") from None


def mark_name(event: dict[str, Any]) -> str:
    mark = event.get("mark")
    name = mark.get("name") if isinstance(mark, dict) else None
    if not isinstance(name, str):
        raise BadMessage("invalid_mark", "mark without a string name")
    return name


# ------------------------------------------------------------- to Twilio
def media_json(sid_json: str, payload: bytes) -> str:
    """``media`` with the mu-law bytes; ``sid_json`` is the streamSid already as JSON."""
    b64 = binascii.b2a_base64(payload, newline=False).decode("ascii")
    return f'{{"event":"media","streamSid":{sid_json},"media":{{"payload":"{b64}"}}}}'


def mark_json(sid_json: str, name: str) -> str:
    return f'{{"event":"mark","streamSid":{sid_json},"mark":{{"name":{json.dumps(name)}}}}}'


def clear_json(sid_json: str) -> str:
    return f'{{"event":"clear","streamSid":{sid_json}}}'


# ------------------------------------------------------------- counters
@dataclass
class Counts:
    """Plain integers bumped by the adapter; read at scrape time, so no lock per message."""

    calls: int = 0
    marks_sent: int = 0
    marks_echoed: int = 0
    mark_delay_s: float = 0.0  # sum over echoed marks of (echo received - mark sent)
    clears_sent: int = 0
    dtmf: int = 0
    bad: collections.Counter[str] = field(default_factory=collections.Counter)


COUNTS = Counts()


class TwilioCollector(Collector):
    def collect(self) -> Iterator[CounterMetricFamily]:
        c = COUNTS
        for name, help_text, value in (
            ("calls", "Twilio Media Streams calls served", c.calls),
            ("marks_sent", "marks sent after answered audio", c.marks_sent),
            ("marks_echoed", "marks Twilio echoed once the audio before them had played", c.marks_echoed),
            ("mark_delay_seconds", "sum of mark send-to-echo times (playback lag; divide by marks_echoed)",
             c.mark_delay_s),
            ("clears_sent", "clear messages sent (audio queued at Twilio dropped)", c.clears_sent),
            ("dtmf", "DTMF events received (not passed to the model)", c.dtmf),
        ):
            yield CounterMetricFamily(f"duplexserve_twilio_{name}", help_text, value=value)
        bad = CounterMetricFamily(
            "duplexserve_twilio_messages_dropped", "messages dropped as bad input, by reason",
            labels=["reason"],
        )
        for reason, count in sorted(c.bad.items()):
            bad.add_metric([reason], count)
        yield bad
