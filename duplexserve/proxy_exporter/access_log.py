"""nginx's metrics log lines (docker/nginx/duplexserve.conf's ``duplexserve_metrics`` format, sent
as syslog) counted as Prometheus counters.

A replica counts the calls it refused, but not the ones no replica was reached for, nor which of
its refusals nginx retried elsewhere unseen: only the proxy knows what the caller got. The line
holds the route's class, the status and the replicas' answers in turn, and nothing else.
"""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter

#: ``<PRI>`` [``TIMESTAMP `` ``TAG: ``] ``duplexserve-proxy/1 ROUTE STATUS UPSTREAM_STATUS``.
LINE = re.compile(r"duplexserve-proxy/1 (?P<route>resume|session|http) (?P<status>[1-5]\d\d) "
                  r"(?P<upstream>.*)$")
#: One replica's answer in $upstream_status: nginx writes 502 for a replica it could not reach
#: (or that answered garbage), 504 for one that did not answer in time.
OUTCOMES = {"503": "refused", "502": "failed", "504": "timed_out"}


class ProxyCounters:
    """The exporter's counters, on a registry of their own (no process metrics: they would be
    the exporter's, and read as the proxy's)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "duplexserve_proxy_requests", "Requests nginx answered, by route class (session: a new "
            "call, resume: a dropped one back, http: the rest) and the class of the status the caller got",
            ["route", "code"], registry=self.registry)
        self.upstream = Counter(
            "duplexserve_proxy_upstream_attempts", "Replicas nginx tried for a request, by their "
            "answer: answered, refused (503: full or draining), failed (not reached), timed_out, error",
            ["outcome"], registry=self.registry)
        self.lines = Counter(
            "duplexserve_proxy_log_lines", "Log lines received, counted or not (a format this "
            "exporter does not know: the site and the exporter of two versions)",
            ["result"], registry=self.registry)
        for route in ("session", "resume", "http"):  # zero, not absent: rate() sees the first refusal
            for code in ("1xx", "2xx", "3xx", "4xx", "5xx"):
                self.requests.labels(route, code)
        for outcome in ("answered", "refused", "failed", "timed_out", "error"):
            self.upstream.labels(outcome)
        for result in ("counted", "unknown"):
            self.lines.labels(result)

    def count(self, line: str) -> bool:
        """Count one syslog message; False for one that is not a metrics line."""
        match = LINE.search(line.rstrip("\r\n\0"))
        if match is None:
            self.lines.labels("unknown").inc()
            return False
        self.lines.labels("counted").inc()
        self.requests.labels(match["route"], match["status"][0] + "xx").inc()
        for answer in re.split(r"[ ,:]+", match["upstream"]):
            if answer.isdigit():  # "-": nginx answered itself (no replica tried)
                self.upstream.labels(outcome(answer)).inc()
        return True


def outcome(status: str) -> str:
    if status in OUTCOMES:
        return OUTCOMES[status]
    return "error" if status.startswith("5") else "answered"
