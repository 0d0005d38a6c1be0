"""Issue 27's first lever, as a probe: matvecs with x in 8 bits and integer dots (llama.cpp's MMVQ form).

The float tiles (ops/qmatmul_pallas) spend ~10 (IQ3_S), ~6 (Q4_K) and ~4 (Q8_0) SASS instructions a value, about
twice what full bandwidth allows for the first two (PERF "Quantized kernels"). ops/dot8 rounds x to int8 per 32
values and sums groups of four weights with dp4a (`Tuning.x8`); this probe runs the projection kernel with and
without it on one token, so the tiles' speed is measured without the model around them.

  python scripts/gpu/dp4a_probe.py --check          # CPU: interpret mode (int32 dp4a) against float64 numpy
  python scripts/gpu/dp4a_probe.py --check --time   # GPU: compiled check (PTX dp4a), then the shipped kernel
                                                    # against the probe's tiles, interleaved
Static SASS counts without a GPU: `scripts/kernel_sass.py dump DIR --cases dp4a`, then its `compile`.
A dev tool, not run by the tests; numbers go to docs/PERF.md.
"""
from __future__ import annotations

import functools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from ops import dot8, quant  # noqa: E402
from ops import qmatmul_pallas as qp  # noqa: E402
from ops.qtensor import QTensor  # noqa: E402

F32 = jnp.float32
FLAGS = flags.FLAGS
flags.DEFINE_bool("check", False, "the probe against a float64 numpy matvec of the same quantized x")
flags.DEFINE_bool("time", False, "time the shipped kernel and the probe's tiles, interleaved (GPU)")
flags.DEFINE_string("types", "Q8_0,IQ3_S,Q4_K", "weight types, comma separated")
flags.DEFINE_string("shape", "16384,2048", "N,K of the timed matvec (16384 x 2048: 14.4 MB IQ3_S, 18.9 MB Q4_K)")
flags.DEFINE_string("tiles", "16:8:4,32:8:4,8:8:2", "more x8 tiles BN:S:num_warps, comma separated")
flags.DEFINE_integer("iters", 200, "timed calls per cell and repeat")


def matvec(x, w, tile: str | None = None, x8: str | None = "dp4a", interpret: bool = False):
  """x [K] @ W^T through qmatmul_pallas with the tile BN:S:num_warps (None: the table's) and Tuning.x8."""
  fields = {} if tile is None else dict(zip(("BN", "S", "num_warps"), map(int, tile.split(":"))))
  return qp.qmatmul_pallas(x[None], w, tuning=qp.Tuning(**fields, x8=x8), interpret=interpret)[0]


def reference(x, data_u8, qtype, K):
  """float64: the dequantized W (gguf's layout, ops.quant) against x as the tiles round it."""
  xq = np.asarray(dot8.rounded_x(jnp.asarray(x)[None])[0], np.float64)
  w = np.asarray(quant.dequantize(jnp.asarray(data_u8), qtype, K), np.float64)
  return w @ xq


def _data(qtype, N, K, seed=0):
  data = quant.random_blocks(qtype, (N, K), np.random.default_rng(seed))
  return data, QTensor.from_gguf(data, qtype, K)


def main(_):
  interpret = jax.default_backend() == "cpu"
  types = FLAGS.types.split(",")
  if FLAGS.check:
    for qtype in types:
      for N, K, BN, S in ((40, 512, 16, 2), (64, 1024, 16, 4), (33, 2048, 8, 8)):
        data, w = _data(qtype, N, K)
        x = np.random.default_rng(1).standard_normal(K).astype(np.float32)
        got = np.asarray(matvec(jnp.asarray(x), w, f"{BN}:{S}:4", interpret=interpret), np.float64)
        want = reference(x, data, qtype, K)
        err = np.max(np.abs(got - want)) / np.max(np.abs(want))
        print(f"check {qtype} N {N} K {K} BN {BN} S {S} ({'interpret, emulated' if interpret else 'compiled, PTX'} "
              f"dp4a): max rel error {err:.2e} {'ok' if err < 1e-5 else 'FAIL'}")
  if FLAGS.time:
    N, K = (int(v) for v in FLAGS.shape.split(","))
    x = jnp.asarray(np.random.default_rng(1).standard_normal(K).astype(np.float32))
    for qtype in types:
      data, w = _data(qtype, N, K)
      cells = {"shipped": functools.partial(matvec, w=w, x8=None, interpret=interpret),
               "x8, the table's tile": functools.partial(matvec, w=w, interpret=interpret)}
      for t in FLAGS.tiles.split(","):
        cells[f"x8, tile {t}"] = functools.partial(matvec, w=w, tile=t, interpret=interpret)
      want = reference(np.asarray(x), data, qtype, K)
      loops = {}
      for name, f in cells.items():
        y = np.asarray(f(x), np.float64)
        err = np.max(np.abs(y - want)) / np.max(np.abs(want))
        print(f"value {qtype} {name}: max rel error against the rounded x {err:.2e}")
        # c[0] * 0 ties each call to the last one, so XLA neither hoists nor overlaps them
        loops[name] = jax.jit(lambda x, f=f: jax.lax.fori_loop(0, FLAGS.iters, lambda i, c: c + f(x + c[0] * 0),
                                                                jnp.zeros((N,), F32)))
        loops[name](x).block_until_ready()
      nbytes = w.nbytes
      times = {n: [] for n in loops}
      for _ in range(5):                              # interleaved repeats
        for name, f in loops.items():
          t0 = time.perf_counter()
          f(x).block_until_ready()
          times[name].append((time.perf_counter() - t0) / FLAGS.iters)
      for name, ts in times.items():
        us = 1e6 * float(np.median(ts))
        print(f"time {qtype} {name}: {us:.2f} us a call ({nbytes / us / 1e3:.0f} GB/s of {nbytes / 1e6:.1f} MB), "
              f"repeats {', '.join(f'{1e6 * t:.2f}' for t in ts)}")


if __name__ == "__main__":
  app.run(main)
