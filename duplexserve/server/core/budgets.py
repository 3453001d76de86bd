"""Connections closed for spending more than a client may: one counter per budget.

A budget is what one connection may cost the server (messages or bytes a second, decoded
samples per received byte, replies queued toward a client that does not read, ...). Where
a budget is enforced, the connection over it is closed and :func:`over_budget` counts it;
``/metrics`` exports the counts as ``duplexserve_connections_over_budget_total{budget}``
(docs/reliability.md lists each budget, its default and its setting). The counts are
process-wide: a connection refused at the transport has no session to count it on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

_closed: Counter[str] = Counter()


def over_budget(budget: str) -> None:
    """Count one connection closed for going over ``budget`` (a short snake_case name)."""
    _closed[budget] += 1


def closed_counts() -> dict[str, int]:
    return dict(_closed)


class BudgetCollector(Collector):
    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "duplexserve_connections_over_budget",
            "connections closed for exceeding a per-connection budget, by budget",
            labels=["budget"],
        )
        for budget, value in sorted(_closed.items()):
            family.add_metric([budget], value)
        yield family
