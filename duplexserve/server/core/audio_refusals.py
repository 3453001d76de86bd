"""Sessions ended for float32 samples that are not audio (codecs/pcm.py): one counter.

``/metrics`` exports ``duplexserve_audio_refused_total{reason}``, ``reason`` being
``non_finite`` (NaN, an infinity) or ``too_large`` (a norm above ``pcm.MAX_NORM``). The
counts are process-wide, like the budgets' (budgets.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

REASONS = ("non_finite", "too_large")
_refused: Counter[str] = Counter()


def audio_refused(reason: str) -> None:
    """Count one session ended for samples refused with ``reason``."""
    _refused[reason] += 1


class AudioRefusalCollector(Collector):
    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "duplexserve_audio_refused",
            "sessions ended invalid_audio for float32 samples that are not audio, by reason",
            labels=["reason"],
        )
        for reason in REASONS:
            family.add_metric([reason], _refused[reason])
        yield family
