"""Shared by the GPU probes in this folder: a compiled call's median wall time and a relative L2 error."""
import time

import jax
import numpy as np


def median_ms(f, *a, iters: int = 20) -> float:
  """Median milliseconds of `iters` calls of f(*a), each waited for, after one untimed (compiling) call."""
  jax.block_until_ready(f(*a))
  ts = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(f(*a))
    ts.append(time.perf_counter() - t)
  return 1e3 * float(np.median(ts))


def rel_l2(y, r) -> float:
  """||y - r|| / ||r|| in float64."""
  y, r = np.asarray(y, np.float64), np.asarray(r, np.float64)
  return float(np.linalg.norm(y - r) / np.linalg.norm(r))
