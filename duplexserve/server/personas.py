"""Persona prompts (a text and a voice: PersonaPlex) as every protocol carries them, and readiness.

Each protocol brings a session's prompt its own way (docs/protocols.md): the native
query or first ``session.update``, Kyutai's ``/api/chat`` query, Realtime's
``instructions`` and output voice, Twilio's custom parameters. What they share is here:
the prompt's fields, what a refusal from ``Orchestrator.run_prompt`` means for the
session (docs/protocol.md: ``prompt_unsupported`` goes on, the others end it), and the counts
``/metrics`` shows: how long sessions took to be ready, per protocol, and prompts by
outcome. Plain counters, read at scrape time (server/metrics.py). ``GET /v1/voices``
lists the voice prompts a session may name.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from duplexserve import errors
from duplexserve.config import ServerConfig
from duplexserve.errors import SessionError
from duplexserve.server import auth
from duplexserve.server.http_errors import http_error

if TYPE_CHECKING:
    from duplexserve.server.orchestrator import Orchestrator

PROMPT_KEYS = ("text_prompt", "voice_prompt")
#: The close that follows a refused prompt; ``prompt_unsupported`` has none (the session
#: goes on without it). ``invalid_prompt`` is bad input in the request: docs/protocol.md's 1007.
_CLOSE_CODES = {
    "voice_not_found": errors.POLICY,
    "invalid_prompt": errors.INVALID_PAYLOAD,
    "engine_error": errors.INTERNAL,
}
OUTCOMES = ("ran", "prompt_unsupported", "voice_not_found", "invalid_prompt", "engine_error")
#: Time to ready: a session without a prompt is ready in a few ms, one with a prompt
#: after its prefill (the target: well under a second).
READY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)


def prompt_of(fields: Mapping[str, Any]) -> dict[str, str] | None:
    """The prompt among ``fields`` (a query, an event): its non-empty fields, or None when it
    sets none. Raises ValueError naming a field that is not a string."""
    prompt = {}
    for key in PROMPT_KEYS:
        value = fields.get(key)
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise ValueError(f"'{key}' must be a string")
        prompt[key] = value
    return prompt or None


def refusal(code: str, message: str) -> SessionError:
    """A refused prompt as the error the client gets: fatal unless ``prompt_unsupported``."""
    close = None if code == "prompt_unsupported" else _CLOSE_CODES.get(code, errors.INTERNAL)
    return SessionError(code, message, close)


def voices_route(config: ServerConfig, orch: Orchestrator) -> Callable[[Request], Awaitable[Response]]:
    """``GET /v1/voices``: the voice prompts of the engine (an empty list for a model without
    prompts), in OpenAI's list shape; the key and Origin checked as for the WebSockets."""

    async def voices(request: Request) -> Response:
        if not auth.origin_ok(request.scope, auth.parse_list(config.allowed_origins)):
            return http_error(403, "origin_not_allowed", "this Origin may not connect")
        if not auth.key_ok(request.scope, dict(request.query_params), auth.parse_list(config.api_keys)):
            return http_error(401, "invalid_api_key", "a valid API key is required")
        data = [{"id": name, "object": "voice"} for name in orch.engine.voices]
        return JSONResponse({"object": "list", "data": data})

    return voices


class _Histogram:
    __slots__ = ("counts", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(READY_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(READY_BUCKETS, seconds)] += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[str, float]]:
        bounds = [*(str(b) for b in READY_BUCKETS), "+Inf"]
        total, out = 0, []
        for bound, count in zip(bounds, self.counts, strict=True):
            total += count
            out.append((bound, total))
        return out


class Readiness:
    """Per protocol: connect to ready (``session.created``, the handshake byte), and how long
    the prompts took, by outcome. Observed once a session, on the loop."""

    def __init__(self) -> None:
        self.ready: dict[str, _Histogram] = collections.defaultdict(_Histogram)
        self.prompt: dict[str, _Histogram] = collections.defaultdict(_Histogram)
        self.prompts: collections.Counter[tuple[str, str]] = collections.Counter()

    def observe_ready(self, protocol: str, seconds: float) -> None:
        self.ready[protocol].observe(seconds)

    def observe_prompt(self, protocol: str, outcome: str, seconds: float) -> None:
        self.prompts[protocol, outcome] += 1
        if outcome == "ran":
            self.prompt[protocol].observe(seconds)

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        for name, doc, table in (
            ("duplexserve_session_ready_seconds",
             "connect to ready: session.created (native, after its prompt; Realtime), the handshake "
             "byte (Moshi, after its prompt), the start of a Twilio call", self.ready),
            ("duplexserve_prompt_seconds",
             "a session's prompt handed to the engine to run (its prefill, between two steps)", self.prompt),
        ):  # fmt: skip
            family = HistogramMetricFamily(name, doc, labels=["protocol"])
            for protocol, histogram in sorted(table.items()):
                family.add_metric([protocol], histogram.cumulative(), sum_value=histogram.sum)
            yield family
        outcomes = CounterMetricFamily(
            "duplexserve_prompts", "session prompts by outcome: ran, or the error code that refused it",
            labels=["protocol", "outcome"],
        )
        for (protocol, outcome), count in sorted(self.prompts.items()):
            outcomes.add_metric([protocol, outcome], count)
        yield outcomes
