"""Shared by the GPU probes in this folder: a compiled call's median wall time (bench.kernels's timer) and a relative
L2 error."""
import numpy as np

from bench.kernels import median_seconds


def median_ms(f, *a, iters: int = 20) -> float:
  """Median milliseconds of `iters` calls of f(*a), each waited for, after the untimed (compiling) calls."""
  return 1e3 * median_seconds(f, *a, iters=iters)


def rel_l2(y, r) -> float:
  """||y - r|| / ||r|| in float64."""
  y, r = np.asarray(y, np.float64), np.asarray(r, np.float64)
  return float(np.linalg.norm(y - r) / np.linalg.norm(r))
