"""From the fused q/k/v matmul's output to attention's inputs in one Pallas kernel (Triton lowering): per-head RMS
norm of q and k (qk_norm models), NEOX RoPE on the first `rope_dim` dims, and the K/V ring write of the T new rows
(int8 absmax quantization with its scales, or a cast), in place.

Why: in a decode step these are ~10 small XLA kernels per layer (two per-head norms, two RoPEs, two absmax
reductions, four ring updates, the splits between them), each a launch of ~1-2 µs on the GPU for a few KB of work;
480 launches per step on a 48-layer model. One launch does all of it (a few programs per token).

`rope_write_ref` is the reference: the model's own jnp ops (ops.layers.rms_norm, ops.layers.rope_neox and
ops.kv_write.write_rows, the ring's write), which the kernel must match; `rope_write` dispatches. Both take and
return the ring's arrays of one layer (k, v, k_scale, v_scale), not the ring.

Kernel. Grid (T, Hq / HB + 1): program (t, j < Hq / HB) does HB q heads of token t, program (t, Hq / HB) its k and v
and the ring write. A program reads row t of qkv as [H, Dh] head tiles, computes the norm
over each head's whole row, rotates the halves [0, rope_dim/2) and [rope_dim/2, rope_dim) (loaded as their own
column slices: Triton has no lane permutation), and stores the pieces. The ring arrays are aliased inputs and
outputs (`input_output_aliases`): only the T rows at slots pos mod R are written, nothing is copied. Rounding
to int8 is round-half-to-even from floor (`round_half_even`: Triton has no round, and XLA simplifies the
1.5 * 2**23 trick away in interpret mode). Differences from the reference on the GPU: Triton's float32 division, cos/sin and rsqrt are
libdevice's, not XLA's, so an int8 code at a rounding tie may differ by one; in interpret mode (CPU tests) the
arithmetic is the reference's. Every output row depends only on its own token, so a 1-token step and a k + 1 token
verify pass agree.

Shapes the kernel takes (`supported`): Hq, Hkv, head_dim and rope_dim / 2 powers of two; the columns past the
rotated ones pass through as power-of-two slices (`tail_pieces`: head_dim 256, rope_dim 64 -> 128 + 64, the hybrid
family's gated attention). Anything else runs the reference.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops.kv_write import write_rows
from ops.layers import rms_norm, rope_neox
from ops.tuning import fill

IMPLS = ("ref", "pallas", "interpret")


class Tuning(NamedTuple):
  """The kernel's tuning; a field left None takes `TUNING`'s: q_programs, programs per token for the q heads
  (each does Hq / q_programs heads; one more program does k, v and the ring write), and Triton warps."""
  q_programs: int | None = None
  num_warps: int | None = None


# q_programs 1 (one program per token) took 4.9 us a call on the 30B shape (Hq 32, Dh 128).
TUNING = Tuning(q_programs=4, num_warps=4)


def _is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def supported(n_heads: int, n_kv_heads: int, head_dim: int, rope_dim: int) -> str | None:
  """None when the kernel takes these shapes, else why not."""
  half = rope_dim // 2
  for what, n in (("Hq", n_heads), ("Hkv", n_kv_heads), ("head_dim", head_dim), ("rope_dim/2", half)):
    if not _is_pow2(n):
      return f"{what}={n} is not a power of two"
  if rope_dim % 2 or rope_dim > head_dim:
    return f"rope_dim={rope_dim} must be even and <= head_dim={head_dim}"
  return None


def tail_pieces(head_dim: int, rope_dim: int) -> list[tuple[int, int]]:
  """The columns past the rotated ones as (start, width) slices of power-of-two widths, widest first (Triton
  blocks are powers of two): head_dim 256 with rope_dim 64 gives [(64, 128), (192, 64)]."""
  out, c0 = [], rope_dim
  while c0 < head_dim:
    n = 1 << ((head_dim - c0).bit_length() - 1)
    out.append((c0, n))
    c0 += n
  return out


def rope_write_ref(qkv_TN, q_norm, k_norm, pos_T, ring_kv, *, n_heads: int, n_kv_heads: int, head_dim: int,
                   rope_dim: int, theta: float, offset: int, eps: float):
  """q [T, Hq, Dh] float32 (normed, rotated) and the ring arrays (k, v, k_scale, v_scale) with rows pos mod R
  written (ops.kv_write.write_rows); scales None for a float ring. q_norm / k_norm None when the model has no qk
  norm."""
  T = qkv_TN.shape[0]
  Hq, Hkv, Dh = n_heads, n_kv_heads, head_dim
  q, k, v = jnp.split(qkv_TN.astype(jnp.float32), [Hq * Dh, (Hq + Hkv) * Dh], axis=-1)
  q, k, v = q.reshape(T, Hq, Dh), k.reshape(T, Hkv, Dh), v.reshape(T, Hkv, Dh)
  if q_norm is not None:
    q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
  q = rope_neox(q, pos_T + offset, rope_dim, theta)
  k = rope_neox(k, pos_T + offset, rope_dim, theta)
  kr, vr, ks, vs = ring_kv
  dtype = {jnp.dtype(jnp.int8): "int8", jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float32): "f32"}[kr.dtype]
  return q, write_rows(kr, vr, ks, vs, pos_T % kr.shape[0], k, v, dtype)


def _kernel(pos_ref, freq_ref, qkv_ref, *refs, Hq: int, Hkv: int, Dh: int, half: int, offset: int, eps: float,
            capacity: int, qk_norm: bool, quant: bool, HB: int):
  refs = list(refs)
  qn_ref, kn_ref = (refs.pop(0), refs.pop(0)) if qk_norm else (None, None)
  n_ring = 4 if quant else 2
  refs = refs[n_ring:]                          # the aliased ring inputs: written through the outputs
  q_out, k_out, v_out, *scale_out = refs
  t, j = pl.program_id(0), pl.program_id(1)     # j < Hq / HB: a block of HB q heads; j = Hq / HB: k and v
  p = pos_ref[t]
  slot = jax.lax.rem(p, jnp.asarray(capacity, p.dtype))
  ang = (p + offset).astype(jnp.float32) * freq_ref[...]               # [half]
  cos, sin = jnp.cos(ang)[None, :], jnp.sin(ang)[None, :]
  rd = 2 * half
  rest = tail_pieces(Dh, rd)

  def pieces(h0, H, w_ref):
    """The normed head rows h0 .. h0 + H - 1 of token t as (rotated first half, rotated second half, rest)."""
    x = qkv_ref[t, pl.ds(h0, H), :]                                     # [H, Dh]
    x1 = qkv_ref[t, pl.ds(h0, H), pl.ds(0, half)]
    x2 = qkv_ref[t, pl.ds(h0, H), pl.ds(half, half)]
    xr = [qkv_ref[t, pl.ds(h0, H), pl.ds(c0, n)] for c0, n in rest]
    if w_ref is not None:                      # rms_norm: x * rsqrt(mean(x^2) + eps) * w, over the whole row
      r = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
      x1 = x1 * r * w_ref[pl.ds(0, half)][None, :]
      x2 = x2 * r * w_ref[pl.ds(half, half)][None, :]
      xr = [y * r * w_ref[pl.ds(c0, n)][None, :] for y, (c0, n) in zip(xr, rest)]
    return [x1 * cos - x2 * sin, x2 * cos + x1 * sin] + xr

  def spans(ys):
    """Column ranges of the pieces: rotated halves and the pass-through tail's, or one whole row (v)."""
    if len(ys) == 1:
      return [(0, Dh)]
    return [(0, half), (half, half)] + rest

  @pl.when(j < Hq // HB)
  def _():
    h0 = pl.multiple_of(j * HB, HB)
    q = pieces(h0, HB, qn_ref)
    for (c0, n), y in zip(spans(q), q):
      q_out[t, pl.ds(h0, HB), pl.ds(c0, n)] = y

  def store(out_ref, sc_ref, ys):
    if quant:                                  # quantize_int8: s = max|x| / 127, round(x / s), clip
      amax = jnp.max(jnp.abs(ys[0]), axis=-1)
      for y in ys[1:]:
        amax = jnp.maximum(amax, jnp.max(jnp.abs(y), axis=-1))
      s = amax / 127.0
      div = jnp.where(s > 0, s, 1.0)[:, None]
      sc_ref[slot, :] = s
      for (c0, n), y in zip(spans(ys), ys):
        r = round_half_even(y / div)
        out_ref[slot, :, pl.ds(c0, n)] = jnp.clip(r, -127.0, 127.0).astype(out_ref.dtype)
    else:
      for (c0, n), y in zip(spans(ys), ys):
        out_ref[slot, :, pl.ds(c0, n)] = y.astype(out_ref.dtype)

  @pl.when(j == Hq // HB)
  def _():
    store(k_out, scale_out[0] if quant else None, pieces(Hq, Hkv, kn_ref))
    store(v_out, scale_out[1] if quant else None, [qkv_ref[t, pl.ds(Hq + Hkv, Hkv), :]])


def round_half_even(x):
  """jnp.round (half to even) from floor, for the Triton lowering: exact for |x| < 2**23."""
  f = jnp.floor(x)
  d = x - f                                                   # exact, in [0, 1)
  odd = (f - 2.0 * jnp.floor(f * 0.5)) == 1.0
  return f + jnp.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)


def head_block(n_heads: int, n_kv_heads: int, q_programs: int) -> int:
  """q heads per program: Hq / q_programs (at least Hkv, at most Hq), so a token's q work is split over a few
  programs beside the one that writes k and v."""
  return max(min(n_kv_heads, n_heads), n_heads // q_programs)


@functools.partial(jax.jit, static_argnames=("n_heads", "n_kv_heads", "head_dim", "rope_dim", "theta", "offset", "eps",
                                             "interpret", "tuning"))
def rope_write_pallas(qkv_TN, q_norm, k_norm, pos_T, ring_kv, *, n_heads: int, n_kv_heads: int, head_dim: int,
                      rope_dim: int, theta: float, offset: int, eps: float, interpret: bool = False,
                      tuning: Tuning | None = None):
  """The kernel; same arguments and results as rope_write_ref. Inside a jitted step the ring
  arrays are updated in place (aliased); called on its own, XLA copies them first. Positions must be >= -offset (as
  everywhere in the model). tuning (static): the fields to set over TUNING."""
  T = qkv_TN.shape[0]
  Hq, Hkv, Dh = n_heads, n_kv_heads, head_dim
  why = supported(Hq, Hkv, Dh, rope_dim)
  if why is not None:
    raise ValueError(f"rope_write_pallas: {why}")
  t = fill(tuning, TUNING)
  HB = head_block(Hq, Hkv, t.q_programs)
  half = rope_dim // 2
  kr, vr, ks, vs = ring_kv
  quant = ks is not None
  qk_norm = q_norm is not None
  freq = theta ** (-2.0 * jnp.arange(half, dtype=jnp.float32) / rope_dim)       # as rope_neox
  args = [jnp.asarray(pos_T, jnp.int32), freq, qkv_TN.astype(jnp.float32).reshape(T, Hq + 2 * Hkv, Dh)]
  if qk_norm:
    args += [q_norm.astype(jnp.float32), k_norm.astype(jnp.float32)]
  ring = [kr, vr] + ([ks, vs] if quant else [])
  first = len(args)
  args += ring
  out_shape = [jax.ShapeDtypeStruct((T, Hq, Dh), jnp.float32)] + [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ring]
  kernel = functools.partial(_kernel, Hq=Hq, Hkv=Hkv, Dh=Dh, half=half, offset=offset, eps=eps, capacity=kr.shape[0],
                             qk_norm=qk_norm, quant=quant, HB=HB)
  outs = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(T, Hq // HB + 1),
      input_output_aliases={first + i: 1 + i for i in range(len(ring))},
      compiler_params=plgpu.CompilerParams(num_warps=t.num_warps, num_stages=1),
      interpret=interpret, name="rope_ring_write")(*args)
  q, new = outs[0], outs[1:]
  return q, (new[0], new[1], new[2] if quant else None, new[3] if quant else None)


def rope_write(qkv_TN, q_norm, k_norm, pos_T, ring_kv, *, impl: str, tuning: Tuning | None = None, **kw):
  """Dispatcher: impl "pallas" | "interpret" runs the kernel where `supported` (with `tuning`, static), "ref" (or
  an unsupported shape) the reference."""
  if impl not in IMPLS:
    raise ValueError(f"rope_write: impl {impl!r}, expected one of {IMPLS}")
  if impl != "ref" and supported(kw["n_heads"], kw["n_kv_heads"], kw["head_dim"], kw["rope_dim"]) is None:
    return rope_write_pallas(qkv_TN, q_norm, k_norm, pos_T, ring_kv, interpret=impl == "interpret", tuning=tuning,
                             **kw)
  return rope_write_ref(qkv_TN, q_norm, k_norm, pos_T, ring_kv, **kw)
