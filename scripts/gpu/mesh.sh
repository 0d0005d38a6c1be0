#!/usr/bin/env bash
# Issue 29 item 5 (expert parallel over the GPUs of one host), for a machine of two or more GPUs; not yet run (written
# on the CPU machine at ccd82f6, the mesh's exactness tested there on 2 and 4 CPU devices: tests/model/test_mesh.py).
# `PART=N bash scripts/gpu/mesh.sh`; carry .whl and .anchor (../shared/anchor) as hybrid_anchor.sh does. Each part fits
# one device call; parts 1 and 2 share the file /tmp/air-iq3s.gguf (the same machine, still warm).
#   1. glm45-air (IQ3_S experts, Q8_0 elsewhere) as one configs.synth file (~50 GB), llama.cpp on it on 1 GPU and
#      split over 2 (its default layer split over the visible GPUs), 1K depth.
#   2. moejax on the same file on 1 GPU and with --mesh ep=2 on 2: plain and MTP arms. Goals: ep=2 >= 1.3x the one
#      GPU's plain decode; ep=2 >= 1.5x llama.cpp's on 2 GPUs.
#   3. The glm45-355b-a32b shape (357B: its IQ3_S experts alone are 146 GB, over one H200) built in memory straight
#      onto the mesh (bench.cells --in_memory --mesh: each tensor placed as it is built), plain and MTP arms on 2 GPUs.
#      The same-file llama.cpp anchor needs the ~165 GB synthetic file: it fits the disk of nvidia-h200-x4 (235 GiB),
#      not of x2 (128 GiB); there run configs.synth --preset glm45-355b-a32b and part 1's llama lines with that file.
# Read beside each table: the plan's rows per device (records' stats.plan.devices) and the first (compiling) run.
set -o pipefail
source scripts/gpu/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
filt() { tr '\r' '\n' | grep --line-buffered -vE "it/s\]|tensor/s\]|arm/s\]|s/it\]|s/arm\]"; }
F=/tmp/air-iq3s.gguf
nvidia-smi -L | tee $OUT/gpus.txt
case "${PART:-1}" in
1)
  df -h /tmp | tail -1
  [ -f $F ] || /usr/bin/time -f "synth %e s" timeout ${TS:-300} python3 -m configs.synth --preset glm45-air \
    --experts IQ3_S --other Q8_0 --out $F 2>&1 | grep -v "writing\|random" | tail -3 | tee $OUT/synth.txt
  ls -la $F
  mkdir -p /tmp/llp && tar xJf .anchor/llama_cpp_cuda_sm90.tar.xz -C /tmp/llp
  CUBLAS=$(python3 -c "import glob,site,os;print([d for p in site.getsitepackages() for d in glob.glob(os.path.join(p,'nvidia','*','lib')) if glob.glob(os.path.join(d,'libcublas.so*'))][0])")
  for gpus in 0 0,1; do
    CUDA_VISIBLE_DEVICES=$gpus PYTHONPATH=/tmp/llp:$PYTHONPATH LD_LIBRARY_PATH=$CUBLAS:/tmp/llp/llama_cpp/lib:$LD_LIBRARY_PATH \
      timeout ${TL:-120} python3 .anchor/llama_bench.py $F --label "gpus=$gpus" --n-ctx 4096 --prompt 1024 --gen 256 \
      --reps 3 --quiet --json $OUT/llama.jsonl 2>&1 | tail -4 | tee -a $OUT/llama.txt
  done
  ;;
2)
  for mesh in "" "--mesh ep=2"; do
    timeout ${TO:-270} python3 -m bench.cells --gguf $F --kernels pallas $mesh --drafts none,mtp --depths 1024 \
      --rings 4096 --kv int8 --max_new_tokens 256 --seeds 3 --cells $OUT/air${mesh:+-ep2}.jsonl 2>&1 | filt \
      | tee $OUT/air${mesh:+-ep2}.log | grep -v "^$" | tail -6
  done
  ;;
3)
  timeout ${TO:-540} python3 -m bench.cells --preset glm45-355b-a32b --in_memory --experts IQ3_S --kernels pallas \
    --mesh ep=2 --drafts none,mtp --depths 1024 --rings 4096 --kv int8 --max_new_tokens 128 --seeds 2 \
    --cells $OUT/g355-ep2.jsonl 2>&1 | filt | tee $OUT/g355-ep2.log | grep -v "^$" | tail -6
  ;;
esac
