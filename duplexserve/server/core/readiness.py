"""How long sessions took to be ready, per protocol, and their prompts by outcome.

Plain counters, observed once a session on the loop and read at scrape time
(server/metrics.py).
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

#: Time to ready: a session without a prompt is ready in a few ms, one with a prompt
#: after its prefill (the target: well under a second).
READY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0)


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
