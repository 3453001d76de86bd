#!/usr/bin/env bash
# The moshi engine's H200 runs (docs/benchmarks.md). Runs on the device machine, from the
# repository root, with the wheels of what its image lacks in .whl/ (moshi, the server's
# web stack). Usage: scripts/bench-moshi-h200.sh PHASE...; results go to $OUT.
#   steps-hibiki            GPU step time against batch size, hibiki-2b
#   rtf-hibiki-N[-process]  paced RTF run, hibiki-2b, N sessions (engine in its own process)
#   rtf-moshi7b-N[-ctxC]    paced RTF run, moshi-7b, N sessions (LM context C frames)
set -uo pipefail
OUT="${OUT:-bench-out}"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ -z "${MOSHI_BENCH_SITE:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD" MOSHI_BENCH_SITE=1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, moshi, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'moshi', moshi.__version__, 'numpy', numpy.__version__)"
nproc
for phase in "$@"; do
  echo "=== $phase $(date +%T)"
  case "$phase" in
    steps-hibiki)
      python3 -m duplexserve bench moshi-steps --preset hibiki-2b --batches 1,32,64,96,128,192 --steps 50 \
        --out "$OUT/steps-hibiki.json" ;;
    rtf-*)
      IFS=- read -r _ model n extra <<<"$phase"
      preset=$([ "$model" = moshi7b ] && echo moshi-7b || echo hibiki-2b)
      flags=()
      [ "$extra" = process ] && flags+=(--engine-process)
      [[ "$extra" == ctx* ]] && flags+=(--context "${extra#ctx}")
      python3 -m duplexserve bench moshi-rtf --preset "$preset" --sessions "$n" "${flags[@]}" \
        --server-log "$OUT/server.log.tmp" --out "$OUT/one.json"
      [ -f "$OUT/one.json" ] && { python3 -c "import json,sys; print(json.dumps(json.load(open(sys.argv[1]))))" "$OUT/one.json" >>"$OUT/rtf.jsonl"; rm "$OUT/one.json"; }
      { echo "=== $phase"; grep -v "connection open\|connection closed\|WebSocket /v1" "$OUT/server.log.tmp" | tail -40; } >>"$OUT/server-logs.txt"
      rm -f "$OUT/server.log.tmp" ;;
  esac
done
echo "=== done $(date +%T)"
