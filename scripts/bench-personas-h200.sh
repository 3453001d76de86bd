#!/usr/bin/env bash
# Personas joining live sessions on the H200 (issue 30; docs/benchmarks.md). From the repository
# root on the GPU host (wheels in .whl/ as for scripts/bench-moshi-h200.sh). One server of
# $PRESET (default personaplex-7b, random weights, int8 KV); for each "C/R" in $RUNS (default
# 64/5 64/2 64/1 128/5 128/2 128/1): C paced sessions live while R a second join, each with a
# text prompt of $TEXT_TOKENS (200) tokens and an 8 s .pt voice. With DISTINCT=1 (default) each
# session's text begins with its own number, so every prompt is new (a prefill); DISTINCT=0
# gives every session the same persona (the first runs a prefill, the others copy it). The C
# first sessions open over C / $OPEN_PER_S (8) seconds. Results in $OUT, three files: the load
# generator's JSON of each run (personas.jsonl), the server's /metrics before and after each
# run (metrics.txt) and the server log's tail.
set -uo pipefail
OUT="${OUT:-bench-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ -z "${MOSHI_BENCH_SITE:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD" MOSHI_BENCH_SITE=1
fi
ASSETS=/tmp/persona-assets; PORT=18991; SLOTS="${SLOTS:-136}"; PRESET="${PRESET:-personaplex-7b}"
TEXT=$(python3 -c '
import sys
from pathlib import Path
import sentencepiece
from duplexserve.bench.moshi_prompt import text_of, write_assets
from duplexserve.engine_bridge.moshi.presets import get_preset
write_assets(Path(sys.argv[1]), get_preset(sys.argv[2]).lm, 100)
print(text_of(sentencepiece.SentencePieceProcessor(sys.argv[1] + "/spm.model"), int(sys.argv[3])))
' "$ASSETS" "$PRESET" "${TEXT_TOKENS:-200}")
[ "${DISTINCT:-1}" = 1 ] && TEXT="Caller {session}. $TEXT"
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
  ramp=$(python3 -c "print($c / ${OPEN_PER_S:-8})")
  echo "=== $c live, $r joining a second ($joins joins) $(date +%T)"
  { echo "=== before $c/$r"; curl -s "http://127.0.0.1:$PORT/metrics"; } >>"$OUT/metrics.txt"
  python3 -m duplexserve loadgen "ws://127.0.0.1:$PORT/v1/duplex" -c "$c" -n $((c + joins)) --warmup 0 --ramp-s "$ramp" \
    --mode paced --message-ms 160 --arrivals-per-s "$r" --text-prompt "$TEXT" --voice-prompt random-100.pt \
    --expect none --no-progress --json /tmp/personas-run.json 2>&1 | tail -8
  python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))))" /tmp/personas-run.json >>"$OUT/personas.jsonl"
  { echo "=== after $c/$r"; curl -s "http://127.0.0.1:$PORT/metrics"; } >>"$OUT/metrics.txt"
done
kill $SERVER; wait $SERVER
grep -v "connection open\|connection closed\|WebSocket /v1" "$OUT/server.log" | tail -40 >"$OUT/server-tail.txt"
rm "$OUT/server.log"; tail -15 "$OUT/server-tail.txt"
