#!/usr/bin/env bash
# Apply a settings, key or image change to the scale profile one replica at a time, with no call
# refused and none cut (docs/deploy-compose.md, "Updating without an outage"). Give it the same
# files and options as `docker compose` (v2, the plugin), from the repository root:
#
#   docker compose --env-file prod.env -f docker/compose.yaml -f docker/compose.tls.yaml build   # or pull
#   scripts/compose-update.sh --env-file prod.env -f docker/compose.yaml -f docker/compose.tls.yaml --profile scale
#
# `docker compose up -d` alone recreates every changed replica at once: for a few seconds no
# replica takes a call, and nginx, which resolved the replicas' names when it started, keeps
# sending calls and resumes to their old addresses. Here, for each replica in turn:
#   1. `stop`: SIGTERM drains it (/ready 503, new calls answered 503, which nginx retries on the
#      other replicas; its live calls finish, up to DUPLEXSERVE_DRAIN_GRACE_S), then it exits;
#   2. `up -d --no-deps`: recreated with the new settings and image;
#   3. wait until its /ready answers 200 (engine loaded, admitting);
#   4. `nginx -s reload` in lb: nginx resolves the names again (the new container's address);
#      the old workers keep the calls they carry (worker_shutdown_timeout, docker/nginx/nginx.conf).
#      Needed because the lb image's nginx (Debian's 1.22) resolves upstream names only then: the
#      `resolve` parameter that re-resolves them at run time is open-source nginx's from 1.27.3,
#      and a variable proxy_pass would lose the pool's least_conn and 503 retries
#      (docs/deploy-compose.md, Scale-out).
# Then the next. The other replicas take every new call meanwhile: keep the fleet's spare slots
# above one replica's worth during an update.
#
# DUPLEXSERVE_UPDATE_SERVICES: the replicas, in order (default: every duplexserve[-N] service of
# the configuration); DUPLEXSERVE_UPDATE_READY_S: how long a replica may take to be ready (600).
set -euo pipefail

compose=(docker compose "$@")
services=${DUPLEXSERVE_UPDATE_SERVICES:-$("${compose[@]}" config --services | { grep -E '^duplexserve(-[0-9]+)?$' || true; } | sort -V)}
ready_s=${DUPLEXSERVE_UPDATE_READY_S:-600}
[ -n "$services" ] || { echo "compose-update: no duplexserve replica in this configuration" >&2; exit 2; }
lb_running=$("${compose[@]}" ps --status running --services 2>/dev/null | grep -x lb || true)

ready() {  # $1: service; its /ready from inside the container (the image has python3)
    "${compose[@]}" exec -T "$1" python3 -c \
        "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('DUPLEXSERVE_PORT', '8998'), timeout=2)" \
        >/dev/null 2>&1
}

for service in $services; do
    echo "compose-update: $service: draining (up to its stop_grace_period)"
    "${compose[@]}" stop "$service"
    echo "compose-update: $service: recreating"
    "${compose[@]}" up -d --no-deps --force-recreate "$service"
    deadline=$((SECONDS + ready_s))
    until ready "$service"; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "compose-update: $service not ready after ${ready_s}s; stopping here (the others are untouched)" >&2
            exit 1
        fi
        sleep 2
    done
    if [ -n "$lb_running" ]; then
        "${compose[@]}" exec -T lb nginx -s reload
    fi
    echo "compose-update: $service: ready"
done
echo "compose-update: every replica updated"
