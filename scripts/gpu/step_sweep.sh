#!/usr/bin/env bash
# Decode step time against ring capacity (depth 1K) and against depth (ring 128K), qwen3moe-30b-a3b shape,
# IQ3_S experts, int8 KV; Pallas decode attention against the jnp reference at one cell for the ratio.
set -o pipefail
source scripts/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m bench.step --preset qwen3moe-30b-a3b --steps 32 --repeats 3 --out $OUT/step.jsonl \
  --cells ${CELLS:-4096:1024,49152:1024,131072:1024,131072:32768,131072:131072,131072:1024:ref} \
  2>&1 | grep --line-buffered -v "it/s\]" | tee $OUT/step.log
