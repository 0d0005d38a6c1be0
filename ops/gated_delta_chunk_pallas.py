"""The gated delta rule over a prefill chunk: two Pallas kernels (Triton lowering) of the chunked (WY / UT-transform)
form, beside its jnp reference ops/gated_delta.py::gated_delta_chunked_ref (semantics and formulas there).
`gated_delta_chunk_pallas` takes the arrays and returns (o, final state).

Tiling. T is padded to a multiple of the chunk C with zeros (g = 0, beta = 0: a padded token leaves S unchanged).
  prep    grid (Hv, T / C), every chunk in parallel: program (h, n) reads chunk n of value head h and of its key
          head kh = `key_head(h)` (interleave: h // (Hv / Hk), tile: h % Hk, read straight from q, k [T, Hk, Dk]:
          no repeat in XLA) and writes, with G = cumsum(g):
            A = strict_lower(beta_i exp(G_i - G_j) k_i . k_j);  Tm = (I + A)^-1
            W = Tm (beta exp(G) k) [C, Dk],  U = Tm (beta v) [C, Dv],  Aqk = lower(exp(G_i - G_j) q_i . k_j) [C, C]
          to [Hv, T, .] arrays (a chunk's rows contiguous): everything of a chunk that does not depend on the state.
  scan    grid (Hv, Dv / BV): program (h, j) owns value head h's state columns [j BV, (j + 1) BV), S [Dk, BV]
          float32 in registers through a fori_loop over the chunks in order:
            delta = U - W S;  o = exp(G) (q S) + Aqk delta;  S = exp(G_last) S + (exp(G_last - G) k)^T delta
  solve   Tm, the inverse of the unit lower triangular I + A, in one of two ways (`Tuning.solve`):
          "subst": forward substitution, row r of Tm = e_r - A[r, :] Tm for r = 1 .. C - 1 (masked row reductions,
          exact float32, C - 1 dependent steps off the tensor cores).
          "doubling": block doubling on the tensor cores: B = I; for s = 1, 2, .., C / 2: B <- B - B N_s B, N_s the
          entries of A in the lower-left s x s quadrant of each 2s x 2s diagonal block (B then holds the inverses
          of the 2s-blocks): 2 log2(C) C x C dots, products of bounded inverses only (a Neumann series would cancel
          binomially large terms when keys repeat).
  dots    float32 operands; compiled: 3xTF32 ("tf32x3", about float32 accuracy), one TF32 pass ("tf32", ~1e-3) or
          IEEE FMA ("ieee") by `Tuning.dots`; interpret mode: float32 at HIGHEST.

The initial state is aliased to the final state (each scan program reads its tile before it writes it).
Tuning: `TUNING` is chosen from static facts only, no GPU time yet: ptxas for sm_90 (Triton 3.6, Dk = Dv = 128,
C = 64, T = 1024) puts every 3xTF32 variant at the 255-register cap (the TF32 operand splits); the table's picks spill
least: prep "subst" at 4 warps 148 B ("doubling" 2.4 KB), scan BV = 32 at 4 warps 444 B (BV = 64: 0.9-1.1 KB). One
pass of TF32 is spill-free (scan 194 registers). C = 16 with 3xTF32 gives a spill-free scan (253 registers).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops.tuning import fill

HEAD_MAPS = ("interleave", "tile")
SOLVES = ("doubling", "subst")
DOTS = {"tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3, "tf32": lax.DotAlgorithmPreset.TF32_TF32_F32,
        "ieee": lax.DotAlgorithmPreset.F32_F32_F32}


class Tuning(NamedTuple):
  """The kernels' tuning; a field left None takes the table's (`config`): BV value columns per program of the scan
  kernel (a power of two dividing Dv, >= 16), its Triton warps and stages, the prep kernel's warps, the inverse's
  method `solve` (SOLVES) and the MMA scheme `dots` (DOTS) of both."""
  BV: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  prep_warps: int | None = None
  solve: str | None = None
  dots: str | None = None


TUNING = {128: Tuning(BV=32, num_warps=4, num_stages=1, prep_warps=4, solve="subst", dots="tf32x3")}
DEFAULT_TUNING = Tuning(BV=32, num_warps=4, num_stages=1, prep_warps=4, solve="subst", dots="tf32x3")


def _is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def config(Dv: int, tuning: Tuning | None = None) -> Tuning:
  """The complete tuning of a call: TUNING[Dv] (BV capped by Dv) with the fields `tuning` sets."""
  base = TUNING.get(Dv, DEFAULT_TUNING)
  c = fill(tuning, base._replace(BV=min(base.BV, Dv)))
  if c.solve not in SOLVES or c.dots not in DOTS or not _is_pow2(c.BV) or c.BV < 16 or Dv % c.BV:
    raise ValueError(f"gated_delta_chunk_pallas: tuning {c} (solve in {SOLVES}, dots in {tuple(DOTS)}, "
                     f"BV a power of two >= 16 dividing Dv={Dv})")
  return c


def supported(T: int, Hk: int, Hv: int, Dk: int, Dv: int, chunk: int) -> str | None:
  """None when the kernel takes this call, else the reason it does not."""
  if T < 1:
    return "no tokens"
  if Hv % Hk:
    return f"Hv={Hv} is not a multiple of Hk={Hk}"
  for name, n in (("Dk", Dk), ("Dv", Dv), ("chunk", chunk)):
    if not (_is_pow2(n) and n >= 16):
      return f"{name}={n} is not a power of two >= 16"
  return None


def key_head(h, Hv: int, Hk: int, head_map: str):
  """The key head program's value head h reads (int32 scalar)."""
  return h // (Hv // Hk) if head_map == "interleave" else lax.rem(h, Hk)


def _dot(a, b, ca: int, cb: int, prec):
  return lax.dot_general(a, b, (((ca,), (cb,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)


def unit_lower_inverse(A, dot, solve: str):
  """(I + A)^-1 for A [C, C] strictly lower triangular, by block doubling or forward substitution."""
  C = A.shape[0]
  i = lax.broadcasted_iota(jnp.int32, (C, C), 0)
  j = lax.broadcasted_iota(jnp.int32, (C, C), 1)
  eye = jnp.where(i == j, 1.0, 0.0).astype(jnp.float32)
  if solve == "doubling":
    B = eye
    s = 1
    while s < C:
      quad = (i // (2 * s) == j // (2 * s)) & ((i // s) % 2 == 1) & ((j // s) % 2 == 0)
      B = B - dot(dot(B, jnp.where(quad, A, 0.0), 1, 0), B, 1, 0)
      s *= 2
    return B

  def row(r, Tm):
    a_r = jnp.sum(jnp.where(i == r, A, 0.0), axis=0)                  # A[r, :] (zero from column r on)
    x = jnp.sum(a_r[:, None] * Tm, axis=0)                             # A[r, :] Tm: rows < r are final
    return jnp.where(i == r, Tm - x[None, :], Tm)                     # row r was e_r

  return lax.fori_loop(1, C, row, eye)


def _prep_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, w_ref, u_ref, a_ref, *, C: int, Hv: int, Hk: int,
                 head_map: str, scale: float, solve: str, prec):
  """Program (h, n): chunk n of value head h's W [C, Dk], U [C, Dv] and masked q k^T [C, C]."""
  h = pl.program_id(0)
  t0 = pl.multiple_of(pl.program_id(1) * C, C)
  kh = key_head(h, Hv, Hk, head_map)
  dot = functools.partial(_dot, prec=prec)
  i = lax.broadcasted_iota(jnp.int32, (C, C), 0)
  j = lax.broadcasted_iota(jnp.int32, (C, C), 1)
  k = k_ref[pl.ds(t0, C), kh, :]                                        # [C, Dk]
  beta = b_ref[pl.ds(t0, C), h]                                         # [C]
  G = jnp.cumsum(g_ref[pl.ds(t0, C), h])
  decay = jnp.exp(jnp.where(i >= j, G[:, None] - G[None, :], -jnp.inf))    # [C, C], zero above the diagonal
  Tm = unit_lower_inverse(jnp.where(i > j, beta[:, None] * decay * dot(k, k, 1, 1), 0.0), dot, solve)
  w_ref[h, pl.ds(t0, C), :] = dot(Tm, (beta * jnp.exp(G))[:, None] * k, 1, 0)
  u_ref[h, pl.ds(t0, C), :] = dot(Tm, beta[:, None] * v_ref[pl.ds(t0, C), h, :], 1, 0)
  a_ref[h, pl.ds(t0, C), :] = decay * dot(q_ref[pl.ds(t0, C), kh, :] * scale, k, 1, 1)


def _scan_kernel(q_ref, k_ref, g_ref, w_ref, u_ref, a_ref, s0_ref, o_ref, s_ref, *, C: int, n_chunks: int, BV: int,
                 Hv: int, Hk: int, head_map: str, scale: float, prec):
  """Program (h, j): value head h's state columns [j BV, (j + 1) BV) through every chunk in order."""
  h = pl.program_id(0)
  v0 = pl.multiple_of(pl.program_id(1) * BV, BV)
  kh = key_head(h, Hv, Hk, head_map)
  dot = functools.partial(_dot, prec=prec)
  last = lax.broadcasted_iota(jnp.int32, (C,), 0) == C - 1

  def body(n, S):
    t0 = pl.multiple_of(n * C, C)
    G = jnp.cumsum(g_ref[pl.ds(t0, C), h])                              # [C]
    delta = u_ref[h, pl.ds(t0, C), pl.ds(v0, BV)] - dot(w_ref[h, pl.ds(t0, C), :], S, 1, 0)      # [C, BV]
    o = (jnp.exp(G)[:, None] * dot(q_ref[pl.ds(t0, C), kh, :] * scale, S, 1, 0)
         + dot(a_ref[h, pl.ds(t0, C), :], delta, 1, 0))
    o_ref[pl.ds(t0, C), h, pl.ds(v0, BV)] = o
    G_last = jnp.sum(jnp.where(last, G, 0.0))
    k_tail = jnp.exp(G_last - G)[:, None] * k_ref[pl.ds(t0, C), kh, :]  # [C, Dk]
    return jnp.exp(G_last) * S + dot(k_tail, delta, 0, 0)               # [Dk, BV]

  S = lax.fori_loop(0, n_chunks, body, s0_ref[h, :, pl.ds(v0, BV)])
  s_ref[h, :, pl.ds(v0, BV)] = S


@functools.partial(jax.jit, static_argnames=("chunk", "head_map", "scale", "interpret", "tuning"))
def gated_delta_chunk_pallas(q_THkDk, k_THkDk, v_THvDv, g_THv, beta_THv, state_HvDkDv, *, chunk: int = 64,
                             head_map: str = "interleave", scale: float | None = None, interpret: bool = False,
                             tuning: Tuning | None = None):
  """(o [T, Hv, Dv], final state [Hv, Dk, Dv]) of the delta rule over T tokens from state_HvDkDv, as
  ops.gated_delta.gated_delta_chunked_ref (q, k [T, Hk, Dk] L2-normalised, v [T, Hv, Dv], g and beta [T, Hv]);
  shapes as `supported` requires. scale None: 1 / sqrt(Dk). tuning (static): the fields to set over the table."""
  T, Hk, Dk = q_THkDk.shape
  _, Hv, Dv = v_THvDv.shape
  why = supported(T, Hk, Hv, Dk, Dv, chunk)
  if why is not None or head_map not in HEAD_MAPS:
    raise ValueError(f"gated_delta_chunk_pallas: {why or f'head_map {head_map!r}, expected one of {HEAD_MAPS}'}")
  c = config(Dv, tuning)
  n_chunks = -(-T // chunk)
  pad = n_chunks * chunk - T
  f32 = jnp.float32

  def padded(x):
    x = x.astype(f32)
    return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if pad else x

  q, k, v, g, beta = (padded(x) for x in (q_THkDk, k_THkDk, v_THvDv, g_THv, beta_THv))
  Tp = n_chunks * chunk
  kw = dict(C=chunk, Hv=Hv, Hk=Hk, head_map=head_map, scale=1.0 / math.sqrt(Dk) if scale is None else scale,
            prec=lax.Precision.HIGHEST if interpret else DOTS[c.dots])
  w, u, a = pl.pallas_call(
      functools.partial(_prep_kernel, solve=c.solve, **kw), grid=(Hv, n_chunks),
      out_shape=[jax.ShapeDtypeStruct((Hv, Tp, Dk), f32), jax.ShapeDtypeStruct((Hv, Tp, Dv), f32),
                 jax.ShapeDtypeStruct((Hv, Tp, chunk), f32)],
      compiler_params=plgpu.CompilerParams(num_warps=c.prep_warps, num_stages=1),
      interpret=interpret, name="gated_delta_chunk_prep")(q, k, v, g, beta)
  o, state = pl.pallas_call(
      functools.partial(_scan_kernel, n_chunks=n_chunks, BV=c.BV, **kw), grid=(Hv, Dv // c.BV),
      out_shape=[jax.ShapeDtypeStruct((Tp, Hv, Dv), f32), jax.ShapeDtypeStruct((Hv, Dk, Dv), f32)],
      input_output_aliases={6: 1},
      compiler_params=plgpu.CompilerParams(num_warps=c.num_warps, num_stages=c.num_stages),
      interpret=interpret, name="gated_delta_chunk_scan")(q, k, g, w, u, a, state_HvDkDv.astype(f32))
  return (o[:T] if pad else o), state
