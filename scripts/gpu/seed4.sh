#!/usr/bin/env bash
# The seed report's experiment (#3166) on the seed-mtp shape (random valid IQ3_S blocks in memory), plus plain
# arms and a replay k sweep: ring 32,768 vs 49,152, NextN / replay / lookup drafts, 1,024-token prompt, int8 KV.
set -o pipefail
source scripts/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m bench.cells --preset seed-mtp --in_memory --arms seed4k --depths 1024 --max_new_tokens ${NEW:-128} \
  --seeds ${SEEDS:-1} --max_context 139264 --cells $OUT/seed4.jsonl 2>&1 | grep --line-buffered -v "it/s\]" | tee $OUT/seed4.log
