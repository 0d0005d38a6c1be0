#!/usr/bin/env bash
# Decode step time against ring capacity (depth 1K) and against depth (ring 128K), qwen3moe-30b-a3b shape,
# IQ3_S experts, int8 KV; Pallas decode attention against the jnp reference at one capacity for the ratio.
set -o pipefail
source scripts/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m decode.bench_step --preset qwen3moe-30b-a3b --rings 4096,32768,49152,131072 --depths 1024 \
  --attn auto --steps 32 --repeats 3 --out $OUT/step_rings.jsonl 2>&1 | grep -v "it/s\]" | tee $OUT/step_rings.log
python3 -m decode.bench_step --preset qwen3moe-30b-a3b --rings 131072 --depths 1024,8192,32768,131072 \
  --attn auto,ref --steps 32 --repeats 3 --out $OUT/step_depths.jsonl 2>&1 | grep -v "it/s\]" | tee $OUT/step_depths.log
