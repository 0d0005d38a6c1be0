"""RoPE and the ring write inside the decode attention kernel: the launch of ops/rope_write_pallas folded into
ops/attention_pallas's split kernel (`Tunings.fuse` "rope", issue 27 item 3).

Program (h, s) of the split kernel (grid (Hkv, S), strided tiles: attention_pallas) starts from the fused q/k/v
matmul's output instead of a rotated q:
  q rows     the G q heads of kv head h for the T tokens (row r = t*G + g, padded to P as `gather_rows` pads),
             each loaded twice from qkv: in natural order and with its rotated halves swapped (a gathered load,
             column c <- c +- rope_dim/2), so NEOX RoPE is x cos + x_swapped (-sin | +sin) with no lane
             permutation; normed per head first (qk_norm models), as rope_write_pallas norms them.
  new rows   the T new K and V rows of head h, normed, rotated and rounded for the ring as rope_write_pallas
             rounds them (int8 absmax codes and scales, or a cast), one row at a time in registers.
  write      program (h, 0) stores them at slots pos mod R of the ring, which is aliased in and out.
  tiles      the split kernel's loop (attention_pallas.tile_step); a tile from the first new position on takes
             the new rows from registers (a select by position) instead of its loaded slots, so no program
             depends on when (h, 0)'s stores land. Tiles before it run unchanged.
The partials merge in attention_pallas.merge_splits. With `with_q` the programs (h, 0) also write the rotated q
[T, Hq, Dh] (the host tier's attention needs it).

Arithmetic: the tile loop, the masks and the merge are the split kernel's, so rows and tiles keep its invariants
(a verify pass's rows are the steps' bitwise; rings of any capacity agree). The q rows' norm sums their squares
from a [P, 1, Dh] load of its own: Triton's coalescing gives every load of one shape the widest vector among them,
so a [P, Dh] load takes the int8 ring tiles' [bk, Dh] layout when P == bk and sums in another order than at other
P (seen on an H100 at head dim 256, T = 4: the pass differed from its steps by ~5e-7; docs/PERF.md 2026-12-06),
where the [P, 1, Dh] shape, which no tile has, reduces alike at every P. A model folds every decode and verify pass
or none (model.transformer.Attention._folds_rope): a step through this kernel and a pass through rope_write_pallas
and the split kernel norm and rotate in different code and need not agree bitwise on a GPU. The rotation computes
x*cos + xs*(-sin) where rope_write_pallas computes x1*cos - x2*sin: equal in exact arithmetic, and within a
rounding of each other when a compiler contracts them differently. Reference: `rope_attention_ref` (rope_write_ref, then the attention
reference over the written ring); `rope_attention` dispatches.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops import attention, attention_pallas as ap, rope_write_pallas as rw


def supported(T: int, n_heads: int, n_kv_heads: int, head_dim: int, rope_dim: int, block: int, k_ring) -> str | None:
  """None when the folded kernel takes this call (the split kernel's shapes, rope_write's, and a power-of-two
  group for the merge kernel), else why not."""
  why = (ap.supported(T, n_heads, n_kv_heads, head_dim, block, k_ring)
         or rw.supported(n_heads, n_kv_heads, head_dim, rope_dim))
  if why is None and not ap._is_pow2(n_heads // n_kv_heads):
    why = f"G={n_heads // n_kv_heads} q heads per kv head is not a power of two"
  return why


def rope_attention_ref(qkv_TN, q_norm, k_norm, pos_T, ring_kv, length, *, n_heads: int, n_kv_heads: int,
                       head_dim: int, rope_dim: int, theta: float, offset: int, eps: float, block: int, scale: float,
                       with_lse: bool = False, lo_T=None, with_q: bool = False):
  """rope_write_ref, then attention over the written ring (ops.attention's reference): (out [T, Hq, Dh] or (out,
  lse), the ring arrays (k, v, k_scale, v_scale), and q when with_q)."""
  q, ring = rw.rope_write_ref(qkv_TN, q_norm, k_norm, pos_T, ring_kv, n_heads=n_heads, n_kv_heads=n_kv_heads,
                              head_dim=head_dim, rope_dim=rope_dim, theta=theta, offset=offset, eps=eps)
  out = attention.ring_attention(q, *ring, pos_T, length, block=block, scale=scale, impl="ref", with_lse=with_lse,
                                 lo_T=lo_T)
  return (out, ring, q) if with_q else (out, ring)


def _kernel(meta_ref, qpos_ref, lo_ref, freq_ref, qkv_ref, *refs, bk: int, capacity: int, quant: bool, tc: bool,
            dots: str, T: int, G: int, P: int, Hq: int, Hkv: int, Dh: int, half: int, offset: int, eps: float,
            qk_norm: bool, scale: float, n_splits: int, with_q: bool):
  """Program (h, s): kv head h's q rows and new rows from qkv, its strided tiles (the split kernel's loop), and
  with s == 0 the ring write (and q out)."""
  refs = list(refs)
  qn_ref, kn_ref = (refs.pop(0), refs.pop(0)) if qk_norm else (None, None)
  k_ref, v_ref = refs.pop(0), refs.pop(0)
  ks_ref, vs_ref = (refs.pop(0), refs.pop(0)) if quant else (None, None)
  o_ref, m_ref, l_ref = refs.pop(0), refs.pop(0), refs.pop(0)
  q_out = refs.pop(0) if with_q else None
  k_out, v_out, *scale_out = refs
  h, s = pl.program_id(0), pl.program_id(1)
  layer, first = meta_ref[0], meta_ref[1]
  end = first + meta_ref[2]                  # one past the last live tile
  fresh_tile = meta_ref[3]                   # the tile of the first new position
  W = Hq + 2 * Hkv                           # head rows in a token's qkv row
  rd = 2 * half

  col = lax.broadcasted_iota(jnp.int32, (Dh,), 0)
  swap = jnp.where(col < half, col + half, jnp.where(col < rd, col - half, col))     # rotated halves exchanged

  def trig(p):
    """(cos, -sin | +sin) per column at position p [Dh], 1 and 0 past the rotated columns."""
    ang = (p + offset).astype(jnp.float32) * freq_ref[jnp.where(col < rd, col % half, 0)]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    return jnp.where(col < rd, cos, 1.0), jnp.where(col < half, -sin, jnp.where(col < rd, sin, 0.0))

  def rotated(base, cs, w_ref):
    """qkv's rows at element offsets `base` ([N, 1], or a scalar for one row), normed when w_ref, rotated by
    cs = (cos, sin) columns (broadcasting to the rows): [N, Dh] (or [Dh])."""
    x, xs = qkv_ref[base + col], qkv_ref[base + swap]
    if w_ref is not None:                    # rms_norm over the head's row, as rope_write_pallas
      if jnp.ndim(base):                     # the q rows: sums of squares from a [N, 1, Dh] load (module doc)
        x3 = qkv_ref[base[:, :, None] + col[None, None, :]]                           # [N, 1, Dh]
        r = lax.rsqrt(jnp.mean(x3 * x3, axis=-1) + eps)                                # [N, 1]
      else:
        r = lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
      x, xs = x * r * w_ref[col], xs * r * w_ref[swap]
    return x * cs[0] + xs * cs[1]

  # q rows of kv head h, rotated, as gather_rows lays them out; each token's cos / sin computed once
  r = lax.broadcasted_iota(jnp.int32, (P,), 0)
  t_r = jnp.minimum(r // G, T - 1)
  cs = trig(qpos_ref[0])
  cos_r, sin_r = cs[0][None, :], cs[1][None, :]
  for t in range(1, T):
    c_t, s_t = trig(qpos_ref[t])
    cos_r = jnp.where((t_r == t)[:, None], c_t[None, :], cos_r)
    sin_r = jnp.where((t_r == t)[:, None], s_t[None, :], sin_r)
  q = rotated((t_r * W + h * G + r % G)[:, None] * Dh, (cos_r, sin_r), qn_ref)
  rowpos = jnp.where(r < T * G, qpos_ref[t_r], -1)
  oldest = ap.row_values(lo_ref, T=T, G=G, P=P)[:, None]

  # the T new rows of head h as the ring holds them, values in the ring's dtype (int8: codes as float32 integers)
  def stored(y):
    if not quant:
      return y.astype(k_out.dtype), None
    sc = jnp.max(jnp.abs(y)) / 127.0
    return jnp.clip(rw.round_half_even(y / jnp.where(sc > 0, sc, 1.0)), -127.0, 127.0), sc

  def new_rows():
    """(position, k, v, k scale, v scale) of each new row, computed after the loop over the tiles before the
    first new position, so that none is live in registers across it."""
    rows = []
    for t in range(T):
      p = qpos_ref[t]
      k_t, ks_t = stored(rotated((t * W + Hq + h) * Dh, trig(p), kn_ref))
      v_t, vs_t = stored(qkv_ref[pl.ds((t * W + Hq + Hkv + h) * Dh, Dh)])
      rows.append((p, k_t, v_t, ks_t, vs_t))
    return rows

  def fresh(kpos, k, v, ks, vs, new):
    for p, k_t, v_t, ks_t, vs_t in new:
      hit = kpos == p                                                    # [bk]
      k = jnp.where(hit[:, None], k_t.astype(k.dtype)[None, :], k)
      v = jnp.where(hit[:, None], v_t.astype(v.dtype)[None, :], v)
      if quant:
        ks, vs = jnp.where(hit, ks_t, ks), jnp.where(hit, vs_t, vs)
    return k, v, ks, vs

  # tiles from the first new position's on hold new rows: at most two (T <= bk), each another program's
  start, count = ap.strided_tiles(s, first, end, n_splits)
  n_old = jnp.clip((fresh_tile - start + n_splits - 1) // n_splits, 0, count)     # this program's tiles before it
  body = functools.partial(ap.tile_step, q=q * scale, rowpos=rowpos, k_ref=k_ref, v_ref=v_ref, ks_ref=ks_ref,
                           vs_ref=vs_ref, layer=layer, h=h, oldest=oldest, bk=bk, capacity=capacity, tc=tc, dots=dots)
  carry = lax.fori_loop(0, n_old, lambda j, c: body(start + j * n_splits, c), ap.init_carry(P, Dh))
  new = new_rows()
  m, l, acc = lax.fori_loop(n_old, count, lambda j, c: body(start + j * n_splits, c,
                                                            fresh=functools.partial(fresh, new=new)), carry)
  o_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l

  @pl.when(s == 0)
  def _():
    for p, k_t, v_t, ks_t, vs_t in new:
      slot = lax.rem(p, jnp.asarray(capacity, p.dtype))
      k_out[layer, slot, h, :] = k_t.astype(k_out.dtype)
      v_out[layer, slot, h, :] = v_t.astype(v_out.dtype)
      if quant:
        scale_out[0][layer, pl.ds(slot, 1), h] = jnp.full((1,), ks_t, jnp.float32)
        scale_out[1][layer, pl.ds(slot, 1), h] = jnp.full((1,), vs_t, jnp.float32)
    if with_q:                               # rows past T*G repeat row T*G - 1's value: a duplicate store
      q_out[(t_r * Hq + h * G + r % G)[:, None] * Dh + col[None, :]] = q


@functools.partial(jax.jit, static_argnames=("n_heads", "n_kv_heads", "head_dim", "rope_dim", "theta", "offset", "eps",
                                             "block", "scale", "interpret", "tuning", "with_lse", "with_q"))
def rope_attention_pallas(qkv_TN, q_norm, k_norm, pos_T, ring_kv, length, lo_T=None, *, n_heads: int,
                          n_kv_heads: int, head_dim: int, rope_dim: int, theta: float, offset: int, eps: float,
                          block: int, scale: float, interpret: bool = False, tuning: ap.Tuning | None = None,
                          with_lse: bool = False, with_q: bool = False):
  """The folded kernel and the merge; arguments and results as rope_attention_ref (length: positions written,
  the T new ones included). The ring arrays are one layer's [R, Hkv, Dh] (scales [R, Hkv]), updated in place
  inside a jitted step (aliased). tuning (static): the split kernel's (attention_pallas.config)."""
  T = qkv_TN.shape[0]
  Hq, Hkv, Dh = n_heads, n_kv_heads, head_dim
  kr, vr, ks, vs = ring_kv
  why = supported(T, Hq, Hkv, Dh, rope_dim, block, kr)
  if why is not None:
    raise ValueError(f"rope_attention_pallas: {why}")
  R = kr.shape[0]
  G = Hq // Hkv
  c = ap.config(Dh, block, Hkv, kr.dtype, tuning)
  bk, S = c.bk, c.n_splits
  if block % bk or R % block:
    raise ValueError(f"rope_attention_pallas: need bk={bk} | block={block} | R={R}")
  P = ap.rows_padded(T, G)
  quant = ks is not None
  qk_norm = q_norm is not None
  half = rope_dim // 2

  pos_T = jnp.asarray(pos_T, jnp.int32)
  lo_T, first, n_tiles = ap.live_window(length, lo_T, pos_T, R, bk)
  meta = jnp.stack([jnp.int32(0), first, n_tiles, jnp.min(pos_T) // bk, 0, 0, 0, 0]).astype(jnp.int32)
  freq = theta ** (-2.0 * jnp.arange(half, dtype=jnp.float32) / rope_dim)           # as rope_neox
  args = [meta, pos_T, lo_T, freq, qkv_TN.astype(jnp.float32).reshape(-1)]
  if qk_norm:
    args += [q_norm.astype(jnp.float32), k_norm.astype(jnp.float32)]
  ring = [kr[None], vr[None]] + ([ks[None], vs[None]] if quant else [])
  first_ring = len(args)
  args += ring
  out_shape, out_specs = ap.partial_outputs(Hkv, S, P, Dh)
  if with_q:
    out_shape.append(jax.ShapeDtypeStruct((T * Hq * Dh,), jnp.float32))
    out_specs.append(ap.whole(out_shape[-1]))
  n_out = len(out_shape)
  out_shape += [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in ring]
  out_specs += [ap.whole(a) for a in ring]
  kernel = functools.partial(
      _kernel, bk=bk, capacity=R, quant=quant, tc=not interpret, dots=c.dots, T=T, G=G, P=P, Hq=Hq, Hkv=Hkv, Dh=Dh,
      half=half, offset=offset, eps=eps, qk_norm=qk_norm, scale=scale, n_splits=S, with_q=with_q)
  outs = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(Hkv, S), in_specs=[ap.whole(a) for a in args], out_specs=out_specs,
      input_output_aliases={first_ring + i: n_out + i for i in range(len(ring))},
      compiler_params=plgpu.CompilerParams(num_warps=c.num_warps, num_stages=c.num_stages),
      interpret=interpret, name="rope_ring_attention")(*args)
  out = ap.merge_splits(*outs[:3], T=T, G=G, with_lse=with_lse, interpret=interpret)
  new = [a[0] for a in outs[n_out:]]
  new = (new[0], new[1], new[2] if quant else None, new[3] if quant else None)
  if with_q:
    return out, new, outs[3].reshape(T, Hq, Dh)
  return out, new


def rope_attention(qkv_TN, q_norm, k_norm, pos_T, ring_kv, length, lo_T=None, *, impl: str,
                   tuning: ap.Tuning | None = None, **kw):
  """Dispatcher: impl "pallas" | "interpret" runs the folded kernel where `supported`, "ref" (or a call it does not
  take) the reference."""
  if impl not in rw.IMPLS:
    raise ValueError(f"rope_attention: impl {impl!r}, expected one of {rw.IMPLS}")
  T = qkv_TN.shape[0]
  if impl != "ref" and supported(T, kw["n_heads"], kw["n_kv_heads"], kw["head_dim"], kw["rope_dim"], kw["block"],
                                 ring_kv[0]) is None:
    return rope_attention_pallas(qkv_TN, q_norm, k_norm, pos_T, ring_kv, length, lo_T, interpret=impl == "interpret",
                                 tuning=tuning, **kw)
  return rope_attention_ref(qkv_TN, q_norm, k_norm, pos_T, ring_kv, length, lo_T=lo_T, **kw)
