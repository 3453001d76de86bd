#!/usr/bin/env bash
# The moshi engine's H200 runs (docs/benchmarks.md). Runs on the GPU host, from the
# repository root; where the host's Python lacks moshi or the server's web stack, put their
# wheels in .whl/ and they are installed first. Usage: scripts/bench-moshi-h200.sh PHASE...;
# results go to $OUT.
#   steps-hibiki            GPU step time against batch size, hibiki-2b
#   steps-live              step time against live sessions (8, 32, 128, 384) in engines built for
#                           8, 32, 128 and 384 slots, hibiki-2b, int8 ring (issue 37)
#   steps-MODEL[-int8]      step time against batch size ($STEPS_BATCHES, default
#                           64,128,256,384,512), MODEL as in rtf-MODEL-N
#   rtf-MODEL-N[-process][-stock][-int8][-paged|-ring][-floorF][-depstock][-mimistock][-tf32][-mimiparts][-convstock][-convcl][-ctxC][-tickT][-xR][-mixedM][-slotsS][-durD]
#                           paced RTF run, MODEL a preset's name without its dashes (moshi7b,
#                           hibiki2b, hibikizero3b, hibiki2bclass) or hibiki (hibiki-2b), zero3b
#                           (hibiki-zero-3b), hibikiclass (hibiki-2b-class); N sessions (N,M,...:
#                           each count in turn on one server start of the largest); engine in its
#                           own process, moshi's stock attention, 8-bit KV, the depformer's
#                           stock attention (--moshi-depformer stock), Mimi's stock
#                           attention (--moshi-mimi-attention stock), Mimi's float32
#                           matmuls as TF32 (--moshi-fp32-matmul tf32), Mimi's CUDA graphs as
#                           the library has them (--moshi-mimi-graph parts), Mimi's convolutions
#                           op by op as the library runs them (--moshi-mimi-convs stock) or fused
#                           with channels-last inputs (--moshi-mimi-convs fused-cl), LM context C,
#                           the engine's step clock T ms (default 0: step at once; 80: one frame),
#                           R runs one after another on one server start (a line each); the LM's KV
#                           in pages (--moshi-kv-layout paged; the default is the ring), a paged KV
#                           floor of F s (--moshi-kv-floor-s); a long-tailed workload of about N
#                           calls open, lognormal lengths of mean M s, Poisson arrivals
#                           (--mixed-mean-s), S slots (--max-sessions; default N), D s of run
#                           (--seconds; default 60). Paged KV (issue 74), not yet measured:
#                             rtf-zero3b-1000-process-int8-paged-x3    1,000 calls of 60 s (H200)
#                             rtf-zero3b-600-process-int8-paged-x3     600 (H100)
#                             rtf-zero3b-672-process-int8-x3           the ring's A/B at its floor
#                             rtf-zero3b-672-process-int8-paged-x3     ... and paged, same card
#                             rtf-zero3b-1000-process-int8-paged-mixed180-slots1100-dur420
#                                                                      mean 3 min, a tail past 4 (H200)
#   first-MODEL-N[-process][-int8][-warmW]
#                           a fresh server at its defaults (--moshi-warm-rows W given -warmW) met by
#                           N sessions at once, then by sessions joining and leaving one at a time
#                           so the batch walks every bucket size up and down, never idle (bench
#                           moshi-first-traffic): late frames, steps over 200 ms, start to ready
#   migrate-MODEL-N         live migration (issue 76): two replicas sharing the GPU, N paced calls on
#                           the first moved to the second on its drain (bench migrate): the pause
#                           its clients heard (p50/p99/max), drain to exit; goal p99 <= 200 ms,
#                           300 calls drained in under 30 s
#   breakdown | attention | agreement | mimi | ring | moves
#                           duplexserve bench moshi-step (step parts, one layer, vs batch 1,
#                           Mimi's float32 matmuls as TF32 against float32, Mimi's ring attention,
#                           a slot's export and import for a live move)
#   breakdown-S | agreement-S | attention-S | moves-S
#                           the same with the arguments in $MOSHI_STEP_ARGS_<S in capitals>
#   PHASE@REF               PHASE run by the package in .ab/REF (an older tree, for A/B runs on one
#                           GPU: git archive REF duplexserve | tar -x -C .ab/REF, and carry .ab)
set -uo pipefail
OUT="${OUT:-bench-out}"; mkdir -p "$OUT"; OUT=$(realpath "$OUT")
ROOT="$PWD"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ -z "${MOSHI_BENCH_SITE:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export MOSHI_BENCH_SITE=1
fi
SITE=$([ -n "${MOSHI_BENCH_SITE:-}" ] && echo /tmp/site:)
export PYTHONPATH="$SITE$ROOT"
# The card and what bounds its clocks (runs on different days compare only if these agree).
gpu_state() {  # (clocks_event_reasons: drivers of 535 and later; else without it)
  local fields=name,memory.total,driver_version,power.limit,power.draw,clocks.sm,clocks.max.sm,temperature.gpu
  nvidia-smi --query-gpu="$fields,clocks_event_reasons.active" --format=csv 2>/dev/null ||
    nvidia-smi --query-gpu="$fields" --format=csv
}
gpu_state
python3 -c "import torch, moshi, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'moshi', moshi.__version__, 'numpy', numpy.__version__)"
nproc
preset_of() {  # a phase's MODEL: a short name, or a preset's name without its dashes
  case "$1" in
    hibiki) echo hibiki-2b ;;
    zero3b) echo hibiki-zero-3b ;;
    hibikiclass) echo hibiki-2b-class ;;
    *) python3 -c "import sys; from duplexserve.engine_bridge.moshi.presets import PRESETS
print(next(n for n in PRESETS if n.replace('-', '') == sys.argv[1]))" "$1" ;;
  esac
}
for spec in "$@"; do
  echo "=== $spec $(date +%T)"
  phase="${spec%@*}"; tree="$ROOT"
  name="${spec//@/-at-}"  # a file name the device's transfer takes back (letters, digits, '.', '_', '-')
  [ "$phase" != "$spec" ] && tree="$ROOT/.ab/${spec#*@}"
  cd "$tree" || continue
  export PYTHONPATH="$SITE$tree"
  case "$phase" in
    steps-hibiki)
      python3 -m duplexserve bench moshi-steps --preset hibiki-2b --batches 1,32,64,96,128,192 --steps 50 \
        --out "$OUT/steps-hibiki.json" ;;
    steps-live)
      python3 -m duplexserve bench moshi-steps --preset hibiki-2b --kv-dtype int8 --batches 8,32,128,384 \
        --live 8,32,128,384 --steps 50 --out "$OUT/steps-live.json" ;;
    steps-*)
      IFS=- read -r -a parts <<<"$phase"
      preset=$(preset_of "${parts[1]}") || { echo "unknown model ${parts[1]}"; continue; }
      kv=$([ "${parts[2]:-}" = int8 ] && echo int8 || echo bf16)
      python3 -m duplexserve bench moshi-steps --preset "$preset" --kv-dtype "$kv" \
        --batches "${STEPS_BATCHES:-64,128,256,384,512}" --steps 50 --out "$OUT/$name.json" ;;
    breakdown|attention|agreement|mimi|ring|moves)
      python3 -m duplexserve bench moshi-step "$phase" ${MOSHI_STEP_ARGS:-} --out "$OUT/$name.json" ;;
    breakdown-*|agreement-*|attention-*|moves-*)
      # e.g. agreement-moshi7b, breakdown-lean: the part, then args from MOSHI_STEP_ARGS_<SUFFIX>
      part="${phase%%-*}"; suffix="${phase#*-}"; var="MOSHI_STEP_ARGS_${suffix^^}"
      python3 -m duplexserve bench moshi-step "$part" ${!var:-} --out "$OUT/$name.json" ;;
    first-*)
      IFS=- read -r -a parts <<<"$phase"
      preset=$(preset_of "${parts[1]}") || { echo "unknown model ${parts[1]}"; continue; }
      flags=()
      for extra in "${parts[@]:3}"; do
        [ "$extra" = process ] && flags+=(--engine-process)
        [ "$extra" = int8 ] && flags+=(--kv-dtype int8)
        [[ "$extra" == warm[0-9]* ]] && flags+=(--warm-rows "${extra#warm}")
      done
      python3 -m duplexserve bench moshi-first-traffic --preset "$preset" --sessions "${parts[2]}" "${flags[@]}" \
        --server-log "$OUT/server.log.tmp" --out "$OUT/one.json"
      [ -f "$OUT/one.json" ] && { python3 -c "import json,sys
for line in open(sys.argv[1]): print(json.dumps({'phase': sys.argv[2], **json.loads(line)}))" "$OUT/one.json" "$spec" >>"$OUT/first.jsonl"; rm "$OUT/one.json"; }
      { echo "=== $spec"; grep -v "connection open\|connection closed\|WebSocket /v1" "$OUT/server.log.tmp" | grep "moshi engine\|ms step\|Traceback\|Error" | tail -60; } >>"$OUT/server-logs.txt"
      rm -f "$OUT/server.log.tmp" ;;
    migrate-*)
      IFS=- read -r -a parts <<<"$phase"
      preset=$(preset_of "${parts[1]}") || { echo "unknown model ${parts[1]}"; continue; }
      python3 -m duplexserve bench migrate --engine moshi --preset "$preset" --calls "${parts[2]}" \
        --before-s 10 --after-s 10 --server-args "${MIGRATE_SERVER_ARGS:-}" \
        --server-log "$OUT/server.log.tmp" --out "$OUT/one.json"
      [ -f "$OUT/one.json" ] && { python3 -c "import json,sys
for line in open(sys.argv[1]): print(json.dumps({'phase': sys.argv[2], **json.loads(line)}))" "$OUT/one.json" "$spec" >>"$OUT/migrate.jsonl"; rm "$OUT/one.json"; }
      { echo "=== $spec"; grep "drain\|move\|Traceback\|Error" "$OUT/server.log.tmp" | tail -40; } >>"$OUT/server-logs.txt"
      rm -f "$OUT/server.log.tmp" ;;
    rtf-*)
      IFS=- read -r -a parts <<<"$phase"
      preset=$(preset_of "${parts[1]}") || { echo "unknown model ${parts[1]}"; continue; }
      n="${parts[2]}"
      flags=()
      for extra in "${parts[@]:3}"; do
        [ "$extra" = process ] && flags+=(--engine-process)
        [ "$extra" = stock ] && flags+=(--attention stock)
        [ "$extra" = int8 ] && flags+=(--kv-dtype int8)
        [ "$extra" = ring ] && flags+=(--kv-layout ring)
        [ "$extra" = paged ] && flags+=(--kv-layout paged)
        [[ "$extra" == floor[0-9]* ]] && flags+=(--kv-floor-s "${extra#floor}")
        [[ "$extra" == mixed[0-9]* ]] && flags+=(--mixed-mean-s "${extra#mixed}")
        [[ "$extra" == slots[0-9]* ]] && flags+=(--slots "${extra#slots}")
        [[ "$extra" == dur[0-9]* ]] && flags+=(--seconds "${extra#dur}")
        [ "$extra" = depstock ] && flags+=(--depformer stock)
        [ "$extra" = mimistock ] && flags+=(--mimi-attention stock)
        [ "$extra" = tf32 ] && flags+=(--fp32-matmul tf32)
        [ "$extra" = mimiparts ] && flags+=(--mimi-graph parts)
        [ "$extra" = convstock ] && flags+=(--mimi-convs stock)
        [ "$extra" = convcl ] && flags+=(--mimi-convs fused-cl)
        [[ "$extra" == ctx* ]] && flags+=(--context "${extra#ctx}")
        [[ "$extra" == tick* ]] && flags+=(--tick-ms "${extra#tick}")
        [[ "$extra" == x[0-9]* ]] && flags+=(--runs "${extra#x}")
      done
      python3 -m duplexserve bench moshi-rtf --preset "$preset" --sessions "$n" "${flags[@]}" \
        --server-log "$OUT/server.log.tmp" --out "$OUT/one.json"
      [ -f "$OUT/one.json" ] && { python3 -c "import json,sys
for line in open(sys.argv[1]): print(json.dumps({'phase': sys.argv[2], **json.loads(line)}))" "$OUT/one.json" "$spec" >>"$OUT/rtf.jsonl"; rm "$OUT/one.json"; }
      { echo "=== $spec"; grep -v "connection open\|connection closed\|WebSocket /v1" "$OUT/server.log.tmp" | tail -40; } >>"$OUT/server-logs.txt"
      rm -f "$OUT/server.log.tmp" ;;
  esac
  cd "$ROOT"
  gpu_state | tail -1
done
echo "=== done $(date +%T)"
