"""Attention of T new queries over one layer of the KV ring: the jnp reference.

Work follows the live length, never the capacity: keys are visited in position blocks of `block` tokens,
from the first live block to the last, with an online softmax (float32). The loop bound and every block's
arithmetic depend on positions alone, so rings of different capacity give bitwise-equal results at any
depth both hold (DESIGN invariants 1 and 2). Block b holds positions [b*block, (b+1)*block), which sit in the
contiguous slots starting at (b*block) mod R because R is a multiple of `block`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

NEG_INF = -1e30


def _load_block(k_ring, v_ring, k_scale, v_scale, start_slot, block):
  k = jax.lax.dynamic_slice_in_dim(k_ring, start_slot, block, axis=0)
  v = jax.lax.dynamic_slice_in_dim(v_ring, start_slot, block, axis=0)
  if k_scale is not None:
    ks = jax.lax.dynamic_slice_in_dim(k_scale, start_slot, block, axis=0)
    vs = jax.lax.dynamic_slice_in_dim(v_scale, start_slot, block, axis=0)
    return k.astype(jnp.float32) * ks[..., None], v.astype(jnp.float32) * vs[..., None]
  return k.astype(jnp.float32), v.astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("block", "scale"))
def ring_attention_ref(q_THD, k_ring, v_ring, k_scale, v_scale, q_pos_T, length, *, block: int, scale: float):
  """softmax(q k^T * scale) v over live, causal keys.

  q_THD: [T, Hq, Dh] (after RoPE); k_ring/v_ring: [R, Hkv, Dh] (one layer, new rows already written);
  k_scale/v_scale: [R, Hkv] or None; q_pos_T: [T] absolute positions; length: positions written (int32).
  Key position p is visible to a query at q if p <= q and p >= length - R (not yet overwritten).
  Returns [T, Hq, Dh] float32.
  """
  T, Hq, Dh = q_THD.shape
  R, Hkv, _ = k_ring.shape
  G = Hq // Hkv
  q = q_THD.astype(jnp.float32).reshape(T, Hkv, G, Dh) * scale
  oldest = jnp.maximum(length - R, 0)
  first_blk = oldest // block
  last_blk = (jnp.max(q_pos_T) // block)                 # no key beyond the last query is ever visible

  def body(b, carry):
    m, l, acc = carry
    start = b * block
    k, v = _load_block(k_ring, v_ring, k_scale, v_scale, start % R, block)
    s = jnp.einsum("tkgd,skd->tkgs", q, k)              # [T, Hkv, G, block]
    kpos = start + jnp.arange(block, dtype=jnp.int32)
    ok = (kpos[None, :] <= q_pos_T[:, None]) & (kpos[None, :] >= oldest)   # [T, block]
    s = jnp.where(ok[:, None, None, :], s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.exp(s - m_new[..., None])
    p = jnp.where(ok[:, None, None, :], p, 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + jnp.sum(p, axis=-1)
    acc = acc * corr[..., None] + jnp.einsum("tkgs,skd->tkgd", p, v)
    return m_new, l, acc

  init = (jnp.full((T, Hkv, G), NEG_INF, jnp.float32), jnp.zeros((T, Hkv, G), jnp.float32),
          jnp.zeros((T, Hkv, G, Dh), jnp.float32))
  m, l, acc = jax.lax.fori_loop(first_blk, last_blk + 1, body, init)
  out = acc / jnp.where(l > 0, l, 1.0)[..., None]
  return out.reshape(T, Hq, Dh)


def ring_attention(q_THD, k_ring, v_ring, k_scale, v_scale, q_pos_T, length, *, block: int, scale: float):
  """Dispatcher (the Pallas decode kernel plugs in here)."""
  return ring_attention_ref(q_THD, k_ring, v_ring, k_scale, v_scale, q_pos_T, length, block=block, scale=scale)
