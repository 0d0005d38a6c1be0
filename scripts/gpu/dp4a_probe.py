"""Issue 27's first lever, as a probe: IQ3_S and Q4_K matvecs with x in 8 bits and integer dots (llama.cpp's MMVQ).

The shipped float tiles (ops/qmatmul_pallas) spend ~10 (IQ3_S) and ~6 (Q4_K) SASS instructions a value, about
twice what full bandwidth allows (PERF "Quantized kernels"). ops/dot8 rounds x to int8 per 32 values and sums
groups of four weights with dp4a; this probe runs its tiles as a plain matvec (one token, grid over row tiles)
beside the shipped qmatmul kernel, so the tiles' speed is measured without the MoE around them.

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
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

from ops import qmatmul_pallas as qp  # noqa: E402
from ops import dot8, quant, repack  # noqa: E402

I32, F32 = jnp.int32, jnp.float32
FLAGS = flags.FLAGS
flags.DEFINE_bool("check", False, "the probe against a float64 numpy matvec of the same quantized x")
flags.DEFINE_bool("time", False, "time the shipped kernel and the probe's tiles, interleaved (GPU)")
flags.DEFINE_string("types", "IQ3_S,Q4_K", "weight types, comma separated")
flags.DEFINE_string("shape", "16384,2048", "N,K of the timed matvec (16384 x 2048: 14.4 MB IQ3_S, 18.9 MB Q4_K)")
flags.DEFINE_string("tiles", "16:8:4,16:4:4,32:8:4,8:8:2", "probe tiles BN:S:num_warps, comma separated")
flags.DEFINE_integer("iters", 200, "timed calls per cell and repeat")


def _kernel(xw_ref, dx_ref, xs_ref, tab_ref, *refs, qtype, N, BN, S, nb, dot):
  *w_refs, o_ref = refs
  W = dict(zip(repack.plane_names(qtype), w_refs))
  rows = jnp.minimum(pl.program_id(0) * BN + jax.lax.iota(I32, BN), N - 1)

  def step(j, acc):
    at = lambda ref: (lambda *idx: ref[(0, pl.ds(j * S, S), *idx)])
    return acc + dot8.TILES[qtype](lambda name, *idx: W[name][(rows, pl.ds(j * S, S), *idx)], at(xw_ref),
                                   at(dx_ref), at(xs_ref), tab_ref, dot)

  o_ref[rows] = qp.block_loop(nb // S, 1, step, jnp.zeros((BN,), F32))


@functools.partial(jax.jit, static_argnames=("qtype", "BN", "S", "num_warps", "interpret"))
def dp4a_matvec(x, planes, *, qtype, BN=16, S=8, num_warps=4, interpret=False):
  """x [K] @ W[N, K]^T for W of `qtype` (IQ3_S or Q4_K) given as its repacked planes, the ops/dot8 tiles with the
  PTX dp4a (the int32 form in interpret mode): float32 [N]."""
  N, nb = planes[0].shape[:2]
  S = min(S, nb)
  kernel = functools.partial(_kernel, qtype=qtype, N=N, BN=BN, S=S, nb=nb, dot=dot8.dot_fn("dp4a", interpret))
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((N,), F32), grid=(pl.cdiv(N, BN),),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2), interpret=interpret,
      name=f"dp4a_{qtype.lower()}",
  )(*dot8.x8_input(x[None], qtype), qp.table(qtype), *planes)


def reference(x, data_u8, qtype, K):
  """float64: the dequantized W (gguf's layout, ops.quant) against x as the tiles round it."""
  xq = np.asarray(dot8.rounded_x(jnp.asarray(x)[None])[0], np.float64)
  w = np.asarray(quant.dequantize(jnp.asarray(data_u8), qtype, K), np.float64)
  return w @ xq


def _data(qtype, N, K, seed=0):
  data = quant.random_blocks(qtype, (N, K), np.random.default_rng(seed))
  return data, tuple(jnp.asarray(p) for p in repack.repack_np(data, qtype, K))


def main(_):
  interpret = jax.default_backend() == "cpu"
  types = FLAGS.types.split(",")
  if FLAGS.check:
    for qtype in types:
      for N, K, BN, S in ((40, 512, 16, 2), (64, 1024, 16, 4), (33, 2048, 8, 8)):
        data, planes = _data(qtype, N, K)
        x = np.random.default_rng(1).standard_normal(K).astype(np.float32)
        got = np.asarray(dp4a_matvec(jnp.asarray(x), planes, qtype=qtype, BN=BN, S=S, interpret=interpret), np.float64)
        want = reference(x, data, qtype, K)
        err = np.max(np.abs(got - want)) / np.max(np.abs(want))
        print(f"check {qtype} N {N} K {K} BN {BN} S {S} ({'interpret, emulated' if interpret else 'compiled, PTX'} "
              f"dp4a): max rel error {err:.2e} {'ok' if err < 1e-5 else 'FAIL'}")
  if FLAGS.time:
    from ops.qtensor import QTensor
    N, K = (int(v) for v in FLAGS.shape.split(","))
    x = jnp.asarray(np.random.default_rng(1).standard_normal(K).astype(np.float32))
    for qtype in types:
      data, planes = _data(qtype, N, K)
      wq = QTensor.from_planes(planes, qtype, K, kernel="pallas")
      cells = {"shipped": lambda x: qp.qmatmul_pallas(x[None], wq)[0]}
      for t in FLAGS.tiles.split(","):
        BN, S, nw = (int(v) for v in t.split(":"))
        cells[f"dp4a BN {BN} S {S} warps {nw}"] = functools.partial(dp4a_matvec, planes=planes, qtype=qtype, BN=BN,
                                                                      S=S, num_warps=nw)
      want = reference(np.asarray(x), data, qtype, K)
      loops = {}
      for name, f in cells.items():
        y = np.asarray(f(x), np.float64)
        print(f"value {qtype} {name}: max rel error against the rounded x {np.max(np.abs(y - want)) / np.max(np.abs(want)):.2e}")
        # c[0] * 0 ties each call to the last one, so XLA neither hoists nor overlaps them
        loops[name] = jax.jit(lambda x, f=f: jax.lax.fori_loop(0, FLAGS.iters, lambda i, c: c + f(x + c[0] * 0),
                                                                jnp.zeros((N,), F32)))
        loops[name](x).block_until_ready()
      nbytes = sum(int(p.nbytes) for p in planes)
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
