"""Prefill attention over the KV ring: a flash-attention Pallas kernel for T > attention_pallas.MAX_T queries.

Same semantics as ops/attention.py::ring_attention_ref (one layer [R, Hkv, Dh] or a stack with its layer index;
f32 | bf16 | int8 with absmax scales): query t at position q_pos[t] sees key positions p with
max(length - R, 0) <= p <= q_pos[t]. It replaces the chunked jnp reference on the GPU for prompt chunks, whose
dynamic-bound block loops run as host-driven XLA while loops (one device-to-host wait per block and layer: 384
per 1,024-token call of the 30B shape) around float32 SIMT matmuls (docs/PERF.md, "Prefill").

Tiling.
  rows    a program takes BQ consecutive queries times the G = Hq/Hkv query heads of one kv head, row r =
          t*G + g (BM = BQ*G rows, a power of two >= 16); padded queries get position -1 (all masked).
  grid    (Hkv, ceil(T / BQ)). Program (h, j) runs an online softmax (float32) over the key tiles of `bk`
          positions from the first live tile to the tile of its own last query (causal: early programs stop
          early), reading K and V of head h straight from the ring (tile i = positions [i*bk, (i+1)*bk) in
          the contiguous slots from (i*bk) mod R; bk divides the ring's block, so a tile never wraps), and
          writes its normalised rows. The tile loop runs inside the kernel: no host round trip.
  dots    as the decode kernel (attention_pallas): bf16x2 for int8 and bf16 rings (K and V exact in bf16, q and
          p split into bf16 high + remainder, float32 accumulation), 3xTF32 for float32 rings.

The prefill pass is shared by plain and speculative decoding (a verify pass of up to MAX_T queries runs the
decode kernel), so this kernel needs no batch invariance; each row still depends on its own query only.
With `with_lse` it also returns each row's log-sum-exp of its scaled scores, for the exact merge with the host
tier's part (ops/attention.merge_lse), so prefill beside a tier runs the kernel too.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops.attention_pallas import _is_pow2, as_stack, dots_for, init_carry, live_tiles, tile_step
from ops.tuning import fill

class Tuning(NamedTuple):
  """The kernel's tuning; a field left None takes the table's (`config`): bm rows per program (BQ = bm / G queries
  of the G heads of one kv head, at least 16 rows), bk key positions per tile (the table's is capped by the
  ring's block), Triton warps and stages, the MMA scheme (attention_pallas.dots_for)."""
  bm: int | None = None
  bk: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  dots: str | None = None


# head_dim -> tuning.
TUNING = {
    64: Tuning(bm=64, bk=64, num_warps=4, num_stages=2, dots="bf16x2"),
    128: Tuning(bm=64, bk=64, num_warps=4, num_stages=2, dots="bf16x2"),
    256: Tuning(bm=32, bk=32, num_warps=4, num_stages=2, dots="bf16x2"),
}
DEFAULT_TUNING = Tuning(bm=64, bk=64, num_warps=4, num_stages=2, dots="bf16x2")


def config(head_dim: int, block: int, ring_dtype, tuning: Tuning | None = None) -> Tuning:
  """The complete tuning of a call: TUNING[head_dim] (bk capped by the ring's block) with the fields `tuning`
  sets, dots as `dots_for` the ring's dtype."""
  base = TUNING.get(head_dim, DEFAULT_TUNING)
  c = fill(tuning, base._replace(bk=min(base.bk, block)))
  return c._replace(dots=dots_for(c.dots, ring_dtype))


def queries_per_program(bm: int, G: int) -> int:
  """BQ for bm rows and group size G: at least 16 rows (tl.dot needs M >= 16)."""
  return max(1, bm // G, -(-16 // G))


def supported(n_heads: int, n_kv_heads: int, head_dim: int, block: int) -> str | None:
  """None when the kernel takes this shape, else the reason it does not."""
  if n_heads % n_kv_heads or not _is_pow2(n_heads // n_kv_heads):
    return f"Hq/Hkv = {n_heads}/{n_kv_heads} is not a power of two"
  if not (_is_pow2(head_dim) and head_dim >= 16):
    return f"head_dim={head_dim} is not a power of two >= 16"
  if not (_is_pow2(block) and block >= 16):
    return f"block={block} is not a power of two >= 16"
  return None


def _kernel(meta_ref, rowpos_ref, q_ref, k_ref, v_ref, *refs, bk: int, capacity: int, quant: bool, tc: bool,
            dots: str, with_lse: bool):
  """Program (h, j): rows of query block j under kv head h, online softmax over their live causal tiles."""
  refs = list(refs)
  lse_ref = refs.pop() if with_lse else None
  ks_ref, vs_ref, o_ref = refs if quant else (None, None, *refs)
  h = pl.program_id(0)
  layer, first, oldest = meta_ref[0], meta_ref[1], meta_ref[2]
  q = q_ref[...]                                   # [BM, Dh] float32, pre-scaled
  rowpos = rowpos_ref[...]                         # [BM] int32, -1 on padded rows
  end = jnp.max(rowpos) // bk + 1                  # one past the tile of the block's last query
  body = functools.partial(tile_step, q=q, rowpos=rowpos, k_ref=k_ref, v_ref=v_ref, ks_ref=ks_ref, vs_ref=vs_ref,
                           layer=layer, h=h, oldest=oldest, bk=bk, capacity=capacity, tc=tc, dots=dots)
  m, l, acc = lax.fori_loop(first, end, body, init_carry(*q.shape))
  o_ref[...] = acc / jnp.where(l > 0, l, 1.0)[:, None]
  if with_lse:                                     # as attention_with_lse: -inf where no key was visible
    lse_ref[...] = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("block", "scale", "interpret", "tuning", "with_lse"))
def prefill_attention_pallas(q_THDh, k_ring, v_ring, k_scale, v_scale, q_pos_T, length, layer=None, *, block: int,
                             scale: float, interpret: bool = False, tuning: Tuning | None = None,
                             with_lse: bool = False):
  """softmax(q k^T * scale) v over live causal keys, as ring_attention_ref, for any T. Returns [T, Hq, Dh] float32,
  and with with_lse (out, lse [T, Hq]) as ops.attention.attention_with_lse.

  k_ring/v_ring: [R, Hkv, Dh] (one layer, layer=None) or [L, R, Hkv, Dh] with `layer` an int32 scalar;
  k_scale/v_scale: [(L,) R, Hkv] or None. tuning (static): the fields to set over the table (`config`).

  >>> import numpy as np
  >>> from ops.attention import ring_attention_ref
  >>> r = np.random.default_rng(0)
  >>> q = jnp.asarray(r.standard_normal((40, 4, 64)), jnp.float32)
  >>> k, v = (jnp.asarray(r.standard_normal((256, 2, 64)), jnp.float32) for _ in range(2))
  >>> pos = jnp.arange(60, 100, dtype=jnp.int32)
  >>> out = prefill_attention_pallas(q, k, v, None, None, pos, 100, block=64, scale=0.125, interpret=True)
  >>> ref = ring_attention_ref(q, k, v, None, None, pos, 100, block=64, scale=0.125)
  >>> bool(jnp.allclose(out, ref, atol=1e-5))
  True
  """
  k_ring, v_ring, k_scale, v_scale, layer = as_stack(k_ring, v_ring, k_scale, v_scale, layer)
  T, Hq, Dh = q_THDh.shape
  _, R, Hkv, _ = k_ring.shape
  G = Hq // Hkv
  why = supported(Hq, Hkv, Dh, block)
  if why is not None:
    raise ValueError(f"prefill_attention_pallas: {why}")
  c = config(Dh, block, k_ring.dtype, tuning)
  bq, bk = queries_per_program(c.bm, G), c.bk
  if block % bk or R % block:
    raise ValueError(f"prefill_attention_pallas: need bk={bk} | block={block} | R={R}")
  BM = bq * G
  if not _is_pow2(BM) or BM < 16:
    raise ValueError(f"prefill_attention_pallas: bq={bq} x G={G} = {BM} rows, expected a power of two >= 16")
  dots = c.dots
  quant = k_scale is not None
  nq = -(-T // bq)
  pad = nq * bq - T

  length = jnp.asarray(length, jnp.int32)
  q_pos_T = jnp.asarray(q_pos_T, jnp.int32)
  first, _ = live_tiles(length, jnp.max(q_pos_T), R, bk)
  oldest = jnp.maximum(length - R, 0)
  meta = jnp.stack([jnp.asarray(layer, jnp.int32), first, oldest, 0]).astype(jnp.int32)

  q = jnp.pad(q_THDh.astype(jnp.float32) * scale, ((0, pad), (0, 0), (0, 0)))
  q = q.reshape(nq, bq, Hkv, G, Dh).transpose(2, 0, 1, 3, 4).reshape(Hkv, nq, BM, Dh)
  rowpos = jnp.repeat(jnp.pad(q_pos_T, (0, pad), constant_values=-1), G).reshape(nq, BM)

  whole = lambda x: pl.BlockSpec(x.shape, lambda h, j: (0,) * x.ndim)  # noqa: E731
  in_specs = [whole(meta), pl.BlockSpec((None, BM), lambda h, j: (j, 0)),
              pl.BlockSpec((None, None, BM, Dh), lambda h, j: (h, j, 0, 0)), whole(k_ring), whole(v_ring)]
  args = [meta, rowpos, q, k_ring, v_ring]
  if quant:
    in_specs += [whole(k_scale), whole(v_scale)]
    args += [k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)]
  out_shape = [jax.ShapeDtypeStruct((Hkv, nq, BM, Dh), jnp.float32)]
  out_specs = [pl.BlockSpec((None, None, BM, Dh), lambda h, j: (h, j, 0, 0))]
  if with_lse:
    out_shape.append(jax.ShapeDtypeStruct((Hkv, nq, BM), jnp.float32))
    out_specs.append(pl.BlockSpec((None, None, BM), lambda h, j: (h, j, 0)))
  outs = pl.pallas_call(
      functools.partial(_kernel, bk=bk, capacity=R, quant=quant, tc=not interpret, dots=dots, with_lse=with_lse),
      out_shape=out_shape, grid=(Hkv, nq), in_specs=in_specs, out_specs=out_specs,
      compiler_params=plgpu.CompilerParams(num_warps=c.num_warps, num_stages=c.num_stages), interpret=interpret,
      name="ring_prefill_attention")(*args)
  out = outs[0].reshape(Hkv, nq, bq, G, Dh).transpose(1, 2, 0, 3, 4).reshape(nq * bq, Hq, Dh)[:T]
  if not with_lse:
    return out
  lse = outs[1].reshape(Hkv, nq, bq, G).transpose(1, 2, 0, 3).reshape(nq * bq, Hq)[:T]
  return out, lse
