import os
import sys

# Tests import the project's top-level packages from the repo root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
  """Drop jax's compiled executables after each test module. Every XLA CPU executable keeps its JIT code in its
  own memory mappings; the whole suite compiles thousands (interpret-mode kernels above all) and, kept alive by
  the caches, they pass the kernel's vm.max_map_count (65,530 by default), after which LLVM's next mmap fails
  and XLA segfaults inside a compile."""
  yield
  import jax
  jax.clear_caches()
  gc.collect()
