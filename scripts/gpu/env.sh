# Source at the start of every device run: the GPU machine lacks the gguf package (carried as a wheel in .whl/).
[ "$(ls -d /tmp/site/*.dist-info 2>/dev/null | wc -l)" -ge "$(ls .whl/*.whl | wc -l)" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
export XLA_PYTHON_CLIENT_PREALLOCATE=false
[ -n "$MOEJAX_ENV_QUIET" ] || nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
[ -n "$MOEJAX_ENV_QUIET" ] || python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"
