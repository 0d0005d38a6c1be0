#!/usr/bin/env bash
# Two parts of next_session.sh at once on a two-GPU machine (kind nvidia-h200-x2), one process per GPU, so
# one device call does two parts' work. Usage: `bash scripts/gpu/pair.sh 4 5` (part on GPU 0, part on GPU 1);
# `bash scripts/gpu/pair.sh 7 3+8` runs parts 3 then 8 on GPU 1 (give them T3=/T8= timeouts that fit together);
# `pair.sh 3@AR,BR 3@AN,BN` runs part 3 on both GPUs with different arms (ONLY; into $OUT/p3-ARBR/, p3-ANBN/).
# Each part's output goes to $OUT/pN/ (its JSONL) and $OUT/pN.log. Timings compare arms within one part only.
source scripts/gpu/env.sh
export MOEJAX_ENV_QUIET=1 MOEJAX_COMMIT=${MOEJAX_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}
OUT=${OUT:-/tmp/out}
pids=()
for i in 0 1; do
  part=${@:$((i+1)):1}; [ -z "$part" ] && continue
  ( for q in ${part//+/ }; do
      p=${q%%@*}; only=; [ "$q" != "$p" ] && only=${q#*@}          # 3@AR,BR: part 3 with ONLY=AR,BR
      d=p$p${only:+-${only//,/}}                                     # p3-ARBR
      mkdir -p $OUT/$d
      CUDA_VISIBLE_DEVICES=$i OUT=$OUT/$d PART=$p ONLY=${only:-$ONLY} bash scripts/gpu/next_session.sh \
        > $OUT/$d.log 2>&1
    done ) &
  pids+=($!)
done
wait "${pids[@]}"
for f in $OUT/p*.log; do echo "=== $f"; tail -25 $f; done
