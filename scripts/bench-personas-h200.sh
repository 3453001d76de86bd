#!/usr/bin/env bash
# Personas joining live sessions on the H200 (issue 30; docs/benchmarks.md). From the repository
# root on the GPU host (wheels in .whl/ as for scripts/bench-moshi-h200.sh). One server of
# $PRESET (default personaplex-7b, random weights, int8 KV); for each "C/R" in $RUNS (default
# 64/5 64/2 64/1 128/5 128/2 128/1): C paced sessions live while R a second join, each with a
# text prompt of $TEXT_TOKENS (200) tokens and an 8 s .pt voice (the same persona: the first
# runs a prefill, the others copy it). Results in $OUT: the load generator's JSON and the
# server's /metrics after each run.
set -uo pipefail
OUT="${OUT:-bench-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ -z "${MOSHI_BENCH_SITE:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD" MOSHI_BENCH_SITE=1
fi
ASSETS="$OUT/assets"; PORT=18991; SLOTS="${SLOTS:-136}"; PRESET="${PRESET:-personaplex-7b}"
TEXT=$(python3 -c '
import sys
from pathlib import Path
import sentencepiece
from duplexserve.bench.moshi_prompt import text_of, write_assets
from duplexserve.engine_bridge.moshi.presets import get_preset
write_assets(Path(sys.argv[1]), get_preset(sys.argv[2]).lm, 100)
print(text_of(sentencepiece.SentencePieceProcessor(sys.argv[1] + "/spm.model"), int(sys.argv[3])))
' "$ASSETS" "$PRESET" "${TEXT_TOKENS:-200}")
python3 -m duplexserve serve --port $PORT --engine moshi --moshi-preset "$PRESET" --moshi-kv-dtype int8 \
  --max-sessions "$SLOTS" --moshi-tokenizer "$ASSETS/spm.model" --voice-prompt-dir "$ASSETS" \
  --idle-timeout-s 300 --log-level info >"$OUT/server.log" 2>&1 &
SERVER=$!
until curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null; do
  kill -0 $SERVER 2>/dev/null || { echo "server exited"; tail -20 "$OUT/server.log"; exit 1; }
  sleep 1
done
for run in ${RUNS:-64/5 64/2 64/1 128/5 128/2 128/1}; do
  c="${run%/*}"; r="${run#*/}"; joins=$(python3 -c "print(max(10, round(10 * $r)))")
  echo "=== $c live, $r joining a second ($joins joins) $(date +%T)"
  curl -s "http://127.0.0.1:$PORT/metrics" >"$OUT/metrics-before-$c-$r.txt"
  python3 -m duplexserve loadgen "ws://127.0.0.1:$PORT/v1/duplex" -c "$c" -n $((c + joins)) --warmup 0 \
    --mode paced --message-ms 160 --arrivals-per-s "$r" --text-prompt "$TEXT" --voice-prompt random-100.pt \
    --expect none --no-progress --json "$OUT/personas-$c-$r.json" 2>&1 | tail -8
  curl -s "http://127.0.0.1:$PORT/metrics" >"$OUT/metrics-after-$c-$r.txt"
done
kill $SERVER; wait $SERVER
grep -v "connection open\|connection closed\|WebSocket /v1" "$OUT/server.log" | tail -15
