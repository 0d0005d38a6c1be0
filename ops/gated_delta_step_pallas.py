"""A Gated DeltaNet decode step or verify pass as one Pallas kernel (Triton lowering): the causal conv over the
window, SiLU, the split into q, k, v, the L2 norm of q and k, and the delta rule for T <= MAX_T tokens in order,
beside its reference ops/gated_delta.py::gated_delta_step_ref (semantics there).

Tiling.
  grid    (Hv, Dv / BV): program (h, j) owns value head h, its value columns [j BV, (j + 1) BV) and the state tile
          S [Dk, BV] float32 (registers). It reads key head kh = `key_head(h)` (interleave: h // (Hv / Hk), tile:
          h % Hk).
  conv    per channel group (q of kh: Dk channels, k of kh: Dk channels, v of the tile: BV channels) the program
          loads the window's Kw columns and the T input rows as [n] vectors, and forms each token's output
          sum_i ext[t + i] w[:, i] in ggml's order, then SiLU. The q and k channels of kh are computed by each of
          the programs that read them (Hv / Hk heads x Dv / BV tiles; a few hundred flops).
  tokens  unrolled over T: q_t, k_t L2-normalised (q_t scaled), then S <- S exp(g_t); d = (v_t - S^T k_t) beta_t;
          S <- S + k_t d^T; o_t = S^T q_t: vector reductions over Dk, no MMA, exact float32 like ggml's.
  writes  o [T, Hv, Dv]; the new window: v channels by their tile's program, q and k channels of kh by one
          program (j = 0 and h the first value head reading kh); the state tile (the input state is aliased to the
          output: each program reads its tile before writing it). keep_states (static): also the window and the
          state after every token, [T, Cc, Kw] and [T, Hv, Dk, Dv], for a verify pass to keep those after its
          accepted prefix.
Tuning: `TUNING` (by Dv) is a first guess, not yet measured on a GPU: BV = 32 gives Hv x 4 programs at Dv = 128
(128 for the 32 value heads of the seed model, about one per SM), so the state's bytes stream from many SMs.
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

from ops.gated_delta_chunk_pallas import HEAD_MAPS, key_head
from ops.tuning import fill

MAX_T = 8                # tokens per call: a decode step, or a verify pass of up to 7 drafts


class Tuning(NamedTuple):
  """The kernel's tuning; a field left None takes the table's (`config`): BV value columns per program (a power of
  two dividing Dv) and Triton warps."""
  BV: int | None = None
  num_warps: int | None = None


TUNING = {128: Tuning(BV=32, num_warps=4)}
DEFAULT_TUNING = Tuning(BV=32, num_warps=4)


def _is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def config(Dv: int, tuning: Tuning | None = None) -> Tuning:
  """The complete tuning of a call: TUNING[Dv] (BV capped by Dv) with the fields `tuning` sets."""
  base = TUNING.get(Dv, DEFAULT_TUNING)
  c = fill(tuning, base._replace(BV=min(base.BV, Dv)))
  if not _is_pow2(c.BV) or Dv % c.BV:
    raise ValueError(f"gated_delta_step_pallas: BV={c.BV} is not a power of two dividing Dv={Dv}")
  return c


def supported(T: int, Hk: int, Hv: int, Dk: int, Dv: int) -> str | None:
  """None when the kernel takes this call, else the reason it does not."""
  if not 1 <= T <= MAX_T:
    return f"T={T} is not in 1 .. MAX_T={MAX_T}"
  if Hv % Hk:
    return f"Hv={Hv} is not a multiple of Hk={Hk}"
  if not (_is_pow2(Dk) and _is_pow2(Dv)):
    return f"Dk={Dk} or Dv={Dv} is not a power of two"
  return None


def _silu(x):
  return x / (1.0 + jnp.exp(-x))


def _kernel(x_ref, win_ref, w_ref, g_ref, b_ref, s0_ref, o_ref, win_out_ref, s_ref, *keep_refs, T: int, Kc: int,
            Hk: int, Hv: int, Dk: int, BV: int, head_map: str, eps: float, scale: float):
  Kw = Kc - 1
  h = pl.program_id(0)
  j = pl.program_id(1)
  v0 = pl.multiple_of(j * BV, BV)
  kh = key_head(h, Hv, Hk, head_map)
  qc0 = pl.multiple_of(kh * Dk, Dk)
  kc0 = pl.multiple_of(Hk * Dk + kh * Dk, Dk)
  vc0 = pl.multiple_of(2 * Hk * Dk + h * s0_ref.shape[2] + v0, BV)

  def ext(c0, n):                       # the window's inputs then the T new ones, each [n]
    return [win_ref[pl.ds(c0, n), i] for i in range(Kw)] + [x_ref[t, pl.ds(c0, n)] for t in range(T)]

  def conv(cols, c0, n):
    w = [w_ref[pl.ds(c0, n), i] for i in range(Kc)]
    out = []
    for t in range(T):
      y = cols[t] * w[0]
      for i in range(1, Kc):
        y = y + cols[t + i] * w[i]
      out.append(_silu(y))
    return out

  def l2(x):
    return x * lax.rsqrt(jnp.sum(x * x) + eps)

  groups = [(qc0, Dk), (kc0, Dk), (vc0, BV)]
  cols = [ext(c0, n) for c0, n in groups]
  qs, ks, vs = (conv(cs, c0, n) for cs, (c0, n) in zip(cols, groups))

  def store_windows(c0, n, cs):
    for i in range(Kw):
      win_out_ref[pl.ds(c0, n), i] = cs[T + i]
      if keep_refs:
        for t in range(T):
          keep_refs[0][t, pl.ds(c0, n), i] = cs[t + 1 + i]

  store_windows(vc0, BV, cols[2])
  first = (lax.rem(h, Hv // Hk) == 0) if head_map == "interleave" else (h < Hk)

  @pl.when(first & (j == 0))
  def _():
    store_windows(qc0, Dk, cols[0])
    store_windows(kc0, Dk, cols[1])

  S = s0_ref[h, :, pl.ds(v0, BV)]                                          # [Dk, BV]
  for t in range(T):
    q = l2(qs[t]) * scale
    k = l2(ks[t])
    S = S * jnp.exp(g_ref[t, h])
    d = (vs[t] - jnp.sum(S * k[:, None], axis=0)) * b_ref[t, h]
    S = S + k[:, None] * d[None, :]
    o_ref[t, h, pl.ds(v0, BV)] = jnp.sum(S * q[:, None], axis=0)
    if keep_refs:
      keep_refs[1][t, h, :, pl.ds(v0, BV)] = S
  s_ref[h, :, pl.ds(v0, BV)] = S


@functools.partial(jax.jit, static_argnames=("eps", "head_map", "scale", "keep_states", "interpret", "tuning"))
def gated_delta_step_pallas(qkv_TCc, win_CcKw, w_CcKc, g_THv, beta_THv, state_HvDkDv, *, eps: float,
                            head_map: str = "interleave", scale: float | None = None, keep_states: bool = False,
                            interpret: bool = False, tuning: Tuning | None = None):
  """(o [T, Hv, Dv], window [Cc, Kw], state [Hv, Dk, Dv]) after T tokens, and with keep_states also the window and
  state after each token ([T, Cc, Kw], [T, Hv, Dk, Dv]); as ops.gated_delta.gated_delta_step_ref. qkv_TCc: the
  pre-conv rows (q | k | v); w_CcKc: the conv weight; g, beta [T, Hv]; Hk from Cc = 2 Hk Dk + Hv Dv. scale None:
  1 / sqrt(Dk). tuning (static): the fields to set over the table."""
  T, Cc = qkv_TCc.shape
  Hv, Dk, Dv = state_HvDkDv.shape
  Kc = w_CcKc.shape[1]
  Hk, rem = divmod(Cc - Hv * Dv, 2 * Dk)
  why = "Cc is not 2 Hk Dk + Hv Dv" if rem or Hk <= 0 else supported(T, Hk, Hv, Dk, Dv)
  if why is None and (head_map not in HEAD_MAPS or Kc < 2 or win_CcKw.shape != (Cc, Kc - 1)):
    why = f"head_map {head_map!r} (expected one of {HEAD_MAPS}), window {win_CcKw.shape}, weight {w_CcKc.shape}"
  if why is not None:
    raise ValueError(f"gated_delta_step_pallas: {why}")
  c = config(Dv, tuning)
  f32 = jnp.float32
  out_shape = [jax.ShapeDtypeStruct((T, Hv, Dv), f32), jax.ShapeDtypeStruct((Cc, Kc - 1), f32),
               jax.ShapeDtypeStruct((Hv, Dk, Dv), f32)]
  if keep_states:
    out_shape += [jax.ShapeDtypeStruct((T, Cc, Kc - 1), f32), jax.ShapeDtypeStruct((T, Hv, Dk, Dv), f32)]
  kernel = functools.partial(_kernel, T=T, Kc=Kc, Hk=Hk, Hv=Hv, Dk=Dk, BV=c.BV, head_map=head_map, eps=eps,
                             scale=1.0 / math.sqrt(Dk) if scale is None else scale)
  args = [x.astype(f32) for x in (qkv_TCc, win_CcKw, w_CcKc, g_THv, beta_THv, state_HvDkDv)]
  return tuple(pl.pallas_call(
      kernel, grid=(Hv, Dv // c.BV), out_shape=out_shape, input_output_aliases={5: 2},
      compiler_params=plgpu.CompilerParams(num_warps=c.num_warps, num_stages=1),
      interpret=interpret, name="gated_delta_step")(*args))
