source scripts/gpu/env.sh
set -o pipefail
C=4096:1024:auto:pallas
ab() {  # $1: before|after, $2: round
  if [ "$1" = before ]; then
    (cd .before && PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m decode.bench_step --preset qwen3moe-30b-a3b --cells $C --steps 64 --repeats 5 --out $OUT/ab.jsonl 2>&1 | grep -v "random params\|cells:" | tail -3)
  else
    timeout 150 python3 -m bench.step --preset qwen3moe-30b-a3b --cells $C --steps 64 --repeats 5 --out $OUT/ab.jsonl 2>&1 | grep -v "random params\|cells:" | tail -3
  fi
}
ab before 1; ab after 1; ab before 2; ab after 2
timeout 120 python3 scripts/gpu/gated_delta_check.py 2>&1 | tee $OUT/gdn_check.txt
timeout 200 python3 -m bench.step --preset seed-mtp --cells 4096:1024:auto:pallas,32768:1024:auto:pallas --steps 64 --repeats 3 --out $OUT/hybrid_step.jsonl 2>&1 | grep -v "random params\|cells:" | tail -6
python3 -c "
import json
for l in open('$OUT/ab.jsonl'): r=json.loads(l); print(r.get('commit'), r['preset'], r['ring'], r['depth'], round(r['ms_per_step'],4), [round(x,4) for x in r['all_ms']])
for l in open('$OUT/hybrid_step.jsonl'): r=json.loads(l); print('hybrid', r['ring'], r['depth'], round(r['ms_per_step'],4), r['first_run_s'])
"
