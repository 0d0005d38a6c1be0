# Issue 25 item 8: qwen3next-80b-a3b (IQ3_S experts, Q8_0 elsewhere) as one configs.synth file, llama.cpp
# (../shared/anchor, carried in .anchor/) and moejax on that file in the same call. Carry .whl and .anchor.
#   PART=short (default): llama.cpp's 1K prompt (prefill + decode) and 32K depth; ours at 1K on the auto ring and
#                         a 4,096-slot one, and at 32K, each seed prefilling its own prompt (prefill tok/s clean).
#   PART=deep:            llama.cpp and ours at 128K depth (ours reuses the compiling run's prefill).
# Writes $OUT/{synth.txt,llama-$PART.jsonl,llama-$PART.txt,ours-$PART*.jsonl,ours-$PART.txt}.
# Other shapes and our variants (issue 27): PRESET=qwen3moe-30b-a3b EXPERTS=Q4_K (the file), GLUES="on on/x8=dp4a"
# (bench.cells --glue, one run of ours per value, 1K only with PART=short1k):
#   PRESET=qwen3moe-30b-a3b GLUES="on on/x8=dp4a" PART=short1k bash scripts/gpu/hybrid_anchor.sh
source scripts/gpu/env.sh
set -o pipefail
PRESET=${PRESET:-qwen3next-80b-a3b}; EXPERTS=${EXPERTS:-IQ3_S}; GLUES=${GLUES:-on}
F=/tmp/$PRESET-$EXPERTS.gguf
PART=${PART:-short}
df -h /tmp | tail -1
[ -f $F ] || /usr/bin/time -f "synth %e s" timeout ${TS:-240} python3 -m configs.synth --preset $PRESET --experts $EXPERTS \
  --other Q8_0 --out $F 2>&1 | grep -v "writing\|random" | tail -3 | tee $OUT/synth.txt
ls -la $F
mkdir -p /tmp/llp && tar xJf .anchor/llama_cpp_cuda_sm90.tar.xz -C /tmp/llp
CUBLAS=$(python3 -c "import glob,site,os;print([d for p in site.getsitepackages() for d in glob.glob(os.path.join(p,'nvidia','*','lib')) if glob.glob(os.path.join(d,'libcublas.so*'))][0])")
llama() { PYTHONPATH=/tmp/llp:$PYTHONPATH LD_LIBRARY_PATH=$CUBLAS:/tmp/llp/llama_cpp/lib:$LD_LIBRARY_PATH \
  timeout ${TL:-200} python3 .anchor/llama_bench.py $F --gen 256 --reps 3 --quiet --json $OUT/llama-$PART.jsonl "$@" 2>&1 \
  | tail -8 | tee -a $OUT/llama-$PART.txt; }
ours() { for g in $GLUES; do
  timeout ${TO:-330} python3 -m bench.cells --gguf $F --kernels pallas --drafts none --max_new_tokens 256 --seeds 3 --glue $g "$@" \
  2>&1 | grep -v "random params\|cells:\|^\s*$" | tail -12 | tee -a $OUT/ours-$PART.txt; done; }
if [ "$PART" = short1k ]; then
  llama --n-ctx 4096 --prompt 1024
  ours --depths 1024 --rings 4096 --cells $OUT/ours-short1k.jsonl
elif [ "$PART" = short ]; then
  llama --n-ctx 36864 --prompt 1024 --depth 32768
  ours --depths 1024 --rings auto,4096 --cells $OUT/ours-short-1k.jsonl
  ours --depths 32768 --cells $OUT/ours-short-32k.jsonl
else
  llama --n-ctx 135168 --depth 131072 --skip-short
  ours --depths 131072 --reuse_prefill --cells $OUT/ours-deep.jsonl
fi
