"""Decode tiles with x in 8 bits and integer dots (llama.cpp's MMVQ form), for Q8_0, IQ3_S and Q4_K weights.

x is rounded per 32 values to int8 with a float scale dx = max|x| / 127 (`round32`: half away from zero), four
values packed in an int32 word (byte m = value 4w + m): an `X8`, made by `quantize_x` in XLA or by the RMSNorm kernel
that produces x (no launches of its own). A tile makes each group of four weights one word of bytes and sums
`dot(w, xw, acc)` = acc + sum over the four byte products, an int32 per group, then one float multiply per 32
values applies the scales:

  Q8_0   the qs words as they sit (4 signed bytes); value d dx sum per block.
  IQ3_S  grid word gw (4 magnitudes 1..15, the float tile's gather), its 4 sign bits s4 spread to bytes:
         t = (s4 * 0x00204081) & 0x01010101, w = (gw ^ (t * 0xFF)) + t (two's complement per byte; no carry
         since every magnitude is >= 1); value d (1 + 2 scale_p) dx_p sum_p.
  Q4_K   (qs word >> 4h) & 0x0F0F0F0F, the nibbles as they sit (value 64i + 32h + 4j + c in byte c of word j);
         d sc_k dx_k sum_k - dmin mn_k xsum_k, xsum_k = dx_k * (sum of sub-block k's rounded x).

The dot is `dp4a` (inline PTX `dp4a.s32.s32`, CUDA only) or `int_dot` (int32 shifts and multiplies: interpret
mode, ROCm). Against the float tiles (ops/qmatmul_pallas) a result differs by x's rounding, at most |x| / 254 a
value; against a float64 matvec of the same rounded x it is exact up to float32 rounding of the scales.
A kernel takes them with its tile's `Tuning.x8` (ops/qmatmul_pallas: the projections; ops/moe_pallas: gate/up, and
down on h that gate/up rounds). The model has the norm before a consumer round x (ops.rmsnorm_pallas x8; the MoE's
gate/up, attention's wqkv, a DeltaNet layer's win); other inputs are rounded by XLA before the kernel. Reference:
`rounded_x` (x as the tiles see it) into ops.moe.moe_ref / ops.qmatmul.qmatmul_ref.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from ops import qmatmul_pallas as qp           # the float tiles' helpers; qmatmul_pallas imports this module lazily
from ops import quant

I32, F32 = jnp.int32, jnp.float32
DOTS = ("dp4a", "int")            # Tuning values: the PTX instruction, or its int32 emulation

# per type: x words of a block [*WVIEW] (word w of the block = values 4w .. 4w + 3, natural order) and its 32-value
# sub-blocks [*SVIEW] (dx, xsum)
WVIEW = {"Q8_0": (8,), "IQ3_S": (2, 4, 2, 4), "Q4_K": (4, 2, 8)}     # [w] / [a, pp, w2, cb] / [i, h, j]
SVIEW = {"Q8_0": (), "IQ3_S": (2, 4), "Q4_K": (4, 2)}                # one per block / [a, pp] / [i, h]


class X8(NamedTuple):
  """x rounded to 8 bits per 32 values, flat: words int32 [T, K/4] (byte m of word w = value 4w + m), dx and
  xsum float32 [T, K/32]. Made by `quantize_x` (XLA) or by the RMSNorm kernel beside its output
  (ops.rmsnorm_pallas, `x8=True`), bitwise the same ops; a kernel views it per type with `x8_input`."""
  words: jax.Array
  dx: jax.Array
  xsum: jax.Array


def round32(xb):
  """xb [..., 32] float32 -> (q int32 [..., 32] in [-127, 127], dx float32 [...]): dx = max|x| * (1 / 127) (1 for
  a block of zeros), q = x / dx rounded half away from zero (C's roundf, as llama.cpp's q8_1). Only ops that Pallas'
  Triton lowering takes (no round_p), so the norm kernel and XLA run the same ones."""
  dx = jnp.max(jnp.abs(xb), axis=-1) * (1.0 / 127.0)
  dx = jnp.where(dx > 0, dx, 1.0)
  v = xb / dx[..., None]
  q = (v + jnp.where(v >= 0, 0.5, -0.5)).astype(I32)                  # truncates toward zero
  return jnp.clip(q, -127, 127), dx


def pack(q):
  """q int32 [..., 32] (values in [-128, 127]) -> words int32 [..., 8]: byte m of word w = q[4w + m]."""
  q4 = q.reshape(*q.shape[:-1], 8, 4)
  return jnp.sum((q4 & 0xFF) << (8 * qp._iota(q4.shape, q4.ndim - 1).astype(I32)), axis=-1)


def quantize_x(x_TK) -> X8:
  """x [T, K] float -> X8 (round32 per 32 values, pack, xsum = dx * sum q)."""
  T, K = x_TK.shape
  q, dx = round32(x_TK.astype(F32).reshape(T, K // 32, 32))
  return X8(pack(q).reshape(T, K // 4), dx, dx * jnp.sum(q, axis=-1).astype(F32))


def rounded_x(x_TK):
  """x as the tiles see it, float32 [T, K]: q * dx per 32 values (the reference's input)."""
  T, K = x_TK.shape
  q, dx = round32(x_TK.astype(F32).reshape(T, K // 32, 32))
  return (q.astype(F32) * dx[..., None]).reshape(T, K)


def x8_view(x8: X8, qtype: str):
  """The kernels' x operands of a rounded x: words [T, nb, *WVIEW], dx and xsum [T, nb, *SVIEW] (free reshapes)."""
  T, nb = x8.dx.shape[0], x8.dx.shape[1] * 32 // quant.GGML_TYPES[qtype][0]
  words, dx, xs = x8
  return words.reshape(T, nb, *WVIEW[qtype]), dx.reshape(T, nb, *SVIEW[qtype]), xs.reshape(T, nb, *SVIEW[qtype])


def x8_input(x_TK, qtype: str, x8: X8 | None = None):
  """x8_view of `x8` (x already rounded, by the norm kernel) or of quantize_x(x)."""
  T, K = x_TK.shape
  if x8 is None:
    x8 = quantize_x(x_TK)
  elif x8.words.shape != (T, K // 4):
    raise ValueError(f"dot8: x8 words {x8.words.shape}, expected {(T, K // 4)} for x {x_TK.shape}")
  return x8_view(x8, qtype)


def int_dot(a, b, c):
  """dp4a.s32.s32 in int32 ops: c + sum_m sext(byte m of a) * sext(byte m of b)."""
  for m in range(4):
    c = c + ((a << (24 - 8 * m)) >> 24) * ((b << (24 - 8 * m)) >> 24)
  return c


def dp4a(a, b, c):
  """The same as one PTX instruction per element (CUDA only)."""
  return plgpu.elementwise_inline_asm("dp4a.s32.s32 $0, $1, $2, $3;", args=[a, b, c], constraints="=r,r,r,r",
                                      pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, I32)])[0]


def check(x8, qtype: str, kernel: str) -> None:
  """A one-line error for a Tuning.x8 the kernel cannot run: not one of DOTS, or a type without 8-bit tiles."""
  if x8 is not None and (x8 not in DOTS or qtype not in TILES):
    raise ValueError(f"{kernel}: x8={x8!r} with {qtype} weights, expected one of {DOTS} for {'/'.join(TILES)}")


def dot_fn(name: str, interpret: bool):
  """The dot of Tuning value `name` ("dp4a" | "int"); interpret mode runs int_dot for both."""
  if name not in DOTS:
    raise ValueError(f"dot8: dot {name!r}, expected one of {DOTS}")
  return int_dot if interpret or name == "int" else dp4a


def _tile_q8_0(ld, xs, tab, dot):
  """Q8_0 (block 32): the qs words are 4 signed bytes as they sit; d dx isum per block."""
  d = ld("d").astype(F32)                                              # [BN, S]
  q = jax.lax.bitcast_convert_type(ld("qs", slice(None)), I32)         # [BN, S, 8]
  out = []
  for xw, dx, _ in xs:
    isum = dot(q, jnp.broadcast_to(xw(slice(None))[None], q.shape), jnp.zeros(q.shape, I32))
    out.append(qp.row_sums((d * dx()[None])[:, :, None] * isum.astype(F32)))
  return out


def _tile_iq3_s(ld, xs, tab, dot):
  """IQ3_S; planes as in qmatmul_pallas._tile_iq3_s."""
  d = ld("d").astype(F32)[:, :, None, None]                            # [BN, S, 1, 1]
  qs = ld("qs", slice(None), slice(None), slice(None))                 # [BN, S, 2, 4, 2]
  qh = ld("qh", slice(None))[:, :, :, None, None]                      # [BN, S, 2, 1, 1]
  sg = ld("signs", slice(None), slice(None))[:, :, :, :, None]         # [BN, S, 2, 4, 1]
  sc = ld("scales")[:, :, None, None]                                  # [BN, S, 1, 1]
  pp, w2 = qp._iota((1, 1, 2, 4, 1), 3), qp._iota((1, 1, 1, 1, 2), 4)
  p = 4 * qp._iota((1, 1, 2, 4), 2) + qp._iota((1, 1, 2, 4), 3)
  db = d * (1 + 2 * ((sc >> (4 * p)) & 15)).astype(I32).astype(F32)   # [BN, S, 2, 4]
  gather, _ = qp.iq3s_grid(tab)
  words = []
  for cb in range(4):
    idx = ((qs >> (8 * cb)) & 255) | (((qh >> (8 * pp + 4 * w2 + cb)) & 1) << 8)
    gw = gather(idx)                                                   # [BN, S, 2, 4, 2]
    t = (((sg >> (16 * w2 + 4 * cb)) & 15) * 0x00204081) & 0x01010101
    words.append(jax.lax.bitcast_convert_type((gw ^ (t * 0xFF)) + t, I32))
  out = []
  for xw, dx, _ in xs:
    isum = None
    for cb, w in enumerate(words):
      xv = jnp.broadcast_to(xw(slice(None), slice(None), slice(None), cb)[None], w.shape)
      isum = dot(w, xv, jnp.zeros(w.shape, I32) if isum is None else isum)
    s = jnp.sum(isum, axis=4).astype(F32)                              # [BN, S, 2, 4]: one sub-block of 32
    out.append(qp.row_sums(db * dx(slice(None), slice(None))[None] * s))
  return out


def _tile_q4_k(ld, xs, tab, dot):
  """Q4_K; planes as in qmatmul_pallas._tile_q45_k. The sums stay word-shaped ([BN, S, 8]) until the end: a
  sub-block's 8 words lie across threads, and summing them first compiled to barriers and shuffles
  (scripts/kernel_sass.py)."""
  h = [ld("hdr", k) for k in range(4)]                                 # [BN, S]
  d, dmin = qp._f16lo(h[0]), qp._f16hi(h[0])
  t, m = [None] * len(xs), [None] * len(xs)
  for i in range(4):
    q = ld("qs", i, slice(None))                                       # [BN, S, 8]
    for hh in range(2):
      w = jax.lax.bitcast_convert_type((q >> (4 * hh)) & 0x0F0F0F0F, I32)
      sc, mn = qp._k_scale_min(h[1], h[2], h[3], 2 * i + hh)
      for b, (xw, dx, xsum) in enumerate(xs):
        isum = dot(w, jnp.broadcast_to(xw(i, hh, slice(None))[None], w.shape), jnp.zeros(w.shape, I32))
        ti = (d * sc * dx(i, hh)[None])[:, :, None] * isum.astype(F32)
        mi = dmin * mn * xsum(i, hh)[None]
        t[b], m[b] = (ti, mi) if t[b] is None else (t[b] + ti, m[b] + mi)
  return [qp.row_sums(jnp.sum(tb, axis=2) - mb) for tb, mb in zip(t, m)]


# tile(ld, xs, tab, dot) -> [[BN] per token]: ld as the float tiles'; xs[b] = (xw, dx, xsum), token b's loaders:
# xw(*idx) / dx(*idx) / xsum(*idx), its words / scales / sums at the tile's blocks, then idx over WVIEW / SVIEW
# -> [S, ...]
TILES = {"Q8_0": _tile_q8_0, "IQ3_S": _tile_iq3_s, "Q4_K": _tile_q4_k}
