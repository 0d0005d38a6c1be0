"""Fused dequantize + matmul, Pallas with the Triton lowering: y[B, N] = x[B, K] @ W[N, K]^T, W packed (B <= 16).

The kernel reads each weight byte once from the repacked planes (ops/repack), dequantizes in registers and never
writes a dequantized weight anywhere. Tiling: program i owns rows [i*BN, i*BN + BN) (clamped to N-1, so odd N
needs no mask: duplicate rows recompute and store row N-1's value) and walks K in steps of S blocks; a step
loads one tile per plane, `[BN, S, *field_shape]` (16-byte vector loads, each row's S blocks contiguous),
and x as `[S, ...]` slices of a free reshape of x (`XVIEW`), shared by the BN rows. Every token b of the
batch reuses the same dequantized tile (a static loop over b). Per-(row, block) partial sums `[BN, S]` are
carried through the loop and reduced once at the end.

Arithmetic, per value, without int->float conversions (quarter-rate on GPUs):
  - an unsigned k-bit code q is moved into the mantissa under the exponent of 1.0: f = 1 + q / 2^k exactly
    (one shift and one mask-or); the tile accumulates A = sum f*x and, per sub-block, X = sum x (shared by all
    rows), and sum q*x = 2^k (A - X). Only the per-sub-block scale arithmetic runs on [BN, S] scalars.
  - Q8_0: q + 128 = byte ^ 0x80 (k = 8). Q4_K k = 4, Q5_K k = 5 (qh bit), Q6_K k = 6 (ql nibble | qh pair).
  - IQ3_S: 9-bit grid index -> one uint32 of 4 magnitudes from a 2 KB table (a gathered load), magnitude
    m -> float(2^23 + m) - 2^23, sign bit xor'ed into the float.
  - IQ4_NL / IQ4_XS: 4-bit index -> a gathered load from the 16 float levels (one 64-byte line).

The per-type tiles (`TILES`) are shared with the MoE kernel (ops/moe_pallas.py). `TUNING` holds the tile
sizes per type; `qmatmul_pallas` is jitted with them static. Tests run it with interpret=True on CPU and lower
it for abstract CUDA and ROCm devices (tests/ops/test_lowering.py).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ops import quant, repack
from ops.tuning import fill

U32, I32, F32 = jnp.uint32, jnp.int32, jnp.float32
MAX_B = 16                        # largest batch the kernels take (static per-token loop); larger B: reference
KERNEL_TYPES = ("Q8_0", "Q4_K", "Q5_K", "Q6_K", "IQ3_S", "IQ4_NL", "IQ4_XS")

# x [B, K] -> [B, nb, *XVIEW[qtype]] splits a block's value index into coordinates (natural order, below), then
# XPERM moves them so that the tile's last (contiguous) weight dim is x's last dim too: x loads are vectors.
XVIEW = {
    "Q8_0": (8, 4),                  # 4w + c
    "Q4_K": (4, 2, 8, 4),            # 64i + 32h + 4j + c
    "Q5_K": (4, 2, 8, 4),
    "Q6_K": (2, 4, 2, 4, 4),         # 128hh + 32s + 16jh + 4jl + cb
    "IQ3_S": (2, 4, 2, 4, 4),        # 128a + 32pp + 16w2 + 4cb + m
    "IQ4_NL": (2, 4, 4),             # 16h + 4jw + cb
    "IQ4_XS": (8, 2, 4, 4),          # 32ib + 16h + 4jw + cb
}
XPERM = {
    "Q8_0": (1, 0),                  # [c, w]
    "Q4_K": (0, 1, 3, 2),            # [i, h, c, j]
    "Q5_K": (0, 1, 3, 2),
    "Q6_K": (0, 1, 4, 2, 3),         # [hh, s, cb, jh, jl]
    "IQ3_S": (3, 4, 0, 1, 2),        # [cb, m, a, pp, w2]
    "IQ4_NL": (0, 2, 1),             # [h, cb, jw]
    "IQ4_XS": (1, 3, 0, 2),          # [h, cb, ib, jw]
}

class Tuning(NamedTuple):
  """A decode kernel's tile (the projection's, or one of the MoE kernels'); a field left None takes the type's
  entry in `TUNING`. BN rows per program (a power of 2), S blocks per K step (a power of 2, clipped to the largest
  power of two dividing nb), Triton warps and pipeline stages, K steps unrolled up to `unroll` (0: a fori_loop),
  natural_b: calls of up to natural_b tokens per program read x in its natural order (`x_natural`), and programs:
  BN halves (down to 1) until the grid has at least that many programs (0: BN as given; it depends on the rows,
  not the batch, so batch invariance holds). x8: the tile reads x rounded to 8 bits per 32 values and sums with
  integer dots (ops/dot8, for its TILES' types): "dp4a" the PTX instruction (CUDA), "int" its int32 form; None
  (the tables): the float tiles."""
  BN: int | None = None
  S: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  unroll: int | None = None
  natural_b: int | None = None
  programs: int | None = None
  x8: str | None = None


# Per type. Measured on the H200: docs/PERF.md "Quantized kernels" (tiles), "The x layout" (natural_b), "The
# hybrid step's SwiGLU and grid levers" (programs: Q8_0's only, the other types unmeasured).
TUNING: dict[str, Tuning] = {
    "Q8_0": Tuning(BN=16, S=32, num_warps=4, num_stages=2, unroll=0, natural_b=16, programs=1024),
    "Q4_K": Tuning(BN=16, S=8, num_warps=4, num_stages=2, unroll=0, natural_b=16, programs=0),
    "Q5_K": Tuning(BN=16, S=8, num_warps=4, num_stages=2, unroll=0, natural_b=0, programs=0),
    "Q6_K": Tuning(BN=16, S=8, num_warps=4, num_stages=2, unroll=0, natural_b=0, programs=0),
    "IQ3_S": Tuning(BN=16, S=8, num_warps=4, num_stages=2, unroll=0, natural_b=0, programs=0),
    "IQ4_NL": Tuning(BN=16, S=32, num_warps=4, num_stages=2, unroll=0, natural_b=0, programs=0),
    "IQ4_XS": Tuning(BN=16, S=8, num_warps=4, num_stages=2, unroll=0, natural_b=0, programs=0),
}


# Float bit patterns the tiles OR into shifted codes. They reach the kernel through its table input: constants
# the compiler cannot see stay in a register, so `(v & mask) | c` is one LOP3 instead of two (-1 op per value).
_CONSTS = np.array([0x3F800000, 0x3FC00000, 0x4B000000] + [0] * 13, np.uint32)
ONE, Q8_FLIP, MAGIC23 = 0, 1, 2


def table(qtype: str) -> jax.Array:
  """The table input of a type's kernel: IQ3_S grid (uint32 of 4 magnitude bytes) then _CONSTS at 512; IQ4 levels
  (float32 [16]); _CONSTS for the other types."""
  if qtype == "IQ3_S":
    g = quant.IQ3_S_GRID.astype(np.uint32)                        # [512, 4], entries 1, 3, .., 15
    return jnp.asarray(np.concatenate([g[:, 0] | (g[:, 1] << 8) | (g[:, 2] << 16) | (g[:, 3] << 24), _CONSTS]))
  if qtype in ("IQ4_NL", "IQ4_XS"):
    return jnp.asarray(quant.IQ4_NL_LEVELS.astype(np.float32))
  return jnp.asarray(_CONSTS)


def iq3s_grid(tab):
  """(gather, magnitude) for the IQ3_S table: gather(idx) -> the grid words of 9-bit indices (uint32),
  magnitude(words, m) -> float32 magnitude m (1..15) of each word, via the 2^23 exponent trick."""
  magic = tab[512 + MAGIC23]
  return (lambda idx: tab[idx.astype(I32)],
          lambda w, m: _f32((_shl(w, -8 * m) & 0xFF) | magic) - 8388608.0)


# ------------------------------------------------------------------------------------------------ helpers


def _shl(w, s: int):
  """w << s for a static s, w >> -s when s < 0."""
  if s > 0:
    return w << s
  if s < 0:
    return w >> (-s)
  return w


def _f32(bits):
  return jax.lax.bitcast_convert_type(bits, F32)


def _f16lo(w):
  return jax.lax.bitcast_convert_type((w & 0xFFFF).astype(jnp.uint16), jnp.float16).astype(F32)


def _f16hi(w):
  return jax.lax.bitcast_convert_type((w >> 16).astype(jnp.uint16), jnp.float16).astype(F32)


def _iota(shape, dim):
  return jax.lax.broadcasted_iota(U32, shape, dim)


def row_sums(t):
  """[BN] from a tile's contribution [BN, S, ...]: the sum over everything but the rows, last axis first (one axis
  per reduction: Pallas' Triton lowering of a multi-axis sum fails under an explicit mesh, jax 0.11.2)."""
  while t.ndim > 1:
    t = jnp.sum(t, axis=-1)
  return t


def _accumulate(fs, xc):
  """sum_c fs[c] * xc[c][None] and sum_c xc[c] (fs [BN, ...], xc [...])."""
  a = x = None
  for f, v in zip(fs, xc):
    a = f * v[None] if a is None else a + f * v[None]
    x = v if x is None else x + v
  return a, x


# ---------------------------------------------------------------------------------------- tiles per type
# tile(ld, xs, tab) -> [contribution [BN, S, ...] for each x in xs] (callers sum all but the rows: row_sums)
#   ld(name, *idx): plane `name` at the tile's rows and blocks, then idx -> [BN, S, ...]
#   xs[b](*idx): token b's x at the tile's blocks, then idx (over XVIEW[qtype]) -> [S, ...]
#   tab: the type's table ref (see `table`).


def _tile_q8_0(ld, xs, tab):
  """Q8_0 block (32): d f16 | qs 8 words, byte c of word w = int8 value 4w + c.   x = d * q."""
  d = ld("d").astype(F32)                                              # [BN, S]
  q = ld("qs", slice(None))                                            # [BN, S, 8]
  flip = tab[Q8_FLIP]
  fs = [_f32((_shl(q, 15 - 8 * c) & 0x7F8000) ^ flip) for c in range(4)]   # 1 + (q + 128) / 256
  out = []
  for xv in xs:
    a, x = _accumulate(fs, [xv(c, slice(None)) for c in range(4)])     # [BN, S, 8], [S, 8]
    out.append(d * (256.0 * jnp.sum(a, axis=2) - 384.0 * jnp.sum(x, axis=1)[None]))
  return out


def _k_scale_min(h1, h2, h3, k: int):
  """6-bit scale and min of sub-block k from the 12 scale bytes (words h1, h2, h3), as float32 [BN, S]."""
  if k < 4:
    sc, mn = (h1 >> (8 * k)) & 63, (h2 >> (8 * k)) & 63
  else:
    j = k - 4
    sc = ((h3 >> (8 * j)) & 15) | (((h1 >> (8 * j + 6)) & 3) << 4)
    mn = ((h3 >> (8 * j + 4)) & 15) | (((h2 >> (8 * j + 6)) & 3) << 4)
  return sc.astype(I32).astype(F32), mn.astype(I32).astype(F32)


def _tile_q45_k(ld, xs, tab, five: bool):
  """Q4_K / Q5_K superblock (256): hdr 4 words (d|dmin<<16, 12 scale bytes) | [Q5_K: qh 8 words, bit 8c+k of
  word j = bit 4 of value 32k + 4j + c] | qs [4 i, 8 j] words, byte c nibble h = value 64i + 32h + 4j + c.
  Sub-block k = 2i + h of 32 values: x = (d * sc_k) * q - dmin * mn_k.

  The contribution stays word-shaped, [BN, S, 8], summed once by the caller: with f = 1 + q / 2^bits,
  sum q x = 2^bits (sum f x - sum x), so word j adds 2^bits ds a_j - (2^bits ds + dm) xw_j (a_j = sum_c f_c x_c,
  xw_j = sum_c x_c). A per-sub-block form (a reduction over the words and over x for each of the 8 sub-blocks)
  compiled on sm_90 to cross-thread reductions and 8 layout conversions of the x sums through shared memory per
  step (scripts/kernel_sass.py)."""
  h = [ld("hdr", k) for k in range(4)]                                 # [BN, S] each
  d, dmin = _f16lo(h[0]), _f16hi(h[0])
  qh = ld("qh", slice(None)) if five else None                         # [BN, S, 8]
  bits = 5 if five else 4
  one = tab[ONE]
  out = [None] * len(xs)
  for i in range(4):
    q = ld("qs", i, slice(None))                                       # [BN, S, 8]
    for hh in range(2):
      k = 2 * i + hh
      sc, mn = _k_scale_min(h[1], h[2], h[3], k)
      ds, dm = d * sc, dmin * mn
      dsb = float(1 << bits) * ds                                      # per word: dsb * a_j - e * xw_j
      dsb3, e3 = dsb[..., None], (dsb + dm)[..., None]
      fs = []
      for c in range(4):
        s = 8 * c + 4 * hh
        if five:   # 1 + q / 32, q = nibble | qh bit << 4
          b = (_shl(q, 18 - s) & 0x3C0000) | (_shl(qh, 22 - (8 * c + k)) & 0x400000)
        else:      # 1 + q / 16
          b = _shl(q, 19 - s) & 0x780000
        fs.append(_f32(b | one))
      for bi, xv in enumerate(xs):
        a, x = _accumulate(fs, [xv(i, hh, c, slice(None)) for c in range(4)])
        t = dsb3 * a - e3 * x[None]                                    # [BN, S, 8]: no reduction here
        out[bi] = t if out[bi] is None else out[bi] + t
  return out


def _tile_q4_k(ld, xs, tab):
  return _tile_q45_k(ld, xs, tab, five=False)


def _tile_q5_k(ld, xs, tab):
  return _tile_q45_k(ld, xs, tab, five=True)


def _tile_q6_k(ld, xs, tab):
  """Q6_K superblock (256): ql [2 hh, 2 s%2, 2 jh, 4 jl] words (nibble s//2 of byte cb) | qh [2 hh, 2 jh, 4 jl]
  words (bits 8cb + 2s) | sc int8 [2 hh, 4 s, 2 jh] | d f16, for value 128hh + 32s + 16jh + 4jl + cb.
  x = (d * sc) * (q - 32), q = ql nibble | qh pair << 4, one scale per 16 values."""
  d = ld("d").astype(F32)[:, :, None]                                  # [BN, S, 1]
  one = tab[ONE]
  out = [0.0] * len(xs)
  for hh in range(2):
    qh = ld("qh", hh, slice(None), slice(None))                        # [BN, S, 2, 4]
    ql = [ld("ql", hh, r, slice(None), slice(None)) for r in range(2)]
    for s in range(4):
      ds = d * ld("sc", hh, s, slice(None)).astype(F32)                # [BN, S, 2]
      fs = []
      for cb in range(4):   # 1 + q / 64
        b = (_shl(ql[s % 2], 17 - (8 * cb + 4 * (s // 2))) & 0x1E0000) | ((_shl(qh, 21 - (8 * cb + 2 * s)) & 0x600000) | one)
        fs.append(_f32(b))
      for bi, xv in enumerate(xs):
        a, x = _accumulate(fs, [xv(hh, s, cb, slice(None), slice(None)) for cb in range(4)])
        xs_ = jnp.sum(x, axis=2)[None]                                 # [1, S, 2]
        out[bi] = out[bi] + jnp.sum(ds * (64.0 * (jnp.sum(a, axis=3) - xs_) - 32.0 * xs_), axis=2)
  return out


def _tile_iq3_s(ld, xs, tab):
  """IQ3_S superblock (256): d f16 | qs [2 a, 4 pp, 2 w2] words | qh [2 a] words | signs [2 a, 4 pp] words |
  scales word. Group k = 8p + 4w2 + cb (p = 4a + pp, 4 values): grid index = byte cb of qs (a, pp, w2) | bit
  8pp + 4w2 + cb of qh (a) << 8; value 4k + m has magnitude byte m of grid[index] and sign bit 16w2 + 4cb + m
  of signs (a, pp).   x = d * (1 + 2 * scale nibble p) * magnitude * sign."""
  d = ld("d").astype(F32)[:, :, None, None, None]                      # [BN, S, 1, 1, 1]
  qs = ld("qs", slice(None), slice(None), slice(None))                 # [BN, S, 2, 4, 2]
  qh = ld("qh", slice(None))[:, :, :, None, None]                      # [BN, S, 2, 1, 1]
  sg = ld("signs", slice(None), slice(None))[:, :, :, :, None]         # [BN, S, 2, 4, 1]
  sc = ld("scales")[:, :, None, None, None]                            # [BN, S, 1, 1, 1]
  a_, pp, w2 = _iota((1, 1, 2, 4, 1), 2), _iota((1, 1, 2, 4, 1), 3), _iota((1, 1, 1, 1, 2), 4)
  db = d * (1 + 2 * ((sc >> (4 * (4 * a_ + pp))) & 15)).astype(I32).astype(F32)   # [BN, S, 2, 4, 1]
  gather, magnitude = iq3s_grid(tab)
  acc = [None] * len(xs)
  for cb in range(4):
    idx = ((qs >> (8 * cb)) & 255) | (((qh >> (8 * pp + 4 * w2 + cb)) & 1) << 8)
    gw = gather(idx)                                                   # [BN, S, 2, 4, 2] uint32
    for m in range(4):
      mag = magnitude(gw, m)
      sbit = (sg << (31 - (16 * w2 + 4 * cb + m))) & jnp.uint32(0x80000000)
      v = _f32(jax.lax.bitcast_convert_type(mag, U32) ^ sbit)
      for bi, xv in enumerate(xs):
        t = v * xv(cb, m, slice(None), slice(None), slice(None))[None]
        acc[bi] = t if acc[bi] is None else acc[bi] + t
  # one axis per reduction (a multi-axis reduce does not lower under an abstract mesh in jax 0.11.2)
  return [jnp.sum(jnp.sum(jnp.sum(db * jnp.sum(a, axis=4, keepdims=True), axis=4), axis=3), axis=2) for a in acc]


def _tile_iq4_nl(ld, xs, tab):
  """IQ4_NL block (32): d f16 | qs 4 words, byte cb of word jw nibble h = level index of value 16h + 4jw + cb.
  x = d * level."""
  d = ld("d").astype(F32)                                              # [BN, S]
  q = ld("qs", slice(None))                                            # [BN, S, 4]
  lv = [tab[((q >> (8 * cb + 4 * h)) & 15).astype(I32)] for h in range(2) for cb in range(4)]
  out = []
  for xv in xs:
    a, _ = _accumulate(lv, [xv(h, cb, slice(None)) for h in range(2) for cb in range(4)])
    out.append(d * jnp.sum(a, axis=2))
  return out


def _tile_iq4_xs(ld, xs, tab):
  """IQ4_XS superblock (256): hdr 2 words (d | scales_h << 16, scales_l) | qs [8 ib, 4 jw] words, byte cb
  nibble h = level index of value 32ib + 16h + 4jw + cb.   x = d * (6-bit scale_ib - 32) * level."""
  h0, h1 = ld("hdr", 0)[:, :, None], ld("hdr", 1)[:, :, None]         # [BN, S, 1]
  ib = _iota((1, 1, 8), 2)
  ls = ((h1 >> (4 * ib)) & 15) | (((h0 >> (16 + 2 * ib)) & 3) << 4)   # [BN, S, 8]
  ds = _f16lo(h0) * (ls.astype(I32) - 32).astype(F32)
  q = ld("qs", slice(None), slice(None))                               # [BN, S, 8, 4]
  lv = [tab[((q >> (8 * cb + 4 * h)) & 15).astype(I32)] for h in range(2) for cb in range(4)]
  out = []
  for xv in xs:
    a, _ = _accumulate(lv, [xv(h, cb, slice(None), slice(None)) for h in range(2) for cb in range(4)])
    out.append(jnp.sum(ds * jnp.sum(a, axis=3), axis=2))
  return out


TILES = {
    "Q8_0": _tile_q8_0, "Q4_K": _tile_q4_k, "Q5_K": _tile_q5_k, "Q6_K": _tile_q6_k, "IQ3_S": _tile_iq3_s,
    "IQ4_NL": _tile_iq4_nl, "IQ4_XS": _tile_iq4_xs,
}
assert set(TILES) == set(KERNEL_TYPES) == set(XVIEW)


# ------------------------------------------------------------------------------------------------ config


def _pow2_floor(v: int) -> int:
  return 1 << (max(int(v), 1).bit_length() - 1)


# Register budget: tokens x rows x values of one step's partial products per program (B=16 otherwise spills).
# IQ3_S holds more per value (grid words, signs): its S = 4 tile at B = 4 spills 504 B per thread on sm_90 (255
# registers), S = 2 holds 128 (`scripts/kernel_sass.py`, PERF "Prefill"), hence half the budget.
STEP_BUDGET = 65536
STEP_BUDGET_OF = {"IQ3_S": 32768}

# Batch invariance (DESIGN invariant 3): a verify pass of k + 1 tokens must compute each of its rows exactly as a
# one-token step does. A row's partial sums are grouped by the tile (BN, S) and the tile shrinks with the batch, so
# every batch up to INVARIANT_B takes the tiles of INVARIANT_B: 4 covers k <= 3 (the default k and the seed's), and
# decode.speculative runs a longer verify as passes of at most INVARIANT_B rows (VERIFY_ROWS). Q8_0 keeps its B = 1
# tiles up to B = 4 (S = 32 either way).
INVARIANT_B = 4


def config(qtype: str, rows: int, nb: int, tuning: Tuning | None = None, batch: int = 1) -> Tuning:
  """The tile for `rows` output rows, `nb` blocks per row and `batch` tokens: TUNING[qtype] with the fields
  `tuning` sets, clipped to the problem and, for larger batches, shrunk (BN to 16, then S) to the type's step
  budget, then BN halved to reach `programs` programs. The matmul asks for its batch but at least INVARIANT_B; the MoE kernels run one token per program
  (batch 1)."""
  c = fill(tuning, TUNING[qtype])
  BN, S = min(_pow2_floor(c.BN), max(16, 1 << (max(rows, 1) - 1).bit_length())), c.S
  block = quant.GGML_TYPES[qtype][0]
  budget = STEP_BUDGET_OF.get(qtype, STEP_BUDGET)
  while batch * BN * S * block > budget and (BN > 16 or S > 1):
    if BN > 16:
      BN //= 2
    else:
      S = max(1, S // 2)
  while c.programs and BN > 1 and -(-rows // BN) < c.programs:
    BN //= 2
  return c._replace(BN=BN, S=min(_pow2_floor(S), _pow2_floor(nb)))


def x_view(x2, qtype: str):
  """x [B, K] float32 -> [B, nb, *permuted XVIEW[qtype]] (one small transpose)."""
  return x_input(x2, qtype, natural=True).transpose(0, 1, *(2 + p for p in XPERM[qtype]))


# The x layout a kernel reads is its tile's choice (`Tuning.natural_b`): calls of up to natural_b tokens per program
# read x in its natural order ([B, nb, *XVIEW], a free reshape: no transpose kernel before the matmul, strided x
# loads inside it); larger calls read the permuted view (`x_view`: contiguous x loads after one small XLA
# transpose). The loaded values and the arithmetic are the same either way, so the choice never changes a bit of
# the result; it is a speed choice per type. The routed-expert kernels read one token per program. Measured on the
# H200 (docs/PERF.md "The x layout"), the 30B step at 1K: Q4_K experts and Q8_0 projections natural 3.24 ms against
# 3.44 permuted; IQ3_S experts natural 4.17 against 3.56 (its 5-D view makes 16 scattered loads per block), Q8_0
# natural beside them 3.52 against 3.58-3.61. Q5_K, Q6_K, IQ4_XS and IQ4_NL are unmeasured and stay permuted.
def x_natural(tile: Tuning, batch: int) -> bool:
  return batch <= tile.natural_b


def x_input(x2, qtype: str, natural: bool):
  """The kernel's x operand: [B, nb, *XVIEW[qtype]] (natural) or x_view(x2, qtype)."""
  if natural:
    block = quant.GGML_TYPES[qtype][0]
    return x2.reshape(x2.shape[0], x2.shape[1] // block, *XVIEW[qtype])
  return x_view(x2, qtype)


def x_index(qtype: str, natural: bool, idx: tuple) -> tuple:
  """Index into the kernel's x operand, after its (token, blocks) dims, of view coordinates `idx` given in the
  permuted order the tiles use (XPERM[qtype]). The tiles' slices keep their relative order under XPERM, so the
  loaded array has the same shape in both layouts."""
  if not natural:
    return idx
  perm = XPERM[qtype]
  sliced = [perm[i] for i, v in enumerate(idx) if isinstance(v, slice)]
  if sliced != sorted(sliced) or len(idx) != len(perm):
    raise ValueError(f"x_index: {qtype} coordinates {idx} change order under {perm}")
  return tuple(idx[perm.index(d)] for d in range(len(perm)))


def x_view_index(qtype: str, k):
  """Flat position in `x_view(x, qtype)` (per row) of value index k (int32 array); for kernels that write an
  activation straight into the next kernel's x layout."""
  block = quant.GGML_TYPES[qtype][0]
  dims = XVIEW[qtype]
  coords, rem = [], k % block
  for i, d in enumerate(dims):
    inner = int(np.prod(dims[i + 1:], dtype=np.int64))
    coords.append((rem // inner) % d)
  pos = 0
  for p in XPERM[qtype]:
    pos = pos * dims[p] + coords[p]
  return (k // block) * block + pos


def block_loop(nsteps: int, unroll: int, body, init):
  """Carry `init` through body(step, carry) for step in range(nsteps): a Python loop when nsteps <= unroll
  (every load visible to the scheduler at once), else a fori_loop."""
  if nsteps <= unroll:
    c = init
    for j in range(nsteps):
      c = body(j, c)
    return c
  return jax.lax.fori_loop(0, nsteps, body, init)


def k_loop(nb: int, S: int, unroll: int, tile_sums, init):
  """Sum tile_sums(b0, s) (a tuple of [BN] per token) over the nb blocks of a row: nb // S steps of S blocks, then
  the remainder in power-of-two pieces (nb = 3 -> 2 + 1), so S need not divide nb (F = 768 is 3 superblocks)."""
  add = lambda a, t: tuple(x + y for x, y in zip(a, t))
  accs = block_loop(nb // S, unroll, lambda j, a: add(a, tile_sums(j * S, S)), init)
  b, s = (nb // S) * S, S
  while b < nb:
    while b + s > nb:
      s //= 2
    accs = add(accs, tile_sums(b, s))
    b += s
  return accs


def compiler_params(t):
  """Triton compiler parameters of a tile (any tuning value with num_warps and num_stages)."""
  return plgpu.CompilerParams(num_warps=t.num_warps, num_stages=t.num_stages)


# ------------------------------------------------------------------------------------------------ kernel


def _qmm_kernel(*refs, qtype, names, B, N, BN, S, nb, unroll, stacked, natural, tile8):
  if tile8:
    xw_ref, dx_ref, xs_ref, tab_ref, *refs = refs
  else:
    x_ref, tab_ref, *refs = refs
  lid_ref, refs = (refs[0], refs[1:]) if stacked else (None, refs)
  *w_refs, o_ref = refs
  W = dict(zip(names, w_refs))
  pre = () if lid_ref is None else (lid_ref[0],)
  rows = jnp.minimum(pl.program_id(0) * BN + jax.lax.iota(I32, BN), N - 1)

  def tile_sums(b0, s):
    ld = lambda name, *idx: W[name][(*pre, rows, pl.ds(b0, s), *idx)]
    if tile8:
      at = lambda ref, b: (lambda *idx: ref[(b, pl.ds(b0, s), *idx)])
      return tuple(tile8(ld, [(at(xw_ref, b), at(dx_ref, b), at(xs_ref, b)) for b in range(B)], tab_ref))
    xs = [functools.partial(lambda b, *idx: x_ref[(b, pl.ds(b0, s), *x_index(qtype, natural, idx))], b)
          for b in range(B)]
    return tuple(row_sums(o) for o in TILES[qtype](ld, xs, tab_ref))

  accs = k_loop(nb, S, unroll, tile_sums, tuple(jnp.zeros((BN,), F32) for _ in range(B)))
  for b in range(B):
    o_ref[b, rows] = accs[b]


@functools.partial(jax.jit, static_argnames=("qtype", "n", "interpret", "cfg"))
def _qmatmul(x2, layer, planes, x8, *, qtype, n, interpret, cfg):
  B = x2.shape[0]
  stacked = layer is not None
  N = planes[0].shape[int(stacked)]
  lid = (jnp.asarray(layer, I32).reshape(1),) if stacked else ()
  nb = n // quant.GGML_TYPES[qtype][0]
  names = repack.plane_names(qtype)
  natural = x_natural(cfg, B)
  if cfg.x8:                    # the 8-bit x tiles (imported here: dot8's tiles build on this module's helpers)
    from ops import dot8
    dot8.check(cfg.x8, qtype, "qmatmul_pallas")
    tile8 = functools.partial(dot8.TILES[qtype], dot=dot8.dot_fn(cfg.x8, interpret))
    xin = dot8.x8_input(x2, qtype, x8)
  else:
    tile8, xin = None, (x_input(x2.astype(F32), qtype, natural),)
  kernel = functools.partial(_qmm_kernel, qtype=qtype, names=names, B=B, N=N, BN=cfg.BN, S=cfg.S, nb=nb,
                             unroll=cfg.unroll, stacked=stacked, natural=natural, tile8=tile8)
  return pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((B, N), F32), grid=(pl.cdiv(N, cfg.BN),),
      compiler_params=compiler_params(cfg), interpret=interpret, name=f"qmatmul_{qtype.lower()}",
  )(*xin, table(qtype), *lid, *planes)


def supported(w, batch: int) -> bool:
  return w.qtype in TILES and 1 <= batch <= MAX_B and len(w.shape) == 2


def qmatmul_pallas(x: jax.Array, w, *, layer=None, interpret: bool = False,
                   tuning: Tuning | None = None, x8=None) -> jax.Array:
  """x [..., K] @ W[N, K]^T -> [..., N] float32 with W a 2-D QTensor of a type in KERNEL_TYPES; B <= MAX_B.
  With `layer` (int32 scalar, may be traced) W is stacked [L, N, K] and layer `layer` is read in place.
  tuning (static): the tile's fields to set over TUNING[w.qtype]. x8: x already rounded to 8 bits (an
  ops.dot8.X8 of x's B rows, by the norm kernel that made x), read by a tile with x8 instead of rounding here."""
  w2 = w if layer is None else w[0]
  N, K = w2.shape
  lead = x.shape[:-1]
  x2 = x.reshape(-1, K)
  if not supported(w2, x2.shape[0]) or len(w.shape) != 2 + (layer is not None):
    raise ValueError(f"qmatmul_pallas: {w.qtype} {w.shape} with batch {x2.shape[0]}"
                     f"{'' if layer is None else ' and a layer index'} is not supported")
  nb = K // quant.GGML_TYPES[w.qtype][0]
  cfg = config(w.qtype, N, nb, tuning, batch=max(x2.shape[0], INVARIANT_B))
  y = _qmatmul(x2, layer, tuple(w.planes), cfg.x8 and x8, qtype=w.qtype, n=K, interpret=interpret, cfg=cfg)
  return y.reshape(*lead, N)
