"""The FFN's RMSNorm (after the residual add) and the router's logits as one Pallas kernel (Triton lowering), beside
its reference `norm_logits_ref` (ops.rmsnorm_pallas.add_rms_norm's reference and a float32 dot).

Why: one launch a MoE layer instead of two (`Tunings.fuse` "router"). The norm kernel runs one short program a
token and the logits kernel a few dozen programs that each need the whole normed row; here each logits program
makes the row itself (x + res, then the norm: a few KB of reads beside its router rows) and program 0 also writes
the stream's sum, the norm and, for a consumer on 8-bit x, its rounding (ops.dot8.X8).

  grid (E / BE,): program i holds router rows [i*BE, i*BE + BE); for each of the T tokens (a static loop: every
  token's arithmetic is the same whatever T is, so a verify pass's rows are the steps' bitwise) s = x + res,
  y = norm(s) (ops.rmsnorm_pallas.norm_row), logits = router rows . y in D-chunks of DC, one sequential float32
  accumulation, as ops.router_pallas's logits kernel. BE, DC and the warps: ops.router_pallas.Tuning. Program 0
  also dots a few extra rows (a shared expert's gate, `extra_ND`) with the norm.

Takes what both kernels take (T <= MAX_T, E and D powers of two, a float router); `supported` says so.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops import dot8, rmsnorm_pallas, router_pallas
from ops.layers import rms_norm
from ops.tuning import fill


def supported(T: int, E: int, D: int, N: int = 0) -> bool:
  """Whether the kernel takes T tokens of width D, E router rows and N extra rows (0, or a power of two)."""
  return (rmsnorm_pallas.supported(T, D) and router_pallas.supported(T, E, D, 1) and D >= 32
          and (N == 0 or N & (N - 1) == 0))


def norm_logits_ref(x_TD, res_TD, w_D, router_ED, eps: float, x8: bool = False, extra_ND=None):
  """(s, norm(s), logits [T, E] float32[, X8 of the norm][, extra logits [T, N]]) for s = x + res: the unfused
  ops."""
  s = x_TD + res_TD
  y = rms_norm(s, w_D, eps)
  dot = lambda w: jnp.einsum("td,ed->te", y.astype(jnp.float32), w.astype(jnp.float32))
  return ((s, y, dot(router_ED)) + ((dot8.quantize_x(y),) if x8 else ())
          + ((dot(extra_ND),) if extra_ND is not None else ()))


def _row_dots(w_ref, e0, n: int, y, D: int, dc: int):
  """Rows [e0, e0 + n) of w dotted with y, in D-chunks of dc (y is in registers: a static loop over its chunks)."""
  acc = jnp.zeros((n,), jnp.float32)
  for c in range(D // dc):
    yc = jax.lax.slice(y, (c * dc,), ((c + 1) * dc,)) if dc < D else y
    acc = acc + jnp.sum(w_ref[pl.ds(e0, n), pl.ds(c * dc, dc)] * yc[None, :], axis=1)
  return acc


def _kernel(x_ref, r_ref, w_ref, router_ref, *refs, T: int, BE: int, D: int, dc: int, eps: float, x8: bool,
            N: int):
  refs = list(refs)
  extra_ref = refs.pop(0) if N else None
  s_ref, y_ref, l_ref = refs[:3]
  x8_refs = refs[3:6] if x8 else ()
  el_ref = refs[-1] if N else None
  i = pl.program_id(0)
  for t in range(T):
    s = x_ref[t, :] + r_ref[t, :]
    y = rmsnorm_pallas.norm_row(s, w_ref[...], eps)
    l_ref[t, pl.ds(i * BE, BE)] = _row_dots(router_ref, i * BE, BE, y, D, dc)

    @pl.when(i == 0)
    def _():
      s_ref[t, :] = s
      y_ref[t, :] = y
      if x8:
        rmsnorm_pallas.write_x8(*x8_refs, t, y)
      if N:
        el_ref[t, :] = _row_dots(extra_ref, 0, N, y, D, dc)


@functools.partial(jax.jit, static_argnames=("eps", "x8", "interpret", "tuning"))
def norm_logits_pallas(x_TD, res_TD, w_D, router_ED, eps: float, *, x8: bool = False, interpret: bool = False,
                       tuning: router_pallas.Tuning | None = None, extra_ND=None):
  """(s, norm(s), logits [T, E] float32[, X8 of the norm][, extra logits [T, N]]) for s = x + res, one launch.
  extra_ND: a few more float rows (N a power of two; a shared expert's gate, N = 1) dotted with the norm by program
  0. tuning (static): the router's (ops.router_pallas.Tuning: programs, D chunk, warps)."""
  T, D = x_TD.shape
  E = router_ED.shape[0]
  N = 0 if extra_ND is None else extra_ND.shape[0]
  t = fill(tuning, router_pallas.TUNING)
  BE, dc = router_pallas.logits_tiling(E, D, t)
  f32 = lambda a: a.astype(jnp.float32)
  row = jax.ShapeDtypeStruct((T, D), jnp.float32)
  out = ([row, row, jax.ShapeDtypeStruct((T, E), jnp.float32)] + (rmsnorm_pallas.x8_shapes(T, D) if x8 else [])
         + ([jax.ShapeDtypeStruct((T, N), jnp.float32)] if N else []))
  outs = pl.pallas_call(functools.partial(_kernel, T=T, BE=BE, D=D, dc=dc, eps=eps, x8=x8, N=N), out_shape=out,
                        grid=(E // BE,), compiler_params=plgpu.CompilerParams(num_warps=t.warps, num_stages=1),
                        interpret=interpret, name="norm_router_logits")(
                            f32(x_TD), f32(res_TD), f32(w_D), f32(router_ED), *([f32(extra_ND)] if N else []))
  return (tuple(outs[:3]) + ((rmsnorm_pallas.as_x8(*outs[3:6]),) if x8 else ())
          + ((outs[-1],) if N else ()))
