"""Attention of T new queries over one layer of the KV ring: the jnp reference.

Work follows the live length, never the capacity: keys are visited in position blocks of `block` tokens,
from the first live block to the last, with an online softmax (float32). The loop bound and every block's
arithmetic depend on positions alone, so rings of different capacity give bitwise-equal results at any
depth both hold (DESIGN invariants 1 and 2). Block b holds positions [b*block, (b+1)*block), which sit in the
contiguous slots starting at (b*block) mod R because R is a multiple of `block`.

`ring_attention` dispatches: the Pallas split-K decode kernel (ops/attention_pallas.py) for T <= 8 queries on
GPU, this reference on CPU and for prefill (chunked over queries, `ring_attention_ref_chunked`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ops import attention_pallas, on_gpu, prefill_attention_pallas
from ops.tuning import Tunings, pick

NEG_INF = -1e30
IMPLS = ("ref", "pallas", "interpret")
PREFILL_Q_CHUNK = 512          # queries per chunk of the prefill reference: [512, Hq, block] f32 scores live


def _rows(x, layer, start_slot, block):
  """x[layer, start_slot:start_slot + block] of a [L, R, ...] array (layer None: x[start_slot:...] of one layer
  [R, ...]), one dynamic slice (no layer copy); a slice of an array in host memory (a host tier on a GPU) is
  moved to the device, so only the visited blocks cross the bus."""
  if layer is None:
    return on_device(jax.lax.dynamic_slice(x, (start_slot,) + (0,) * (x.ndim - 1), (block,) + x.shape[1:]))
  idx = (layer, start_slot) + (0,) * (x.ndim - 2)
  return on_device(jax.lax.dynamic_slice(x, idx, (1, block) + x.shape[2:])[0])


def in_host_memory(x) -> bool:
  """Whether traced value x lives in host memory (jax memory space Host: pinned_host arrays inside jit)."""
  return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def on_device(x):
  """x moved to device memory inside jit when it lives in host memory; x itself otherwise."""
  return jax.device_put(x, jax.memory.Space.Device) if in_host_memory(x) else x


def _load_block(k_ring, v_ring, k_scale, v_scale, layer, start_slot, block):
  k = _rows(k_ring, layer, start_slot, block)
  v = _rows(v_ring, layer, start_slot, block)
  if k_scale is not None:
    ks = _rows(k_scale, layer, start_slot, block)
    vs = _rows(v_scale, layer, start_slot, block)
    return k.astype(jnp.float32) * ks[..., None], v.astype(jnp.float32) * vs[..., None]
  return k.astype(jnp.float32), v.astype(jnp.float32)


def _ref_core(q_THDh, k_ring, v_ring, k_scale, v_scale, q_pos_T, length, layer, block, scale, with_lse=False,
              lo_T=None):
  """The reference on a layer stack [L, R, Hkv, Dh] (scales [L, R, Hkv]) at layer `layer` (int32), or on one
  layer [R, Hkv, Dh] (layer None).
  with_lse: also return the log-sum-exp of the scores [T, Hq] (-inf where no key was visible), for merging.
  lo_T: None, or row t's first visible position [T] (at least length - R), as the decode kernel's."""
  T, Hq, Dh = q_THDh.shape
  R, Hkv, _ = k_ring.shape[-3:]
  G = Hq // Hkv
  q = q_THDh.astype(jnp.float32).reshape(T, Hkv, G, Dh) * scale
  oldest = jnp.maximum(length - R, 0)
  if lo_T is not None:
    oldest = jnp.maximum(jnp.asarray(lo_T, jnp.int32), oldest)[:, None]         # [T, 1]
  first_blk = jnp.min(oldest) // block
  last_blk = (jnp.max(q_pos_T) // block)                 # no key beyond the last query is ever visible

  def body(b, carry):
    m, l, acc = carry
    start = b * block
    k, v = _load_block(k_ring, v_ring, k_scale, v_scale, layer, start % R, block)
    s = jnp.einsum("tkgd,skd->tkgs", q, k)              # [T, Hkv, G, block]
    kpos = start + jnp.arange(block, dtype=jnp.int32)
    ok = (kpos[None, :] <= q_pos_T[:, None]) & (kpos[None, :] >= oldest)   # [T, block] (oldest: () or [T, 1])
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
  if with_lse:
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
    return out.reshape(T, Hq, Dh), lse.reshape(T, Hq)
  return out.reshape(T, Hq, Dh)


def attention_with_lse(q_THDh, k, v, k_scale, v_scale, q_pos_T, length, layer=None, *, block: int, scale: float,
                       lo_T=None):
  """The reference over one layer (layer None) or a stack, returning (out [T, Hq, Dh], lse [T, Hq]) for an
  exact merge of partial attentions."""
  k, v, k_scale, v_scale, layer = _stack(k, v, k_scale, v_scale, layer)
  return _ref_core(q_THDh, k, v, k_scale, v_scale, jnp.asarray(q_pos_T, jnp.int32), jnp.asarray(length, jnp.int32),
                   layer, block, scale, with_lse=True, lo_T=lo_T)


def merge_lse_pair(o1, lse1, o2, lse2):
  """merge_lse, also returning the merged log-sum-exp: folds partials one at a time (the tier's blocks). A partial
  with lse -inf (no visible key) leaves the other bitwise unchanged."""
  M = jnp.maximum(lse1, lse2)
  M = jnp.where(jnp.isfinite(M), M, 0.0)
  w1, w2 = jnp.exp(lse1 - M), jnp.exp(lse2 - M)
  tot = w1 + w2
  o = (o1 * w1[..., None] + o2 * w2[..., None]) / jnp.where(tot > 0, tot, 1.0)[..., None]
  return o, jnp.where(tot > 0, M + jnp.log(jnp.where(tot > 0, tot, 1.0)), -jnp.inf)


def tier_pieces(capacity: int, tier_block: int, tier_span: int | None = None) -> tuple[int, int]:
  """(block, span) in positions: the pieces tier_attention reads a tier of `capacity` positions in. The span
  (None: the block, i.e. blocks alone) is halved until it fits the tier, and is at least the block.

  >>> tier_pieces(139272, 4096, 16384), tier_pieces(1032, 256, 16384), tier_pieces(1032, 256)
  ((4096, 16384), (256, 1024), (256, 256))
  """
  tb, ts = tier_block, tier_span or tier_block
  if ts % tb:
    raise ValueError(f"tier_attention: tier_span {ts}, expected a multiple of tier_block {tb}")
  while ts > max(capacity, tb):                    # a span never runs past the tier (static shapes)
    ts //= 2
  return tb, ts


def tier_attention(q_THDh, k, v, k_scale, v_scale, q_hi_T, *, tier_block: int, block: int, scale: float,
                   tier_span: int | None = None, impl: str | None = None, tunings: Tunings | None = None):
  """Attention of T queries over a host tier (one layer [C, Hkv, Dh], position p in slot p), row t seeing
  positions 0 .. q_hi_T[t] (-1: none): (out [T, Hq, Dh], lse [T, Hq], -inf where nothing is visible).

  With a kernel (impl as ring_attention's) the tier moves to the device in pieces, each run through the kernel as
  a ring of one piece, and the pieces' partials fold in position order (merge_lse_pair). Row t visits the
  (q_hi_t + 1) // tier_span spans of `tier_span` positions it sees whole, then blocks of `tier_block` positions
  (tier_span a multiple of tier_block; None: tier_block alone) up to q_hi_t. Few large spans cut the per-piece
  cost (one copy per array, one kernel call, one loop test each: ~15 us on the H200), the blocks bound what is
  read past the last visible position. A row's pieces depend on its own q_hi_t alone: a piece the row does not
  take runs with the row masked (lse -inf), which merge_lse_pair leaves bitwise unchanged, so every row's
  arithmetic is the one-row call's at its bound. Decode and verify (T <= MAX_T) take the decode kernel, whose
  rows are independent: a verify pass's rows are then the steps' bitwise (DESIGN invariant 3). Prefill chunks take
  the prefill kernel, which never holds a [T, Hq, block] score array (the reference's is 512 MB per 4,096-position
  block at T = 1,024 on the seed-mtp shape). Otherwise the reference walks the tier in blocks of tier_block.
  tunings (static): as ring_attention's."""
  T, Hq, Dh = q_THDh.shape
  C = k.shape[0]
  chosen = impl or default_impl(T, tunings)
  q_hi_T = jnp.asarray(q_hi_T, jnp.int32)
  if T <= attention_pallas.MAX_T:
    kernel = None if attention_pallas.supported(T, Hq, k.shape[-2], Dh, block, k) else \
        functools.partial(attention_pallas.ring_attention_pallas, tuning=pick(tunings, "attention"))
  else:
    kernel = None if prefill_attention_pallas.supported(Hq, k.shape[-2], Dh, block) else \
        functools.partial(prefill_attention_pallas.prefill_attention_pallas, tuning=pick(tunings, "prefill_attention"))
  if chosen == "ref" or kernel is None:
    return attention_with_lse(q_THDh, k, v, k_scale, v_scale, q_hi_T, C, None, block=tier_block, scale=scale)
  tb, ts = tier_pieces(C, tier_block, tier_span)

  def piece(start, size, hi_T, carry):             # positions [start, start + size) as a ring of `size` slots
    blk = [None if x is None else _rows(x, None, start, size) for x in (k, v, k_scale, v_scale)]
    o, lse = kernel(q_THDh, *blk, jnp.minimum(hi_T, start + size - 1), start + size, block=min(block, size),
                    scale=scale, interpret=chosen == "interpret", with_lse=True)
    return merge_lse_pair(*carry, o, lse)

  carry = (jnp.zeros((T, Hq, Dh), jnp.float32), jnp.full((T, Hq), -jnp.inf, jnp.float32))
  spans_T = jnp.zeros_like(q_hi_T)                 # whole spans row t sees
  if ts > tb:
    spans_T = (jnp.maximum(q_hi_T, -1) + 1) // ts
    carry = jax.lax.fori_loop(0, jnp.max(spans_T), lambda j, c: piece(
        j * ts, ts, jnp.where(j < spans_T, q_hi_T, -1), c), carry)
  base = jnp.min(spans_T) * ts                     # the first position some row visits in blocks
  n = (jnp.maximum(jnp.max(q_hi_T) + 1 - base, 0) + tb - 1) // tb
  return jax.lax.fori_loop(0, n, lambda b, c: piece(
      base + b * tb, tb, jnp.where(base + b * tb >= spans_T * ts, q_hi_T, -1), c), carry)


def merge_lse(o1, lse1, o2, lse2):
  """Exact merge of two attention partials over disjoint key sets (float32)."""
  return merge_lse_pair(o1, lse1, o2, lse2)[0]


def _stack(k_ring, v_ring, k_scale, v_scale, layer):
  """One layer [R, Hkv, Dh] (layer None, kept as is: no op touches an array that may live in host memory) or a
  stack [L, R, Hkv, Dh] with its layer index as int32."""
  if layer is not None:
    return k_ring, v_ring, k_scale, v_scale, jnp.asarray(layer, jnp.int32)
  return k_ring, v_ring, k_scale, v_scale, None


@functools.partial(jax.jit, static_argnames=("block", "scale"))
def ring_attention_ref(q_THDh, k_ring, v_ring, k_scale, v_scale, q_pos_T, length, *, block: int, scale: float,
                       lo_T=None):
  """softmax(q k^T * scale) v over live, causal keys.

  q_THDh: [T, Hq, Dh] (after RoPE); k_ring/v_ring: [R, Hkv, Dh] (one layer, new rows already written);
  k_scale/v_scale: [R, Hkv] or None; q_pos_T: [T] absolute positions; length: positions written (int32).
  Key position p is visible to a query at q if p <= q and p >= length - R (not yet overwritten).
  Returns [T, Hq, Dh] float32.
  """
  k_ring, v_ring, k_scale, v_scale, layer = _stack(k_ring, v_ring, k_scale, v_scale, None)
  return _ref_core(q_THDh, k_ring, v_ring, k_scale, v_scale, q_pos_T, length, layer, block, scale, lo_T=lo_T)


@functools.partial(jax.jit, static_argnames=("block", "scale", "q_chunk"))
def ring_attention_ref_chunked(q_THDh, k_ring, v_ring, k_scale, v_scale, q_pos_T, length, layer=None, *,
                               block: int, scale: float, q_chunk: int = PREFILL_Q_CHUNK):
  """The reference for prefill: queries in chunks of `q_chunk` (lax.map), each chunk visiting blocks only up
  to its own last position (causal: about half the blocks of one pass), with [q_chunk, Hq, block] scores
  live at a time instead of [T, Hq, block]. Rings one layer (layer None) or a stack with `layer`.
  Chunking depends on T alone, so capacity invariance holds as for the reference."""
  k_ring, v_ring, k_scale, v_scale, layer = _stack(k_ring, v_ring, k_scale, v_scale, layer)
  length = jnp.asarray(length, jnp.int32)
  q_pos_T = jnp.asarray(q_pos_T, jnp.int32)
  T, Hq, Dh = q_THDh.shape
  if T <= q_chunk:
    return _ref_core(q_THDh, k_ring, v_ring, k_scale, v_scale, q_pos_T, length, layer, block, scale)
  n = -(-T // q_chunk)
  pad = n * q_chunk - T
  q = jnp.pad(q_THDh, ((0, pad), (0, 0), (0, 0))).reshape(n, q_chunk, Hq, Dh)
  pos = jnp.concatenate([q_pos_T, jnp.broadcast_to(q_pos_T[-1], (pad,))]).reshape(n, q_chunk)
  out = jax.lax.map(lambda qp: _ref_core(qp[0], k_ring, v_ring, k_scale, v_scale, qp[1], length, layer, block,
                                         scale), (q, pos))
  return out.reshape(n * q_chunk, Hq, Dh)[:T]


def default_impl(T: int, tunings: Tunings | None = None) -> str:
  """The impl a call of T queries takes without an explicit one: the tunings' attention_impl (decode and verify,
  T <= MAX_T) or prefill_attention_impl (prefill) where set; else "pallas" on a GPU backend (CUDA or ROCm: the
  decode kernel, and the prefill kernel, 286 against 325 ms with the chunked reference on the 30B prefill of
  1,024 tokens on the H200, docs/PERF.md "Prefill"), "ref" elsewhere."""
  chosen = pick(tunings, "attention_impl" if T <= attention_pallas.MAX_T else "prefill_attention_impl")
  if chosen is not None:
    return chosen
  return "pallas" if on_gpu() else "ref"


def ring_attention(q_THDh, k_ring, v_ring, k_scale, v_scale, q_pos_T, length, *, block: int, scale: float,
                   impl: str | None = None, layer=None, with_lse: bool = False, lo_T=None,
                   tunings: Tunings | None = None):
  """Dispatcher: the Pallas decode kernel (ops/attention_pallas.py, T <= MAX_T), the Pallas prefill kernel
  (ops/prefill_attention_pallas.py, T > MAX_T) or the jnp reference.

  impl (static): "ref" | "pallas" | "interpret" (the kernels in Pallas interpret mode, CPU tests) | None
  (default_impl, from `tunings`). tunings (static): the kernels' pieces (`attention`, `prefill_attention`) and the
  impl choice. Rings are one layer [R, Hkv, Dh] (layer None) or the whole stack
  [L, R, Hkv, Dh] with `layer` (int or int32 scalar): pass the stack, since slicing `ring.k[L]` outside
  makes XLA copy the whole layer (R-proportional bytes) before a custom call or a loop.
  Under the default impl, shapes the kernel does not take (see attention_pallas.supported) fall back to the
  reference; an explicit "pallas"/"interpret" raises instead.
  with_lse (static): return (out, lse [T, Hq]) for an exact merge with another partial (the ring beside a host
  tier), from either kernel; the reference then runs unchunked (attention_with_lse).
  lo_T: None, or each row's first visible position [T] (decode and verify, T <= MAX_T: the ring beside a host
  tier, where row t sees the window of the step at its position).
  """
  T, Hq, Dh = q_THDh.shape
  chosen = impl or default_impl(T, tunings)
  if chosen not in IMPLS:
    raise ValueError(f"ring_attention: impl {impl!r}, expected one of {IMPLS}")
  if lo_T is not None and T > attention_pallas.MAX_T:
    raise ValueError(f"ring_attention: per-row windows (lo_T) are for T <= {attention_pallas.MAX_T}, got T={T}")
  if chosen != "ref" and T <= attention_pallas.MAX_T:
    why = attention_pallas.supported(T, Hq, k_ring.shape[-2], Dh, block, k_ring)
    if why is None:
      return attention_pallas.ring_attention_pallas(
          q_THDh, k_ring, v_ring, k_scale, v_scale, q_pos_T, length, layer, block=block, scale=scale,
          interpret=chosen == "interpret", with_lse=with_lse, lo_T=lo_T, tuning=pick(tunings, "attention"))
    if impl is not None:
      raise ValueError(f"ring_attention: impl={impl!r} cannot take this call: {why}")
  elif chosen != "ref":
    why = prefill_attention_pallas.supported(Hq, k_ring.shape[-2], Dh, block)
    if why is None:
      return prefill_attention_pallas.prefill_attention_pallas(
          q_THDh, k_ring, v_ring, k_scale, v_scale, q_pos_T, length, layer, block=block, scale=scale,
          interpret=chosen == "interpret", with_lse=with_lse, tuning=pick(tunings, "prefill_attention"))
    if impl is not None:
      raise ValueError(f"ring_attention: impl={impl!r} cannot take this prefill call: {why}")
  if with_lse:
    return attention_with_lse(q_THDh, k_ring, v_ring, k_scale, v_scale, q_pos_T, length, layer, block=block,
                              scale=scale, lo_T=lo_T)
  if lo_T is not None:
    k, v, ks, vs, layer = _stack(k_ring, v_ring, k_scale, v_scale, layer)
    return _ref_core(q_THDh, k, v, ks, vs, jnp.asarray(q_pos_T, jnp.int32), jnp.asarray(length, jnp.int32), layer,
                     block, scale, lo_T=lo_T)
  if layer is None and T <= PREFILL_Q_CHUNK:
    return ring_attention_ref(q_THDh, k_ring, v_ring, k_scale, v_scale, q_pos_T, length, block=block, scale=scale)
  return ring_attention_ref_chunked(q_THDh, k_ring, v_ring, k_scale, v_scale, q_pos_T, length, layer, block=block,
                                    scale=scale)
