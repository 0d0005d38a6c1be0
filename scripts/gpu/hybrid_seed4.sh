#!/usr/bin/env bash
# Issue 26 item 4: the seed report's experiment on its own model shape (seed-mtp = qwen3next-80b-a3b, random valid
# IQ3_S blocks in memory, int8 KV) under the seed machine's 24 GiB: the expert cache sized by the plan
# (--expert_cache auto --device_budget 24GiB), max_context 139,264 (a host tier behind each ring), rings 32,768
# and 49,152, NextN / replay / lookup drafts at k = 3, 3 seeds x 256 tokens. One depth per device call, one or two
# arms: at 604b844 arm AR's compiling run took 233 s (405 s before) and a seed 58 s, 44 s of it two 1K prefills in
# 8-token chunks through the slots; since 584a92f the prompt streams each block's experts once per 1,024-token
# chunk (PERF "Replay rounds against the faster step"), so a pair (ONLY=AR,BR) may fit 10 minutes:
#   ONLY=AR,BR DEPTH=1024 bash scripts/gpu/hybrid_seed4.sh      then AS,BS and AN,BN; then DEPTH=32768, 131072
# The engine holds the tier out of calls that stay inside the ring's window (model.api.split_idle_tier): at 1K
# every program is compiled ring-only, at depth with the tier (once each, no lax.cond of both).
# JOBS=3 compiles the arms' programs side by side in threads before the timed runs (bench.cells --compile_jobs):
#   ONLY=AS,AR,AN JOBS=3 DEPTH=1024 bash scripts/gpu/hybrid_seed4.sh       then ONLY=BS,BR,BN (the other ring)
# Deep cells (REUSE=1: arms of a ring share a prompt's streamed prefill, 30.5 s at 32K under the card, ~2 min at
# 128K). With JOBS > 1 one arm's compiling run goes first (AR's: its seed-0 prefill), the others' in threads take
# that prefill (bench.cells.compile_all); on 2026-12-04 each thread ran its own and the three arms' compiling runs
# took 323-399 s at 32K, which left ~150 s of a 540 s call for seeds (~90 s each): fewer arms per call until then,
#   ONLY=AS,AR,AN JOBS=3 REUSE=1 DEPTH=32768 TO=545 bash scripts/gpu/hybrid_seed4.sh
# What a cached step spends beyond its copies (PERF "The copies are not most of it"): a trace of arm AN's decode,
#   ONLY=AN SEEDS=1 PROFILE=1 DEPTH=1024 bash scripts/gpu/hybrid_seed4.sh
# A cell's seeds split over calls (FIRST=1 SEEDS=2: seeds 1 and 2), e.g. the 32K cell's missing ones:
#   ONLY=AS,AR,AN FIRST=1 SEEDS=2 JOBS=3 REUSE=1 DEPTH=32768 bash scripts/gpu/hybrid_seed4.sh   (then BS,BR,BN FIRST=2 SEEDS=1)
# The table of all calls: python -m bench.cells --report a.jsonl,b.jsonl,c.jsonl --arms seed4
# GLUE (bench.cells --glue) defaults to on/fuse=none: every seed of the cells recorded before the launch fusions became
# the default (2026-12-07) ran unfused, and a cell's missing seeds run as its others did.
set -o pipefail
source scripts/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
ONLY=${ONLY:-AR}; DEPTH=${DEPTH:-1024}
timeout ${TO:-560} python3 -m bench.cells --preset seed-mtp --in_memory --kernels pallas --arms seed4 --only $ONLY \
  --depths $DEPTH --expert_cache auto --device_budget 24GiB --max_context 139264 --max_new_tokens ${NEW:-256} \
  --seeds ${SEEDS:-3} --first_seed ${FIRST:-0} --glue ${GLUE:-on/fuse=none} --compile_jobs ${JOBS:-1} ${REUSE:+--reuse_prefill} ${PROFILE:+--trace $OUT/prof} --cells $OUT/seed4-$DEPTH-${ONLY//,/}.jsonl 2>&1 | grep --line-buffered -v "it/s\]\|random params" \
  | tee $OUT/seed4-$DEPTH-${ONLY//,/}.log | tail -30
# PROFILE=1: each arm's traced decode request (bench.cells --trace) as one tarball; read it here with
#   python scripts/gpu/trace_summary.py <arm>/plugins/profile/*/perfetto_trace.json.gz --steps 31 --gaps 50
[ -z "$PROFILE" ] || { tar czf $OUT/prof.tgz -C $OUT prof && rm -rf $OUT/prof; }
(cd $OUT && tar czf logs.tgz *.logs && rm -rf *.logs)
report_jaxcache
