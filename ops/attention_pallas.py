"""Decode attention over the KV ring: a split-K (flash-decoding) Pallas kernel, Triton lowering.

For T = 1..MAX_T new queries (a plain decode step, or the verify pass of k+1 drafts) against one layer of the
ring `[L, R, Hkv, Dh]` (f32 | bf16 | int8 with absmax scales `[L, R, Hkv]`); same semantics as
ops/attention.py::ring_attention_ref.

Tiling.
  rows    all G = Hq/Hkv query heads of one kv head times the T queries, row r = t*G + g, padded to
          P = max(16, next_pow2(T*G)) rows (tl.dot needs M >= 16); padded rows get position -1 (all masked).
          The kernel gathers and scales its rows from q [T, Hq, Dh] itself (`gather_rows`: no XLA kernel
          before it).
  tiles   key *position* tiles of `bk` tokens (bk divides the ring's `block`, so bk divides R and a tile
          never straddles the wrap): tile i holds positions [i*bk, (i+1)*bk) in the contiguous slots from
          (i*bk) mod R. Live tiles run from oldest//bk to max(q_pos)//bk, oldest = max(length - R, 0):
          only live tiles are ever read, and at depths below R the range is [0, max(q_pos)//bk], the
          same for every capacity.
  grid    (Hkv, S) programs, S = max_splits(Hkv) a static constant (never a function of R). Program (h, s)
          runs an online softmax (float32) over the live tiles i with i mod S == s, in increasing i (a strided
          schedule: which program takes a tile and in what order depends on the tile's absolute index alone,
          never on where the live range starts or how long it is), and writes an unnormalised partial (acc
          [P, Dh], running max m [P], sum l [P]); a program without a live tile writes (0, NEG_INF, 0).
          `split_schedule(n_live_tiles, S)` gives the busy programs and the most tiles one visits. A second
          kernel merges the partials by log-sum-exp over the static S axis (`merge_splits`: batch-invariant,
          and it writes [T, Hq, Dh] directly).
  windows each row sees positions lo_t <= p <= q_pos_t: lo_t = max(length - R, 0) for every row, or a per-row
          `lo_T` (the model passes it beside a host tier, where row t's window is [q_pos_t + 1 - W, q_pos_t]
          exactly as in the step that decodes position q_pos_t alone). A tile wholly outside a row's window
          leaves that row's (m, l, acc) bitwise unchanged (masked scores give p = 0 and a correction of
          exp(0) = 1), so a row's result depends only on the tiles it sees: a verify pass's row t equals the step
          at q_pos_t bitwise however the pass's live range differs from the step's (DESIGN invariant 3; a split
          into contiguous runs of tiles would move its boundaries with the pass's first tile and tile count).
  loads   per tile: K, V [bk, Dh] of head h (strided by Hkv*Dh in the ring), converted to bf16 (float32 for
          tf32x3) in registers; int8 scales [bk] apply around the dots (never dequantized in memory).
  dots    q [P, Dh] x K^T [Dh, bk] and p [P, bk] x V [bk, Dh] on the tensor cores. Default (the table's,
          "bf16x2"): the ring's values are exact in bf16 (int8 integers, or a bf16 ring), so K and V load as
          bf16 and only q and p are split into a bf16 high part and a bf16 remainder: two bf16 MMAs per dot,
          float32 accumulation, ~16 significant bits of q and p (3e-6 relative against the float32
          reference). "tf32x3" (each float32 operand split into TF32 high and remainder, three MMAs: about
          float32 accuracy) stays for float32 rings and on request; it is compute-bound on the H200 (1.7x
          slower at 32K). The int8 K scale multiplies the scores column after the dot and the V scale
          multiplies p's column before it. Every output row depends only on its own query row (an MMA's
          row is a dot of that row), so 1 query and k+1 verify queries agree.

The model's ring keeps one array per layer (model/kv_ring.py), passed as is; a caller holding a stacked
[L, R, ...] ring passes it whole with the layer index (`layer=`, an int32 input): slicing `ring.k[L]` outside
would make XLA copy the layer (R-proportional bytes) before the custom call. Per-row arithmetic depends on
positions only, and the schedule on the live tile count only, so rings of any capacity give bitwise-equal
outputs at depths they both hold (DESIGN invariants 1 and 2).

Triton caveat (jax 0.11.2): the lowering computes element offsets in int32 unless an array exceeds 2**32
bytes; an int8 ring of 2**31..2**32 elements (e.g. 48 layers x 128K x 4 x 128) would overflow, so
`supported()` refuses it and the dispatcher falls back to the reference.
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

NEG_INF = -1e30          # as the reference: finite, so exp(NEG_INF - NEG_INF) = 1 never makes a NaN
MAX_T = 8                # queries per call the kernel takes (decode, verify of up to 7 drafts); more -> reference
TARGET_PROGRAMS = 256    # ~ two programs per SM on an H200 (132 SMs): S = TARGET_PROGRAMS / Hkv splits
MAX_SPLITS = 64

class Tuning(NamedTuple):
  """The kernel's tuning; a field left None takes the table's (`config`): bk key positions per tile (the table's
  is capped by the ring's block), Triton warps and stages, the MMA scheme `dots` ("tf32x3" | "bf16x2"; float32
  rings always run tf32x3, `dots_for`) and n_splits programs per kv head (`max_splits`)."""
  bk: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  dots: str | None = None
  n_splits: int | None = None


DOTS = ("tf32x3", "bf16x2")
# head_dim -> tuning. bf16x2 for int8 and bf16 rings (exact in bf16): 30B step at 32K 8.28 -> 6.43 ms on the H200
# (PERF.md).
TUNING = {
    64: Tuning(bk=128, num_warps=4, num_stages=2, dots="bf16x2"),
    128: Tuning(bk=64, num_warps=4, num_stages=2, dots="bf16x2"),
    256: Tuning(bk=32, num_warps=4, num_stages=2, dots="bf16x2"),
}
DEFAULT_TUNING = Tuning(bk=64, num_warps=4, num_stages=2, dots="bf16x2")


def config(head_dim: int, block: int, n_kv_heads: int, ring_dtype, tuning: Tuning | None = None) -> Tuning:
  """The complete tuning of a call: TUNING[head_dim] (bk capped by the ring's block, n_splits `max_splits`) with
  the fields `tuning` sets, dots as `dots_for` the ring's dtype."""
  base = TUNING.get(head_dim, DEFAULT_TUNING)
  base = base._replace(bk=min(base.bk, block), n_splits=max_splits(n_kv_heads))
  c = fill(tuning, base)
  return c._replace(dots=dots_for(c.dots, ring_dtype))


def is_spec(spec: str) -> bool:
  """Whether `spec` parses (parse_spec), for flag validators."""
  try:
    parse_spec(spec)
  except ValueError:
    return False
  return True


def parse_spec(spec: str) -> Tuning:
  """'dots[:bk:warps:stages]' (benchmarks' kernel variants) -> the Tuning it names; ValueError names what was
  expected."""
  parts = spec.split(":")
  if parts[0] not in DOTS or len(parts) not in (1, 4) or not all(x.isdigit() and int(x) > 0 for x in parts[1:]):
    raise ValueError(f"attention kernel spec {spec!r}, expected dots[:bk:warps:stages] with dots in {DOTS}")
  if len(parts) == 1:
    return Tuning(dots=parts[0])
  bk, warps, stages = (int(x) for x in parts[1:])
  return Tuning(bk=bk, num_warps=warps, num_stages=stages, dots=parts[0])


def max_splits(n_kv_heads: int) -> int:
  """Static number of split programs per kv head: a power of two, from the head count only."""
  s = max(1, TARGET_PROGRAMS // n_kv_heads)
  return min(MAX_SPLITS, 1 << (s.bit_length() - 1))


def _is_pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def rows_padded(T: int, G: int) -> int:
  return max(16, 1 << max(0, (T * G - 1).bit_length()))


def supported(T: int, n_heads: int, n_kv_heads: int, head_dim: int, block: int, k_ring) -> str | None:
  """None when the kernel takes this call, else the reason it does not."""
  if T > MAX_T:
    return f"T={T} > MAX_T={MAX_T} (prefill stays on the reference)"
  if n_heads % n_kv_heads:
    return f"Hq={n_heads} not a multiple of Hkv={n_kv_heads}"
  if not (_is_pow2(head_dim) and head_dim >= 16):
    return f"head_dim={head_dim} is not a power of two >= 16"
  if not (_is_pow2(block) and block >= 16):
    return f"block={block} is not a power of two >= 16"
  n = math.prod(k_ring.shape)
  itemsize = jnp.dtype(k_ring.dtype).itemsize
  if n >= 2**31 and n * itemsize <= 2**32:
    return f"ring of {n} elements x {itemsize} B overflows the Triton lowering's int32 offsets"
  return None


def live_tiles(length, q_pos_max, capacity: int, tile: int):
  """(first live tile, number of live tiles): tiles that hold a position in [max(length - R, 0), q_pos_max].

  Below the capacity (length <= R) this is (0, q_pos_max // tile + 1): independent of R."""
  oldest = jnp.maximum(jnp.asarray(length, jnp.int32) - capacity, 0)
  first = oldest // tile
  return first, jnp.asarray(q_pos_max, jnp.int32) // tile - first + 1


def split_schedule(n_tiles, n_splits_max: int):
  """(busy programs, most tiles one program visits) for `n_tiles` consecutive live tiles under the strided
  schedule (tile i to program i mod S): (min(n, S), ceil(n / S)), a function of the live tile count alone.
  Works on Python ints and traced int32 scalars."""
  n = jnp.maximum(jnp.asarray(n_tiles, jnp.int32), 1)
  return jnp.minimum(n, n_splits_max), (n + n_splits_max - 1) // n_splits_max


def strided_tiles(s, first, end, n_splits: int):
  """(first tile, count) of program s under the strided schedule over live tiles [first, end): tiles
  i = start + j * n_splits, j < count, with start the first i >= first such that i mod n_splits == s."""
  start = first + lax.rem(s - lax.rem(first, n_splits) + n_splits, n_splits)
  return start, jnp.maximum((end - start + n_splits - 1) // n_splits, 0)


def _dot(a, b, b_contract: int, tc: bool):
  """2-D float32 dot contracting a's last axis with b's axis `b_contract`: 3xTF32 on the tensor cores when
  `tc` (compiled), float32 otherwise (interpret mode on CPU, which has no TF32 algorithm)."""
  prec = lax.DotAlgorithmPreset.TF32_TF32_F32_X3 if tc else lax.Precision.HIGHEST
  return lax.dot_general(a, b, (((1,), (b_contract,)), ((), ())), precision=prec,
                         preferred_element_type=jnp.float32)


def _dot_bf16x2(a, b, b_contract: int):
  """The same dot with `b` exact in bf16 (int8 integers or a bf16 ring) and float32 `a` split into a bf16 high
  part and a bf16 remainder: two bf16 MMAs, float32 accumulation, ~16 significant bits of `a` (relative
  error ~1e-5), half the MMAs of 3xTF32 at twice the rate. Same arithmetic in interpret mode."""
  a_hi = a.astype(jnp.bfloat16)
  a_lo = (a - a_hi.astype(jnp.float32)).astype(jnp.bfloat16)
  dims = (((1,), (b_contract,)), ((), ()))
  return (lax.dot_general(a_hi, b, dims, preferred_element_type=jnp.float32)
          + lax.dot_general(a_lo, b, dims, preferred_element_type=jnp.float32))


def dots_for(dots: str | None, ring_dtype) -> str:
  """The dot mode a call runs: `dots` (None: bf16x2); float32 rings always 3xTF32 (not exact in bf16)."""
  dots = dots or "bf16x2"
  if dots not in DOTS:
    raise ValueError(f"ring_attention_pallas: dots {dots!r}, expected one of {DOTS}")
  return "tf32x3" if jnp.dtype(ring_dtype) == jnp.float32 else dots


def tile_step(i, carry, q, rowpos, k_ref, v_ref, ks_ref, vs_ref, *, layer, h, oldest, bk: int, capacity: int,
              tc: bool, dots: str, fresh=None):
  """One key tile of an online softmax (float32): rows q [P, Dh] (pre-scaled) at positions rowpos [P] against
  key tile i of kv head h (positions [i*bk, (i+1)*bk), slots from (i*bk) mod R), masked to oldest <= p <= row
  position (oldest: a scalar, or per row [P, 1]); carry (running max m [P], sum l [P], acc [P, Dh]). Shared by the
  decode and prefill kernels. fresh: None, or fresh(kpos [bk], k, v, ks, vs) -> (k, v, ks, vs), the tile with
  rows replaced in registers (ops/rope_attention_pallas: the pass's new rows, not read back from the ring)."""
  m, l, acc = carry
  slot0 = pl.multiple_of(lax.rem(i, capacity // bk) * bk, bk)
  kv_t = jnp.bfloat16 if dots == "bf16x2" else jnp.float32
  k = k_ref[layer, pl.ds(slot0, bk), h, :].astype(kv_t)              # [bk, Dh] (int8: the integers)
  v = v_ref[layer, pl.ds(slot0, bk), h, :].astype(kv_t)
  ks = vs = None
  if ks_ref is not None:
    ks, vs = ks_ref[layer, pl.ds(slot0, bk), h], vs_ref[layer, pl.ds(slot0, bk), h]
  if fresh is not None:
    k, v, ks, vs = fresh(i * bk + lax.broadcasted_iota(jnp.int32, (bk,), 0), k, v, ks, vs)
  dot = _dot_bf16x2 if dots == "bf16x2" else functools.partial(_dot, tc=tc)
  sc = dot(q, k, 1)                                                      # [P, bk] = q k^T
  if ks is not None:
    sc = sc * ks[None, :]
  kpos = i * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
  ok = (kpos <= rowpos[:, None]) & (kpos >= oldest)                     # [P, bk]
  sc = jnp.where(ok, sc, NEG_INF)
  m_new = jnp.maximum(m, jnp.max(sc, axis=1))
  p = jnp.where(ok, jnp.exp(sc - m_new[:, None]), 0.0)
  corr = jnp.exp(m - m_new)
  l = l * corr + jnp.sum(p, axis=1)
  pv = p * vs[None, :] if vs is not None else p
  acc = acc * corr[:, None] + dot(pv, v, 0)
  return m_new, l, acc


def init_carry(P: int, Dh: int):
  return jnp.full((P,), NEG_INF, jnp.float32), jnp.zeros((P,), jnp.float32), jnp.zeros((P, Dh), jnp.float32)


def as_stack(k_ring, v_ring, k_scale, v_scale, layer):
  """(k, v, k_scale, v_scale, layer) as [L, R, ...] stacks with a layer index: one layer (layer None) becomes a
  stack of one at index 0."""
  if layer is not None:
    return k_ring, v_ring, k_scale, v_scale, layer
  if k_scale is not None:
    k_scale, v_scale = k_scale[None], v_scale[None]
  return k_ring[None], v_ring[None], k_scale, v_scale, 0


def gather_rows(q_ref, qpos_ref, h, *, T: int, G: int, P: int, scale: float):
  """Rows of kv head h for a program: q [P, Dh] (scaled) and rowpos [P], row r = t*G + g taken straight from q
  [T*Hq, Dh] (row t*Hq + h*G + g) and the query positions [T]; rows r >= T*G repeat a real row and get position -1
  (all keys masked). Done in the kernel, so no XLA pad/transpose runs before it."""
  r = lax.broadcasted_iota(jnp.int32, (P,), 0)
  t = jnp.minimum(r // G, T - 1)
  Hq = q_ref.shape[0] // T
  q = q_ref[t * Hq + h * G + r % G, :].astype(jnp.float32) * scale
  rowpos = jnp.where(r < T * G, qpos_ref[t], -1)
  return q, rowpos


def row_values(ref, *, T: int, G: int, P: int):
  """A per-query value [T] (ref) spread over the program's rows [P] (row r = t*G + g; padding repeats query T-1)."""
  r = lax.broadcasted_iota(jnp.int32, (P,), 0)
  return ref[jnp.minimum(r // G, T - 1)]


def live_window(length, lo_T, q_pos_T, capacity: int, bk: int):
  """(lo_T [T], first live tile, live tile count) of a call: each row's first visible position (lo_T None: every
  row's is max(length - R, 0); given: at least that, older slots are overwritten), the oldest row's first tile, and
  the tiles up to the last query's."""
  T = q_pos_T.shape[0]
  oldest = jnp.maximum(jnp.asarray(length, jnp.int32) - capacity, 0)
  lo_T = jnp.full((T,), oldest, jnp.int32) if lo_T is None else jnp.maximum(jnp.asarray(lo_T, jnp.int32), oldest)
  first = jnp.min(lo_T) // bk
  return lo_T, first, jnp.max(q_pos_T) // bk - first + 1


def whole(x):
  """A block of all of x for every program of a (Hkv, S) grid."""
  return pl.BlockSpec(x.shape, lambda h, s: (0,) * x.ndim)


def partial_outputs(Hkv: int, S: int, P: int, Dh: int):
  """(out_shape, out_specs) of a split kernel's partials: acc [Hkv, S, P, Dh], m and l [Hkv, S, P], program (h, s)
  writing its own block of each."""
  f32 = jnp.float32
  return ([jax.ShapeDtypeStruct((Hkv, S, P, Dh), f32), jax.ShapeDtypeStruct((Hkv, S, P), f32),
           jax.ShapeDtypeStruct((Hkv, S, P), f32)],
          [pl.BlockSpec((None, None, P, Dh), lambda h, s: (h, s, 0, 0)),
           pl.BlockSpec((None, None, P), lambda h, s: (h, s, 0)),
           pl.BlockSpec((None, None, P), lambda h, s: (h, s, 0))])


def _kernel(meta_ref, qpos_ref, lo_ref, q_ref, k_ref, v_ref, *refs, bk: int, capacity: int, quant: bool,
            count_visits: bool, tc: bool, dots: str, T: int, G: int, P: int, scale: float, n_splits: int):
  """Program (h, s): online softmax of q rows of kv head h over its live tiles i (i mod S == s), each row masked
  to its own window [lo_t, q_pos_t]."""
  ks_ref, vs_ref = (None, None)
  if quant:
    ks_ref, vs_ref, *refs = refs
  o_ref, m_ref, l_ref, *cnt_ref = refs
  h = pl.program_id(0)
  s = pl.program_id(1)
  layer = meta_ref[0]
  first = meta_ref[1]
  end = first + meta_ref[2]          # one past the last live tile
  start, count = strided_tiles(s, first, end, n_splits)
  oldest = row_values(lo_ref, T=T, G=G, P=P)[:, None]           # [P, 1]: each row's first visible position

  q, rowpos = gather_rows(q_ref, qpos_ref, h, T=T, G=G, P=P, scale=scale)    # [P, Dh] scaled, [P] (-1: padding)
  Dh = q.shape[1]
  body = functools.partial(tile_step, q=q, rowpos=rowpos, k_ref=k_ref, v_ref=v_ref, ks_ref=ks_ref, vs_ref=vs_ref,
                           layer=layer, h=h, oldest=oldest, bk=bk, capacity=capacity, tc=tc, dots=dots)
  m, l, acc = lax.fori_loop(0, count, lambda j, c: body(start + j * n_splits, c), init_carry(P, Dh))
  o_ref[...] = acc
  m_ref[...] = m
  l_ref[...] = l
  if count_visits:
    cnt_ref[0][...] = jnp.full((P,), count, jnp.int32)


@functools.partial(jax.jit, static_argnames=("block", "scale", "interpret", "count_visits", "tuning", "with_lse"))
def ring_attention_pallas(q_THDh, k_ring, v_ring, k_scale, v_scale, q_pos_T, length, layer=None, *,
                          block: int, scale: float, interpret: bool = False, count_visits: bool = False,
                          tuning: Tuning | None = None, with_lse: bool = False, lo_T=None):
  """softmax(q k^T * scale) v over live causal keys, as ring_attention_ref. Returns [T, Hq, Dh] float32.

  lo_T: None (every row sees positions >= max(length - R, 0)) or int32 [T], row t's first visible position
  (at least length - R: older slots are overwritten).

  k_ring/v_ring: [R, Hkv, Dh] (one layer, layer=None) or [L, R, Hkv, Dh] with `layer` an int32 scalar;
  k_scale/v_scale: [(L,) R, Hkv] or None. tuning (static): the fields to set over the table (`config`: tile,
  warps, stages, MMA scheme, splits).
  With with_lse, returns (out, lse [T, Hq]): the log-sum-exp of each row's scaled scores (-inf where no key was
  visible), as ops.attention.attention_with_lse, for an exact merge with another partial (the host tier).
  With count_visits, also returns the number of tiles each program visited, [Hkv, S] int32.
  """
  k_ring, v_ring, k_scale, v_scale, layer = as_stack(k_ring, v_ring, k_scale, v_scale, layer)
  T, Hq, Dh = q_THDh.shape
  _, R, Hkv, _ = k_ring.shape
  G = Hq // Hkv
  c = config(Dh, block, Hkv, k_ring.dtype, tuning)
  bk, S = c.bk, c.n_splits
  if block % bk or R % block:
    raise ValueError(f"ring_attention_pallas: need bk={bk} | block={block} | R={R}")
  P = rows_padded(T, G)
  quant = k_scale is not None

  q_pos_T = jnp.asarray(q_pos_T, jnp.int32)
  lo_T, first, n_tiles = live_window(length, lo_T, q_pos_T, R, bk)
  meta = jnp.stack([jnp.asarray(layer, jnp.int32), first, n_tiles, 0, 0, 0, 0, 0]).astype(jnp.int32)

  q = q_THDh.astype(jnp.float32).reshape(T * Hq, Dh)     # a free reshape: rows are gathered in the kernel

  in_specs = [whole(meta), whole(q_pos_T), whole(lo_T), whole(q), whole(k_ring), whole(v_ring)]
  args = [meta, q_pos_T, lo_T, q, k_ring, v_ring]
  if quant:
    in_specs += [whole(k_scale), whole(v_scale)]
    args += [k_scale.astype(jnp.float32), v_scale.astype(jnp.float32)]
  out_shape, out_specs = partial_outputs(Hkv, S, P, Dh)
  if count_visits:
    out_shape.append(jax.ShapeDtypeStruct((Hkv, S, P), jnp.int32))
    out_specs.append(pl.BlockSpec((None, None, P), lambda h, s: (h, s, 0)))
  kernel = functools.partial(_kernel, bk=bk, capacity=R, quant=quant, count_visits=count_visits, tc=not interpret,
                             dots=c.dots, T=T, G=G, P=P, scale=scale, n_splits=S)
  outs = pl.pallas_call(
      kernel, out_shape=out_shape, grid=(Hkv, S), in_specs=in_specs, out_specs=out_specs,
      compiler_params=plgpu.CompilerParams(num_warps=c.num_warps, num_stages=c.num_stages),
      interpret=interpret, name="ring_decode_attention")(*args)
  if _is_pow2(G):
    out = merge_splits(*outs[:3], T=T, G=G, with_lse=with_lse, interpret=interpret)
  else:                      # a G the merge kernel cannot tile: jnp (not batch-invariant on the GPU)
    out = _merge_jnp(*outs[:3], T=T, G=G, with_lse=with_lse)
  if count_visits:
    return out, outs[3][:, :, 0]
  return out


def _merge_jnp(o, m, l, *, T: int, G: int, with_lse: bool):
  Hkv, _, _, Dh = o.shape
  o, m, l = o[:, :, :T * G], m[:, :, :T * G], l[:, :, :T * G]
  m_all = jnp.max(m, axis=1, keepdims=True)                    # [Hkv, 1, TG]
  w = jnp.exp(m - m_all)                                       # [Hkv, S, TG]
  l_all = jnp.sum(w * l, axis=1)                               # [Hkv, TG]
  acc = jnp.sum(w[..., None] * o, axis=1)                      # [Hkv, TG, Dh]
  out = acc / jnp.where(l_all > 0, l_all, 1.0)[..., None]
  out = out.reshape(Hkv, T, G, Dh).transpose(1, 0, 2, 3).reshape(T, Hkv * G, Dh)
  if with_lse:
    lse = jnp.where(l_all > 0, m_all[:, 0] + jnp.log(jnp.where(l_all > 0, l_all, 1.0)), -jnp.inf)
    out = out, lse.reshape(Hkv, T, G).transpose(1, 0, 2).reshape(T, Hkv * G)
  return out


MERGE_DB = 16            # head-dim columns per merge program: [S, G, MERGE_DB] partials in registers


def _merge_kernel(o_ref, m_ref, l_ref, out_ref, *lse_ref, G: int, DB: int):
  """Program (h, t, c): columns [c*DB, (c+1)*DB) of the G rows of query t under kv head h, merged over all S splits
  at once. Every block shape ([S, G], [S, G, DB]) is independent of T, so a query's reduction order is too."""
  h, t, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows = pl.ds(t * G, G)
  m = m_ref[h, :, rows]                                              # [S, G]
  m_all = jnp.max(m, axis=0)                                         # [G]
  w = jnp.exp(m - m_all[None, :])
  l_all = jnp.sum(w * l_ref[h, :, rows], axis=0)
  acc = jnp.sum(w[:, :, None] * o_ref[h, :, rows, pl.ds(c * DB, DB)], axis=0)          # [G, DB]
  out_ref[t, pl.ds(h * G, G), pl.ds(c * DB, DB)] = acc / jnp.where(l_all > 0, l_all, 1.0)[:, None]
  if lse_ref:
    @pl.when(c == 0)
    def _():
      lse_ref[0][t, pl.ds(h * G, G)] = jnp.where(l_all > 0, m_all + jnp.log(jnp.where(l_all > 0, l_all, 1.0)),
                                                 -jnp.inf)


def merge_splits(o, m, l, *, T: int, G: int, with_lse: bool = False, interpret: bool = False):
  """Log-sum-exp merge of the split partials (o [Hkv, S, P, Dh], m and l [Hkv, S, P]) into out [T, Hq, Dh] (and
  lse [T, Hq]): a Pallas kernel, one program per (kv head, query, MERGE_DB head-dim columns) over all S splits.

  A kernel rather than jnp reductions for batch invariance: XLA's reduction over the split axis picks its order
  from the whole shape, so a verify pass's rows would not be summed like a one-query step's; here a query's G rows
  are merged by the same code, on blocks of the same shapes, for any T (DESIGN invariant 3). One pass over all
  splits (a loop over them one by one is latency-bound: 46 µs a call on the H200). It also writes the [T, Hq, Dh]
  layout directly (no transpose kernel)."""
  Hkv, S, P, Dh = o.shape
  DB = min(MERGE_DB, Dh)
  out_shape = [jax.ShapeDtypeStruct((T, Hkv * G, Dh), jnp.float32)]
  if with_lse:
    out_shape.append(jax.ShapeDtypeStruct((T, Hkv * G), jnp.float32))
  outs = pl.pallas_call(functools.partial(_merge_kernel, G=G, DB=DB), out_shape=out_shape, grid=(Hkv, T, Dh // DB),
                        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
                        name="ring_attention_merge")(o, m, l)
  return (outs[0], outs[1]) if with_lse else outs[0]
