# Issue 28's finite check on the logits: the plain decode step before (.before: a tree without it, e.g.
# `git archive ed104d7 | tar -x -C .before`) and after, alternating, on the 30B shape (the other changes since
# ed104d7 do not touch that shape); then a perfetto trace of the hybrid seed-mtp decode step (issue 25 item 8: where
# the time goes), summarised per kernel. HYBRID_AB=1 also runs the seed-mtp step in both trees (since ed104d7:
# rope_write over the 192-column tail, the DeltaNet input projections fused into one matmul).
source scripts/gpu/env.sh
set -o pipefail
C=4096:1024:auto:pallas
ab() {  # $1: before|after
  if [ "$1" = before ]; then
    (cd .before && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m bench.step --preset qwen3moe-30b-a3b --cells $C \
      --steps 64 --repeats 5 --out $OUT/ab-before.jsonl 2>&1 | grep -v "random params\|cells:" | tail -2)
  else
    timeout 150 python3 -m bench.step --preset qwen3moe-30b-a3b --cells $C --steps 64 --repeats 5 \
      --out $OUT/ab-after.jsonl 2>&1 | grep -v "random params\|cells:" | tail -2
  fi
}
[ -n "$SKIP_AB" ] || { ab before; ab after; ab before; ab after; }
if [ -n "$HYBRID_AB" ]; then
  (cd .before && PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m bench.step --preset seed-mtp --cells $C --steps 64 \
    --repeats 3 --out $OUT/hyb-before.jsonl 2>&1 | grep -v "random params\|cells:" | tail -2)
  timeout 200 python3 -m bench.step --preset seed-mtp --cells $C --steps 64 --repeats 3 --out $OUT/hyb-after.jsonl \
    2>&1 | grep -v "random params\|cells:" | tail -2
fi
timeout 240 python3 -m bench.step --preset seed-mtp --cells $C --steps 32 --repeats 2 --profile /tmp/prof \
  --out $OUT/hybrid_step.jsonl 2>&1 | grep -v "random params\|cells:" | tail -3
T=$(find /tmp/prof -name "*.trace.json.gz" -o -name "perfetto_trace.json.gz" | head -1)
[ -n "$T" ] && python3 scripts/gpu/trace_summary.py "$T" --steps 32 --top 45 --gaps 20 2>&1 | tee $OUT/trace.txt | head -80
python3 -c "
import json, glob
for f in sorted(glob.glob('$OUT/*.jsonl')):
  for l in open(f): r=json.loads(l); print(f.split('/')[-1], r.get('commit'), r['preset'], round(r['ms_per_step'],4), [round(x,4) for x in r['all_ms']])
"
