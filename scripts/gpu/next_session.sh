#!/usr/bin/env bash
# GPU measurements, split into parts that each fit one device call (<= 9.5 min); `PART=N bash
# scripts/gpu/next_session.sh` runs one. On a two-GPU machine (kind nvidia-h200-x2) `bash scripts/gpu/pair.sh A
# B+C` runs part A on GPU 0 and B then C on GPU 1 in one call (half the device time per part). Results land in
# $OUT as JSONL + logs; docs/PERF.md says which table each feeds. Every step has its own timeout so one slow
# step cannot eat the others' output; the JSONL records survive a timeout, the filtered logs do not.
#
# Since 2026-12-07 (b) every launch fusion is on by default: `--glue on` is the bundle F, `on/fuse=none` the unfused
# kernels; the parts below written before it read "on" as unfused (their PERF sections say so).
# Still open, in the order to run them (2026-12-08): miss2, misstrace (a trace of the cached step and the row store
# probe), seed32b, seed128c (warm, right after seed32b: the same ring), seed128b, k6, fuse2. Ran: 2026-12-08 miss
# (PERF "The miss copies in groups move nothing"); 2026-12-07 (b) fold8, misscb2, miss (PERF "No verify pass of 8 rows"):
#   k6        replay k = 3 against k = 6 (a verify in two passes of decode.speculative.VERIFY_ROWS since f13b789) and
#             plain on seed-mtp at 1K, everything resident, the default glue (~4 min)
#   misscb2   issue 26 item 5: WHILE / CONDITIONAL command buffers on a resident request and the cached step, each
#             beside the default (~7 min; 2026-12-07 c4 ran it cut to 65 s a request: too short for the first)
#   hybfix    (ran 2026-12-07 c3: 96/96 with x8 + dx8 + F; its rows ran out of 220 s) issue 26/27: the rope fold
#             with its q norm's own load at every T: replay with x8 + dx8 + F and F, rows, trunk
#   hybinv    (ran 2026-12-07 c1, before hybfix's change) issue 26/27: the rope fold kept off where the q norm's
#             order varied, the seed-mtp rows and
#             trunk with x8 + dx8 + every fusion, then replay k = 3 against plain with them (0/378 accepted at
#             f98652a, where the fold ran at head dim 256); ~6 min
#   fuse2     issue 27 item 3: topk alone and the bundle less residual, 30B, both expert types (~5 min)
#   miss      the expert cache's miss copies in groups (Tunings.miss_lanes / miss_eager, commit e327050): the seed-mtp
#             step through 15,800 slots (the 24 GiB card's count), default against groups of 4 and 10 (~5 min)
#   x8anchor  needs the tree under 64 MiB with .anchor: keep configs/data/hybrid.gguf out of the call (git rm
#             --cached + .git/info/exclude for the call, `git reset` after), as 2026-12-06 did
# Earlier list (2026-12-04, night; each a PART that fits one call; run since: seed128a, PERF
# "The seed's experiment at 128K"; the numbered parts below are earlier sessions' measurements, kept as the
# commands their PERF sections cite). Run a ring's calls back to back: a warm machine keeps .jaxcache between calls
# (compiling runs 431 -> 246 s at 128K) and is given back after 30 s idle.
#   x8fuse    issue 27: x8norm's and fuse's step cells in one call, both expert types (7 cells each, interleaved),
#             and the rows' invariance with both (~9.5 min). FIRST when the budget is one session's 30 min: it decides
#             x8's default and each fusion's fate; then fusetrace, fusehyb
#   x8norm    issue 27: x8 with the rounding in the norm kernel, the step A/B for both expert types, its rows'
#             invariance, a trace (~5 min). FIRST: it decides x8's default (PERF "Integer dots on 8-bit x on the GPU")
#   fuse      issue 27 item 3: the step with the launch fusions (Tunings.fuse rope, residual, router, topk), both expert types,
#             interleaved, alone and on x8; the fused kernels' rows' invariance (~7 min); then PART=fusetrace (a
#             trace per variant, ~4 min). Right after x8norm: a fusion that measures no gain is deleted
#   fusehyb   issues 26 item 5 / 27: the fusions on the hybrid seed-mtp step (-5 or -6 launches a layer) and replay
#             k = 3 against plain at 1K with them (~8 min)
#   kcache    compile time: XLA's kernel cache file across programs and processes (~7 min). If it cuts the second
#             program's compile, env.sh sets it for every call (a seed4 arm's cold compile is 110-430 s)
#   x8anchor  issue 27: llama.cpp and ours with and without x8 on one 30B file at 1K, same call (~6 min; carry .whl
#             and .anchor: `mkdir -p .anchor && cp ../shared/anchor/{llama_cpp_cuda_sm90.tar.xz,llama_bench.py} .anchor/`;
#             .whl also needs diskcache's wheel for llama-cpp-python: `cp /opt/pypi/files/diskcache-*.whl .whl/`)
#   x8replay  issues 26 item 5 / 27 item 5: replay k = 3 and plain at 1K on seed-mtp, with and without x8 (~6 min)
#   dp4a      (ran 2026-12-04 evening) issue 27: Q8_0, IQ3_S and Q4_K tiles on 8-bit x with dp4a (ops/dot8) checked compiled and timed
#             against the float tiles (scripts/gpu/dp4a_probe.py), then the 30B step with them in the experts'
#             gate/up (--glue on/x8=dp4a) and the projections too (px8), interleaved; their rows' batch invariance;
#             ~9 min. First: it decides the next kernel work
#   x8trace   (ran 2026-12-04 evening) the 30B step traced with and without x8, per kernel, both expert types (issue 27 item 3); ~7 min
#   seed128c  issue 26 item 4 at 128K: ring 49,152 seed 1 (BS, BR, BN); its compiling runs do not fit one cold call
#             (2026-12-04: nothing came back): run it warm, right after seed32b (same ring) or a second time
#   seed128d  (ran 2026-12-04 evening: seed 2 of BS, BR, BN)
#   seed128b  ring 32,768 seed 2 of AR and AN (AS has its three seeds); ~9 min cold
#   seed32b   the 32K cell's seed 2 on the 49,152 ring (BS, BR, BN); ~7 min cold (compile ~330 s)
#   probes    which programs of a seed4 request take its compiling run's time, at seed-mtp widths
#             (scripts/compile_probe.py --widths seed-mtp); compile against layers and the loop test are measured
# Every call: carry [".whl"] and set MOEJAX_COMMIT to the commit (the device copy's git is stale).
# Outputs: write every step's lines to a file under $OUT with tee (a call that times out returns files, not stdout).
# Since commit d45edc3 a seed-mtp bench arm without slots compiles in ~35 s; with slots a first run takes
# 110-150 s (compile + prefill through slots at 24-80 tok/s).
set -o pipefail
source scripts/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
filt() { tr '\r' '\n' | grep --line-buffered -vE "it/s\]|tensor/s\]|arm/s\]|s/it\]|s/arm\]"; }
S30="python3 -m bench.step --preset qwen3moe-30b-a3b --steps 32 --repeats 3 --out $OUT/step.jsonl"
case "${PART:-1}" in
spans)  # issue 26 item 5: the tier read in spans (HOST_SPAN) against blocks alone (span=4096, the code before) and
  # spans of 32K, at 128K and at 40K depth (a tier of ~8K positions); the GPU's bitwise verify rows with spans;
  # replay rounds at 128K beside the tier with the default spans
  timeout ${TA:-160} python3 -m bench.step --preset seed-mtp --kernels pallas --steps 16 --repeats 3 --out $OUT/spans.jsonl \
    --cells 32768:131072:auto:pallas:139264,32768:40960:auto:pallas:139264 --glue on,on/span=4096,on/span=32768 \
    2>&1 | filt | tee $OUT/spans.log | tail -9
  timeout ${T13:-130} python3 scripts/gpu/batch_invariance.py --preset seed-mtp --layers 4 --proj_types Q8_0 \
    --moe_types IQ3_S 2>&1 | grep -vE "^(W|I)[0-9]" | tee $OUT/invariance.txt | tail -14
  timeout ${TC:-230} python3 -m bench.cells --preset seed-mtp --in_memory --kernels pallas --rings 32768 --max_context 139264 \
    --drafts none,replay@3 --depths 131072 --max_new_tokens 64 --seeds 1 --reuse_prefill \
    --cells $OUT/replay-spans.jsonl 2>&1 | filt | tee $OUT/replay-spans.log | tail -5
  (cd $OUT && tar czf logs.tgz *.logs && rm -rf *.logs) ;;
tier)  bash scripts/gpu/tier_depth.sh ;;
hybinv)  # the hybrid's exactness with x8 + dx8 + every fusion (the rope fold off where its q norm's order varies), then replay
  F=fuse=residual+router+topk+gated_norm+rope
  timeout ${TI:-200} python3 scripts/gpu/batch_invariance.py --preset seed-mtp --layers 4 --proj_types Q8_0 \
    --moe_types IQ3_S --glue on/x8=dp4a/dx8=dp4a/$F,on/$F 2>&1 | grep -vE "^(W|I)[0-9]" | tee $OUT/hybinv.txt \
    | grep -E "trunk|DIFF"
  timeout ${TR:-300} python3 -m bench.cells --preset seed-mtp --in_memory --kernels pallas --drafts none,replay@3 \
    --depths 1024 --rings 4096 --max_new_tokens 128 --seeds 2 --glue on/x8=dp4a/dx8=dp4a/$F --trace $OUT/prof \
    --cells $OUT/hybinv.jsonl 2>&1 | filt | tail -5
  # where a verify round's time goes against a plain step's (issue 26 item 5, issue 27 item 5): 32 traced tokens,
  # 32 steps plain, 8 rounds of k = 3 when every draft is accepted
  for a in $OUT/prof/*; do f=$(find $a -name perfetto_trace.json.gz | head -1)
    n=$(case $a in *replay*) echo 8;; *) echo 32;; esac); echo "== $(basename $a) (per ${n}th)"
    python3 scripts/gpu/trace_summary.py $f --steps $n --top 30 --gaps 40; done 2>&1 | tee $OUT/hybtrace.txt | tail -80
  rm -rf $OUT/prof ;;
hybfix)  # the rope fold's q norm from its own [P, 1, Dh] load and every decode / verify pass folded (norm_order_varies
  # gone): replay k = 3 against plain with x8 + dx8 + every fusion (0/378 and 7/735 accepted before), then with the
  # fusions alone, then the rows (the fold's T = 4 pass against its steps) and the 2-layer trunk with x8 + dx8 + F
  F=fuse=residual+router+topk+gated_norm+rope
  for g in on/x8=dp4a/dx8=dp4a/$F on/$F; do
    timeout ${TR:-130} python3 -m bench.cells --preset seed-mtp --in_memory --kernels pallas --drafts none,replay@3 \
      --depths 1024 --rings 4096 --max_new_tokens 128 --seeds 1 --glue $g --cells $OUT/hybfix.jsonl 2>&1 | filt \
      | tee -a $OUT/hybfix.log | tail -4
  done
  timeout ${TI:-220} python3 scripts/gpu/batch_invariance.py --preset seed-mtp --layers 2 --proj_types Q8_0 \
    --moe_types IQ3_S --x8 dp4a --glue on/x8=dp4a/dx8=dp4a/$F 2>&1 | grep -vE "^(W|I)[0-9]" | tee $OUT/hybfix-inv.txt \
    | grep -E "trunk|DIFF|fuse rope" ;;
misscb2)  # WHILE / CONDITIONAL command buffers (the loop tests on the device), each beside the default in its own process:
  # a plain resident request at 1K (decode_loop tests its bound every step: ~1.2 ms idle after each test in c1's
  # trace), then the cached step through 15,800 slots (ensure's loop: a test a miss)
  CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"
  P="python3 -m bench.cells --preset seed-mtp --in_memory --kernels pallas --drafts none --depths 1024 --rings 4096 --max_new_tokens 128 --seeds 1"
  M="python3 -m bench.step --preset seed-mtp --kernels pallas --steps 16 --repeats 3 --cells 4096:1024:auto:pallas::15800 --glue on"
  timeout ${TP:-110} $P --cells $OUT/cb-off.jsonl 2>&1 | filt | tail -3
  XLA_FLAGS="$CB" timeout ${TP:-110} $P --cells $OUT/cb-on.jsonl 2>&1 | filt | tail -3
  timeout ${TM:-120} $M --out $OUT/misscb-off.jsonl 2>&1 | filt | tail -3
  XLA_FLAGS="$CB" timeout ${TM:-120} $M --out $OUT/misscb-on.jsonl 2>&1 | filt | tail -3 ;;
miss)  # the misses' copies a group at a time (lanes) with the first group before the loop (eager), one cell after
  # another (interleaved, three 15,800-slot caches did not fit an 80 GB card: 2026-12-07b c3 ran the first cell only)
  timeout ${TM:-280} python3 -m bench.step --preset seed-mtp --kernels pallas --steps 32 --repeats 5 \
    --glue on,on/miss=4:1,on/miss=10:1 --cells 4096:1024:auto:pallas::15800 --out $OUT/miss.jsonl 2>&1 | filt \
    | tee $OUT/miss.log | tail -6 ;;
miss2)  # rows before the loop one at a time (lanes 1, eager 2 and 3): 2026-12-08 c1 put a row's copy at ~90 µs and a loop
  # test at ~45 µs in the cached step; with 3.4 misses a layer, eager rows that skip 2-3 tests should win 9-28 %
  timeout ${TM:-330} python3 -m bench.step --preset seed-mtp --kernels pallas --steps 32 --repeats 3 \
    --glue on,on/miss=1:2,on/miss=1:3 --cells 4096:1024:auto:pallas::15800 --out $OUT/miss2.jsonl 2>&1 | filt \
    | tee $OUT/miss2.log | tail -6 ;;
misstrace)  # where a cached step's ~23 ms beyond the resident step goes: a trace of the step through 15,800 slots (the
  # copies' own time, the gaps after each loop test), then the miss copy probe with the row store's variant (one copy
  # a miss, repacked on the device into the 15 planes, checked bytewise against the planes' copies); ~4 min
  timeout ${TM:-200} python3 -m bench.step --preset seed-mtp --kernels pallas --steps 16 --repeats 2 --glue on \
    --cells 4096:1024:auto:pallas::15800 --out $OUT/misstrace.jsonl --profile $OUT/prof 2>&1 | filt | tail -4
  for f in $(find $OUT/prof -name perfetto_trace.json.gz); do
    python3 scripts/gpu/trace_summary.py $f --steps 16 --top 40 --gaps 30; done 2>&1 | tee $OUT/misstrace.txt | head -90
  rm -rf $OUT/prof
  timeout ${TP:-120} python3 scripts/gpu/miss_copy_probe.py 2>&1 | grep -vE "^(W|I)[0-9]" | tee $OUT/miss_copy.txt ;;
k6)  # the two-pass verify's cost: plain, replay k = 3 (one pass) and k = 6 (passes of 4 and 3), accepted 100 %
  timeout ${TR:-300} python3 -m bench.cells --preset seed-mtp --in_memory --kernels pallas --drafts none,replay@3,replay@6 \
    --depths 1024 --rings 4096 --max_new_tokens 128 --seeds 1 --cells $OUT/k6.jsonl 2>&1 | filt | tee $OUT/k6.log | tail -6 ;;
fold8)  # the rope fold's q rows at the 30B shape's T = 8 (P = 64 = its ring tile bk: the layout that made seed-mtp's
  # T = 3, 4 passes differ before da3050f), F and x8 + dx8 + F: the rows and a 2-layer trunk's 8-token pass against its steps
  F=fuse=residual+router+topk+rope
  timeout ${TI:-500} python3 scripts/gpu/batch_invariance.py --preset qwen3moe-30b-a3b --layers 2 --T 8 --proj_types Q8_0 \
    --moe_types IQ3_S --x8 dp4a --glue on/$F,on/x8=dp4a/dx8=dp4a/$F 2>&1 | grep -vE "^(W|I)[0-9]" \
    | tee $OUT/fold8-inv.txt | grep -E "trunk|DIFF|fuse rope" ;;
fuse2)  # the bundle's members: none, topk alone, the bundle less residual, and the bundle (the default), interleaved
  for x in IQ3_S Q4_K; do
    timeout ${TS:-150} $S30 --experts $x --glue on/fuse=none,on/fuse=topk,on/fuse=router+topk+rope,on \
      --interleave --repeats 5 --cells 4096:1024:auto:pallas 2>&1 | filt | tee -a $OUT/fuse2-step.log | tail -6
  done ;;
seed32a)  ONLY=AS,AR,AN FIRST=1 SEEDS=2 JOBS=3 REUSE=1 DEPTH=32768 TO=545 bash scripts/gpu/hybrid_seed4.sh ;;
seed32b)  ONLY=BS,BR,BN FIRST=2 SEEDS=1 JOBS=3 REUSE=1 DEPTH=32768 TO=545 bash scripts/gpu/hybrid_seed4.sh ;;
dp4a)  # issue 27: ops/dot8's tiles as a matvec against the shipped kernel, then the 30B step with the routed experts'
  # gate/up on them (moe_pallas.Tuning.x8) against the float tiles, interleaved, IQ3_S then Q4_K experts
  timeout ${TD:-200} python3 scripts/gpu/dp4a_probe.py --check --time 2>&1 | grep -vE "^(W|I)[0-9]" \
    | tee $OUT/dp4a.txt
  for x in IQ3_S Q4_K; do
    timeout ${TS:-170} $S30 --experts $x --glue on,on/x8=dp4a,on/x8=dp4a/px8=dp4a --interleave --repeats 5 \
      --cells 4096:1024:auto:pallas 2>&1 | filt | tee -a $OUT/x8-step.log | tail -6
  done
  timeout ${TI:-120} python3 scripts/gpu/batch_invariance.py --preset qwen3moe-30b-a3b --layers 2 --proj_types Q8_0 \
    --moe_types IQ3_S,Q4_K --x8 dp4a 2>&1 | grep -vE "^(W|I)[0-9]" | tee $OUT/x8-invariance.txt | grep -E "x8|DIFF" ;;
x8norm)  # issue 27: x8 with the rounding in the RMSNorm kernel (commit 31c9947) against the float tiles, both expert
  # types, interleaved, with down on 8-bit h too (dx8: gate/up rounds h), then the projections too (px8: the norm
  # rounds for wqkv / win, XLA for o and the head); the x8 rows' batch invariance; one
  # traced run per variant (the launches a step: 644 float, 740 with XLA's rounding at a8c03c3, 596 expected now)
  for x in IQ3_S Q4_K; do
    timeout ${TS:-140} $S30 --experts $x --glue on,on/x8=dp4a,on/x8=dp4a/dx8=dp4a,on/x8=dp4a/dx8=dp4a/px8=dp4a --interleave --repeats 5 \
      --cells 4096:1024:auto:pallas 2>&1 | filt | tee -a $OUT/x8norm-step.log | tail -8
  done
  timeout ${TI:-100} python3 scripts/gpu/batch_invariance.py --preset qwen3moe-30b-a3b --layers 1 --proj_types Q8_0 \
    --moe_types IQ3_S,Q4_K --x8 dp4a 2>&1 | grep -vE "^(W|I)[0-9]" | tee $OUT/x8norm-invariance.txt | grep -E "x8|DIFF"
  GX=on/x8=dp4a,on/x8=dp4a/dx8=dp4a/px8=dp4a TX=${TX:-120} PART=x8trace bash scripts/gpu/next_session.sh ;;
x8fuse)  # x8norm and fuse in one call (commit 8146bb3; rope since 34ef97a): float, x8, +dx8, +px8, the fusions alone
  # and on x8 (+dx8)
  F=fuse=residual+router+topk+rope
  for x in IQ3_S Q4_K; do
    timeout ${TS:-230} $S30 --experts $x --glue on,on/x8=dp4a,on/x8=dp4a/dx8=dp4a,on/x8=dp4a/dx8=dp4a/px8=dp4a,on/$F,on/x8=dp4a/$F,on/x8=dp4a/dx8=dp4a/$F \
      --interleave --repeats 5 --cells 4096:1024:auto:pallas 2>&1 | filt | tee -a $OUT/x8fuse-step.log | tail -10
  done
  timeout ${TI:-100} python3 scripts/gpu/batch_invariance.py --preset qwen3moe-30b-a3b --layers 4 --proj_types Q8_0 \
    --moe_types IQ3_S,Q4_K --x8 dp4a --glue on/$F 2>&1 | grep -vE "^(W|I)[0-9]" | tee $OUT/x8fuse-invariance.txt \
    | grep -E "x8|fuse|trunk|DIFF" ;;
fuse)  # issue 27 item 3: RoPE and the ring write inside the attention kernel (fuse=rope: -1 launch a layer), a
  # block's FFN sum added by the next norm kernel (residual: -1), the FFN norm and the router logits in one kernel
  # (router: -1 more), gate/up routing for itself (topk: -1 more), alone and on x8; the fused kernels' rows and a
  # 4-layer trunk's verify pass against its steps (~9 min)
  F=fuse=residual+router+topk+rope
  for x in IQ3_S Q4_K; do
    timeout ${TS:-250} $S30 --experts $x --glue on,on/fuse=rope,on/fuse=residual,on/fuse=residual+router,on/$F,on/x8=dp4a/$F --interleave \
      --repeats 5 --cells 4096:1024:auto:pallas 2>&1 | filt | tee -a $OUT/fuse-step.log | tail -8
  done
  timeout ${TI:-150} python3 scripts/gpu/batch_invariance.py --preset qwen3moe-30b-a3b --layers 4 --moe_types IQ3_S \
    --glue on,on/$F 2>&1 | grep -vE "^(W|I)[0-9]" | tee $OUT/fuse-invariance.txt | grep -E "fuse|trunk|DIFF" ;;
fusehyb)  # the fusions on the seed-mtp step (its shared expert's gate logit and product fold too, and the DeltaNet
  # output norm's gate: gated_norm), interleaved, then replay k = 3 against plain at 1K with them, everything
  # resident (item 5's 1.8x)
  F=fuse=residual+router+topk+gated_norm+rope
  timeout ${TS:-300} python3 -m bench.step --preset seed-mtp --kernels pallas --steps 32 --repeats 5 --interleave \
    --glue on,on/$F --cells 4096:1024:auto:pallas --out $OUT/step.jsonl 2>&1 | filt | tee $OUT/fusehyb-step.log | tail -6
  timeout ${TR:-270} python3 -m bench.cells --preset seed-mtp --in_memory --kernels pallas --drafts none,replay@3 \
    --depths 1024 --rings 4096 --max_new_tokens 128 --seeds 2 --glue on/$F --cells $OUT/fusehyb.jsonl 2>&1 | filt | tail -6 ;;
fusetrace)  # the traces of PART=fuse's variants (launches and kernel time a step, per kernel: 596 for the float
  # Q4_K step at a8c03c3, 452 expected with the three fusions); first the fused attn norm's warps (it reads 10
  # rows a token in one program: norm=8 puts more loads in flight)
  timeout ${TS:-150} $S30 --experts Q4_K --glue on/fuse=residual+router+topk+rope,on/fuse=residual+router+topk+rope/norm=8 \
    --interleave --repeats 5 --cells 4096:1024:auto:pallas 2>&1 | filt | tee -a $OUT/fuse-step.log | tail -4
  GX=on,on/fuse=residual+router+topk+rope,on/x8=dp4a/fuse=residual+router+topk+rope TX=${TX:-120} PART=x8trace \
    bash scripts/gpu/next_session.sh ;;
kcache)  # compile time (every cold call pays it: a seed4 arm's compiling run is 110-430 s): does XLA's kernel cache
  # file (--xla_gpu_kernel_cache_file) keep the Pallas kernels' compiled code across programs and processes? Each
  # process has its own empty jax cache (no executable reuse); rings 4,096 and 8,192 share every kernel but the
  # attention's. Without the kernel cache, then with it (the first fills it); first_run_s is the compile (~7 min)
  K=$PWD/.jaxcache/kernels.bin; rm -f $K
  for kc in "" "--xla_gpu_kernel_cache_file=$K"; do
    for R in 4096 8192; do
      JAX_COMPILATION_CACHE_DIR=$(mktemp -d) XLA_FLAGS="${XLA_FLAGS:-} $kc" timeout ${TK:-110} $S30 --steps 8 \
        --repeats 1 --cells $R:1024:auto:pallas --out $OUT/kcache.jsonl 2>&1 | filt | tee -a $OUT/kcache.log | tail -2
    done
  done
  ls -la $K; grep -o '"first_run_s": [0-9.]*' $OUT/kcache.jsonl ;;
x8anchor)  # issue 27 items 1-2 with x8: llama.cpp (../shared/anchor's tarball and llama_bench.py copied into .anchor/,
  # carried) and ours with and without x8 on one 30B file at 1K (EXPERTS=Q4_K for the other expert type); ~6 min
  PRESET=qwen3moe-30b-a3b EXPERTS=${EXPERTS:-IQ3_S} GLUES="on on/x8=dp4a" PART=short1k TO=${TO:-150} \
    bash scripts/gpu/hybrid_anchor.sh ;;
x8replay)  # issue 26 item 5 (replay k = 3 >= 1.8x plain at 1K on seed-mtp) and issue 27 item 5 (the verify pass's
  # cost) with and without x8, everything resident; ~6 min
  for g in on on/x8=dp4a; do
    timeout ${TR:-270} python3 -m bench.cells --preset seed-mtp --in_memory --kernels pallas --drafts none,replay@3 \
      --depths 1024 --rings 4096 --max_new_tokens 128 --seeds 2 --glue $g --cells $OUT/x8replay.jsonl 2>&1 | filt | tail -6
  done ;;
x8trace)  # issue 27 item 3: where a 30B step's time goes with and without the x8 tiles, IQ3_S then Q4_K experts (1K):
  # one traced run of 32 steps per variant, summarised per kernel (launches, kernel time against the device span);
  # PART=dp4a's step A/B: x8 won 5 % with IQ3_S experts and lost 4 % with Q4_K, px8 moved nothing
  for x in IQ3_S Q4_K; do
    timeout ${TX:-200} $S30 --experts $x --steps 32 --repeats 1 --glue ${GX:-on,on/x8=dp4a} \
      --profile $OUT/trace-$x --cells 4096:1024:auto:pallas 2>&1 | filt | tail -5
    for c in $OUT/trace-$x/*; do [ -d $c ] || continue; f=$(find $c -name "*.json.gz" | head -1)
      [ -n "$f" ] && python3 scripts/gpu/trace_summary.py $f --steps 32 --top 30 > ${c//[=+]/-}.summary.txt 2>&1; rm -rf $c; done
  done
  tail -n 4 $OUT/trace-*/*.summary.txt ;;
seed128b)  ONLY=AR,AN FIRST=2 SEEDS=1 JOBS=2 REUSE=1 DEPTH=131072 TO=555 bash scripts/gpu/hybrid_seed4.sh ;;
seed128c)  ONLY=BS,BR,BN FIRST=1 SEEDS=1 JOBS=3 REUSE=1 DEPTH=131072 TO=555 bash scripts/gpu/hybrid_seed4.sh ;;
seed128d)  ONLY=BS,BR,BN FIRST=2 SEEDS=1 JOBS=3 REUSE=1 DEPTH=131072 TO=555 bash scripts/gpu/hybrid_seed4.sh ;;
probes)  # issue 27 / item 4's compiling runs: which programs of a seed4 request take the compile time at the real
  # model's widths (the layer count does not: PERF "The host tier read in spans", compile against layers)
  timeout ${TP:-420} python3 scripts/compile_probe.py --kernels pallas --widths seed-mtp --layers 48 --experts 64 \
    --top_k 10 --slots 1024 --ring 4096 --max_context 16384 --programs prefill8,prefillB,step,verify,decode,spec \
    --features plain,cache+tier --out $OUT/compile.jsonl 2>&1 | filt | tail -3
  python3 scripts/compile_probe.py --report --out $OUT/compile.jsonl 2>&1 | tee $OUT/compile.txt
  ;;
1)  # issue 7: fused q/k/v A/B; issue 4: the host tier since commit 1496654 (ring part on the decode kernel,
    # write-only evict), 1K..128K, plain evict first, then the idle-evict cond (its own timeout: a seed4 run with
    # the cond wrote nothing in 300 s)
  timeout 100 $S30 --cells 4096:1024:auto:pallas,32768:32768:auto:pallas 2>&1 | filt | tail -4          # fused
  timeout 100 $S30 --nofuse_qkv --cells 4096:1024:auto:pallas,32768:32768:auto:pallas 2>&1 | filt | tail -4
  H=32768:1024:auto:pallas:139264,32768:32768:auto:pallas:139264,32768:65536:auto:pallas:139264,32768:131072:auto:pallas:139264
  timeout 170 $S30 --steps 16 --cells $H 2>&1 | filt | tee -a $OUT/host.log | grep -v "^$" | tail -6
  ;;
2)  # issue 5: k = 1 and 3 in one run with their plain arm, lookup with draftless rounds as plain steps; issue 7:
    # prefill chunk 4 and 16 against the default 8 (16 runs the reference attention: the kernel takes T <= 8)
  timeout 330 python3 -m bench.cells --preset seed-mtp --in_memory --kernels pallas \
    --drafts none,replay@1,replay@3,lookup@3 --seeds 1 --max_new_tokens 64 --depths 1024 --rings 4096 \
    --cells $OUT/rounds.jsonl 2>&1 | filt | tee $OUT/rounds.log | grep -v "^$" | tail -12
  for c in 4 16; do
    timeout 100 python3 -m bench.cells --preset qwen3moe-30b-a3b --in_memory --kernels pallas --drafts none \
      --depths 1024 --rings 4096 --max_new_tokens 32 --seeds 2 --prefill_chunk $c --cells $OUT/prefill.jsonl \
      2>&1 | filt | tail -3
  done ;;
3)  # issue 7 item 3: the seed's arms on the GPU with the Pallas kernels, 3 seeds; max_context 139,264 over rings of
    # 32K/48K attaches a host tier (idle at 1K depth). Two arms per call (ONLY=AN,BN etc.: ~5 min on one GPU at
    # 490ae0f). An idle tier is held out of the calls (model.api.split_idle_tier)
  timeout ${T3:-560} python3 -m bench.cells --preset seed-mtp --in_memory --kernels pallas --arms seed4 --depths 1024 \
    --expert_cache auto ${ONLY:+--only $ONLY} \
    --max_new_tokens 256 --seeds ${SEEDS:-3} --max_context 139264 --cells $OUT/seed4.jsonl 2>&1 | filt | tail -30 ;;
4)  # issue 6: the seed's 24 GiB card on seed-mtp (experts do not fit: auto slots), ring +16K, drafts on/off
  timeout 560 python3 -m bench.cells --preset seed-mtp --in_memory --kernels pallas --device_budget 24GiB \
    --expert_cache auto --rings 32768,49152 --drafts none,replay@3 --depths 1024 --max_new_tokens 64 --seeds 1 \
    --cells $OUT/xcache.jsonl 2>&1 | filt | tail -12 ;;
5)  # issue 6: tok/s and hit rate against slots on the 30B shape (all experts fit 24 GiB there: a slot sweep). A
    # 256-token prompt: with slots the prefill runs at ~50 tok/s (every chunk misses), 20 s per 1,024 tokens
  timeout 560 python3 -m bench.cells --preset qwen3moe-30b-a3b --in_memory --kernels pallas \
    --expert_cache all,5120,4096,2048,1024 --rings 4096 --drafts none --depths 256 --max_new_tokens 64 --seeds 1 \
    --cells $OUT/xslots.jsonl 2>&1 | filt | tail -10 ;;
6)  # issue 3: part (b) for the other types at B = 1, 4, 16 against XLA (done 2026-11-30 17:11: T6=0 skips it),
    # then their --check on the GPU (C6: the types to check; Q8_0 and Q6_K passed at 17:11)
  [ "${T6:-300}" != 0 ] && timeout ${T6:-300} python3 -m bench.kernels --out $OUT/kern --types Q8_0,Q6_K,IQ4_XS,IQ4_NL,Q5_K --batches 1,4,16 \
    --impls pallas,xla --parts b --iters 10 2>&1 | filt | tee $OUT/kern.log | tail -14
  timeout ${T6C:-200} python3 -m bench.kernels --out $OUT/kern --check --types ${C6:-IQ4_XS,IQ4_NL,Q5_K} --batches 1 \
    --impls pallas --parts b --layers 2 --iters 1 2>&1 | grep --line-buffered "^check" ;;
8)  # issue 6, PART 4 made to fit (a 1,024-token prompt through slots runs at ~80 tok/s: 13 s a run): the seed's
    # 24 GiB card on seed-mtp at depth 256, ring 32K and 48K, MTP off and on (replay k = 3), one seed
  timeout ${T8:-560} python3 -m bench.cells --preset seed-mtp --in_memory --kernels pallas --device_budget 24GiB \
    --expert_cache auto --rings ${R8:-49152,32768} --drafts ${D8:-none,replay@3} --depths 256 --max_new_tokens 64 --seeds 1 \
    --cells $OUT/xcache.jsonl 2>&1 | filt | tail -12 ;;
9)  # issue 6: the 30B slot sweep with the prefill/decode split of the cache counters (commit 21b9083), a short
    # prompt (64 tokens: prefill through slots is slow) so that four arms fit
  timeout ${T9:-560} python3 -m bench.cells --preset qwen3moe-30b-a3b --in_memory --kernels pallas \
    --expert_cache ${X9:-1024,all} --rings 4096 --drafts none --depths 64 --max_new_tokens 64 --seeds 1 \
    --cells $OUT/xslots.jsonl 2>&1 | filt | tail -10 ;;
11) # issue 7 (the prefill goal): the tensor-core GEMMs of ops/qgemm_pallas, compiled check and kernel timings, then
    # the 30B prefill through them (chunk 1,024; 256) against the decode kernels (chunk 8) in one process, with
    # with PROF11=1 one traced run per chunk summarised per kernel (the traces are deleted: too big to bring back)
  timeout ${T11A:-220} python3 scripts/gpu/qgemm_check.py --types ${TY11:-Q8_0,IQ3_S,Q4_K} \
    --tiles "${TL11:-BN=128;BN=32;BN=64,S=16}" > $OUT/qgemm.log 2>&1; grep -E "^(check|time)" $OUT/qgemm.log; tail -3 $OUT/qgemm.log
  timeout ${T11B:-330} python3 scripts/gpu/prefill_probe.py --chunks ${C11:-8,256,1024} --variants "${V11:-default}" \
    ${PROF11:+--profile $OUT/trace} 2>&1 | filt | grep -v "^$" | tail -8
  for c in $OUT/trace/*; do [ -d $c ] || continue; f=$(find $c -name "*.json.gz" | head -1)
    [ -n "$f" ] && python3 scripts/gpu/trace_summary.py $f --top 20 > $c.summary.txt 2>&1; rm -rf $c; done
  head -30 $OUT/trace/*.summary.txt ;;
12) # issue 7 (the 1K decode goal): the step's glue kernels. The fused rope + ring-write kernel against the separate XLA
    # ops, cell by cell in one process, at 1K (ring 4,096) and 32K (ring 32,768: a copy of the aliased ring would
    # show there); then one traced run with XLA's optimized HLO, summarised per kernel with each fusion's ops
  timeout ${T12A:-260} $S30 --glue on,off --cells ${C12:-4096:1024:auto:pallas,32768:32768:auto:pallas} 2>&1 | filt | tail -7
  XLA_FLAGS="--xla_dump_to=$OUT/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode_loop.*" \
    timeout ${T12B:-200} $S30 --repeats 1 --steps 16 --glue ${RW12:-on} --profile $OUT/trace --cells 4096:1024:auto:pallas \
    --out $OUT/step-traced.jsonl 2>&1 | filt | tail -2
  h=$(ls $OUT/hlo/*decode_loop*after_optimizations.txt 2>/dev/null | grep -v buffer | head -1)
  f=$(find $OUT/trace -name "*.json.gz" 2>/dev/null | head -1)
  [ -n "$h" ] && [ -n "$f" ] && python3 scripts/gpu/hlo_fusions.py $h $f --steps 16 --top 80 > $OUT/fusions.md
  [ -n "$h" ] && gzip -c $h > $OUT/decode_loop_hlo.txt.gz; rm -rf $OUT/hlo $OUT/trace
  head -45 $OUT/fusions.md; tail -2 $OUT/fusions.md ;;
13) # DESIGN invariant 3 on the GPU: is a verify pass (T = 4) bitwise the plain steps it replaces, op by op and for
    # a 4-layer trunk? (seed4's replay arms accepted 5-19 % at ded51a0, 100 % at d45edc3)
  for p in ${P13:-seed-mtp qwen3moe-30b-a3b}; do
    timeout ${T13:-150} python3 scripts/gpu/batch_invariance.py --preset $p --layers 4 --proj_types ${PT13:-Q8_0} --moe_types ${MT13:-IQ3_S} 2>&1 | grep -vE "^(W|I)[0-9]" | tail -${N13:-12}
  done ;;
16) # issue 7 (prefill): the prefill precisions, bf16 (one MMA, the GPU default) against the float32-accurate f32,
    # kernels then the 30B prefill (start_request whole and the prompt's calls alone), interleaved; PROF16=1 traces
    # each (GAP16: idle stretches); then the end-to-end cells at 1K for both expert types (E16=0 skips them)
  [ "${T16A:-200}" != 0 ] && timeout ${T16A:-200} python3 scripts/gpu/qgemm_check.py --types ${TY16:-Q8_0,IQ3_S,Q4_K} --precisions f32,bf16,f32,bf16 \
    2>&1 | tee $OUT/forms.log | grep -E "^precision"
  timeout ${T16B:-300} python3 scripts/gpu/prefill_probe.py --chunks 1024 --variants "${V16:-precision=f32;default;precision=f32;default}" \
    ${PROF16:+--profile $OUT/trace} 2>&1 | filt | grep -E "^prefill"
  for c in $OUT/trace/*; do [ -d $c ] || continue; f=$(find $c -name "*.json.gz" | head -1)
    [ -n "$f" ] && python3 scripts/gpu/trace_summary.py $f --top 25 --gaps ${GAP16:-30} > $c.summary.txt 2>&1; rm -rf $c; done
  head -80 $OUT/trace/*.summary.txt 2>/dev/null
  [ "${E16:-1}" != 0 ] && for x in IQ3_S Q4_K; do timeout 200 python3 -m bench.cells --preset qwen3moe-30b-a3b --in_memory \
    --kernels pallas --drafts none --depths 1024 --max_new_tokens 256 --seeds 3 --experts $x --cells $OUT/e2e.jsonl 2>&1 | filt | tail -3; done ;;
17) # issue 7 item 3: a deep request with the host tier stage by stage (the second prefill compile is gone since 1911e7e?
    # random_params threaded since 5924a88?), then one pair of seed4 arms at one depth (ONLY17=AN,BN | AR,BR | AS,BS;
    # D17=32768 | 131072), records per timed run in seed4-deep.jsonl (they survive a timeout); T17A=0 skips the probe.
    # Join the calls' records into one table with `python -m bench.cells --arms seed4 --depths D --report a,b`
  [ "${T17A:-240}" != 0 ] && timeout ${T17A:-240} python3 scripts/gpu/tier_probe.py --preset seed-mtp --depth ${D17:-32768} --ring 32768 --max_context 139264 --requests ${R17:-lookup} --steps 32 \
    2>&1 | tr '\r' '\n' | grep --line-buffered -E "^stage|^  chunk|Error" | tee $OUT/tier.log
  [ "${T17B:-400}" != 0 ] && timeout ${T17B:-400} python3 -m bench.cells --preset seed-mtp --in_memory --kernels pallas --arms seed4 \
    --only ${ONLY17:-AN,BN} --depths ${D17:-32768} --expert_cache auto --max_new_tokens 256 --seeds ${SEEDS:-1} --max_context 139264 \
    --reuse_prefill --cells $OUT/seed4-deep.jsonl 2>&1 | filt | grep -vE "^(W|I)[0-9]" | tee $OUT/seed4-deep.log | tail -12 ;;
18) # issue 3: part (b) at B = 1 taken apart. A sweep against the default (split K of gate/up over KS programs, stages,
    # row tiles), then --profile: a trace of 10 part (b) steps per type, summarised per kernel with the idle gaps
  # then --check (compiled kernels against the reference) for Q4_K and Q5_K
  SW='[{},{"gateup":{"KS":2}},{"gateup":{"KS":4}},{"gateup":{"KS":8}},
      {"gateup":{"num_stages":3},"down":{"num_stages":3}},{"gateup":{"BN":8,"KS":2}},{"down":{"BN":32}},{}]'
  timeout ${T18:-420} python3 -m bench.kernels --out $OUT/kern18 --types ${TY18:-Q4_K,IQ3_S} --batches 1 --parts b --impls pallas \
    --sweep "$SW" --sweep_layers 48 --iters 10 --profile $OUT/trace18 2>&1 | filt | grep -E "^(sweep|copy|\||profile)"
  timeout ${T18C:-120} python3 -m bench.kernels --out $OUT/kern18 --check --types Q4_K,Q5_K --batches 1 --parts b \
    --impls pallas --layers 2 --iters 1 2>&1 | grep --line-buffered "^check"
  for t in $OUT/trace18/*; do f=$(find $t -name "perfetto_trace.json.gz" | head -1)
    [ -n "$f" ] && python3 scripts/gpu/trace_summary.py $f --steps 10 --top 12 --gaps 2 > $t.summary.txt 2>&1; rm -rf $t; done
  head -40 $OUT/trace18/*.summary.txt ;;
19) # issue 3: how much of the B = 1 step any kernel change could still win. Part (b) with its floor (the same
    # launches, grids and glue without weight bytes: bench.kernels._floor_fn) for separate per-layer weights (the
    # default, as the model) and then stacked ones, then a trace of the separate form
  timeout ${T19A:-300} python3 -m bench.kernels --out $OUT/kern19 --types ${TY19:-Q4_K,IQ3_S} --batches 1,4 --parts b \
    --impls pallas --iters 20 --profile $OUT/trace19 2>&1 | filt | tee $OUT/kern19.log \
    | grep -E "^(copy|\||profile|sweep)"
  timeout ${T19B:-120} python3 -m bench.kernels --out $OUT/kern19s --types ${TY19:-Q4_K,IQ3_S} --batches 1 --parts b \
    --impls pallas --iters 20 --layer_weights stacked 2>&1 | filt | tee $OUT/kern19s.log | grep -E "^(copy|\|)"
  for t in $OUT/trace19/*; do f=$(find $t -name "perfetto_trace.json.gz" | head -1)
    [ -n "$f" ] && python3 scripts/gpu/trace_summary.py $f --steps 20 --top 12 --gaps 2 > $t.summary.txt 2>&1; rm -rf $t; done
  head -30 $OUT/trace19/*.summary.txt ;;
14) # issue 7 (prefill): which tensor-core path could reach llama.cpp (scripts/gpu/gemm_paths.py: the shipped
    # register-dequantizing GEMM, a plain bf16 GEMM from memory, int8 MMAs on Q8_0 codes with per-block scales);
    # then the Q4_K 1K decode goal with 3 seeds (met by 1.2 % with 2 seeds at 4de51d2)
  timeout ${T14A:-200} python3 scripts/gpu/gemm_paths.py ${TL14:+--tiles "$TL14"} 2>&1 | tee $OUT/gemm_paths.log | grep -E "^(check|time|fail|shape)"
  [ "${T14B:-300}" != 0 ] && timeout ${T14B:-300} python3 -m bench.cells --preset qwen3moe-30b-a3b --in_memory --kernels pallas \
    --drafts none --depths 1024 --max_new_tokens 256 --seeds 3 --experts Q4_K --cells $OUT/e2e-q4k.jsonl 2>&1 | filt | tail -8 ;;
10) # issue 7 (the 1K goal): Q8_0 projection tiles at the 30B shapes, fused q/k/v (N 5,120, K 2,048) and o (N 2,048,
    # K 4,096); in the model they run at ~1 TB/s. bench.kernels's projection cells are unrolled since this commit
  SW='[{"proj":{"BN":16,"S":32}},{"proj":{"BN":8,"S":32}},{"proj":{"BN":32,"S":32}},{"proj":{"BN":16,"S":64}},
      {"proj":{"BN":16,"S":16}},{"proj":{"BN":8,"S":64,"num_warps":2}},{"proj":{"BN":16,"S":32,"num_warps":8}},
      {"proj":{"BN":16,"S":32,"num_stages":3}},{"proj":{"BN":8,"S":128}}]'
  for sh in 2048,768,128,8,5120 4096,768,128,8,2048; do
    timeout 240 python3 -m bench.kernels --out $OUT/proj --types Q8_0 --batches 1 --parts a --impls pallas --layers 2 \
      --sweep_layers 2 --shape $sh --sweep "$SW" --iters 20 2>&1 | filt | grep -E "^sweep|^copy|^\| Q8_0"
  done ;;
7)  # issue 7 (decode goal at 32K): decode-attention variants (MMA scheme, tile, warps, stages, splits) on the
    # 30B attention shape, int8 KV, T = 1 and T = 8; then the step with the current kernel, bf16x2 and the
    # fastest variant at 32K, interleaved in one process; then Q4_K experts (issue 7's second anchor)
  V=tf32x3:64:4:2,bf16x2:64:4:2,bf16x2:64:4:3,bf16x2:128:4:2,bf16x2:128:8:2,bf16x2:128:8:3,bf16x2:256:8:2,bf16x2:64:4:2:128,tf32x3:64:4:2:128
  timeout 100 python3 -m bench.attention --kv int8 --depths 1024,8192,32768,131072 --capacities 131072 \
    --impls= --variants $V 2>&1 | filt | tee $OUT/attn.log | grep -E "^\||GB/s" | grep -v "^I" 
  timeout 40 python3 -m bench.attention --kv int8 --T 8 --depths 1024,32768 --capacities 32768 \
    --impls= --variants tf32x3:64:4:2,bf16x2:64:4:2,bf16x2:128:8:2 2>&1 | filt | tee $OUT/attn8.log | grep "^|"
  best=$(python3 scripts/gpu/best_attn.py $OUT/attn.log 32768 bf16x2/64/4/2); echo "best at 32K: $best"
  A="tf32x3/64/4/2 bf16x2/64/4/2 $best"; C=""
  for d in 1024 32768; do for a in $A; do C="$C,$([ $d = 1024 ] && echo 4096 || echo 32768):$d:$a:pallas"; done; done
  timeout 250 $S30 --cells ${C#,} 2>&1 | filt | tail -9
  timeout 170 $S30 --experts Q4_K --cells 4096:1024:tf32x3/64/4/2:pallas,4096:1024:$best:pallas,32768:32768:$best:pallas \
    2>&1 | filt | tail -6 ;;
esac
