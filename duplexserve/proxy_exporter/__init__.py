"""``duplexserve proxy-exporter``: what the compose deployment's nginx answered callers, as
Prometheus counters (docs/deploy-compose.md, "Monitoring")."""
