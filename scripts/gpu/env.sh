# Source at the start of every device run: the GPU machine lacks the gguf package (carried as a wheel in .whl/).
[ "$(ls -d /tmp/site/*.dist-info 2>/dev/null | wc -l)" -ge "$(ls .whl/*.whl | wc -l)" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
export XLA_PYTHON_CLIENT_PREALLOCATE=false
[ -n "$MOEJAX_ENV_QUIET" ] || nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
[ -n "$MOEJAX_ENV_QUIET" ] || python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"
# Compiled programs kept across the device calls of a session (each call's machine starts bare; the seed4 cells at
# depth spent 300-400 s a call compiling): jax's persistent cache in .jaxcache (ignored by git). A script ends with
# `pack_jaxcache` (below): the compressed cache comes back as $OUT/jaxcache.tgz.00, .01, .. (15 MiB pieces: a
# returned file holds at most 16 MiB) when it is under 28 MiB, the room the carry (64 MiB) leaves beside the
# tracked tree. Join the pieces here as .jaxcache.tgz (ignored: `cat jaxcache.tgz.* > .jaxcache.tgz`) and name it
# in the next call's carry: it is unpacked here first.
mkdir -p .jaxcache
if [ -f .jaxcache.tgz ]; then tar xzf .jaxcache.tgz; fi
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
pack_jaxcache() {
  local mb; mb=$(du -sm .jaxcache | cut -f1)
  tar czf /tmp/jaxcache.tgz .jaxcache
  local gz; gz=$(( $(stat -c %s /tmp/jaxcache.tgz) / 1048576 ))
  [ "$gz" -lt 28 ] && split -b 15M -d /tmp/jaxcache.tgz $OUT/jaxcache.tgz.
  echo "jax cache: ${mb} MiB in $(ls .jaxcache | wc -l) entries, ${gz} MiB compressed$([ "$gz" -lt 28 ] || echo ', too big to return')"
}
