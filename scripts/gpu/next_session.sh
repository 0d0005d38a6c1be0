#!/usr/bin/env bash
# The GPU measurements still open after 2026-11-30, in priority order, split into parts that each fit one device
# call (<= 9.5 min; the machine compiles a 48-layer model per arm in ~60-120 s). Run `PART=1 bash
# scripts/gpu/next_session.sh`, then PART=1b, 1c, 2, 3, 4, 5. Results land in $OUT as JSONL + logs; docs/PERF.md says
# which table each feeds. Every step has its own timeout so one slow step cannot eat the others' output.
set -o pipefail
source scripts/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache            # steps of one call that compile the same function
filt() { tr '\r' '\n' | grep --line-buffered -vE "it/s\]|tensor/s\]|arm/s\]|s/it\]|s/arm\]"; }
case "${PART:-1}" in
1)  # issue 4: R flatness at 1K on the current kernels, depth with a host tier; issue 7: where a step goes (trace),
    # whole-loop command buffers, and what XLA autotuning costs in compile time
  timeout 330 python3 -m decode.bench_step --preset qwen3moe-30b-a3b --steps 32 --repeats 3 --out $OUT/step.jsonl \
    --profile /tmp/prof --cells 4096:1024:auto:pallas,49152:1024:auto:pallas,131072:1024:auto:pallas,\
32768:1024:auto:pallas:139264,32768:32768:auto:pallas:139264,32768:131072:auto:pallas:139264 2>&1 | filt | tail -12
  t=$(ls /tmp/prof/R4096-d1024-pallas-auto/plugins/profile/*/perfetto_trace.json.gz | head -1)
  [ -n "$t" ] && python3 scripts/gpu/trace_summary.py $t --steps 32 | tee $OUT/prof_summary.md | head -40
  XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL,WHILE,CONDITIONAL timeout 110 python3 -m \
    decode.bench_step --preset qwen3moe-30b-a3b --steps 32 --repeats 3 --out $OUT/step.jsonl --cells 4096:1024:auto:pallas \
    2>&1 | filt | tail -2                                                      # launch overhead: whole-loop graphs
  XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 100 python3 -m decode.bench_step --preset qwen3moe-30b-a3b --steps 32 \
    --repeats 3 --out $OUT/step.jsonl --cells 4096:1024:auto:pallas 2>&1 | filt | tail -2       # compile time
  ;;
1b) # issue 7: Q4_K experts end to end; where a step's time goes; whole-loop command buffers; issue 6 store; checks
  timeout 130 python3 -m decode.bench_step --preset qwen3moe-30b-a3b --experts Q4_K --steps 32 --repeats 3 \
    --out $OUT/step.jsonl --cells 4096:1024:auto:pallas,32768:32768:auto:pallas 2>&1 | filt | tail -5
  timeout 120 python3 -m decode.bench_step --preset qwen3moe-30b-a3b --steps 16 --repeats 1 --out $OUT/prof.jsonl \
    --cells 4096:1024:auto:pallas --profile /tmp/prof 2>&1 | filt | tail -3          # where a 4.8 ms step goes
  for t in /tmp/prof/*/plugins/profile/*/perfetto_trace.json.gz; do python3 scripts/gpu/trace_summary.py $t --steps 16 | tee $OUT/prof_summary.md; done
  XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUSTOM_CALL,WHILE,CONDITIONAL timeout 100 python3 -m \
    decode.bench_step --preset qwen3moe-30b-a3b --steps 32 --repeats 3 --out $OUT/step.jsonl --cells 4096:1024:auto:pallas \
    2>&1 | filt | tail -2                                                      # launch overhead: whole-loop graphs
  timeout 90 python3 scripts/gpu/expert_store_check.py --kernels pallas 2>&1 | filt | tail -12
  timeout 60 python3 -m ops.bench --out $OUT/kern --check --types Q8_0,Q6_K,IQ4_XS,IQ4_NL,Q5_K --batches 1 \
    --impls pallas --parts b --layers 2 --iters 1 2>&1 | grep --line-buffered "^check" ;;
1c) # issue 7: prefill (TTFT of a 1,024-token prompt) with the grouped Pallas kernels against the XLA path
  for kn in pallas xla; do
    timeout 250 python3 -m decode.bench --preset qwen3moe-30b-a3b --in_memory --kernels $kn --drafts none \
      --depths 1024 --rings 4096 --max_new_tokens 16 --seeds 2 --cells $OUT/prefill.jsonl 2>&1 | filt | tail -4
  done ;;
2)  # issue 5: round vs step for k = 2, 4 with replay, and lookup (plain arm for the ratio); prefill through
    # the decode kernels (engine.KERNEL_PREFILL_CHUNK, the GPU default) against call 2's 1,024-token call
  timeout 570 python3 -m decode.bench --preset seed-mtp --in_memory --kernels pallas \
    --drafts none,replay@2,replay@4,lookup@3 --seeds 1 --max_new_tokens 64 --depths 1024 --rings 4096 \
    --cells $OUT/rounds.jsonl 2>&1 | filt | tee $OUT/rounds.log | grep -v "^$" | tail -30 ;;
2h) # issue 4: depth with a host tier in pinned host memory (slices and updates inside the jitted step)
  timeout 250 python3 -m decode.bench_step --preset qwen3moe-30b-a3b --steps 16 --repeats 3 --out $OUT/step.jsonl \
    --cells 32768:1024:auto:pallas:139264,32768:32768:auto:pallas:139264,32768:65536:auto:pallas:139264,\
32768:131072:auto:pallas:139264,4096:1024:auto:pallas 2>&1 | filt | tee $OUT/host.log | grep -v "^$" | tail -12
  timeout 200 python3 -m decode.bench --preset qwen3moe-30b-a3b --in_memory --kernels pallas --drafts none \
    --depths 1024 --rings 4096 --max_new_tokens 32 --seeds 2 --cells $OUT/prefill.jsonl 2>&1 | filt | tail -4 ;;
3)  # issue 7 item 3: the seed's four arms on the GPU with the Pallas kernels (+ plain arms), 3 seeds
  timeout 560 python3 -m decode.bench --preset seed-mtp --in_memory --kernels pallas --arms seed4 --depths 1024 \
    --max_new_tokens 256 --seeds ${SEEDS:-2} --max_context 139264 --cells $OUT/seed4.jsonl 2>&1 | filt | tail -30 ;;
4)  # issue 6: the seed's 24 GiB card on seed-mtp (experts do not fit: auto slots), ring +16K, drafts on/off
  timeout 560 python3 -m decode.bench --preset seed-mtp --in_memory --kernels pallas --device_budget 24GiB \
    --expert_cache auto --rings 32768,49152 --drafts none,replay@3 --depths 1024 --max_new_tokens 64 --seeds 1 \
    --cells $OUT/xcache.jsonl 2>&1 | filt | tail -12 ;;
5)  # issue 6: tok/s and hit rate against slots on the 30B shape (all experts fit 24 GiB there: a slot sweep)
  timeout 560 python3 -m decode.bench --preset qwen3moe-30b-a3b --in_memory --kernels pallas \
    --expert_cache all,4096,2048,1024 --rings 4096 --drafts none --depths 1024 --max_new_tokens 64 --seeds 1 \
    --cells $OUT/xslots.jsonl 2>&1 | filt | tail -10 ;;
esac
