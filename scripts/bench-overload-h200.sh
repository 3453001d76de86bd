#!/usr/bin/env bash
# The engine process's hand-offs and an HTTP pipelining flood on the GPU (issue 67;
# docs/reliability.md, "Overload"). Runs on the GPU host from the repository root; wheels in
# .whl/ are installed first, as scripts/bench-floor-h200.sh does. Results go to $OUT.
# Usage: scripts/bench-overload-h200.sh STEP...
#   handoffs-N          the engine process's step with the event loop idle, then saturated (pure
#                       Python callbacks that never let it block, as the flood kept it), at
#                       switch intervals of 5 ms (Python's) and 0.5 ms: N paced sessions of
#                       Hibiki 2B, random weights, 8-bit KV (bench handoffs)
#   rtf-N               N paced sessions of 60 s through the server, engine process (bench moshi-rtf)
#   rtf-N-flood         the same, two connections pipelining GET /health from 127.0.0.2 from 25 s
#                       into the run for 30 s (bench http-flood), each closed for its budgets and
#                       opened again at once
#   ...@REF             the step run by the package in .ab/REF (an older tree, for A/B runs on one
#                       GPU: git archive REF duplexserve | tar -x -C .ab/REF, and carry .ab)
set -uo pipefail
OUT="${OUT:-bench-out}"; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
ROOT="$PWD"
export PYTHONUNBUFFERED=1
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-/tmp/pycache}"
SITE=""
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  SITE=/tmp/site:
fi
export PYTHONPATH="$SITE$ROOT"
python3 -c "import fastapi, uvicorn, uvloop, prometheus_client, janus, soxr, sphn, websockets, moshi, torch
import duplexserve.server.app" || { echo "preflight: an import failed; add its wheel to .whl/"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
nproc
MODEL=(--preset hibiki-2b --kv-dtype int8)
for spec in "$@"; do
  echo "=== $spec $(date +%T)"
  step="${spec%@*}"; tree="$ROOT"
  name="${spec//@/-at-}"
  [ "$step" != "$spec" ] && tree="$ROOT/.ab/${spec#*@}"
  cd "$tree" || continue
  export PYTHONPATH="$SITE$tree"
  IFS=- read -r -a parts <<<"$step"
  case "${parts[0]}" in
    handoffs)
      python3 -m duplexserve bench handoffs --engine moshi --moshi-preset hibiki-2b --moshi-kv-dtype int8 \
        --sessions "${parts[1]}" --max-sessions "${parts[1]}" --seconds 10 --switch-intervals-ms 5,0.5 \
        --bench-out "$OUT/$name.json" 2>&1 | grep -v Warning | tail -6 ;;
    rtf)
      flood=""
      if [ "${parts[2]:-}" = flood ]; then
        python3 -m duplexserve bench http-flood --port 18990 --wait-s 25 --seconds 30 --out "$OUT/$name-flood.json" &
        flood=$!
      fi
      python3 -m duplexserve bench moshi-rtf "${MODEL[@]}" --sessions "${parts[1]}" --seconds 60 --engine-process \
        --port 18990 --server-log "$OUT/$name.log" --out "$OUT/rtf.tmp"
      [ -n "$flood" ] && wait "$flood"
      [ -f "$OUT/rtf.tmp" ] && python3 -c "import json,sys
for line in open(sys.argv[1]): print(json.dumps({'step': sys.argv[2], **json.loads(line)}))" "$OUT/rtf.tmp" "$spec" \
        >>"$OUT/rtf.jsonl"
      rm -f "$OUT/rtf.tmp"
      grep -h "over its\|overload\|engine ready" "$OUT/$name.log" | cut -c1-300 | tail -8 ;;
    *) echo "unknown step $spec" ;;
  esac
  cd "$ROOT"
done
echo "=== done $(date +%T)"
