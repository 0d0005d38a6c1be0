"""Which tensor-core path can make prefill GEMMs fast? One process, one dense Q8_0 projection (N 5,120 x K 2,048,
T = 1,024 rows: the 30B q/k/v shape), several kernel designs side by side (ratios within the run).

  - `cur`: ops.qgemm_pallas as shipped (dequantize a weight piece in registers, split w and x into bf16 hi/lo
    in the kernel, three bf16 MMAs per piece).
  - `bf16`: the ceiling of "dequantize once, then a plain GEMM": W pre-dequantized to bf16 in memory, x
    pre-split into bf16 hi/lo in memory, two MMAs per K step, operands straight from memory (Triton's
    pipelined load -> MMA path). Not an exact path (w rounded to bf16): a speed bound only.
  - `int8`: llama.cpp's MMQ idea. x quantized per 32 values to int8 with a float scale (outside the kernel),
    W's Q8_0 codes read as int8 straight from memory; per 32-value block one int8 MMA into int32, scaled by
    dx[m] * dw[n] into a float32 accumulator.
  - `int8raw`: the int8 MMAs alone over whole K steps, no per-block scaling (not a correct product: it
    bounds what the scaling costs).

Prints `check` lines (relative L2 against float64) and `time` lines (ms per call, median of --iters).

  python scripts/gpu/gemm_paths.py [--iters 20] [--tiles '128,128,8,3;128,64,4,3'] [--small]
"""
import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops import qgemm_pallas, quant
from ops.qtensor import QTensor
from timing import median_ms, rel_l2 as rel  # scripts/gpu/timing.py (the script's folder is on sys.path)

ap = argparse.ArgumentParser()
ap.add_argument("--iters", type=int, default=20)
ap.add_argument("--tiles", default="128,128,8,3;128,64,4,3;64,128,4,3;128,128,4,4",
                help="';'-separated M,BN,warps,stages for the bf16 and int8 kernels")
ap.add_argument("--variants", default="cur,bf16,int8,int8raw")
ap.add_argument("--small", action="store_true", help="CPU dry run: interpret mode, small shapes")
args = ap.parse_args()
INTERP = jax.default_backend() == "cpu"
T, N, K = (128, 256, 256) if args.small else (1024, 5120, 2048)
F32, BF16, I8, I32 = jnp.float32, jnp.bfloat16, jnp.int8, jnp.int32
DIMS_T = (((1,), (1,)), ((), ()))        # a [M, k] . b [BN, k]^T


def timeit(f, *a):
  return median_ms(f, *a, iters=args.iters)


def params(M, BN, warps, stages):
  return dict(compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages), interpret=INTERP)


# ---------------------------------------------------------------------------------------------- kernels


def _bf16_kernel(xh_ref, xl_ref, w_ref, o_ref, *, M, BN, BK):
  rm = pl.ds(pl.program_id(1) * M, M)
  rn = pl.ds(pl.program_id(0) * BN, BN)
  dot = functools.partial(jax.lax.dot_general, dimension_numbers=DIMS_T, preferred_element_type=F32)

  def step(k, acc):
    ks = pl.ds(pl.multiple_of(k * BK, BK), BK)
    w = w_ref[rn, ks]
    return acc + dot(xh_ref[rm, ks], w) + dot(xl_ref[rm, ks], w)

  o_ref[rm, rn] = jax.lax.fori_loop(0, K // BK, step, jnp.zeros((M, BN), F32))


def gemm_bf16(xh, xl, w, *, M, BN, warps, stages, BK=64):
  return pl.pallas_call(functools.partial(_bf16_kernel, M=M, BN=BN, BK=BK),
                        out_shape=jax.ShapeDtypeStruct((T, N), F32), grid=(N // BN, T // M),
                        **params(M, BN, warps, stages))(xh, xl, w)


def _int8_kernel(xq_ref, dx_ref, wq_ref, dw_ref, o_ref, *, M, BN, SB, raw):
  """xq [T, K] int8, dx [nb, T] f32, wq [N, K] int8, dw [nb, N] f32. SB 32-value blocks per loop step."""
  rm = pl.ds(pl.program_id(1) * M, M)
  rn = pl.ds(pl.program_id(0) * BN, BN)
  dot = functools.partial(jax.lax.dot_general, dimension_numbers=DIMS_T, preferred_element_type=I32)

  def step(k, acc):
    if raw:
      ks = pl.ds(pl.multiple_of(k * 32 * SB, 32 * SB), 32 * SB)
      return acc + dot(xq_ref[rm, ks], wq_ref[rn, ks])
    for s in range(SB):
      b = k * SB + s
      ks = pl.ds(pl.multiple_of(b * 32, 32), 32)
      p = dot(xq_ref[rm, ks], wq_ref[rn, ks]).astype(F32)
      acc = acc + p * (dx_ref[b, rm][:, None] * dw_ref[b, rn][None, :])
    return acc

  acc = jax.lax.fori_loop(0, K // 32 // SB, step, jnp.zeros((M, BN), I32 if raw else F32))
  o_ref[rm, rn] = acc.astype(F32)


def gemm_int8(xq, dx, wq, dw, *, M, BN, warps, stages, SB=2, raw=False):
  return pl.pallas_call(functools.partial(_int8_kernel, M=M, BN=BN, SB=SB, raw=raw),
                        out_shape=jax.ShapeDtypeStruct((T, N), F32), grid=(N // BN, T // M),
                        **params(M, BN, warps, stages))(xq, dx, wq, dw)


def quantize_x(x):
  """x [T, K] f32 -> (int8 codes [T, K], scales [nb, T]): per 32 values, d = absmax / 127, q = round(x / d)."""
  xb = x.reshape(T, K // 32, 32)
  d = jnp.max(jnp.abs(xb), axis=-1) / 127.0
  q = jnp.round(xb / jnp.where(d == 0, 1.0, d)[..., None]).astype(I8)
  return q.reshape(T, K), d.T




# ------------------------------------------------------------------------------------------------- run

rng = np.random.default_rng(0)
wt = QTensor.from_gguf(quant.random_blocks("Q8_0", (N, K), rng), "Q8_0", K).replace(
    kernel="interpret" if INTERP else "pallas")
d_np, qs_np = (np.asarray(p) for p in wt.planes)                          # [N, nb] f16, [N, nb, 8] u32
wq_np = qs_np.view(np.int8).reshape(N, K)                                 # codes in value order
dw_np = d_np.astype(np.float32)
x_np = rng.standard_normal((T, K)).astype(np.float32)
w64 = wq_np.astype(np.float64) * np.repeat(dw_np.astype(np.float64), 32, axis=1)
ref = x_np.astype(np.float64) @ w64.T
x = jnp.asarray(x_np)
wq, dw = jnp.asarray(wq_np), jnp.asarray(dw_np.T.copy())
w_bf16 = jnp.asarray(w64.astype(np.float32)).astype(BF16)
xq, dx = jax.jit(quantize_x)(x)
x_deq = np.asarray(xq, np.float64) * np.repeat(np.asarray(dx, np.float64).T, 32, axis=1)
ref_q = x_deq @ w64.T                                                     # the int8 path's exact product
print(f"shape T {T} N {N} K {K}; backend {jax.default_backend()}", flush=True)
tiles = [tuple(int(v) for v in t.split(",")) for t in args.tiles.split(";")]
if args.small:
  tiles = [(min(m, T), min(bn, N), w, s) for m, bn, w, s in tiles]
flop = 2 * T * N * K

for v in args.variants.split(","):
  if v == "cur":
    f = jax.jit(lambda x, w: qgemm_pallas.qgemm_pallas(x, w, interpret=INTERP))
    print(f"check cur: rel {rel(f(x, wt), ref):.2e}", flush=True)
    t = timeit(f, x, wt)
    print(f"time cur: {t:.3f} ms ({flop / t / 1e9:.0f} TFLOP/s)", flush=True)
    fq = jax.jit(lambda x: quantize_x(x))
    print(f"time quantize_x (XLA, per call): {timeit(fq, x):.3f} ms", flush=True)
    fs = jax.jit(qgemm_pallas.split_bf16_xla)
    print(f"time qgemm_pallas.split_bf16_xla (XLA, per call): {timeit(fs, x):.3f} ms", flush=True)
    continue
  for M, BN, warps, stages in tiles:
    tag = f"{v} M={M} BN={BN} w={warps} st={stages}"
    try:
      if v == "bf16":
        f = jax.jit(lambda x, w, M=M, BN=BN, wa=warps, st=stages:
                    gemm_bf16(*qgemm_pallas.split_bf16_xla(x), w, M=M, BN=BN, warps=wa, stages=st))
        a = (x, w_bf16)
      else:
        f = jax.jit(lambda x, wq, dw, M=M, BN=BN, wa=warps, st=stages, raw=(v == "int8raw"):
                    gemm_int8(*quantize_x(x), wq, dw, M=M, BN=BN, warps=wa, stages=st, raw=raw))
        a = (x, wq, dw)
      y = f(*a)
      if v == "int8":
        print(f"check {tag}: rel {rel(y, ref):.2e} (x quantized: {rel(y, ref_q):.2e})", flush=True)
      elif v == "bf16":
        print(f"check {tag}: rel {rel(y, ref):.2e}", flush=True)
      t = timeit(f, *a)
      print(f"time {tag}: {t:.3f} ms ({flop / t / 1e9:.0f} TFLOP/s)", flush=True)
    except Exception as e:  # noqa: BLE001  (a tile that does not compile is a finding, not the end of the run)
      print(f"fail {tag}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
