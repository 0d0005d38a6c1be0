#!/usr/bin/env bash
# Issue 26 item 5: the host tier at 128K depth on seed-mtp (everything resident, int8 KV), in one call:
#  1. the plain step with a 32,768-slot ring + host tier against the tier-free ring at the same depth, the tier's
#     block size as the A/B (bench.step --glue on/tier=N; the default block is model.host_tier.HOST_BLOCK);
#  2. attention over one layer's 128K tier on this machine's CPU (where the tier lives);
#  3. replay rounds (k = 3) beside the tier at 128K: a round reads the tier once for k + 1 tokens.
# Each step has its own timeout (TA, TB, TC seconds); the JSONL records survive a timeout.
set -o pipefail
source scripts/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
filt() { tr '\r' '\n' | grep --line-buffered -vE "it/s\]|tensor/s\]|arm/s\]|s/it\]|s/arm\]|run/s\]|s/run\]"; }
timeout ${TA:-150} python3 -m bench.step --preset seed-mtp --kernels pallas --steps 16 --repeats 3 --out $OUT/tier.jsonl \
  --cells 32768:131072:auto:pallas:139264,139264:131072:auto:pallas --glue ${GLUES:-on,on/tier=8192,on/tier=16384} \
  2>&1 | filt | tee $OUT/tier.log | tail -12
timeout ${TB:-60} python3 scripts/gpu/host_attention_probe.py 2>&1 | tee $OUT/host_attention.txt
timeout ${TC:-300} python3 -m bench.cells --preset seed-mtp --in_memory --kernels pallas --rings 32768 --max_context 139264 \
  --drafts none,replay@3 --depths ${DEPTH:-131072} --max_new_tokens ${NEW:-64} --seeds 1 --reuse_prefill \
  --cells $OUT/replay-tier.jsonl 2>&1 | filt | tee $OUT/replay-tier.log | tail -14
report_jaxcache
