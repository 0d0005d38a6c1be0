#!/usr/bin/env bash
# Quantized-kernel benchmark on the GPU (issue 3): compile probe, GPU correctness check, B = 1 tile sweep, then
# parts a and b for the main types. Everything lands in $OUT/kern/results.jsonl (one line per cell).
set -o pipefail
source scripts/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/kern
SWEEP=${SWEEP:-'[{}, {"gateup": {"BN": 8}, "down": {"BN": 32}}, {"gateup": {"BN": 16, "S": 4, "num_warps": 8}, "down": {"BN": 32, "num_warps": 8}}, {"gateup": {"BN": 32, "S": 1}, "down": {"BN": 64}}, {"gateup": {"BN": 16, "S": 1, "num_warps": 2}, "down": {"BN": 16, "num_warps": 2}}, {"gateup": {"BN": 8, "S": 4, "num_stages": 3}, "down": {"BN": 16, "num_stages": 3}}]'}
python3 -m bench.kernels --out $OUT/kern --compile_probe --check --types ${TYPES:-IQ3_S,Q4_K} --batches ${BATCHES:-1,4,16} \
  --impls ${IMPLS:-pallas,xla} --parts ${PARTS:-b,a} --iters ${ITERS:-10} --sweep "$SWEEP" --sweep_layers 48 \
  2>&1 | grep --line-buffered -v "it/s\]" | tee $OUT/kern/log
