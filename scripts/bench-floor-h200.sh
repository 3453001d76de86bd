#!/usr/bin/env bash
# The memory floor and the restart on the H200 (issue 56; docs/moshi-engine.md, "Gathering",
# and docs/benchmarks.md). Runs on the GPU host from the repository root; wheels in .whl/
# are installed first, as scripts/bench-moshi-h200.sh does. Results go to $OUT.
# Usage: scripts/bench-floor-h200.sh STEP...
#   zero3b-int8-N[,M]   Hibiki-Zero 3B, 8-bit KV, N (then M) sessions of 60 s on one server
#   zero3b-bf16-N       Hibiki-Zero 3B, bf16 KV
#   hibiki2b-bf16-N     Hibiki 2B, bf16 KV
#   ...-on              the same with --engine-gather on (docs/moshi-engine.md, Gathering)
#   ...-tf32            the same with --moshi-fp32-matmul tf32 (Mimi's float32 matmuls as TF32)
#   ...-cl              the same with --moshi-mimi-convs fused-cl (Mimi's inputs channels last)
#   ...-xR              R runs one after another on the same server
#   restart-N[-off][-compiled]  Hibiki-Zero 3B int8, N live sessions, the engine process SIGKILLed
#                       20 s in (-off: --engine-spare off, the restart spawns and imports anew;
#                       -compiled: --moshi-compile on)
#   steps-N[-compiled]  Hibiki-Zero 3B int8, the engine alone: 100 steps of N rows
#                       (bench moshi-steps; -compiled: --moshi-compile on)
#   breakdown-N         Hibiki-Zero 3B int8, the engine alone: where a step of N rows goes at 2.4 s
#                       and 60 s of session age, the engine's defaults against tf32 + fused-cl
set -uo pipefail
OUT="${OUT:-bench-out}"; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
export PYTHONUNBUFFERED=1
# The host's site-packages may be read-only with no bytecode (each process would compile some
# 2,000 modules from source, 5.6 s of an engine's start): cache it as the image's compiled venv has it.
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-/tmp/pycache}"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD"
fi
# Fail at once, not once per step, where a wheel the server imports is missing from .whl/.
python3 -c "import fastapi, uvicorn, uvloop, prometheus_client, janus, soxr, sphn, websockets, moshi, torch
import duplexserve.server.app" || { echo "preflight: an import failed; add its wheel to .whl/"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
for step in "$@"; do
  echo "=== $step $(date +%T)"
  IFS=- read -r -a parts <<<"$step"
  log="$OUT/${step//,/_}.log"
  case "${parts[0]}" in
    zero3b) preset=hibiki-zero-3b ;;
    hibiki2b) preset=hibiki-2b ;;
    steps)
      compile=off; [ "${parts[2]:-}" = compiled ] && compile=on
      python3 -m duplexserve bench moshi-steps --preset hibiki-zero-3b --kv-dtype int8 --batches "${parts[1]}" \
        --steps 100 --compile "$compile" --out "$OUT/$step.json" 2>&1 | grep -v Warning | tail -4
      continue ;;
    breakdown)
      python3 -m duplexserve bench moshi-step breakdown --preset hibiki-zero-3b --kv-dtype int8 --attention live \
        --batches "${parts[1]}" --ages 30,750 --steps 20 \
        --builds live/lean/live/float32/whole/fused,live/lean/live/tf32/whole/fused-cl \
        --out "$OUT/$step.json" 2>&1 | grep -v Warning | tail -8
      continue ;;
    restart)
      spare=on; compile=off
      for extra in "${parts[@]:2}"; do
        [ "$extra" = off ] && spare=off
        [ "$extra" = compiled ] && compile=on
      done
      python3 -m duplexserve bench moshi-restart --preset hibiki-zero-3b --kv-dtype int8 --engine-process \
        --engine-spare "$spare" --moshi-compile "$compile" --sessions "${parts[1]}" --seconds 45 --kill-at 20 \
        --server-log "$log" --out "$OUT/restart.jsonl"
      grep -h "engine ready\|engine restart\|engine process ready" "$log" | cut -c1-700
      continue ;;
    *) echo "unknown step $step"; continue ;;
  esac
  flags=(--kv-dtype "${parts[1]}" --sessions "${parts[2]}" --seconds 60 --engine-process)
  for extra in "${parts[@]:3}"; do
    [ "$extra" = on ] && flags+=(--engine-gather on)
    [ "$extra" = tf32 ] && flags+=(--fp32-matmul tf32)
    [ "$extra" = cl ] && flags+=(--mimi-convs fused-cl)
    [[ "$extra" == x[0-9]* ]] && flags+=(--runs "${extra#x}")
  done
  python3 -m duplexserve bench moshi-rtf --preset "$preset" "${flags[@]}" --server-log "$log" --out "$OUT/rtf.tmp"
  python3 -c "import json,sys
for line in open(sys.argv[1]): print(json.dumps({'step': sys.argv[2], **json.loads(line)}))" "$OUT/rtf.tmp" "$step" >>"$OUT/rtf.jsonl"
  rm -f "$OUT/rtf.tmp"
  grep -h "engine ready\|engine memory" "$log" | cut -c1-700
done
echo "=== done $(date +%T)"
