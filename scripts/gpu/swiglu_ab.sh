# One gate|up matmul per SwiGLU (model.api.fuse_qkv: the shared expert's gateup_shexp): the decode step of the
# tree before (.before: `git archive 3cc7da9`, gate and up apart) and after, alternating, on the hybrid seed-mtp
# shape (48 shared experts: 48 launches fewer per step) and the 30B shape (no shared expert: the control).
source scripts/gpu/env.sh
set -o pipefail
C=4096:1024:auto:pallas
one() {  # $1 before|after, $2 preset
  if [ "$1" = before ]; then
    (cd .before && PYTHONPATH=/tmp/site:$PWD timeout ${TO:-120} python3 -m bench.step --preset $2 --cells $C --steps 64 \
      --repeats 3 --out $OUT/swiglu-$2-before.jsonl 2>&1 | grep -v "random params\|cells:" | tail -1)
  else
    timeout ${TO:-120} python3 -m bench.step --preset $2 --cells $C --steps 64 --repeats 3 --glue ${3:-on} \
      --out $OUT/swiglu-$2-after.jsonl 2>&1 | grep -v "random params\|cells:" | tail -${4:-1}
  fi
}
# the second "after" process also runs the projections' grid variants (ops.qmatmul_pallas.Tuning.programs) after
# its default cell: --glue on/qmm=P
for P in ${PRESETS:-seed-mtp}; do one before $P; one after $P; one before $P; one after $P ${QMM:-on} 8; done
python3 -c "
import json, glob
for f in sorted(glob.glob('$OUT/swiglu-*.jsonl')):
  for l in open(f): r=json.loads(l); print(f.split('/')[-1], r.get('glue'), round(r['ms_per_step'],4), [round(x,4) for x in r['all_ms']])
"
