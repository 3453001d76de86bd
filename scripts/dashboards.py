#!/usr/bin/env python3
"""Write the Grafana dashboard of a duplexserve fleet, or check that the file is current.

One source for the panels: the JSON in deploy/kubernetes/gateway/dashboard/ (a ConfigMap there,
labelled grafana_dashboard: "1", and docker compose's monitoring profile) is generated here.
tests/test_dashboards.py runs every panel's query against a real Prometheus scraping a real
server, so a query naming a metric the server does not export fails CI.

    scripts/dashboards.py           write the JSON
    scripts/dashboards.py --check   exit 1 when the JSON differs from what this writes
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "deploy/kubernetes/gateway/dashboard/duplexserve.json"

#: Every series is filtered to the chosen namespaces (one overlay, one model, per namespace).
NS = 'namespace=~"$namespace"'

#: (title, unit, [(PromQL, legend)], description). Grafana lays them out two a row.
PANELS: list[tuple[str, str, list[tuple[str, str]], str]] = [
    ("Slots in use, fleet", "percentunit", [
        (f"sum(duplexserve_sessions_active{{{NS}}}) / sum(duplexserve_max_sessions{{{NS}}})", "in use"),
    ], "What the autoscaler acts on (deploy/kubernetes/base/scaledobject.yaml, threshold 0.75)."),
    ("Sessions and slots per pod", "short", [
        (f"duplexserve_sessions_active{{{NS}}}", "{{pod}} sessions"),
        (f"duplexserve_max_sessions{{{NS}}}", "{{pod}} slots"),
    ], "Sessions holding an engine slot, and the slots each replica has."),
    ("Replicas admitting and draining", "short", [
        (f"sum(duplexserve_ready{{{NS}}})", "admitting (/ready 200)"),
        (f"sum(duplexserve_draining{{{NS}}})", "draining"),
    ], "A full replica stops admitting; a draining one finishes its calls for the grace period."),
    ("Sessions accepted and refused", "ops", [
        (f"sum(rate(duplexserve_sessions_accepted_total{{{NS}}}[$__rate_interval]))", "accepted"),
        (f"sum(rate(duplexserve_sessions_rejected_total{{{NS}}}[$__rate_interval]))",
         "refused (full or draining)"),
    ], "Refused sessions got HTTP 503 (or close 1013) from every replica the gateway tried."),
    ("Frame turnaround", "s", [
        (f"histogram_quantile({q}, sum by (le) "
         f"(rate(duplexserve_frame_turnaround_seconds_bucket{{{NS}}}[$__rate_interval])))",
         f"p{int(q * 100)}")
        for q in (0.5, 0.9, 0.99)
    ], "Input message received to its output frame handed to the socket: the server's share of the "
       "round trip."),
    ("Late frames", "percentunit", [
        (f"sum(rate(duplexserve_frames_late_total{{{NS}}}[$__rate_interval])) "
         f"/ sum(rate(duplexserve_frames_out_total{{{NS}}}[$__rate_interval]))", "late / answered"),
    ], "Output frames answered later than --late-frame-ms: a gap the caller hears."),
    ("Engine step time", "s", [
        (f"histogram_quantile({q}, sum by (le) "
         f"(rate(duplexserve_engine_step_seconds_bucket{{{NS}}}[$__rate_interval])))", f"p{int(q * 100)}")
        for q in (0.5, 0.99)
    ], "One step advances every session by one 80 ms frame: past 80 ms the batch falls behind."),
    ("Engine batch size", "short", [
        (f"sum(rate(duplexserve_engine_batch_size_sum{{{NS}}}[$__rate_interval])) "
         f"/ sum(rate(duplexserve_engine_batch_size_count{{{NS}}}[$__rate_interval]))",
         "mean sessions a step"),
    ], "Sessions stepped together."),
    ("Engine restarts", "short", [
        (f"sum by (pod) (increase(duplexserve_engine_restarts_total{{{NS}}}[$__rate_interval]))", "{{pod}}"),
        (f"sum by (cause) "
         f"(increase(duplexserve_engine_restart_sessions_ended_total{{{NS}}}[$__rate_interval]))",
         "sessions ended: {{cause}}"),
    ], "A failed or stalled engine is restarted; the sessions it held end with engine_error."),
    ("CPU: server and codec workers", "percentunit", [
        (f"sum by (pod) (rate(duplexserve_cpu_seconds_total{{{NS}}}[$__rate_interval]))", "{{pod}} server"),
        (f"sum by (pod) (rate(duplexserve_codec_processes_cpu_seconds_total{{{NS}}}[$__rate_interval]))",
         "{{pod}} codec workers"),
    ], "CPU seconds a second (1 = one core). The Opus codec workers are processes of their own."),
    ("WebRTC", "short", [
        (f"sum(duplexserve_webrtc_calls_active{{{NS}}})", "calls"),
        (f"sum by (event) (rate(duplexserve_jitter_packets_total{{{NS}}}[$__rate_interval]))",
         "jitter buffer: {{event}}"),
    ], "Calls over WebRTC, and what their jitter buffers did with the packets (a second)."),
    ("Event loop: engine results waiting", "s", [
        (f"histogram_quantile(0.99, sum by (le) "
         f"(rate(duplexserve_loop_pickup_seconds_bucket{{{NS}}}[$__rate_interval])))", "p99"),
    ], "An engine step's results waiting for the event loop: a busy loop shows here first."),
    ("Overload and shedding", "short", [
        (f"sum by (pod) (rate(duplexserve_overload_seconds_total{{{NS}}}[$__rate_interval]))",
         "{{pod}} overloaded (s/s)"),
        (f"sum by (work) (rate(duplexserve_overload_shed_total{{{NS}}}[$__rate_interval]))",
         "shed: {{work}}"),
        (f"sum by (work) (rate(duplexserve_fair_share_cut_total{{{NS}}}[$__rate_interval]))",
         "over fair share: {{work}}"),
    ], "Time overloaded a second; work shed (503, 1013) and work of clients over their fair share "
       "of the loop cut (429, 1013, connections closed), a second (docs/reliability.md)."),
]


def panel(
    index: int, title: str, unit: str, queries: list[tuple[str, str]], description: str
) -> dict[str, Any]:
    return {
        "id": index + 1,
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(queries)
        ],
    }


def dashboard() -> dict[str, Any]:
    return {
        "uid": "duplexserve-fleet",
        "title": "duplexserve fleet",
        "description": "Sessions, slots, refusals, latency and engine health of duplexserve replicas "
                       "(generated by scripts/dashboards.py)",
        "tags": ["duplexserve"],
        "timezone": "browser",
        "schemaVersion": 39,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "editable": True,
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
            {
                "name": "namespace", "label": "Namespace", "type": "query",
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "query": {"query": "label_values(duplexserve_max_sessions, namespace)", "refId": "namespace"},
                "refresh": 2, "multi": True, "includeAll": True, "allValue": ".*",
                "current": {"text": "All", "value": "$__all"},
            },
        ]},
        "panels": [panel(i, *p) for i, p in enumerate(PANELS)],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="fail when the file differs from the generator")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    text = render()
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is not what scripts/dashboards.py writes: run it", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
