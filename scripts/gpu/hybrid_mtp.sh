# Issue 26: on the hybrid seed-mtp shape (qwen3next-80b-a3b, IQ3_S experts, in memory), everything resident, int8
# KV, 1K depth. First the verify-pass batch-invariance probe (a 4-layer trunk), then plain decode against replay
# drafts (the plain greedy output: 100 % acceptance when a verify pass reproduces the steps) at k = 3, one process.
# INV=0 skips the probe.
source scripts/gpu/env.sh
set -o pipefail
[ "${INV:-1}" = 0 ] || timeout 150 python3 scripts/gpu/hybrid_invariance.py --preset seed-mtp --layers 4 --T 4 2>&1 | tail -2 | tee $OUT/inv.txt
timeout ${TO:-400} python3 -m bench.cells --preset seed-mtp --in_memory --kernels pallas --rings 4096 \
  --drafts ${DRAFTS:-none,replay@3} --depths 1024 --max_new_tokens 256 --seeds 3 --cells $OUT/mtp.jsonl 2>&1 \
  | grep -v "random params\|cells:\|^\s*$" | tail -14 | tee $OUT/mtp.txt
