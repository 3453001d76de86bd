#!/usr/bin/env bash
# Two GPUs, one replica each, the shipped nginx site in front (docs/deploy-compose.md; issue 55's
# measurement, with issue 68's resume check; NOT RUN YET: no machine with two GPUs was lent).
# Runs on the GPU host from the repository root, in the venv of scripts/install-moshi.sh with the
# loadgen extra, with Debian's nginx on PATH (or its .deb unpacked: NGINX=/path/to/usr/sbin/nginx).
#
#   scripts/fleet-2gpu.sh    1. 1,344 paced Hibiki-Zero int8 sessions (60 s) through nginx, 672 a
#                               replica (the H200's setup of docs/benchmarks.md), every one real time;
#                            2. the same with every session's connection cut about every 15 s and
#                               resumed through nginx: each resume reaches the replica holding it
#                               (its name in the token, nginx's map), every frame once (loadgen's
#                               guards), no token refused (duplexserve_session_resumes_total);
#                            3. 1,420 at once: the 76 past both replicas' slots refused with 503,
#                               no admitted session disturbed.
#
# Random weights of the hibiki-zero-3b preset (the released checkpoint's shapes and cost; the
# weights cannot be fetched on the host). Results in $OUT (default bench-out/fleet-2gpu).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-bench-out/fleet-2gpu}")
NGINX=${NGINX:-$(command -v nginx || echo /usr/sbin/nginx)}
SLOTS=${SLOTS:-672}
SECONDS_PER_SESSION=${SECONDS_PER_SESSION:-60}
DROP_EVERY=${DROP_EVERY:-15}  # seconds between cuts of a session in step 2
# The engine; a CPU rehearsal of the script's own steps (not the measurement):
#   ENGINE="--engine synthetic" SLOTS=8 SECONDS_PER_SESSION=4 DROP_EVERY=1 scripts/fleet-2gpu.sh
ENGINE=${ENGINE:-"--engine moshi --device cuda --moshi-preset hibiki-zero-3b --moshi-kv-dtype int8 --moshi-fp32-matmul tf32 --moshi-mimi-convs fused-cl"}
mkdir -p "$OUT"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait || true; }
trap cleanup EXIT

# The replicas: GPU 0 on 8998, GPU 1 on 8999, named as compose names them (their resume tokens
# start with the name), refusing with 503 when full (what nginx retries). Mimi as TF32 with
# channels-last inputs: the setup that held 672 on an H200 (docs/deploy-kubernetes.md).
for gpu in 0 1; do
  name=duplexserve; [ "$gpu" = 1 ] && name=duplexserve-1
  # shellcheck disable=SC2086  # ENGINE is a list of flags
  CUDA_VISIBLE_DEVICES=$gpu python -m duplexserve serve --host 127.0.0.1 --port $((8998 + gpu)) \
    $ENGINE --max-sessions "$SLOTS" \
    --max-detached "$SLOTS" --max-sessions-per-client 0 --replica-id "$name" \
    --refuse-with-http-503 --drain-grace-s 30 >"$OUT/server-$gpu.log" 2>&1 &
  pids+=($!)
done
for port in 8998 8999; do
  until curl -sf "127.0.0.1:$port/ready" >/dev/null; do sleep 2; done
done

# nginx with the shipped site, its replicas (pool and resume upstreams) on the two loopback ports.
mkdir -p "$OUT/nginx"
sed -e 's/server duplexserve:8998/server 127.0.0.1:8998/g' -e 's/server duplexserve-1:8998/server 127.0.0.1:8999/g' \
  -e 's/listen 8080;/listen 127.0.0.1:8080;/' docker/nginx/duplexserve.conf >"$OUT/nginx/site.conf"
cat >"$OUT/nginx/nginx.conf" <<CONF
daemon off;
worker_processes 4;
pid $OUT/nginx/nginx.pid;
error_log $OUT/nginx/error.log notice;
worker_rlimit_nofile 65536;
events { worker_connections 16384; }
http {
    log_format upstreams '\$request_uri \$status \$upstream_addr';
    access_log $OUT/nginx/access.log upstreams;
    client_body_temp_path $OUT/nginx/body;
    proxy_temp_path $OUT/nginx/proxy;
    include $OUT/nginx/site.conf;
}
CONF
"$NGINX" -p "$OUT/nginx" -c "$OUT/nginx/nginx.conf" &
nginx_pid=$!
pids+=("$nginx_pid")
until curl -sf 127.0.0.1:8080/lb-health >/dev/null; do kill -0 "$nginx_pid"; sleep 0.5; done

ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"  # two sockets a session, and nginx's
TOTAL=$((2 * SLOTS))
scrape() { for port in 8998 8999; do curl -s "127.0.0.1:$port/metrics" >"$OUT/metrics-$1-$port.txt"; done; }
# 1. Both replicas full through nginx: least_conn splits them SLOTS/SLOTS.
python -m duplexserve loadgen ws://127.0.0.1:8080 --concurrency "$TOTAL" --sessions "$TOTAL" --warmup 0 \
  --seconds "$SECONDS_PER_SESSION" --message-ms 160 --mode paced --processes 8 \
  --json "$OUT/rtf-$TOTAL.json" --no-progress | tee "$OUT/rtf-$TOTAL.txt"
scrape "$TOTAL"
# 2. The same with drops: every resume must reach its replica; none may be refused.
python -m duplexserve loadgen ws://127.0.0.1:8080 --concurrency "$TOTAL" --sessions "$TOTAL" --warmup 0 \
  --seconds "$SECONDS_PER_SESSION" --message-ms 160 --mode paced --processes 8 --drop-every "$DROP_EVERY" \
  --json "$OUT/resume-$TOTAL.json" --no-progress | tee "$OUT/resume-$TOTAL.txt"
scrape "resume"
grep -h '^duplexserve_session_resumes_total' "$OUT"/metrics-resume-*.txt | tee "$OUT/resumes.txt"
refused=$(awk '/outcome="refused"/ {s += $2} END {print s + 0}' "$OUT"/metrics-resume-*.txt)
misrouted=$(awk '/resume=duplexserve-1\./ && $3 != "127.0.0.1:8999" {n++} /resume=duplexserve\./ && $3 != "127.0.0.1:8998" {n++} END {print n + 0}' "$OUT/nginx/access.log")
echo "resumes refused: $refused; resumes routed to another replica than their token's: $misrouted" | tee -a "$OUT/resumes.txt"
# 3. 76 past both replicas' slots: refused with 503 (counted in duplexserve_sessions_rejected_total
# on the replicas, and as failed sessions by loadgen).
OVER=$((TOTAL + 76))
python -m duplexserve loadgen ws://127.0.0.1:8080 --concurrency "$OVER" --sessions "$OVER" --warmup 0 \
  --seconds "$SECONDS_PER_SESSION" --message-ms 160 --mode paced --processes 8 \
  --json "$OUT/rtf-$OVER.json" --no-progress | tee "$OUT/rtf-$OVER.txt" || true
scrape "$OVER"
grep -h "^duplexserve_sessions_\(accepted\|rejected\)_total\|^duplexserve_frames_late_total" "$OUT"/metrics-"$OVER"-*.txt
[ "$refused" = 0 ] && [ "$misrouted" = 0 ]
