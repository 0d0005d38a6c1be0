"""RMSNorm (optionally after a residual add) as a Pallas kernel (Triton lowering), one program per token, beside its
reference ops.layers.rms_norm.

Why a kernel for a norm: batch invariance. Greedy speculative decoding is exact only if a verify pass of k + 1
tokens computes every token's row exactly as a one-token step does (DESIGN invariant 3). XLA's row reductions pick
their strategy from the whole shape, and on the H200 the norm of a 4-row batch differs from the 1-row norm in the
last bits (2.4e-7; `scripts/gpu/batch_invariance.py`), enough to flip a 512-expert router and, 48 layers later, a
greedy token. Here every row is one program running the same code whatever T is, so its bits never depend on the
batch. It also folds the residual add and the norm's two XLA kernels into one launch.

`add_rms_norm(x, w, eps, res=None, impl=..., tuning=None, x8=False)`: with `res`, s = x + res and returns (s,
norm(s)); without, norm(x). res is one array [T, D], or the pieces of one: arrays [T, J, D] (or [T, D], J = 1) whose
J rows are added first, left to right over the pieces and their rows, so s = x + (((r_0 + r_1) + ...) + r_n): a
layer's routed experts' X partial rows and its shared expert's output (a `Gated` piece where a sigmoid gate scales
it per token), summed here instead of in XLA launches before the norm (`Tunings.fuse` "residual"); with x8 the norm
rounded to 8 bits per 32 values comes last (ops.dot8.X8, for a consumer on 8-bit x: the MoE's gate/up, the mixer's
input projection), made in the same program instead of XLA's three launches. Takes D a power of two (the kernel
loads whole rows); other shapes run the reference.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops import dot8
from ops.gated_delta import silu
from ops.layers import rms_norm
from ops.tuning import fill

IMPLS = ("ref", "pallas", "interpret")
MAX_T = 16               # decode and verify passes; prefill keeps XLA's norm (its rows need no batch invariance)


class Tuning(NamedTuple):
  """The kernel's tuning; a field left None takes `TUNING`'s: Triton warps per program (one program per row)."""
  num_warps: int | None = None


TUNING = Tuning(num_warps=4)


def supported(T: int, D: int) -> bool:
  return 1 <= T <= MAX_T and D > 0 and D & (D - 1) == 0


class Gated(NamedTuple):
  """A residual piece scaled per token by sigmoid(logit): a shared expert's output and its gate's logit (qwen2moe,
  the hybrid family), the product made by the norm kernel instead of an XLA launch."""
  y_TD: jax.Array
  logit_T: jax.Array


def sigmoid(v):
  """1 / (1 + exp(-v)): the gated pieces' sigmoid, the same ops in the kernel and in `residual_sum`."""
  return 1.0 / (1.0 + jnp.exp(-v))


def _kernel(x_ref, w_ref, *refs, eps: float, parts: tuple, x8: bool, gated: bool):
  refs = list(refs)
  r_refs = [(refs.pop(0), refs.pop(0)) if J == "gated" else (refs.pop(0), None) for J in parts]
  z_ref = refs.pop(0) if gated else None
  s_ref = refs.pop(0) if parts else None
  y_ref = refs.pop(0)
  t = pl.program_id(0)
  x = x_ref[t, :]
  if parts:
    r = None
    for (r_ref, l_ref), J in zip(r_refs, parts):    # left to right over the pieces and their rows
      rows = [r_ref[t, :] * sigmoid(l_ref[t])] if J == "gated" else [r_ref[t, j, :] for j in range(J)]
      for row in rows:
        r = row if r is None else r + row
    x = x + r
    s_ref[t, :] = x
  y = norm_row(x, w_ref[...], eps)
  if gated:                                         # a gated norm: norm(x) * silu(z)
    y = y * silu(z_ref[t, :])
  y_ref[t, :] = y
  if x8:
    write_x8(*refs, t, y)


def norm_row(x_D, w_D, eps: float):
  """One row's RMSNorm inside a kernel (the ops of ops.layers.rms_norm)."""
  return x_D * jax.lax.rsqrt(jnp.mean(x_D * x_D) + eps) * w_D


def write_x8(words_ref, dx_ref, xsum_ref, t, y_D):
  """Row t of an X8 ([T, D/32, 8] words, [T, D/32] dx and xsum) from a kernel's row y (ops.dot8.quantize_x's ops)."""
  q, dx = dot8.round32(y_D.reshape(y_D.shape[0] // 32, 32))
  words_ref[t, :, :] = dot8.pack(q)
  dx_ref[t, :] = dx
  xsum_ref[t, :] = dx * jnp.sum(q, axis=1).astype(jnp.float32)


def x8_shapes(T: int, D: int) -> list:
  """The out_shape entries of an X8 a kernel writes with `write_x8`; `as_x8` views them flat."""
  return [jax.ShapeDtypeStruct((T, D // 32, 8), jnp.int32)] + [jax.ShapeDtypeStruct((T, D // 32), jnp.float32)] * 2


def as_x8(words, dx, xsum) -> dot8.X8:
  return dot8.X8(words.reshape(words.shape[0], -1), dx, xsum)


def _pieces(res) -> tuple:
  """res (None, an array [T, D] or [T, J, D], a `Gated`, or a tuple of them) as a tuple of [T, J, D] arrays and
  `Gated`s."""
  if res is None:
    return ()
  res = (res,) if isinstance(res, Gated) or not isinstance(res, (tuple, list)) else res
  return tuple(r if isinstance(r, Gated) or r.ndim == 3 else r[:, None] for r in res)


def residual_sum(res):
  """The jnp sum of res's rows in the kernel's order: ((r_0 + r_1) + ...) + r_n over the pieces and their rows (a
  `Gated` piece is one row, y * sigmoid(logit))."""
  r = None
  for piece in _pieces(res):
    if isinstance(piece, Gated):
      rows = [piece.y_TD * sigmoid(piece.logit_T.astype(jnp.float32))[:, None]]
    else:
      rows = [piece[:, j] for j in range(piece.shape[1])]
    for row in rows:
      r = row if r is None else r + row
  return r


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "tuning", "x8"))
def rms_norm_pallas(x_TD, w_D, eps: float, res_TD=None, *, interpret: bool = False, tuning: Tuning | None = None,
                    x8: bool = False, gate_TD=None):
  """The kernel (see add_rms_norm); gate_TD: the norm is multiplied by silu(gate) in the same program (a Gated
  DeltaNet layer's output norm, `Tunings.fuse` "gated_norm")."""
  T, D = x_TD.shape
  t = fill(tuning, TUNING)
  residual = res_TD is not None
  pieces = _pieces(res_TD)
  args = [x_TD.astype(jnp.float32), w_D.astype(jnp.float32)] + [
      a.astype(jnp.float32) for r in pieces for a in (r if isinstance(r, Gated) else (r,))]
  out = [jax.ShapeDtypeStruct((T, D), jnp.float32)] * (2 if residual else 1)
  if x8:
    out += x8_shapes(T, D)
  parts = tuple("gated" if isinstance(r, Gated) else r.shape[1] for r in pieces)
  gated = gate_TD is not None
  args += [gate_TD.astype(jnp.float32)] if gated else []
  outs = pl.pallas_call(functools.partial(_kernel, eps=eps, parts=parts, x8=x8, gated=gated), out_shape=out,
                        grid=(T,), compiler_params=plgpu.CompilerParams(num_warps=t.num_warps, num_stages=1),
                        interpret=interpret, name="rms_norm")(*args)
  n = 2 if residual else 1
  rounded = (as_x8(*outs[n:n + 3]),) if x8 else ()
  return (*outs[:n], *rounded) if residual or x8 else outs[0]


def add_rms_norm(x_TD, w_D, eps: float, res_TD=None, *, impl: str = "ref", tuning: Tuning | None = None,
                 x8: bool = False):
  """norm(x) or, with res, (x + r, norm(x + r)), r = res or the sum of its pieces (`residual_sum`); with x8 the
  result also carries the norm rounded to 8 bits (an ops.dot8.X8, last) for a consumer on 8-bit x. impl "pallas" |
  "interpret" runs the kernel where `supported` (x 2-D, T <= MAX_T, D a power of two) with `tuning` (static), the
  rounding in the same program; "ref" the jnp ops and dot8.quantize_x."""
  if impl not in IMPLS:
    raise ValueError(f"add_rms_norm: impl {impl!r}, expected one of {IMPLS}")
  if impl != "ref" and x_TD.ndim == 2 and supported(*x_TD.shape) and (not x8 or x_TD.shape[1] >= 32):
    return rms_norm_pallas(x_TD, w_D, eps, res_TD, interpret=impl == "interpret", tuning=tuning, x8=x8)
  if res_TD is None:
    out = (rms_norm(x_TD, w_D, eps),)
  else:
    s = x_TD + residual_sum(res_TD)
    out = (s, rms_norm(s, w_D, eps))
  if x8:
    out += (dot8.quantize_x(out[-1].reshape(-1, x_TD.shape[-1])),)
  return out if len(out) > 1 else out[0]
