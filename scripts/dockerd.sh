#!/usr/bin/env bash
# Start the Docker engine (Debian's docker.io) unless one already answers, and wait until
# it does. For machines without systemd, such as CI's (.ci/run calls this before the
# tests that build and run the images). As root; the log goes to $DOCKERD_LOG.
#   scripts/dockerd.sh            start it in the background, print its pid
#   scripts/dockerd.sh --stop PID stop the dockerd started before (by its pid)
set -euo pipefail
LOG=${DOCKERD_LOG:-/var/log/dockerd.log}

if [ "${1:-}" = "--stop" ]; then
  pid=${2:?pid of the dockerd to stop}
  kill -TERM "$pid" 2>/dev/null || exit 0
  for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || exit 0; sleep 0.5; done
  echo "dockerd.sh: dockerd $pid still running after 30 s" >&2
  exit 1
fi

if docker info >/dev/null 2>&1; then
  echo "dockerd.sh: a Docker engine is already running" >&2
  exit 0
fi
command -v dockerd >/dev/null || { echo "dockerd.sh: dockerd not found (Debian package docker.io)" >&2; exit 1; }
nohup dockerd >"$LOG" 2>&1 </dev/null &
pid=$!
for _ in $(seq 120); do
  if docker info >/dev/null 2>&1; then
    echo "$pid"
    exit 0
  fi
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.5
done
echo "dockerd.sh: dockerd did not come up; the end of $LOG:" >&2
tail -n 30 "$LOG" >&2 || true
exit 1
