"""Issue 27's first lever, as a probe: IQ3_S and Q4_K matvecs with x in 8 bits and integer dots (llama.cpp's MMVQ).

The shipped IQ3_S tile (ops/qmatmul_pallas._tile_iq3_s) makes a float32 value of every weight and FMAs it with x:
~8 SASS instructions a value plus a gathered grid load per 4 (PERF "Quantized kernels"), about twice what full
bandwidth allows. Here x is quantized per 32 values (one IQ3_S sub-block) to int8 with a float scale, four values
packed in an int32 word in the grid word's byte order, and each group of 4 weights is one signed-byte word:

  magnitudes  gw = grid[idx]                     (the shipped gather: 4 bytes, 1..15)
  sign bytes  t = ((s4 * 0x00204081) & 0x01010101), s4 the group's 4 sign bits: 0x01 in each negative byte
  signed      v = (gw ^ (t * 0xFF)) + t          (two's complement per byte; no carry, every magnitude >= 1)
  dot         acc = dp4a(v, xw, acc)             (dp4a.s32.s32 inline PTX on CUDA; `emulated` elsewhere)

and one float multiply per 32 values and token: d * (1 + 2 scale) * dx * acc. The result differs from the float
kernel by x's rounding (|x| / 254 per value at most), as llama.cpp's does.

  python scripts/gpu/dp4a_probe.py --check            # CPU: interpret mode (emulated dp4a) vs float64 numpy
  python scripts/gpu/dp4a_probe.py --check --time     # GPU: compiled check (inline dp4a), then the shipped
                                                           # kernel against the probe, interleaved
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
from ops import quant, repack  # noqa: E402

U32, I32, F32 = jnp.uint32, jnp.int32, jnp.float32
FLAGS = flags.FLAGS
flags.DEFINE_bool("check", False, "the probe against a float64 numpy matvec of the same quantized x")
flags.DEFINE_bool("time", False, "time the shipped IQ3_S kernel and the probe, interleaved (GPU)")
flags.DEFINE_string("types", "IQ3_S,Q4_K", "weight types, comma separated")
flags.DEFINE_string("shape", "16384,2048", "N,K of the timed matvec (16384 x 2048: 14.4 MB IQ3_S, 18.9 MB Q4_K)")
flags.DEFINE_string("tiles", "16:8:4,16:4:4,32:8:4,8:8:2", "probe tiles BN:S:num_warps, comma separated")
flags.DEFINE_integer("iters", 200, "timed calls per cell and repeat")


def quantize_x(x):
  """x [K] float -> (words int32 [K/4]: byte m of word k = round(x[4k+m] / dx), dx float32 [K/32]): per 32 values
  dx = max|x| / 127 (1 where the block is 0)."""
  xb = x.astype(F32).reshape(-1, 32)
  dx = jnp.max(jnp.abs(xb), axis=1) / 127.0
  dx = jnp.where(dx > 0, dx, 1.0)
  q = jnp.clip(jnp.round(xb / dx[:, None]), -127, 127).astype(jnp.int8).reshape(-1, 4)
  w = jax.lax.bitcast_convert_type(q, I32)                              # [K/4]: little-endian, byte m = value 4k+m
  return w, dx


def emulated(a, b, c):
  """dp4a.s32.s32 in int32 ops: c + sum_m sext(byte m of a) * sext(byte m of b)."""
  for m in range(4):
    c = c + ((a << (24 - 8 * m)) >> 24) * ((b << (24 - 8 * m)) >> 24)
  return c


def inline(a, b, c):
  return plgpu.elementwise_inline_asm("dp4a.s32.s32 $0, $1, $2, $3;", args=[a, b, c], constraints="=r,r,r,r",
                                      pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, I32)])[0]


def _iq3_s_kernel(xw_ref, dx_ref, xs_ref, tab_ref, d_ref, qs_ref, qh_ref, sg_ref, sc_ref, o_ref, *, N, BN, S, nb,
                  dot):
  rows = jnp.minimum(pl.program_id(0) * BN + jax.lax.iota(I32, BN), N - 1)
  gather, _ = qp.iq3s_grid(tab_ref)
  io = lambda shape, dim: jax.lax.broadcasted_iota(U32, shape, dim)
  pp, w2 = io((1, 1, 2, 4, 1), 3), io((1, 1, 1, 1, 2), 4)
  a_ = io((1, 1, 2, 4), 2)

  def step(j, acc):
    b0 = j * S
    blk = (rows, pl.ds(b0, S))
    d = d_ref[blk].astype(F32)[:, :, None, None]                        # [BN, S, 1, 1]
    qs = qs_ref[(*blk, slice(None), slice(None), slice(None))]          # [BN, S, 2, 4, 2]
    qh = qh_ref[(*blk, slice(None))][:, :, :, None, None]               # [BN, S, 2, 1, 1]
    sg = sg_ref[(*blk, slice(None), slice(None))][:, :, :, :, None]     # [BN, S, 2, 4, 1]
    sc = sc_ref[blk][:, :, None, None]                                  # [BN, S, 1, 1]
    pp4 = io((1, 1, 2, 4), 3)
    db = d * (1 + 2 * ((sc >> (4 * (4 * a_ + pp4))) & 15)).astype(I32).astype(F32)   # [BN, S, 2, 4]
    dx = dx_ref[pl.ds(b0, S), slice(None), slice(None)]                 # [S, 2, 4]
    isum = None
    for cb in range(4):
      idx = ((qs >> (8 * cb)) & 255) | (((qh >> (8 * pp + 4 * w2 + cb)) & 1) << 8)
      gw = gather(idx)                                                  # [BN, S, 2, 4, 2] magnitudes
      t = (((sg >> (16 * w2 + 4 * cb)) & 15) * 0x00204081) & 0x01010101
      v = jax.lax.bitcast_convert_type((gw ^ (t * 0xFF)) + t, I32)
      xv = xw_ref[pl.ds(b0, S), slice(None), slice(None), slice(None), cb]   # [S, 2, 4, 2]
      isum = dot(v, jnp.broadcast_to(xv[None], v.shape), jnp.zeros(v.shape, I32) if isum is None else isum)
    s = jnp.sum(isum, axis=4).astype(F32)                               # [BN, S, 2, 4]: one sub-block of 32
    part = jnp.sum(jnp.sum(jnp.sum(db * dx[None] * s, axis=3), axis=2), axis=1)
    return acc + part

  acc = jax.lax.fori_loop(0, nb // S, step, jnp.zeros((BN,), F32)) if nb // S > 1 else step(0, jnp.zeros((BN,), F32))
  o_ref[rows] = acc


def _q4_k_kernel(xw_ref, dx_ref, xs_ref, tab_ref, hdr_ref, qs_ref, o_ref, *, N, BN, S, nb, dot):
  """Q4_K: word j of qs (i) holds nibble h of values 64i + 32h + 4j + c in byte c, so (word >> 4h) & 0x0F0F0F0F is
  4 unsigned bytes, a dp4a operand as it stands; sub-block k = 2i + h adds d sc_k dx_k isum - dmin mn_k xsum_k
  (xsum_k: the sub-block's rounded x summed, times dx)."""
  rows = jnp.minimum(pl.program_id(0) * BN + jax.lax.iota(I32, BN), N - 1)

  def step(j, acc):
    b0 = j * S
    blk = (rows, pl.ds(b0, S))
    h = [hdr_ref[(*blk, k)] for k in range(4)]                          # [BN, S] each
    d, dmin = qp._f16lo(h[0]), qp._f16hi(h[0])
    t = m = None                    # word-shaped [BN, S, 8] and [BN, S], reduced once a step (no cross-thread sums
    for i in range(4):              # per sub-block)
      q = qs_ref[(*blk, i, slice(None))]                                # [BN, S, 8]
      for hh in range(2):
        w = jax.lax.bitcast_convert_type((q >> (4 * hh)) & 0x0F0F0F0F, I32)
        xv = xw_ref[pl.ds(b0, S), i, hh, slice(None)]                   # [S, 8]
        isum = dot(w, jnp.broadcast_to(xv[None], w.shape), jnp.zeros(w.shape, I32))   # [BN, S, 8]
        sc, mn = qp._k_scale_min(h[1], h[2], h[3], 2 * i + hh)
        dx, xs = dx_ref[pl.ds(b0, S), i, hh], xs_ref[pl.ds(b0, S), i, hh]   # [S]
        ti = (d * sc * dx[None])[:, :, None] * isum.astype(F32)
        mi = dmin * mn * xs[None]
        t, m = (ti, mi) if t is None else (t + ti, m + mi)
    return acc + jnp.sum(jnp.sum(t, axis=2) - m, axis=1)

  acc = jax.lax.fori_loop(0, nb // S, step, jnp.zeros((BN,), F32)) if nb // S > 1 else step(0, jnp.zeros((BN,), F32))
  o_ref[rows] = acc


# qtype -> (kernel, x words view per block, dx / xsum view per block): a word holds values 4w..4w+3 of its block
KERNELS = {"IQ3_S": (_iq3_s_kernel, (2, 4, 2, 4), (2, 4)), "Q4_K": (_q4_k_kernel, (4, 2, 8), (4, 2))}


@functools.partial(jax.jit, static_argnames=("qtype", "BN", "S", "num_warps", "interpret"))
def dp4a_matvec(x, planes, *, qtype, BN=16, S=8, num_warps=4, interpret=False):
  """x [K] @ W[N, K]^T for W of `qtype` (IQ3_S or Q4_K) given as its repacked planes: float32 [N]."""
  kernel, wview, sview = KERNELS[qtype]
  N, nb = planes[0].shape[:2]
  S = min(S, nb)
  xw, dx = quantize_x(x)
  xq = jax.lax.bitcast_convert_type(xw, jnp.int8).reshape(-1, 32).astype(I32)
  xs = dx * jnp.sum(xq, axis=1).astype(F32)                             # sum of each 32 rounded values
  kernel = functools.partial(kernel, N=N, BN=BN, S=S, nb=nb, dot=emulated if interpret else inline)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((N,), F32), grid=(pl.cdiv(N, BN),),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2), interpret=interpret,
      name=f"dp4a_{qtype.lower()}",
  )(xw.reshape(nb, *wview), dx.reshape(nb, *sview), xs.reshape(nb, *sview), qp.table(qtype), *planes)


def reference(x, data_u8, qtype, K):
  """float64: the dequantized W (gguf's layout, ops.quant) against x after the probe's own rounding."""
  xw, dx = quantize_x(jnp.asarray(x))
  xq = np.asarray(jax.lax.bitcast_convert_type(xw, jnp.int8)).reshape(-1, 32).astype(np.float64)
  xq = (xq * np.asarray(dx, np.float64)[:, None]).reshape(-1)
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
