"""Count what nginx answered callers: listen for its metrics log (syslog over UDP, as
docker/nginx/nginx.conf sends it) and serve the counts on /metrics for Prometheus.

In the compose deployment's scale profile this runs as the service lb-exporter
(docs/deploy-compose.md, "Monitoring"); the alert on it is DuplexserveProxyRefusing
(docker/prometheus/alerts.yml, docs/runbook.md)."""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys

from prometheus_client import start_http_server

from duplexserve.proxy_exporter.access_log import ProxyCounters

log = logging.getLogger("duplexserve.proxy_exporter")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--syslog", default="0.0.0.0:5514", metavar="HOST:PORT",
                        help="where nginx's access_log syslog:server= sends (UDP)")
    parser.add_argument("--metrics", default="0.0.0.0:9145", metavar="HOST:PORT",
                        help="where Prometheus scrapes /metrics")


def address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    counters = ProxyCounters()
    syslog_host, syslog_port = address(args.syslog)
    sock = socket.socket(socket.AF_INET6 if ":" in syslog_host else socket.AF_INET, socket.SOCK_DGRAM)
    # A burst of refusals is a burst of lines: room for it while the loop counts.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind((syslog_host, syslog_port))
    metrics_host, metrics_port = address(args.metrics)
    start_http_server(metrics_port, metrics_host, registry=counters.registry)
    # docker stop: PID 1 has no default SIGTERM handler, so end at once instead of at SIGKILL.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    log.info("counting nginx's lines on udp %s:%d, /metrics on %s:%d",
             syslog_host, syslog_port, metrics_host, metrics_port)
    try:
        while True:
            counters.count(sock.recv(65536).decode("utf-8", "replace"))
    except KeyboardInterrupt:
        return 0
