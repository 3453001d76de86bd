#!/usr/bin/env bash
# Two GPUs, one replica each, nginx in front as docker/compose.yaml has it (issue 55's
# measurement; NOT RUN YET: no machine with two GPUs was lent when this was written).
# Runs on the GPU host from the repository root, in the venv of scripts/install-moshi.sh with the
# loadgen extra, with Debian's nginx on PATH (or its .deb unpacked: NGINX=/path/to/usr/sbin/nginx).
#
#   scripts/fleet-2gpu.sh            1,024 paced Hibiki-Zero int8 sessions (60 s) through nginx,
#                                    512 a replica, every one real time; then 1,100 at once:
#                                    76 refused with 503, no admitted session disturbed
#
# Random weights of the hibiki-zero-3b preset (the released checkpoint's shapes and cost; the
# weights cannot be fetched on the host). Results in $OUT (default bench-out/fleet-2gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out/fleet-2gpu}
NGINX=${NGINX:-$(command -v nginx || echo /usr/sbin/nginx)}
SLOTS=${SLOTS:-512}
SECONDS_PER_SESSION=${SECONDS_PER_SESSION:-60}
mkdir -p "$OUT"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait || true; }
trap cleanup EXIT

# The replicas: GPU 0 on 8998, GPU 1 on 8999, refusing with 503 when full (what nginx retries).
for gpu in 0 1; do
  CUDA_VISIBLE_DEVICES=$gpu python -m duplexserve serve --host 127.0.0.1 --port $((8998 + gpu)) \
    --engine moshi --device cuda --moshi-preset hibiki-zero-3b --moshi-kv-dtype int8 \
    --max-sessions "$SLOTS" --refuse-with-http-503 --drain-grace-s 30 >"$OUT/server-$gpu.log" 2>&1 &
  pids+=($!)
done
for port in 8998 8999; do
  until curl -sf "127.0.0.1:$port/ready" >/dev/null; do sleep 2; done
done

# nginx with the shipped site, its upstreams on the two loopback ports.
mkdir -p "$OUT/nginx"
sed -e 's/server duplexserve:8998 /server 127.0.0.1:8998 /' -e 's/server duplexserve-1:8998 /server 127.0.0.1:8999 /' \
  -e 's/listen 8080;/listen 127.0.0.1:8080;/' docker/nginx/duplexserve.conf >"$OUT/nginx/site.conf"
cat >"$OUT/nginx/nginx.conf" <<EOF
daemon off;
worker_processes 4;
pid $PWD/$OUT/nginx/nginx.pid;
error_log $PWD/$OUT/nginx/error.log notice;
worker_rlimit_nofile 65536;
events { worker_connections 16384; }
http {
    access_log off;
    client_body_temp_path $PWD/$OUT/nginx/body;
    proxy_temp_path $PWD/$OUT/nginx/proxy;
    include $PWD/$OUT/nginx/site.conf;
}
EOF
"$NGINX" -p "$OUT/nginx" -c "$PWD/$OUT/nginx/nginx.conf" &
pids+=($!)
until curl -sf 127.0.0.1:8080/lb-health >/dev/null; do sleep 0.5; done

ulimit -n 65536
# 1,024 paced sessions at once through nginx: least_conn splits them 512/512.
python -m duplexserve loadgen ws://127.0.0.1:8080 --concurrency 1024 --sessions 1024 --warmup 0 \
  --seconds "$SECONDS_PER_SESSION" --message-ms 160 --mode paced --processes 8 \
  --json "$OUT/rtf-1024.json" --no-progress | tee "$OUT/rtf-1024.txt"
for port in 8998 8999; do curl -s "127.0.0.1:$port/metrics" >"$OUT/metrics-1024-$port.txt"; done
# 1,100: the 76 past both replicas' slots are refused with 503 (counted in
# duplexserve_sessions_rejected_total on the replicas, and as failed sessions by loadgen).
python -m duplexserve loadgen ws://127.0.0.1:8080 --concurrency 1100 --sessions 1100 --warmup 0 \
  --seconds "$SECONDS_PER_SESSION" --message-ms 160 --mode paced --processes 8 \
  --json "$OUT/rtf-1100.json" --no-progress | tee "$OUT/rtf-1100.txt" || true
for port in 8998 8999; do curl -s "127.0.0.1:$port/metrics" >"$OUT/metrics-1100-$port.txt"; done
grep -h "^duplexserve_sessions_\(accepted\|rejected\)_total\|^duplexserve_frames_late_total" "$OUT"/metrics-1100-*.txt
