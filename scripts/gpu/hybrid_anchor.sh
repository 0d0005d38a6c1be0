# Issue 25 item 8: qwen3next-80b-a3b (IQ3_S experts, Q8_0 elsewhere) as one configs.synth file, llama.cpp
# (../shared/anchor, carried in .anchor/) and moejax on that file in the same call: decode at 1K depth and prefill
# of the 1K prompt; 32K and 128K depth. Carry .whl and .anchor. Writes $OUT/{synth.txt,llama.jsonl,llama.txt,ours.jsonl,ours.txt}.
source scripts/gpu/env.sh
set -o pipefail
F=/tmp/q3n-iq3s.gguf
df -h /tmp | tail -1
[ -f $F ] || /usr/bin/time -f "synth %e s" timeout ${TS:-240} python3 -m configs.synth --preset qwen3next-80b-a3b --experts IQ3_S \
  --other Q8_0 --out $F 2>&1 | grep -v "writing\|random" | tail -3 | tee $OUT/synth.txt
ls -la $F
mkdir -p /tmp/llp && tar xJf .anchor/llama_cpp_cuda_sm90.tar.xz -C /tmp/llp
CUBLAS=$(python3 -c "import glob,site,os;print([d for p in site.getsitepackages() for d in glob.glob(os.path.join(p,'nvidia','*','lib')) if glob.glob(os.path.join(d,'libcublas.so*'))][0])")
PYTHONPATH=/tmp/llp:$PYTHONPATH LD_LIBRARY_PATH=$CUBLAS:/tmp/llp/llama_cpp/lib:$LD_LIBRARY_PATH \
  timeout ${TL:-200} python3 .anchor/llama_bench.py $F --n-ctx 36864 --prompt 1024 --gen 256 --reps 3 --depth 32768 \
  --quiet --json $OUT/llama.jsonl 2>&1 | tail -8 | tee $OUT/llama.txt
PYTHONPATH=/tmp/llp:$PYTHONPATH LD_LIBRARY_PATH=$CUBLAS:/tmp/llp/llama_cpp/lib:$LD_LIBRARY_PATH \
  timeout ${TL2:-200} python3 .anchor/llama_bench.py $F --n-ctx 135168 --gen 256 --reps 3 --depth 131072 --skip-short \
  --quiet --json $OUT/llama128k.jsonl 2>&1 | tail -4 | tee -a $OUT/llama.txt
timeout ${TO:-330} python3 -m bench.cells --gguf $F --kernels pallas --drafts none --depths ${DEPTHS:-1024,32768,131072} \
  --max_new_tokens 256 --seeds 3 --reuse_prefill --cells $OUT/ours.jsonl 2>&1 | grep -v "random params\|cells:\|^\s*$" | tail -12 | tee $OUT/ours.txt
