# The projections' grid (ops.qmatmul_pallas.Tuning.programs): BN halves until a matmul has P programs. The trace of
# the hybrid step (PERF "The finite check's cost, and the hybrid step's two levers") reads its 4,096 -> 2,048 output
# projections at ~0.95 TB/s on 128 programs and the shared expert's 2,048 -> 512 gate and up on 32. One process per
# shape runs every variant cell by cell (default first and last: the order's drift).
source scripts/gpu/env.sh
set -o pipefail
V=${V:-on,on/qmm=256,on/qmm=512,on/qmm=1024,on}
for P in ${PRESETS:-seed-mtp qwen3moe-30b-a3b}; do
  timeout ${TO:-200} python3 -m bench.step --preset $P --cells 4096:1024:auto:pallas --glue $V --steps 64 --repeats 3 \
    --out $OUT/qmm-$P.jsonl 2>&1 | grep -v "random params\|cells:" | tail -8
done
python3 -c "
import json, glob
for f in sorted(glob.glob('$OUT/qmm-*.jsonl')):
  for l in open(f): r=json.loads(l); print(f.split('/')[-1], r.get('glue'), round(r['ms_per_step'],4), [round(x,4) for x in r['all_ms']])
"
