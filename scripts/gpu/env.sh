# Source at the start of every device run: the GPU machine lacks the gguf package (carried as a wheel in .whl/).
[ "$(ls -d /tmp/site/*.dist-info 2>/dev/null | wc -l)" -ge "$(ls .whl/*.whl | wc -l)" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
export XLA_PYTHON_CLIENT_PREALLOCATE=false
[ -n "$MOEJAX_ENV_QUIET" ] || nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
[ -n "$MOEJAX_ENV_QUIET" ] || python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"
# Compiled programs kept across the device calls on one warm machine (the device keeps ignored build outputs between
# calls; a machine is given back after 30 s idle): jax's persistent cache in .jaxcache (ignored by git). At 128K the
# seed4 compiling runs took 431 s cold and 246 s on the second call of the same ring (PERF "The seed's experiment at
# 128K"). It cannot travel further: 77 MiB for one ring compresses to 70 MiB, past the carry's 64 MiB. A script ends
# with `report_jaxcache` (below), which reports its size.
mkdir -p .jaxcache
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
report_jaxcache() {
  echo "jax cache: $(du -sm .jaxcache | cut -f1) MiB in $(ls .jaxcache | wc -l) entries"
}
